"""Device-byte meters: the CUDA allocator's peak on a GPU, live tensor bytes on the CPU.

On a CPU-only machine the device and the host are the same memory, so the CPU meter
counts what a GPU would hold: every live tensor storage, except storage the runtime
marked as host-resident (pinned pools, offloaded activations, host optimizer state).
It is a TorchDispatchMode: each op's outputs are recorded when they appear, and a
weakref on the storage subtracts them when the last reference dies.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Storages the runtime placed on the host on purpose; the CPU meter never counts them.
_HOST_RESIDENT: dict[int, weakref.finalize] = {}
# Meters currently measuring; marking storage host-resident takes it off their count.
_ACTIVE: weakref.WeakSet = weakref.WeakSet()


def _key(storage: torch.UntypedStorage) -> int:
    return id(storage)


def mark_host_resident(tensor: torch.Tensor) -> torch.Tensor:
    """Declare `tensor`'s storage host memory (excluded from device bytes). Returns it."""
    storage = tensor.untyped_storage()
    key = _key(storage)
    if key not in _HOST_RESIDENT:
        _HOST_RESIDENT[key] = weakref.finalize(storage, _HOST_RESIDENT.pop, key, None)
        for meter in list(_ACTIVE):
            meter.forget(key)
    return tensor


def is_host_resident(tensor: torch.Tensor) -> bool:
    return _key(tensor.untyped_storage()) in _HOST_RESIDENT


class LiveBytesMeter(TorchDispatchMode):
    """Counts live storage bytes on the metered device type; `peak` is the high-water mark."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[int, weakref.finalize]] = {}

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors that already exist (parameters, gradients, optimizer state, inputs)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track_one(t)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _track_one(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type or t.is_sparse:
            return
        storage = t.untyped_storage()
        key = _key(storage)
        if key in self._live or key in _HOST_RESIDENT:
            return
        nbytes = storage.nbytes()
        self._live[key] = (nbytes, weakref.finalize(storage, self._release, key))
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        nbytes, _ = self._live.pop(key, (0, None))
        self.current -= nbytes

    def forget(self, key: int) -> None:
        """Stop counting a storage (it became host-resident); the peak already reached stands."""
        nbytes, finalizer = self._live.pop(key, (0, None))
        if finalizer is not None:
            finalizer.detach()
        self.current -= nbytes

    def __enter__(self):
        _ACTIVE.add(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.discard(self)
        return super().__exit__(*exc)

    def close(self) -> None:
        """Stop watching storages that outlive the measurement (parameters, optimizer state)."""
        for _, finalizer in self._live.values():
            finalizer.detach()
        self._live.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Inputs first: a tensor made before the meter started is live when it is used.
        inputs, _ = tree_flatten((args, kwargs or {}))
        self.track(inputs)
        out = func(*args, **(kwargs or {}))
        outputs, _ = tree_flatten(out)
        self.track(outputs)
        return out


class CpuMeter:
    """Per-step device peak on the CPU: a LiveBytesMeter around the step."""

    kind = "measured: live tensor bytes (CPU meter)"

    @contextlib.contextmanager
    def measure(self, resident: Iterable[torch.Tensor | None]) -> Iterator[LiveBytesMeter]:
        meter = LiveBytesMeter("cpu")
        meter.track(resident)
        try:
            with meter:
                yield meter
        finally:
            meter.close()


class _CudaReading:
    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0


class CudaMeter:
    """Per-step device peak on CUDA: the caching allocator's max_memory_allocated."""

    kind = "measured: CUDA allocator peak"

    def __init__(self, device: torch.device):
        self.device = device

    @contextlib.contextmanager
    def measure(self, resident: Iterable[torch.Tensor | None]) -> Iterator[_CudaReading]:
        del resident  # the allocator already knows every live tensor
        torch.cuda.reset_peak_memory_stats(self.device)
        reading = _CudaReading(self.device)
        try:
            yield reading
        finally:
            reading.peak = torch.cuda.max_memory_allocated(self.device)


class _NoReading:
    peak = None


class NullMeter:
    """For runs that opt out of measuring (train.measure_memory=false); peaks read as None."""

    kind = "not measured"

    @contextlib.contextmanager
    def measure(self, resident: Iterable[torch.Tensor | None]) -> Iterator[_NoReading]:
        del resident
        yield _NoReading()


def meter_for(device: torch.device, enabled: bool = True) -> CpuMeter | CudaMeter | NullMeter:
    if not enabled:
        return NullMeter()
    return CudaMeter(device) if device.type == "cuda" else CpuMeter()
