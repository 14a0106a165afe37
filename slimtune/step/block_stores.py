"""Where a checkpointed block's input waits between forward and backward: a store, one per step.

`with open_store(cfg, device, default_dir) as store:` gives the store for activations.checkpoint.
recompute (and none): inputs stay on the device (BlockStore). host: host RAM (CUDA: pinned, copied on
a side stream, the way back prefetched a block ahead; CPU-only: a copy marked host-resident, so the
meter counts what a GPU would hold). disk: one raw file per block (dtype, shape, strides kept aside)
in a private folder under disk_dir, written by a worker thread, read back a block ahead, deleted once
read; free space is checked first. A store leaves nothing behind after success, an exception,
KeyboardInterrupt or a graph dropped without backward. Counters: bytes_written, link_bytes (both
ways: twice per stored input after backward), peak_bytes.

Under FakeTensorMode (the planner's estimate) nothing reaches a disk (a fake host copy marked
host-resident stands for each file), free space is not checked, and bytes are still counted.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.device import runtime
from slimtune.config import ActivationsConfig
from slimtune.errors import UserError
from slimtune.device.memory import mark_host_resident

SCRATCH_KIND = "blocks"  # runtime.scratch_folder's name for a store's folder of block files
DISK_USE = runtime.DiskUse("activations.checkpoint=disk", "block inputs", "activations.disk_dir",
                           "activations.checkpoint=host")
WRITES_IN_FLIGHT = 2  # disk writes queued at once: bounds the host buffers waiting for the disk
DISK_MARGIN = 64 << 20  # free space left on the disk after every block file is written


def open_store(cfg: ActivationsConfig, device: torch.device, default_dir: str | Path | None = None):
    """The store for cfg.checkpoint (none: an unused BlockStore, so callers need no branch).
    `default_dir`: for block files when activations.disk_dir is unset (output_dir/activations)."""
    if cfg.checkpoint in ("none", "recompute"):
        return BlockStore(device)
    if cfg.checkpoint == "host":
        return HostStore(device)
    if not (cfg.disk_dir or default_dir):
        raise UserError("activations.checkpoint=disk needs activations.disk_dir (a folder for block files).")
    return DiskStore(device, cfg.disk_dir or default_dir)


@dataclass
class _StoredInput:
    nbytes: int
    host: torch.Tensor | None = None  # the host copy (host store; disk under fake tensors)
    ready: object = None  # CUDA event: `host` is filled
    path: Path | None = None  # disk: the block's file until it is read back
    layout: tuple = ()  # disk: (shape, stride, dtype) to rebuild the tensor
    read: Future | None = None  # disk: the read-back in flight
    fetched: tuple | None = None  # (device tensor, CUDA event) once prefetched


class BlockStore:
    """checkpoint=recompute: block inputs stay on the device. The base of the other stores."""

    def __init__(self, device: torch.device | None = None):
        self.device, self.entries, self._ids, self.closed = device, {}, itertools.count(), False
        self.bytes_written = 0  # into host RAM or onto the disk
        self.link_bytes = 0  # across the host link, both directions
        self.stored_bytes = self.peak_bytes = 0  # held in host RAM or on disk: now, at most
        self.cache_kept = self.cache_hits = 0  # cache=small: op outputs kept in forward, handed back

    def reserve(self, example: torch.Tensor, count: int) -> None:
        """`count` inputs like `example` are about to be put (a disk checks its free space)."""

    def put(self, x: torch.Tensor) -> int:
        key = next(self._ids)
        self.entries[key] = (x.detach(), x._version)
        return key

    def prefetch(self, key: int) -> None:
        pass

    def take(self, key: int) -> torch.Tensor:
        x, version = self.entries.pop(key)
        if x._version != version:  # changed in place after forward: its recompute would be wrong
            raise RuntimeError("a checkpointed block's input was modified in place after its forward.")
        return x

    def discard(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if isinstance(entry, _StoredInput):
            self.stored_bytes -= entry.nbytes

    def close(self) -> None:
        self.closed = True
        self.entries.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _count_in(self, nbytes: int) -> None:
        self.bytes_written += nbytes
        self.link_bytes += nbytes
        self.stored_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.stored_bytes)


class HostStore(BlockStore):
    """checkpoint=host: block inputs in host RAM (pinned on CUDA)."""

    def __init__(self, device: torch.device | None = None):
        super().__init__(device)
        self.link = runtime.Link(device)

    def put(self, x: torch.Tensor) -> int:
        key = next(self._ids)
        host, ready = self.link.to_host(x)
        self.entries[key] = _StoredInput(runtime.nbytes(x), host=host, ready=ready)
        self._count_in(runtime.nbytes(x))
        return key

    def prefetch(self, key: int) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.fetched is None and entry.host is not None:
            entry.fetched, entry.host = self.link.to_device(entry.host, entry.ready), None

    def take(self, key: int) -> torch.Tensor:
        self.prefetch(key)
        entry = self.entries.pop(key)
        self.link_bytes += entry.nbytes
        self.stored_bytes -= entry.nbytes
        return self.link.ready(entry.fetched)


class DiskStore(HostStore):
    """checkpoint=disk: one file per block input in a private folder under `folder`."""

    def __init__(self, device: torch.device | None, folder: str | Path):
        super().__init__(device)
        self.root, self.scratch, self._cleanup = Path(folder), None, None  # scratch: made on the first write
        self.worker = runtime.one_thread("slimtune-disk", device)  # in order: reads follow writes
        self.writes: deque[Future] = deque()

    def _ensure_folder(self) -> Path:
        if self.scratch is None:
            self.scratch = runtime.scratch_folder(self.root, SCRATCH_KIND, DISK_USE.setting, DISK_USE)
            # Also runs at interpreter exit and when the store is dropped unclosed.
            self._cleanup = weakref.finalize(self, _shut_down, self.worker, self.scratch)
        return self.scratch.path

    def reserve(self, example: torch.Tensor, count: int) -> None:
        if count <= 0 or is_fake(example):
            return
        self._ensure_folder()
        DISK_USE.check(self.root, runtime.nbytes(example) * count, DISK_MARGIN)

    def put(self, x: torch.Tensor) -> int:
        if self.closed:
            raise RuntimeError("the disk store is closed.")
        if is_fake(x):  # the estimate: a fake host copy stands for the file
            return super().put(x)
        key = next(self._ids)
        host, ready = self.link.to_host(x)
        path = self._ensure_folder() / f"block-{key}.bin"
        self.writes.append(self.worker.submit(_write_file, path, host, ready))
        self.entries[key] = _StoredInput(runtime.nbytes(x), path=path, layout=(x.shape, host.stride(), x.dtype))
        self._count_in(runtime.nbytes(x))
        while len(self.writes) > WRITES_IN_FLIGHT or (self.writes and self.writes[0].done()):
            self._wait(self.writes.popleft())  # back-pressure; write errors surface here
        return key

    def prefetch(self, key: int) -> None:
        # From the disk into a host buffer; the device copy is made when taken (a fake entry too).
        entry = self.entries.get(key)
        if entry is not None and entry.path is not None and entry.read is None:
            entry.read = self.worker.submit(_read_file, entry.path, entry.layout, self.link.cuda)

    def take(self, key: int) -> torch.Tensor:
        entry = self.entries[key]
        if entry.path is not None:
            self.prefetch(key)
            entry.host = mark_host_resident(self._wait(entry.read))  # the file is gone once read
            entry.path = entry.read = None
        entry.fetched, entry.host = self.link.to_device(entry.host, entry.ready), None
        return super().take(key)

    def discard(self, key: int) -> None:
        entry = self.entries.get(key)
        super().discard(key)
        if entry is not None and entry.path is not None and not self.closed:
            self.worker.submit(entry.path.unlink, missing_ok=True)  # after its write: jobs run in order

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.writes.clear()
            self._cleanup() if self._cleanup is not None else self.worker.shutdown(wait=True)

    def _wait(self, job: Future):
        try:
            return job.result()
        except OSError as err:
            raise UserError(f"activations.disk_dir '{self.root}': block file I/O failed ({err}).") from None


def _byte_view(t: torch.Tensor):
    """The bytes of t's (fresh, dense) storage as a numpy array: any dtype, bf16 included."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (runtime.nbytes(t),), (1,)).numpy()


def _write_file(path: Path, host: torch.Tensor, ready) -> None:
    if ready is not None:
        ready.synchronize()  # the copy from the device has landed
    with open(path, "wb") as f:
        f.write(memoryview(_byte_view(host)))


def _read_file(path: Path, layout: tuple, pinned: bool) -> torch.Tensor:
    shape, stride, dtype = layout
    host = torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=pinned)
    view = memoryview(_byte_view(host))
    with open(path, "rb") as f:
        got = f.readinto(view)
    path.unlink()
    if got != len(view):
        raise OSError(f"{path}: read {got} of {len(view)} bytes")
    return host


def _shut_down(worker: ThreadPoolExecutor, scratch: runtime.ScratchFolder) -> None:
    with contextlib.suppress(RuntimeError):  # run by the worker itself (its GC): it cannot join itself
        worker.shutdown(wait=True, cancel_futures=True)
    scratch.remove()
