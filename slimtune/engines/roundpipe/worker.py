"""A stateless worker: one device (or a share of one), its own copy stream, compute stream and
module replica, and one controller thread that runs its jobs in the order they were given.

Nothing of the model lives on a worker between jobs: a job's stage weights come up when it starts
(or were prefetched while the worker's previous job ran: at most two stages are on the device at
once, the spec's double buffering) and are dropped when it ends. Its trainable gradients go down to
the host when the job ends.

On the CPU the copies are synchronous and the same code runs (N worker threads on one machine, so
every path runs in CI). Under fake tensors (the planner's estimate, whose FakeTensorMode is not
thread-safe) the workers run inline: each job at once on the caller's thread, in job order, which
is an order the threads could have taken too.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from slimtune.device import memory, runtime
from slimtune.optim.host_unit import HostUnit
from slimtune.engines.roundpipe.mailbox import Mailbox, WorkerFailed
from slimtune.engines.roundpipe.replica import Replica
from slimtune.engines.roundpipe.stages import Job
from slimtune.engines.roundpipe.timing import Clock


PIECE_BYTES = 256 * 2**20  # weights go up in pieces of at most this, so an activation waits for one piece


@dataclass
class Uploaded:
    """A stage's tensors on a worker: per unit, the device copies in its binding's order."""

    copies: list[list[torch.Tensor]]
    ready: object  # the last copy's event (None on the CPU)


class Prefetch:
    """The next job's weights, copied up in groups between the current job's activation copies (the
    spec's priority rule without stream priorities): the tensors are cut into pieces of at most
    PIECE_BYTES, bin-packed largest first into `groups` groups, and `advance` queues one group. On
    the one copy stream an activation then waits behind at most one group, never a whole stage."""

    def __init__(self, link: runtime.Link, units: list[HostUnit], source, groups: int):
        self.link, self.ready = link, None
        self.copies, pieces = [], []
        with torch.cuda.stream(link.stream) if link.cuda else contextlib.nullcontext():
            for unit in units:
                row = []
                for t in unit.binding.tensors:
                    host = source(t)
                    x = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=link.device)
                    row.append(x)
                    pieces += _pieces(x, host)
                self.copies.append(row)
        self.pending = _bin_pack(pieces, max(1, groups))

    def advance(self) -> None:
        if self.pending:
            for dst, src in self.pending.pop(0):
                self.ready = self.link.copy_up(dst, src)

    def finish(self) -> Uploaded:
        while self.pending:
            self.advance()
        return Uploaded(self.copies, self.ready)


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(device view, host view) pairs of at most PIECE_BYTES each (a strided tensor goes whole)."""
    if not (dst.is_contiguous() and src.is_contiguous()) or runtime.nbytes(src) <= PIECE_BYTES:
        return [(dst, src)]
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    step = max(1, PIECE_BYTES // src.element_size())
    return [(flat_dst[i:i + step], flat_src[i:i + step]) for i in range(0, flat_src.numel(), step)]


def _bin_pack(pieces: list[tuple[torch.Tensor, torch.Tensor]], groups: int) -> list[list[tuple]]:
    """Largest piece first into the lightest group; groups in order of their first piece."""
    bins: list[list[tuple]] = [[] for _ in range(groups)]
    loads = [0] * groups
    for piece in sorted(pieces, key=lambda p: -runtime.nbytes(p[1])):
        lightest = loads.index(min(loads))
        bins[lightest].append(piece)
        loads[lightest] += runtime.nbytes(piece[1])
    return [b for b in bins if b]


class Worker:
    def __init__(self, index: int, device: torch.device, model: nn.Module, inline: bool):
        self.index, self.device = index, device
        self.link = runtime.Link(device)
        self.replica = Replica(model)
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.executor = None if inline else ThreadPoolExecutor(1, thread_name_prefix=f"slimtune-worker{index}")
        self.rotary = self._upload_rotary()
        self.meter: memory.LiveBytesMeter | None = None  # the CPU meter of the job running (its step's)
        self.clock = Clock(device)  # per-layer times for the partitioner
        self.delay = None  # tests: a callable(worker, job, micro_batch) run before each micro-batch

    def __repr__(self) -> str:
        return f"worker {self.index} ({self.device})"

    def _upload_rotary(self) -> list[torch.Tensor]:
        """The rotary tables' buffers stay on the worker for the run (a few KiB)."""
        rotary = self.replica.stack.rotary
        for name, buffer in list(rotary._buffers.items()):
            if buffer is not None:
                rotary._buffers[name] = self.link.ready(self.link.to_device(buffer))
        if self.cuda:  # once, before any job: the worker's own stream is not ordered after these copies
            self.link.stream.synchronize()
        return [b for b in rotary.buffers()]

    # ------------------------------------------------------------ running jobs

    def submit(self, fn, job_label: str, mailbox: Mailbox, meter: memory.LiveBytesMeter | None = None) -> Future:
        """Run fn() as this worker's next job, counted by `meter` (its step's CPU meter); a failure is
        handed to every waiter (mailbox.fail) and named: which worker, which job."""
        def run():
            self.meter = meter  # a worker runs one job at a time: the job's step's meter is the worker's
            try:
                with self._on_device():
                    return fn()
            except WorkerFailed:
                raise
            except BaseException as err:  # noqa: BLE001 - any failure stops every worker, named once
                failed = WorkerFailed(f"roundpipe {self} failed in {job_label}: {type(err).__name__}: {err}")
                mailbox.fail(failed)
                raise failed from err
            finally:
                self.meter = None

        if self.executor is None:
            done = Future()
            try:
                done.set_result(run())
            except BaseException as err:  # noqa: BLE001 - the caller reads it from the future
                done.set_exception(err)
            return done
        return self.executor.submit(run)

    @contextlib.contextmanager
    def _on_device(self):
        """The worker's compute stream (CUDA) and its step meter (CPU) around a job."""
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            with self.meter if self.meter is not None else contextlib.nullcontext():
                yield

    def phase(self, category: str):
        """Tag what the worker makes inside with a memory.CATEGORIES category (its step meter's)."""
        return self.meter.phase(category) if self.meter is not None else contextlib.nullcontext()

    def retag(self, tensor: torch.Tensor | None, category: str) -> None:
        if self.meter is not None:
            self.meter.retag(tensor, category)

    def pause(self, job: Job, micro_batch: int) -> None:
        if self.delay is not None:
            self.delay(self, job, micro_batch)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------ weights up, gradients down

    def upload(self, units: list[HostUnit], source) -> Uploaded:
        """Copy the units' tensors up now; `source(slot_tensor)` is the host tensor to read."""
        with self.phase("weights"):
            return Prefetch(self.link, units, source, 1).finish()

    def prefetch(self, units: list[HostUnit], source, groups: int) -> Prefetch:
        """Start copying a later job's weights up, a group at a time (Prefetch.advance)."""
        with self.phase("weights"):  # allocated here, whole: the copies come group by group
            return Prefetch(self.link, units, source, groups)

    def bind(self, units: list[HostUnit], uploaded: Uploaded, with_grads: bool) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """The replica's modules onto the uploaded copies; returns (original, device leaf) pairs of
        the trainable tensors when `with_grads`."""
        self.link.wait(uploaded.ready)
        if self.cuda:  # made on the copy stream, used and freed on the compute stream
            for x in (x for row in uploaded.copies for x in row):
                x.record_stream(torch.cuda.current_stream(self.device))
        pairs = []
        for unit, copies in zip(units, uploaded.copies):
            trained = iter(self.replica.bind(unit.binding.tensors, copies, with_grads))
            pairs += [(t.param, next(trained)) for t in unit.binding.tensors if with_grads and t.trainable]
        return pairs

    def unbind(self, units: list[HostUnit]) -> None:
        for unit in units:
            self.replica.unbind(unit.binding.tensors)

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(b, "weights") for b in self.rotary]
