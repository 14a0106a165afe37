"""Which weights each step computes at, and what a step begun early must wait for (roundpipe.md
2.4, and 2.5 (C)'s per-layer flags between the main, worker and optimizer threads).

With the async optimizer step s computes at the weights after s - 1 updates (staleness 1): W0 for
steps 0 and 1, then update s - 2's result. So two host versions of every trainable tensor serve
all steps: step s reads version s % 2, and update j writes its result (the masters rounded to the
upload dtype, which an update writes anyway) straight into version j % 2, the one step j has just
read and step j + 2 reads next. Nothing is copied, and update j waits for no other step's reads:
it is submitted when step j ends, and the step running meanwhile (j + 1) reads the other version.
What update j does wait for, on a GPU, is the end of step j's own uploads of the unit (their
events), since a finished job does not mean its copies have left host memory.

A step's jobs wait, unit by unit, for the update that writes their version: the flag
("weights", unit) in the step's mailbox, put when that unit's update is done (the optimizer goes
unit by unit in the order a step first reads them, so a step's first jobs need not wait for the
whole update), or at once when it is done already.

So step s + 1 may be dispatched while step s still runs (the loop hands the engine the next step's
batches, `then=`). Its gradient additions must still wait for step s's end, since step s's are
still being summed into the same buffers: its `Gate` holds them until step s's update has been
submitted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch

from slimtune.device import runtime
from slimtune.optim.host_unit import HostUnit
from slimtune.engines.roundpipe.mailbox import Mailbox


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
    """One step's view of the weight versions: which one it reads (`step` % 2), the units it waits
    for (`versioned`: those with trainable tensors; the rest are read where they live), and the
    upload events of its reads, which the step's own update of each unit waits for."""

    def __init__(self, step: int, versioned: frozenset[int], pending: dict[int, Future], timeout_s: float | None,
                 gate: Gate):
        """`pending`: unit -> the update (two steps before) that writes this step's version, where
        it may still run; every other versioned unit's version is in place."""
        self.step, self.versioned = step, versioned  # it reads version step % 2
        self.mailbox = Mailbox(timeout_s)
        self.gate = gate
        self._events: dict[int, list] = {u: [] for u in versioned}
        self._lock = threading.Lock()
        for unit in versioned:
            update = pending.get(unit)
            if update is None:
                self.mailbox.put(("weights", unit), True)
            else:
                update.add_done_callback(lambda done, u=unit: self._updated(u, done))

    def _updated(self, unit: int, done: Future) -> None:
        failed = done.exception()
        if failed is None:
            self.mailbox.put(("weights", unit), True)
        else:  # this step's waiters hear of it
            self.mailbox.fail(failed)

    def wait(self, units: Iterable[int]) -> None:
        """Until every versioned unit of `units` holds this step's weights."""
        for unit in units:
            if unit in self.versioned:
                self.mailbox.wait(("weights", unit))

    def read(self, units: Iterable[int], event: object) -> None:
        """A read of `units` is complete once `event` is (None: already)."""
        if event is None:
            return
        with self._lock:
            for unit in units:
                if unit in self.versioned:
                    self._events[unit].append(event)

    def reads_of(self, unit: int) -> list:
        """The upload events of the step's reads of `unit` (call once its jobs have all ended)."""
        with self._lock:
            return list(self._events.get(unit, ()))


class WeightVersions:
    """The two host versions of the trainable tensors of every unit with an optimizer, laid out as
    its HostAdam's masters (flat per group) so an update writes one straight into a version. In
    bf16 with whole masters version 0 is the HostAdam's own shadows (what goes up anyway), so async
    costs one more copy of the weights in the upload dtype (2 bytes a number); under the split
    layout (train.master=split) both versions are copies (4 bytes), as the weights are half the master; where the weights go up in the
    masters' dtype (fp32, fp64) both versions are copies, since the masters change under an update."""

    def __init__(self, units: list[HostUnit], device: torch.device):
        self._flats: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (version 0, version 1)
        self._own: list[torch.Tensor] = []  # the flats made here (host RAM async adds)
        for index, unit in enumerate(units):
            if unit.adam is not None:
                self._flats[index] = (self._first(unit, device), self._made(unit, device))
                for param, k, i in unit.members:
                    self._views[id(param)] = tuple(unit.adam.cut(k, i, flats[k]) for flats in self._flats[index])

    def _made(self, unit: HostUnit, device: torch.device) -> list[torch.Tensor]:
        adam = unit.adam
        flats = [runtime.host_empty((g.numel,), adam.shadow_dtype or adam.dtype, device) for g in adam.groups]
        adam.refresh_shadows(flats)  # the current weights, as they go up
        self._own += flats
        return flats

    def _first(self, unit: HostUnit, device: torch.device) -> list[torch.Tensor]:
        """Version 0: the HostAdam's own shadows where they only follow the masters; a copy where they
        are the masters' own top half (the split layout: they change with every update)."""
        shadows = unit.adam.shadows
        if unit.adam.split or any(s is None for s in shadows):
            return self._made(unit, device)
        return list(shadows)

    def of(self, param: torch.Tensor, parity: int) -> torch.Tensor:
        """The version `parity` of a trainable tensor (step s reads parity s % 2)."""
        return self._views[id(param)][parity]

    def flats(self, unit: int, parity: int) -> list[torch.Tensor]:
        """Unit `unit`'s version `parity`, per HostAdam group: where update j (parity j % 2) writes."""
        return self._flats[unit][parity]

    def extra_bytes(self) -> int:
        return sum(runtime.nbytes(t) for t in self._own)
