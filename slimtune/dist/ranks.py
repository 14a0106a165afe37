"""Data parallelism across processes that torchrun launched: one `Dist` per process.

`Dist` holds this process's rank, local rank and the world size, read from torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, ...), and the reductions the run needs. It travels with the assembled
run (train.Run.dist) into every engine, which sums its gradients across ranks where it keeps them,
before its optimizer: dense device gradients (resident), host accumulators (slide, roundpipe: on
the host worker thread, overlapped with the device's backward), d x d matrices (lsp), the active
chunk's slices (chunk). A single process gets `SINGLE`, whose reductions do nothing.

Two process groups. `device_group` is the default group (NCCL for CUDA tensors, gloo for CPU
ones) and is used from the main thread (and autograd's, which the main thread waits on); host
tensors are summed over `host_group`, a second gloo group, because engines sum them on their host
worker thread while the main thread may use the first: collectives of one group must be issued in
the same order on every rank, which two threads sharing a group could not promise.

Sums are exact where the order is fixed: the reduction of a bucket gives every rank the same bytes,
so every rank takes the same clipping and update decisions. Bytes summed are counted
(`reduced_bytes`): the loop logs them per step as `allreduce_bytes`.

A rank that dies or stops answering makes the next collective on every other rank fail (gloo: at
once for a closed connection, after `dist.timeout_s` for a silent peer): `PeerFailed`, one sentence;
torchrun then stops what is left of the job.
"""

from __future__ import annotations

import datetime
import gc
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from slimtune.errors import UserError

BUCKET_BYTES = 32 * 2**20  # tensors are summed in flat buckets of at most this size (as DDP's 25 MB)
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class PeerFailed(UserError):
    """Another rank of the job died, hung past dist.timeout_s, or failed: this one cannot go on."""


class Echo(UserError):
    """Rank 0's error, raised on the other ranks too so that all stop: rank 0 alone says it."""


class JoinFailed(UserError):
    """This rank could not join its job (each rank says its own)."""


def say_error(err: BaseException) -> None:
    """Say a UserError now, in the CLI's words, and mark it said (the CLI does not repeat it); other
    errors keep their traceback for the CLI."""
    if isinstance(err, UserError) and not getattr(err, "said", False):
        import sys

        print(f"slimtune: error: {err}", file=sys.stderr, flush=True)
        err.said = True


_JOINED = threading.Event()  # set once this process has joined its job's process group


def joined() -> bool:
    """True once this process joined a torchrun job (from_env): an error after it may be its own."""
    return _JOINED.is_set()


def launched() -> bool:
    """True inside a process that torchrun (or another launcher with its environment) started with
    more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def env_rank() -> int:
    """This process's rank from the launcher's environment (0 outside torchrun): readable before
    any process group exists (the CLI prints a config error on rank 0 only)."""
    return int(os.environ.get("RANK", "0")) if launched() else 0


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device_group: object = None
    host_group: object = None
    timeout_s: float = 0.0
    reduced_bytes: int = 0
    broadcast_bytes: int = 0  # what broadcast_ sent (rank 0) or took (the others), since the job began
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(self.world_size // max(self.local_world_size, 1), 1)

    def shard(self, items: Sequence) -> list:
        """This rank's share of a list every rank holds whole: items rank, rank + world, ..."""
        return list(items[self.rank :: self.world_size])

    # ------------------------------------------------------------ reductions

    def all_reduce_(self, tensors: Iterable[torch.Tensor], host: bool = False, what: str = "the gradient sum") -> None:
        """Sum `tensors` in place across ranks, in flat buckets (one collective per bucket and dtype).
        `host`: host tensors summed over the gloo host group (call from one thread only: the host
        worker's). Every rank must pass tensors of the same shapes in the same order."""
        if not self.active:
            return
        group = self.host_group if host else self.device_group
        for bucket in buckets([t for t in tensors if t is not None and t.numel()]):
            if len(bucket) == 1:
                self._reduce(bucket[0], group, what)
                continue
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self._reduce(flat, group, what)
            _copy_back(flat, bucket)

    def broadcast_(self, tensors: Iterable[torch.Tensor], host: bool = False, what: str = "rank 0's values") -> None:
        """Rank 0's values of `tensors` written into every rank's (`host`: over the gloo host group, from
        one thread only). One collective a tensor, in place: no flat copy beside them on the device (a
        tensor not contiguous goes through a contiguous copy of itself). Every rank passes tensors of
        the same shapes in the same order. Counted in broadcast_bytes, not in reduced_bytes (the step's
        gradient payload)."""
        if not self.active:
            return
        import torch.distributed as tdist

        group = self.host_group if host else self.device_group
        for tensor in tensors:
            if tensor is None or not tensor.numel():
                continue
            held = tensor if tensor.is_contiguous() else tensor.contiguous()
            self.collective(lambda: tdist.broadcast(held, src=0, group=group), what)
            self.broadcast_bytes += held.numel() * held.element_size()
            if held is not tensor:
                tensor.copy_(held)

    def start_sum(self, tensors: list[torch.Tensor], what: str) -> tuple:
        """Begin summing `tensors` (one flat copy) over the device group without waiting; `finish_sum`
        waits and writes the sums back. Launches must be in the same order on every rank."""
        import torch.distributed as tdist

        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._count(flat)
        work = self.collective(lambda: tdist.all_reduce(flat, group=self.device_group, async_op=True), what)
        return tensors, flat, work, what

    def finish_sum(self, flight: tuple) -> None:
        tensors, flat, work, what = flight
        self.collective(work.wait, what)
        _copy_back(flat, tensors)

    def _count(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self.reduced_bytes += tensor.numel() * tensor.element_size()

    def _reduce(self, tensor: torch.Tensor, group, what: str, op=None) -> None:
        import torch.distributed as tdist

        self._count(tensor)
        self.collective(lambda: tdist.all_reduce(tensor, op=op or tdist.ReduceOp.SUM, group=group), what)

    def sum_floats(self, values: Sequence[float], what: str) -> list[float]:
        """The sums over ranks of a few numbers (host float64: gloo's part of the default group)."""
        if not self.active:
            return list(values)
        packed = torch.tensor([float(v) for v in values], dtype=torch.float64)
        self._reduce(packed, self.device_group, what)
        return packed.tolist()

    def max_floats(self, values: Sequence[float], what: str) -> list[float]:
        if not self.active:
            return list(values)
        import torch.distributed as tdist

        packed = torch.tensor([float(v) for v in values], dtype=torch.float64)
        self._reduce(packed, self.device_group, what, op=tdist.ReduceOp.MAX)
        return packed.tolist()

    def broadcast_object(self, value, what: str):
        """Rank 0's `value` on every rank (a small picklable object: an error sentence, a flag)."""
        if not self.active:
            return value
        import torch.distributed as tdist

        box = [value if self.is_main else None]
        self.collective(lambda: tdist.broadcast_object_list(box, src=0, group=self.host_group), what)
        return box[0]

    def barrier(self, what: str) -> None:
        if self.active:
            import torch.distributed as tdist

            self.collective(lambda: tdist.barrier(group=self.host_group), what)

    def collective(self, call, what: str):
        """Run one collective; a rank lost on the way is said in one sentence (PeerFailed)."""
        try:
            return call()
        except (RuntimeError, OSError, _checkpoint_error()) as err:  # gloo/NCCL errors, timeouts, DCP's
            raise PeerFailed(f"rank {self.rank} of {self.world_size}: another rank {self._why(err)} during {what}; the"
                             " run stops on every rank.") from None

    def _why(self, err: BaseException) -> str:
        return what_happened(err, self.timeout_s)

    def take_reduced_bytes(self) -> int:
        """Bytes summed since the last call (this rank's payload, per collective)."""
        with self._lock:
            taken, self.reduced_bytes = self.reduced_bytes, 0
        return taken

    def close(self) -> None:
        """Leave the job. The groups' C++ objects go now, while the interpreter is alive: gloo's
        worker threads may still hold the last collective's tensors, and a tensor released on such
        a thread during interpreter shutdown takes the GIL there and aborts the process
        ("terminate called without an active exception", pytorch/pytorch#179291)."""
        if self.active:
            import torch.distributed as tdist

            if tdist.is_initialized():
                tdist.destroy_process_group()
            self.device_group = self.host_group = None
            gc.collect()  # engines in reference cycles may hold the groups' last references


SINGLE = Dist()


def what_happened(err: BaseException, timeout_s: float | None = None) -> str:
    """What the backend's message says happened to the peer, in words."""
    text = str(err).lower()
    if "timed out" in text or "timeout" in text:
        limit = "dist.timeout_s" if timeout_s is None else f"dist.timeout_s={timeout_s:g} s"
        return f"did not answer within {limit} (it hangs, or is far slower)"
    if "connection" in text or "closed" in text or "reset" in text or "broken pipe" in text:
        return "closed its connection (it died or was killed)"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"failed ({first[:120]})"


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err`, raised inside torch's own collectives (FSDP's, outside Dist.collective), is a
    peer lost rather than a bug: torch's DistError (NCCL, the store), or gloo's transport failing,
    which torch raises as a plain RuntimeError ("[.../gloo/transport/tcp/pair.cc:553] Connection
    closed by peer ...", "[.../unbound_buffer.cc:129] Timed out waiting 5000ms for send ...")."""
    import torch.distributed as tdist

    return isinstance(err, tdist.DistError) or (isinstance(err, RuntimeError) and "gloo/transport/" in str(err))


def _checkpoint_error() -> type:
    """torch.distributed.checkpoint's CheckpointException (a BaseException): a rank's failed write."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


class Counting(Dist):
    """One process that counts what it would send: the bytes each all_reduce_ would sum across
    ranks, with nothing sent and nothing changed (the planner's fake step: every engine's gradient
    payload per step, measured on the real code path)."""

    def all_reduce_(self, tensors: Iterable[torch.Tensor], host: bool = False, what: str = "the gradient sum") -> None:
        del host, what
        counted = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        with self._lock:
            self.reduced_bytes += counted


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    start = 0
    for t in tensors:
        t.copy_(flat[start : start + t.numel()].view_as(t))
        start += t.numel()


def buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive runs of one dtype and device, each at most BUCKET_BYTES (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        fits = out and out[-1][0].dtype == t.dtype and out[-1][0].device == t.device and size + nbytes <= BUCKET_BYTES
        if fits:
            out[-1].append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


def from_env(timeout_s: float, on_cuda: bool = True) -> Dist:
    """The process group torchrun's environment describes (NCCL for CUDA tensors where CUDA is
    present, gloo for CPU tensors), or SINGLE outside torchrun. CUDA: this process's device is
    cuda:LOCAL_RANK. `on_cuda` False (a run with device=cpu): no card is claimed and the job is gloo's
    alone, even where CUDA is present (set_device would make each rank a CUDA context on its card)."""
    if not launched():
        return SINGLE
    import torch.distributed as tdist

    missing = [name for name in ENV if name not in os.environ]
    if missing:
        raise JoinFailed(f"the launcher's environment lacks {', '.join(missing)}; start with torchrun "
                        "(or slimtune train --nproc N).")
    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(seconds=timeout_s)
    cuda = on_cuda and torch.cuda.is_available()
    if cuda and local_rank < torch.cuda.device_count():  # else assembly.resolve_device says so (device=cuda)
        torch.cuda.set_device(local_rank)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    try:
        if not tdist.is_initialized():
            tdist.init_process_group(backend=backend, timeout=timeout)
        host_group = tdist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, OSError, ValueError) as err:
        raise JoinFailed(f"could not join the job at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} as rank "
                        f"{os.environ['RANK']} of {os.environ['WORLD_SIZE']} ({str(err).splitlines()[0][:160]}).") from None
    _JOINED.set()
    return Dist(rank=tdist.get_rank(), local_rank=local_rank, world_size=tdist.get_world_size(),
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), device_group=tdist.group.WORLD,
                host_group=host_group, timeout_s=timeout_s)
