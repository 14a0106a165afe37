"""Which weights each step computes at, and what a step begun early must wait for (roundpipe.md
2.4, and 2.5 (C)'s per-layer flags between the main, worker and optimizer threads).

With the async optimizer step s computes at the weights after s - 1 updates (staleness 1). One host
copy per trainable tensor ("compute") serves every step: once step s has read a unit's copy for the
last time (its last job's upload has completed, or the host has gathered the embedding rows), the
copy is overwritten with the unit's weights for step s + 1, as soon as the unit's own update s - 1
is done (the optimizer goes unit by unit in the order a step first reads them, so a step's first
jobs need not wait for the whole update). The copy then puts the flag ("weights", unit) in step
s + 1's mailbox, which that step's jobs wait for before they upload the unit. Update s, which
overwrites what the copy reads, comes after it (RoundPipeEngine._release says why).

So step s + 1 may be dispatched while step s still runs (the loop hands the engine the next step's
batches, `then=`). Two kinds of its work must still wait for step s's end, and its `Gate` holds
them, in order:
  - its gradient additions: step s's are still being summed into the same buffers;
  - its copies for step s + 2: they must wait for update s, submitted when step s ends.
The gate opens once step s's update has been submitted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from slimtune.pipeline.mailbox import Mailbox


class Gate:
    """Host work of one step, held in order while the step before it still runs."""

    def __init__(self, opened: bool):
        self._opened, self._held, self._lock = opened, [], threading.Lock()

    def run(self, fn: Callable[[], None]) -> None:
        """fn() now if the gate is open, else when it opens (on the opening thread). Under the lock
        either way, so nothing run after the opening overtakes what was held (fn must be short and
        must not use the gate)."""
        with self._lock:
            if self._opened:
                fn()
            else:
                self._held.append(fn)

    def open(self) -> None:
        with self._lock:
            self._opened = True
            held, self._held = self._held, []
            for fn in held:
                fn()


class StepWeights:
    """One step's view of the compute copies: which units it waits for (`versioned`: those with
    trainable tensors; the rest are read where they live), how many of its reads of each are left,
    and its mailbox and gate."""

    def __init__(self, versioned: frozenset[int], timeout_s: float | None, opened: bool):
        self.versioned = versioned
        self.mailbox = Mailbox(timeout_s)
        self.gate = Gate(opened)
        self._reads: dict[int, list] = {}  # unit -> [reads left, the copy events to wait for]
        self._lock = threading.Lock()

    @classmethod
    def ready(cls, versioned: frozenset[int], timeout_s: float | None) -> "StepWeights":
        """A step whose weights are all in place already (the run's first, or the first after a load)."""
        weights = cls(versioned, timeout_s, opened=True)
        for unit in versioned:
            weights.mailbox.put(("weights", unit), True)
        return weights

    def expect(self, reads: dict[int, int], release: Callable[[int, list], None]) -> None:
        """The step's reads of each versioned unit (its jobs' uploads, the gather); a unit it never
        reads is released for the next step at once."""
        self._release = release
        with self._lock:
            self._reads = {u: [reads.get(u, 0), []] for u in self.versioned}
        for unit in [u for u in self.versioned if reads.get(u, 0) == 0]:
            release(unit, [])

    def wait(self, units: Iterable[int]) -> None:
        """Until every versioned unit of `units` holds this step's weights."""
        for unit in units:
            if unit in self.versioned:
                self.mailbox.wait(("weights", unit))

    def read(self, units: Iterable[int], event: object) -> None:
        """One read of each of `units` is complete once `event` is (None: already)."""
        done = []
        with self._lock:
            for unit in units:
                if unit in self.versioned:
                    left = self._reads[unit]
                    left[0] -= 1
                    if event is not None:
                        left[1].append(event)
                    if left[0] == 0:
                        done.append((unit, left[1]))
        for unit, events in done:
            self._release(unit, events)
