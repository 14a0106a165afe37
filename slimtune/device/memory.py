"""Device-byte meters: the CUDA allocator's peak on a GPU, live tensor bytes on the CPU.

On a CPU-only machine the device and the host are the same memory, so the CPU meter
counts what a GPU would hold: every live tensor storage, except storage the runtime
marked as host-resident (pinned pools, offloaded activations, host optimizer state).
It is a TorchDispatchMode: each op's outputs are recorded when they appear, and a
weakref on the storage subtracts them when the last reference dies. FSDP2 (dist.strategy=fsdp)
keeps each gathered weight's storage for the run and frees and refills it by resizing, which no op
shows: the meter follows those storages from the op that fills them (_fsdp_fills) and reads their
size before every op while they hold bytes.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode

# Storages the runtime placed on the host on purpose; the CPU meter never counts them.
_HOST_RESIDENT: dict[int, weakref.finalize] = {}
# Meters currently measuring; marking storage host-resident takes it off their count.
_ACTIVE: weakref.WeakSet = weakref.WeakSet()


def _key(storage: torch.UntypedStorage) -> int:
    return id(storage)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of `tensor`: a DTensor's (dist.strategy=fsdp's shards) own part, whose
    storage is the shard; the wrapper's storage reads as the whole tensor's bytes."""
    if type(tensor) is torch.Tensor or type(tensor).__name__ != "DTensor":  # by name: no import on the hot path
        return tensor
    return tensor._local_tensor


def mark_host_resident(tensor: torch.Tensor) -> torch.Tensor:
    """Declare `tensor`'s storage host memory (excluded from device bytes). Returns it."""
    storage = tensor.untyped_storage()
    key = _key(storage)
    if key not in _HOST_RESIDENT:
        _HOST_RESIDENT[key] = weakref.finalize(storage, _HOST_RESIDENT.pop, key, None)
        for meter in list(_ACTIVE):
            meter.forget(key)
    return tensor


@contextlib.contextmanager
def host_allocation() -> Iterator[None]:
    """Storage made inside is host memory (pinned pools, host copies): no meter counts it, not even
    for the moment before mark_host_resident declares it, which a GPU would never hold."""
    here = threading.get_ident()  # meters measuring other threads (pipeline workers) go on counting theirs
    meters = [m for m in list(_ACTIVE) if m.thread == here]
    for meter in meters:
        meter.host_allocations += 1
    try:
        yield
    finally:
        for meter in meters:
            meter.host_allocations -= 1


def representative(steps: Sequence, like: torch.Tensor, alike_from: int = 1, last_alike: bool = False) -> Sequence:
    """The steps to run of a loop in which every step after step `alike_from` holds the same memory
    as that one (it frees what it makes, or adds in place into what an earlier step made; the last
    may be smaller): all of them, but under fake tensors (the planner's estimate, which computes no
    value) only steps 0..alike_from and the last, which reach the same peak in a fraction of the
    ops. alike_from=0: a loop that keeps nothing from one step to the next (weight tiles dequantized
    and dropped); 1 (default): the first step may leave something the later ones reuse (an
    accumulator made on first use). Callers are loops over token chunks and weight tiles; the
    estimate is tested equal to a real run's meter on shapes where each of them has many steps.
    last_alike: the last step holds no more than step alike_from (every step the same shape: the r
    terms of a sparse product; or the last the least: a tiled block's backward ends at tile 0, which
    attends to the fewest keys), so steps 0..alike_from alone show the peak."""
    if not is_fake(like):
        return steps
    if last_alike:
        return steps[:alike_from + 1]
    if len(steps) <= alike_from + 2:
        return steps
    return [*steps[:alike_from + 1], steps[-1]]


class TransientReplay:
    """Under fake tensors, a call that leaves memory as it found it and whose transient peak depends
    only on `key` (its tensors' shapes) runs once per key; each later call allocates that peak
    above the current bytes and frees it, which is all a meter sees of it, in one op. With real
    tensors every call runs, the first of each key under the meter and the later ones off it (their
    peak counted by that one op): a meter's per-op cost is paid once per key. (lsp fits the
    projectors of every matrix of a shape alike.)"""

    def __init__(self):
        self.peaks: dict = {}

    def run(self, key, like: torch.Tensor, fn, *args) -> None:
        meters = [m for m in list(_ACTIVE) if isinstance(m, LiveBytesMeter)]
        if not meters:
            fn(*args)
            return
        if key in self.peaks:
            torch.empty(self.peaks[key], dtype=torch.uint8, device=like.device)  # made and dropped at once
            if not is_fake(like):
                with _disable_current_modes():  # the values are still needed; the meter has its count
                    fn(*args)
            return
        meter = meters[0]
        meter.track([like, *(a for a in args if isinstance(a, torch.Tensor))])  # inputs are not its transient
        self.peaks[key] = _transient(meter, fn, *args)


def _transient(meter: LiveBytesMeter, fn, *args) -> int:
    """fn(*args) on `meter`, and how far above the bytes it began with it went."""
    start, before = meter.current, (meter.peak, meter.peak_breakdown)
    meter.peak = start
    fn(*args)
    peak = meter.peak - start
    if meter.peak < before[0]:
        meter.peak, meter.peak_breakdown = before
    return peak


def replayed(key, fn, leaves: Sequence[torch.Tensor] = ()) -> None:
    """In the planner's estimate (a MeteredFakeMode that meters), fn() runs once per key of its
    replay table, and later calls with that key allocate the transient peak it measured and drop it
    in one op, which is all the meter sees of fn; elsewhere (a real run, or no meter) fn() just runs.
    For calls that leave memory as they found it (they write into tensors that exist) and hold a
    transient that `key` decides: a later tile of a tiled block's forward or backward, which every
    block of a step and both steps of the estimate by depth repeat (step/seq_tiles.py).
    `leaves`: tensors fn may give their first gradient (a block's parameters, in the first tile of its
    backward), by position. Where fn keeps exactly those gradients' bytes, a replay first gives the
    same positions' tensors a gradient of zeros through autograd (their hooks run, as they did for
    fn's) and then allocates the rest of the peak; where fn keeps anything else, it always runs."""
    mode = _replaying_mode(key)
    if mode is None:
        fn()
        return
    meter = mode.meter
    if key in mode.replays:
        peak, made, kept = mode.replays[key]
        if made:
            torch.autograd.backward([leaves[i] for i in made], [torch.zeros_like(leaves[i]) for i in made])
        torch.empty(peak - kept, dtype=torch.uint8, device=meter.device_type)  # made and dropped at once
    else:
        without = [t.grad is None for t in leaves]
        start = meter.current
        peak = _transient(meter, fn)
        made = tuple(i for i, t in enumerate(leaves) if without[i] and t.grad is not None)
        kept = meter.current - start
        made_bytes = sum(leaves[i].grad.untyped_storage().nbytes() for i in made)
        mode.replays[key] = (peak, made, kept) if kept == made_bytes else None


def replayed_making(key, fn) -> tuple[torch.Tensor, ...]:
    """replayed() for a call that makes tensors and keeps them: fn() returns them (a tiled block's first
    tile: the block's output, whole K and V, which the later tiles write into). A replay makes empty
    tensors of the same shapes, strides and dtypes (under fake tensors no value is computed), then
    allocates the rest of the measured peak above them and drops it. Where fn keeps bytes other than
    the whole storages of what it returns, it always runs."""
    mode = _replaying_mode(key)
    if mode is None:
        return fn()
    meter = mode.meter
    if key in mode.replays:
        peak, specs = mode.replays[key]
        made = tuple(torch.empty_strided(shape, stride, dtype=dtype, device=device)
                     for shape, stride, dtype, device in specs)
        torch.empty(peak - sum(_storage_bytes(t) for t in made), dtype=torch.uint8, device=meter.device_type)
        return made
    start, result = meter.current, []
    peak = _transient(meter, lambda: result.extend(fn()))
    whole = all(t.storage_offset() == 0 and _storage_bytes(t) == t.numel() * t.element_size() for t in result)
    distinct = len({_key(t.untyped_storage()) for t in result}) == len(result)
    kept = meter.current - start
    specs = tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in result)
    fits = whole and distinct and kept == sum(_storage_bytes(t) for t in result)
    mode.replays[key] = (peak, specs) if fits else None
    return tuple(result)


def _replaying_mode(key) -> "MeteredFakeMode | None":
    """The planner's metering fake mode, where a call of `key` may be measured or replayed; None in a
    real run, with no meter, while host allocations are counted, or where `key` must always run."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    meter = mode.meter if isinstance(mode, MeteredFakeMode) else None
    if meter is None or meter.host_allocations or mode.replays.get(key, 0) is None:
        return None
    return mode


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def note_tiled_block() -> None:
    """A block ran in tiles of tokens (step/seq_tiles.py): the planner's estimate (a MeteredFakeMode)
    records it, so the planner knows a shorter tile would weigh less without estimating one."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if isinstance(mode, MeteredFakeMode):
        mode.tiled_blocks = True


def is_host_resident(tensor: torch.Tensor) -> bool:
    return _key(tensor.untyped_storage()) in _HOST_RESIDENT


# What the breakdown of a peak is made of. Resident tensors are tagged when a step starts;
# anything created during the step takes the phase the engine is in.
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "loss", "temporaries")


class LiveBytesMeter(TorchDispatchMode):
    """Counts live storage bytes on the metered device type; `peak` is the high-water mark and
    `peak_breakdown` splits it by category at that moment. With `segments`, it also keeps the
    high-water mark (and its breakdown) of each segment of the step that `mark` starts, keyed by
    (label..., occurrence): what the estimate's depth extrapolation is built from."""

    def __init__(self, device_type: str = "cpu", segments: bool = False):
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self.category = "temporaries"  # the phase new storage is tagged with
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_breakdown = dict(self.by_category)
        self._live: dict[int, list] = {}  # key -> [nbytes, finalizer, category]
        self.segments: dict[tuple, tuple[int, dict]] | None = {} if segments else None
        self.host_allocations = 0  # > 0 while host memory is being made: nothing is counted
        self._segment: tuple = ("start", 0)
        self._occurrences: dict[tuple, int] = {}
        self.thread: int | None = None  # the thread it measures (set when entered)
        # A storage may die on another thread than the one that made it (a pipeline worker's tensor
        # freed by the main thread): its release and the counting thread's updates take turns.
        self._lock = threading.RLock()  # re-entrant: a collection inside the block may release a storage
        # FSDP2's gathered-weight storages now holding bytes (key -> weakref): resized to 0 after a
        # unit's forward and backward without an op, so read before each op until they are.
        self._resizable: dict[int, weakref.ref] = {}
        self._fills = _fsdp_fills()

    def enter_segment(self, label: tuple) -> None:
        """The step enters segment `label` (its n-th occurrence this step: micro-batches repeat them)."""
        n = self._occurrences.get(label, 0)
        self._occurrences[label] = n + 1
        self._segment = (*label, n)
        self._note_segment()

    def _note_segment(self) -> None:
        best = self.segments.get(self._segment)
        if best is None or self.current > best[0]:
            self.segments[self._segment] = (self.current, dict(self.by_category))

    def track(self, tensors: Iterable[torch.Tensor | None], category: str | None = None) -> None:
        """Count tensors that already exist (parameters, gradients, optimizer state, inputs)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track_one(t, category or self.category)

    @contextlib.contextmanager
    def phase(self, category: str) -> Iterator[None]:
        """Tag storage created inside the block with `category`."""
        previous, self.category = self.category, category
        try:
            yield
        finally:
            self.category = previous

    def retag(self, tensor: torch.Tensor | None, category: str) -> None:
        """Move a tracked storage to another category (a gradient made during backward)."""
        entry = self._live.get(_key(_local(tensor).untyped_storage())) if tensor is not None else None
        if entry is not None:
            self.by_category[entry[2]] -= entry[0]
            self.by_category[category] += entry[0]
            entry[2] = category

    def _track_one(self, t: torch.Tensor, category: str) -> None:
        # Called for every tensor of every op: the common case (already counted) returns first.
        t = _local(t)
        if t.layout != torch.strided:  # a sparse tensor: its parts are strided tensors, counted as made
            return
        storage = t.untyped_storage()
        key = _key(storage)
        if key in self._live or key in _HOST_RESIDENT or t.device.type != self.device_type:
            return
        nbytes = storage.nbytes()
        with self._lock:
            self._live[key] = [nbytes, weakref.finalize(storage, self._release, key), category]
            self.current += nbytes
            self.by_category[category] += nbytes
            if self.current > self.peak:
                self.peak = self.current
                self.peak_breakdown = dict(self.by_category)
        if self.segments is not None:
            self._note_segment()

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[0]
                self.by_category[entry[2]] -= entry[0]

    def forget(self, key: int) -> None:
        """Stop counting a storage (it became host-resident); the peak already reached stands."""
        entry = self._live.get(key)
        if entry is not None:
            entry[1].detach()
            self._release(key)

    def __enter__(self):
        self.thread = threading.get_ident()
        _ACTIVE.add(self)
        inner = _get_current_dispatch_mode()
        if isinstance(inner, MeteredFakeMode) and inner.meter is None:
            inner.attach(self)  # counted by the fake mode: one Python mode fewer an op
            self._host_mode = inner
            return self
        self._host_mode = None
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.discard(self)
        if getattr(self, "_host_mode", None) is not None:
            self._host_mode.attach(None)
            self._host_mode = None
            return None
        return super().__exit__(*exc)

    def _follow_resizes(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count `tensors`' storages at their size now, and read it before each op from here on."""
        for t in tensors:
            self._track_one(t, self.category)
            storage = t.untyped_storage()
            self._resizable[_key(storage)] = weakref.ref(storage)
        self._read_resized()

    def _read_resized(self) -> None:
        """Bring the count of each followed storage to its size; stop following those now empty."""
        for key, ref in list(self._resizable.items()):
            storage, entry = ref(), self._live.get(key)
            nbytes = storage.nbytes() if storage is not None else 0
            if entry is not None and nbytes != entry[0]:
                with self._lock:
                    self.current += nbytes - entry[0]
                    self.by_category[entry[2]] += nbytes - entry[0]
                    entry[0] = nbytes
                    if self.current > self.peak:
                        self.peak, self.peak_breakdown = self.current, dict(self.by_category)
                if self.segments is not None:
                    self._note_segment()
            if nbytes == 0 or entry is None:
                del self._resizable[key]

    def close(self) -> None:
        """Stop watching storages that outlive the measurement (parameters, optimizer state)."""
        for entry in self._live.values():
            entry[1].detach()
        self._live.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.host_allocations or func in _ALLOCATES_NOTHING:  # host memory in the making
            return func(*args, **(kwargs or {}))  # (host_allocation): not the device's
        return self.counted(func, args, kwargs, lambda: func(*args, **(kwargs or {})))

    def counted(self, func, args, kwargs, run):
        """run() (func on args), with its inputs and outputs counted."""
        if self._resizable:
            self._read_resized()
        if func in self._fills:  # FSDP2 copies a gather into its weights' storages, just resized to hold it
            self._follow_resizes(kwargs["out"])
        # Inputs first: a tensor made before the meter started is live when it is used.
        category = self.category
        for t in _tensors(args):
            self._track_one(t, category)
        if kwargs:
            for t in _tensors(kwargs.values()):
                self._track_one(t, category)
        out = run()
        for t in _tensors((out,)):
            self._track_one(t, category)
        return out


def _fsdp_fills() -> frozenset:
    """FSDP2's op that copies an all-gather into the gathered weights' storages (fsdp::split_with_sizes_copy),
    where FSDP is in use (imported): none otherwise."""
    import sys

    if "torch.distributed.fsdp._fully_shard._fsdp_collectives" not in sys.modules:
        return frozenset()
    return frozenset({torch.ops.fsdp.split_with_sizes_copy.default})


# Queries the dispatcher makes of a tensor subclass (two in three of a fake step's calls reach the
# meter as prim.device): they allocate nothing and their argument was counted when it was made.
_ALLOCATES_NOTHING = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})


_PRIM_DEVICE = torch.ops.prim.device.default


class MeteredFakeMode(FakeTensorMode):
    """The planner's FakeTensorMode, which also does the counting of a LiveBytesMeter entered inside
    it (LiveBytesMeter.__enter__ attaches itself instead of pushing a mode of its own). The counts
    are the same: the meter sees each op the step dispatches, before the fake mode runs it, and none
    of the ops the fake mode runs inside (a decomposition), as an outer mode would; but every op
    passes one Python mode, not two. And a FakeTensor's device, which the dispatcher asks for about
    twice an op (prim.device: two in three of a fake step's calls, most from autograd), is answered
    at once, as FakeTensor's own handler answers it. Under it a step's estimate takes about an eighth
    less time (benchmarks/docs/max_seq_time.md).

    A meter pushed as a mode sees nothing while the modes are switched off (_disable_current_modes:
    the runtime's inline host jobs); a FakeTensor's op then enters the fake mode again on its own
    (`with fake_mode`). So the attached meter counts only ops dispatched at the depth of entries it
    attached at."""

    def __init__(self, *args, replays: dict | None = None, **kwargs):
        """`replays`: the table of replayed() (transient peaks by key), shared by the steps of one
        estimate (the two depths of the estimate by depth)."""
        super().__init__(*args, **kwargs)
        self.meter: LiveBytesMeter | None = None
        self.replays = {} if replays is None else replays
        self.tiled_blocks = False  # a block of the step ran in tiles of tokens (note_tiled_block)
        self.entries = 0  # times entered and not left: `with mode` nested
        self.metered_entries = -1  # the entries at which the meter attached
        self._inside = 0  # > 0 while the fake mode runs an op: what it dispatches then is its own

    def __enter__(self):
        self.entries += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.entries -= 1
        return super().__exit__(*exc)

    def attach(self, meter: LiveBytesMeter | None) -> None:
        self.meter, self.metered_entries = meter, self.entries

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and len(args) == 1 and isinstance(args[0], FakeTensor):
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        meter = self.meter  # a pushed meter sees its own thread only (modes are per thread)
        if meter is None or meter.thread != threading.get_ident() or self.entries != self.metered_entries:
            return super().__torch_dispatch__(func, types, args, kwargs or {})
        if self._inside or meter.host_allocations or func in _ALLOCATES_NOTHING:
            return self._run(func, types, args, kwargs)
        return meter.counted(func, args, kwargs, lambda: self._run(func, types, args, kwargs))

    def _run(self, func, types, args, kwargs):
        self._inside += 1
        try:
            return super().__torch_dispatch__(func, types, args, kwargs or {})
        finally:
            self._inside -= 1


def _tensors(values) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments or results (nested in lists, tuples and dicts): what
    torch's pytree flattening finds there, at a fraction of its cost on the hot path."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)
        elif isinstance(value, dict):
            yield from _tensors(value.values())


class CpuMeter:
    """Per-step device peak on the CPU: a LiveBytesMeter around the step. `segments`: also keep
    each segment's peak (the estimate's depth extrapolation); the last step's reading stays in
    `last_reading`."""

    kind = "measured: live tensor bytes (CPU meter)"

    def __init__(self, segments: bool = False):
        self.segments = segments
        self.last_reading: LiveBytesMeter | None = None

    @contextlib.contextmanager
    def measure(self, resident: Iterable[tuple[torch.Tensor | None, str]]) -> Iterator[LiveBytesMeter]:
        """`resident`: (tensor, category) pairs alive when the step starts."""
        meter = LiveBytesMeter("cpu", self.segments)
        for tensor, category in resident:
            meter.track([tensor], category)
        if meter.segments is not None:
            meter.enter_segment(("start",))
        try:
            with meter:
                yield meter
        finally:
            meter.close()
            self.last_reading = meter


def mark(*label) -> None:
    """The step enters segment `label` (e.g. ("forward", block index)): every segmenting meter
    measuring now starts counting its peak apart. Engines and the Stack mark block boundaries; it
    costs nothing when no meter keeps segments."""
    for meter in list(_ACTIVE):
        if meter.segments is not None:
            meter.enter_segment(label)


def mark_on_backward(tensor: torch.Tensor, *label) -> None:
    """Mark segment `label` when autograd reaches `tensor`'s gradient (a block's backward begins),
    for backward passes autograd runs itself. Registers nothing unless a segmenting meter measures."""
    if tensor.requires_grad and any(m.segments is not None for m in list(_ACTIVE)):
        tensor.register_hook(lambda grad: mark(*label))


class _TotalsOnly:
    """A reading with a total and no breakdown: phases and re-tags are accepted and ignored."""

    peak: int | None = None
    peak_breakdown: dict | None = None

    @contextlib.contextmanager
    def phase(self, category: str) -> Iterator[None]:
        yield

    def retag(self, tensor: torch.Tensor | None, category: str) -> None:
        pass


NO_READING = _TotalsOnly()  # for code paths that are not measured (evaluation)


class _CudaReading(_TotalsOnly):
    """The allocator's peak since the step began: live while it runs (lsp keeps its projector pass's
    peak mid-step), fixed when the meter closes."""

    def __init__(self, device: torch.device):
        self.device, self.final = device, None

    @property
    def peak(self) -> int:
        return self.final if self.final is not None else torch.cuda.max_memory_allocated(self.device)


class CudaMeter:
    """Per-step device peak on CUDA: the caching allocator's max_memory_allocated."""

    kind = "measured: CUDA allocator peak"

    def __init__(self, device: torch.device):
        self.device = device

    @contextlib.contextmanager
    def measure(self, resident: Iterable[tuple[torch.Tensor | None, str]]) -> Iterator[_CudaReading]:
        del resident  # the allocator already knows every live tensor
        torch.cuda.reset_peak_memory_stats(self.device)
        reading = _CudaReading(self.device)
        try:
            yield reading
        finally:
            reading.final = torch.cuda.max_memory_allocated(self.device)


class NullMeter:
    """For runs that opt out of measuring (train.measure_memory=false); peaks read as None."""

    kind = "not measured"

    @contextlib.contextmanager
    def measure(self, resident: Iterable[tuple[torch.Tensor | None, str]]) -> Iterator[_TotalsOnly]:
        del resident
        yield _TotalsOnly()


def meter_for(device: torch.device, enabled: bool = True) -> CpuMeter | CudaMeter | NullMeter:
    if not enabled:
        return NullMeter()
    return CudaMeter(device) if device.type == "cuda" else CpuMeter()
