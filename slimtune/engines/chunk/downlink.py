"""chunk.gradients=host: the active chunk's gradient goes to its host accumulators while backward
makes it, so the device holds a bounded window of it instead of the whole chunk's (4 bytes a number
over 1/N of the numbers: 7.5 GiB at N = 4 for Llama-3.1-8B).

The slice-aware ops (chunk/sliced.py, the sliced head in loss.py) hand each contribution to the
`Downlink` set as their slice's sink: a Linear's weight-gradient slice (in the compute dtype, as
the op made it), an LM-head tile's rows (fp32, summed over token chunks), an embedding's rows with
their token ids. Each is copied down on the link's side stream (runtime.Link, bytes counted) and
the host worker adds it into the slice's fp32 accumulator, the host optimizer's own (chunk/state.py's
Working set): the same numbers a device buffer would add, so the update is unchanged but for the
order of fp32 additions within a head tile.

The window: a contribution stays referenced on the device until its copy has landed, and a new one
waits for the oldest copy while more than IN_FLIGHT_BYTES are held (so the device holds at most
that plus the contribution being made). The link's pace, not the compute's, then bounds the device
memory; and since the references are kept on every device, the CPU meter and the planner's fake
step see the same window a GPU holds. The host additions run behind the copies, never holding up
the backward: only their pinned staging, past HOST_STAGING_BYTES, makes the next send wait for the
oldest addition.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from slimtune.device import runtime
from slimtune.engines.chunk.sliced import ActiveSlice

# Device bytes of contributions held at once awaiting their copy (one more may be made beside
# them). The largest Llama-8B contributions: an MLP matrix's bf16 gradient is 112 MiB, a head
# tile's (8192 rows, fp32) 128 MiB.
IN_FLIGHT_BYTES = 128 * 2**20
# Pinned host bytes of copies awaiting their addition into the accumulators.
HOST_STAGING_BYTES = 512 * 2**20


class Downlink:
    """The sink of the active chunk's slices: their contributions to host accumulators."""

    def __init__(self, link: runtime.Link, worker: runtime.HostWorker):
        self.link, self.worker = link, worker
        self.targets: dict[int, torch.Tensor] = {}  # id(ActiveSlice) -> its active range's host accumulator
        self.window: deque[tuple[tuple[torch.Tensor, ...], int, object]] = deque()  # (tensors, bytes, copy event)
        self.staged: deque[tuple[int, Future]] = deque()  # (pinned bytes, its addition)
        self.held = self.staging = 0
        self.retag: Callable[[torch.Tensor], None] = lambda t: None

    def open(self, targets: list[tuple[ActiveSlice, torch.Tensor]], retag=None) -> None:
        """These slices send to these accumulators (of their active range's shape) from now on;
        `retag(tensor)`, if given, files each held contribution under the meter's gradients."""
        for active, host in targets:
            if host.shape != active.shape:
                raise ValueError(f"A host accumulator of shape {tuple(host.shape)} for {active!r}.")
            active.sink = self
            self.targets[id(active)] = host
        if retag is not None:
            self.retag = retag

    def close(self, slices) -> None:
        """Waits for every addition; the slices hold their gradients on the device again."""
        self.drain()
        self._detach(slices)

    def abandon(self, slices) -> None:
        """After a step that raised: waits for everything in flight, whatever the host work's errors
        (the step's own error is the one to report), and detaches the slices. The accumulators then
        hold a partial sum: the caller zeroes them."""
        for _, _, event in self.window:
            if event is not None:
                event.synchronize()
        for _, job in self.staged:
            job.exception()  # waits, and keeps the error to itself
        self.window.clear()
        self.staged.clear()
        self.held = self.staging = 0
        try:
            self.worker.barrier()
        except Exception:  # noqa: BLE001 - already waited for above; only its list is emptied here
            pass
        self._detach(slices)

    def _detach(self, slices) -> None:
        for active in slices:
            active.sink = None
        self.targets = {}
        self.retag = lambda t: None  # the step's meter reading goes with the step

    def drain(self) -> None:
        """Every contribution sent so far is in its accumulator (errors of the host work re-raised)."""
        while self.window:
            self._retire_copy()
        while self.staged:
            self._retire_addition()
        self.worker.barrier()

    # ------------------------------------------------------------ what the ops call

    def add(self, active: ActiveSlice, offset: int, g: torch.Tensor) -> None:
        """g: the gradient of the slice's positions [offset, offset + len) along its axis."""
        target = self.targets[id(active)].narrow(active.axis, offset, g.shape[active.axis])
        self._send((g,), lambda host: target.add_(host[0]))

    def add_indexed(self, active: ActiveSlice, ids: torch.Tensor, source: torch.Tensor) -> None:
        """source's rows added at positions ids along axis 0."""
        target = self.targets[id(active)]
        self._send((ids, source), lambda host: target.index_add_(0, host[0], host[1].to(target.dtype)))

    # ------------------------------------------------------------ the window

    def _send(self, tensors: tuple[torch.Tensor, ...], apply: Callable[[list[torch.Tensor]], object]) -> None:
        size = sum(runtime.nbytes(t) for t in tensors)
        while self.window and self.held + size > IN_FLIGHT_BYTES:
            self._retire_copy()
        while self.staged and self.staging + size > HOST_STAGING_BYTES:
            self._retire_addition()
        copies = [self.link.to_host(t.detach()) for t in tensors]  # one stream: the last event is after all
        event = copies[-1][1]
        self.staged.append((size, self.worker.submit(_apply, event, apply, [host for host, _ in copies])))
        self.staging += size
        for t in tensors:
            self.retag(t)
        self.window.append((tensors, size, event))
        self.held += size

    def _retire_copy(self) -> None:
        """The oldest contribution has landed on the host: its device tensors may go."""
        _, size, event = self.window.popleft()
        if event is not None:
            event.synchronize()
        self.held -= size

    def _retire_addition(self) -> None:
        size, job = self.staged.popleft()
        job.result()
        self.staging -= size


def _apply(event, apply, hosts: list[torch.Tensor]) -> None:
    """On the host worker: once the copies are done, the addition."""
    if event is not None:
        event.synchronize()
    with torch.no_grad():
        apply(hosts)
