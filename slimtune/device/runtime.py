"""The offload runtime: host storage kept for the device, the host <-> device link, a fixed pool of
device slots, and a host worker. Shared by activations' host/disk stores and the engines that keep
state off the device (slide today).

- `host_empty` / `to_host_storage`: host tensors made for the device: pinned on CUDA (so copies are
  asynchronous DMA); on a CPU-only run, marked host-resident so the device meter leaves them out,
  as a GPU's meter would.
- `Link`: copies across the host link, counted in bytes both ways. CUDA: a side copy stream ordered
  by events, so copies overlap compute. CPU: the same calls done synchronously (events are None).
- `SlotPool`: `count` device buffers of fixed size (weights + gradients), allocated once and lent
  to units in turn; never reallocated, so device memory does not grow with depth.
- `SlotBinding`: some modules' tensors laid out in a slot. `bind` copies them in and points the
  modules' parameters and buffers at the copies (and, for training, their .grad at zeroed gradient
  views), `unbind` points them back at their host tensors, `download_grads` sends the gradients down.
- `scratch_folder` / `remove_orphans`: private folders on disk for state kept off the device (block
  inputs, memory-mapped moments), named after their process, so a later run removes those a killed
  process left behind. A `ScratchFolder` reserves its files' blocks before they are mapped and
  refuses a disk without room in one sentence (`DiskUse`); removed, it takes with it the folders
  above it that it made and that are left empty.
- `HostWorker`: one thread running host work (optimizer updates) in submission order. torch's CPU
  kernels release the GIL, so the device loop keeps going while it runs; `barrier()` waits for all.
  The device meter (a thread-local dispatch mode) does not see host work, as it should not. Under
  FakeTensorMode (the planner's estimate), which is not thread-safe, `inline=True` runs each job
  at once on the caller's thread with the dispatch modes (meter included) switched off.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from slimtune.errors import UserError
from slimtune.device.memory import host_allocation, mark_host_resident
from slimtune.units import human_bytes

SLOT_ALIGN = 256  # bytes: every tensor view in a slot starts on this boundary


def host_empty(shape, dtype: torch.dtype, device: torch.device | None, stride=None, pinned: bool = True) -> torch.Tensor:
    """An uninitialised host tensor made for traffic with `device`: pinned on CUDA unless told not
    to (host state that never crosses the link: pinned memory is scarce and allocated in powers of two)."""
    cuda = pinned and device is not None and device.type == "cuda"
    with host_allocation():
        if stride is None:
            host = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=cuda)
        else:
            host = torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=cuda)
    return mark_host_resident(host)


def to_host_storage(x: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of x (in `dtype` if given) that lives for the device: pinned / host-resident."""
    host = host_empty(x.shape, dtype or x.dtype, device)
    with torch.no_grad():
        host.copy_(x)
    return host


class Link:
    """Host <-> device copies. Counts bytes_up (host to device) and bytes_down."""

    def __init__(self, device: torch.device | None):
        self.device, self.cuda = device, device is not None and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.bytes_up = self.bytes_down = 0

    @property
    def bytes(self) -> int:
        return self.bytes_up + self.bytes_down

    def to_host(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        """A new host copy of device tensor x, and the event after which it is filled."""
        # x's strides when dense (a permutation), else contiguous ones: what empty_like keeps.
        host = host_empty(x.shape, x.dtype, self.device, torch.empty_like(x, device="meta").stride())
        return host, self.copy_down(host, x)

    def to_device(self, host: torch.Tensor, after: object = None) -> tuple[torch.Tensor, object]:
        """A new device copy of host tensor `host` (after event `after`), and its ready event."""
        if not self.cuda:
            self.bytes_up += nbytes(host)
            return host.clone(), None  # clone keeps dense strides; the meter counts it as device memory
        with torch.cuda.stream(self.stream):  # allocated on the side stream: see ready()
            x = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        return x, self.copy_up(x, host, after)

    def copy_up(self, dst: torch.Tensor, src: torch.Tensor, after: object = None) -> object:
        """Host src into the existing device tensor dst (a dtype cast on the way is allowed)."""
        self.bytes_up += nbytes(src)
        if not self.cuda:
            with torch.no_grad():
                dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream), torch.no_grad():
            if after is not None:
                self.stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            return self.stream.record_event()

    def compute_mark(self) -> object:
        """An event after everything the compute stream has issued so far (None off CUDA): the `after` of a
        copy up that overwrites a tensor those kernels may still read (copy_up waits for nothing else)."""
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def drain(self) -> None:
        """Wait, on the host, for every copy issued on this link so far: before the host writes the source
        of a copy up (a non-blocking copy from pinned memory reads it when it runs, not when issued)."""
        if self.cuda:
            self.stream.synchronize()

    def zero(self, dst: torch.Tensor, after: object = None) -> object:
        """Zero a device tensor on the copy stream (ordered after its earlier copies, e.g. the
        download of the gradients it held)."""
        if not self.cuda:
            with torch.no_grad():
                dst.zero_()
            return None
        with torch.cuda.stream(self.stream), torch.no_grad():
            if after is not None:
                self.stream.wait_event(after)
            dst.zero_()
            return self.stream.record_event()

    def copy_down(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        """Device src into the existing host tensor dst, after the compute that made src."""
        self.bytes_down += nbytes(src)
        if not self.cuda:
            with torch.no_grad():
                dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)  # src may be freed on the main stream before this copy ran
            return self.stream.record_event()

    def wait(self, event: object) -> None:
        """The compute stream waits for `event` (a copy's completion)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def ready(fetched: tuple) -> torch.Tensor:
        """(device tensor, its copy event) -> the tensor, usable on the compute stream."""
        x, event = fetched
        if event is not None:
            current = torch.cuda.current_stream(x.device)
            current.wait_event(event)
            x.record_stream(current)  # allocated on the side stream, used and freed on this one
        return x


def nbytes(x: torch.Tensor) -> int:
    """Bytes of x's elements (not of its storage)."""
    return x.numel() * x.element_size()


def aligned(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def nbytes_of(shape, dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of `shape` and `dtype`."""
    return int(torch.Size(shape).numel()) * dtype.itemsize


def view_bytes(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A `dtype` tensor of `shape` over bytes [offset, ...) of a uint8 buffer whose size and `offset`
    are multiples of dtype's size (slots and staging buffers are SLOT_ALIGN-aligned): two ops, not
    three (a unit binds every tensor's weight and gradient views each time it comes up)."""
    strides, step = [], 1
    for size in reversed(shape):  # contiguous
        strides.insert(0, step)
        step *= size
    return buffer.view(dtype).as_strided(shape, strides, offset // dtype.itemsize)


@dataclass
class Slot:
    weights: torch.Tensor  # uint8 device buffer: a unit's weights (and frozen buffers)
    grads: torch.Tensor | None  # uint8 device buffer: its trainable weights' gradients
    released: object = None  # event: the previous borrower's device work on it is done
    holder: str | None = None


class SlotPool:
    """`count` device slots of fixed size, allocated once; `acquire` lends the oldest free one."""

    def __init__(self, device: torch.device, count: int, weight_bytes: int, grad_bytes: int):
        self.device = device
        self.slots = [Slot(torch.empty(aligned(weight_bytes), dtype=torch.uint8, device=device),
                           torch.empty(aligned(grad_bytes), dtype=torch.uint8, device=device) if grad_bytes else None)
                      for _ in range(count)]
        self.free = list(self.slots)
        self.allocations = count  # buffers ever made: stays `count` for the pool's life

    def tensors(self) -> list[torch.Tensor]:
        return [t for s in self.slots for t in (s.weights, s.grads) if t is not None]

    def acquire(self, holder: str) -> Slot:
        if not self.free:
            held = ", ".join(s.holder or "?" for s in self.slots)
            raise RuntimeError(f"no free device slot for {holder}: all {len(self.slots)} are held ({held}).")
        slot = self.free.pop(0)
        if slot.released is not None:
            # The host waits for the last borrower's compute: this bounds how far it runs ahead,
            # so buffers freed on the device are reusable and memory stays that of the window.
            slot.released.synchronize()
        slot.holder = holder
        return slot

    def release(self, slot: Slot) -> None:
        """Give the slot back once the work queued on it so far is done (an event on CUDA)."""
        if self.device.type == "cuda":
            slot.released = torch.cuda.current_stream(self.device).record_event()
        slot.holder = None
        self.free.append(slot)


@dataclass
class SlotTensor:
    """One tensor of a binding: where it rests on the host and where it goes in a slot."""

    owner: nn.Module
    attr: str
    param: nn.Parameter | None  # None: a buffer
    host: torch.Tensor  # at rest: e.g. a view into a flat master, or the frozen host tensor
    device_dtype: torch.dtype
    trainable: bool
    shadow: torch.Tensor | None = None  # the master in device_dtype, when that is narrower (what goes up)
    offset: int = 0  # bytes into slot.weights
    grad_offset: int = 0  # bytes into slot.grads (trainable only)

    @property
    def upload(self) -> torch.Tensor:
        """What crosses the link: the narrow shadow of a master, else the host tensor itself."""
        return self.shadow if self.shadow is not None else self.host

    def weight_in(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor's place in a slot's weight buffer."""
        return view_bytes(buffer, self.offset, tuple(self.host.shape), self.device_dtype)

    def grad_in(self, buffer: torch.Tensor) -> torch.Tensor:
        """Its gradient's place in a slot's gradient buffer or a host staging buffer (same layout)."""
        return view_bytes(buffer, self.grad_offset, tuple(self.host.shape), self.device_dtype)


def own_tensors(modules: list[nn.Module]):
    """(owner, attr, tensor, is_param) of every parameter and buffer of `modules`, each tensor once."""
    seen = set()
    for module in modules:
        for owner in module.modules():
            for table, is_param in ((owner._parameters, True), (owner._buffers, False)):
                for attr, tensor in table.items():
                    if tensor is not None and id(tensor) not in seen:
                        seen.add(id(tensor))
                        yield owner, attr, tensor, is_param


class SlotBinding:
    """Tensors laid out in a slot (each view SLOT_ALIGN-aligned): `weight_bytes` and `grad_bytes` are
    what a slot must hold for them."""

    def __init__(self, tensors: list[SlotTensor]):
        self.tensors = tensors
        self.slot: Slot | None = None
        self.grads_bound = False
        self.weight_bytes = self.grad_bytes = 0
        for t in tensors:
            t.offset = self.weight_bytes
            self.weight_bytes += aligned(nbytes_of(t.host.shape, t.device_dtype))
            if t.trainable:
                t.grad_offset = self.grad_bytes
                self.grad_bytes += aligned(nbytes_of(t.host.shape, t.device_dtype))

    def bind(self, slot: Slot, link: Link, with_grads: bool) -> object:
        """Copy the tensors into `slot` and point their modules at the copies; zero and attach the
        gradient views when `with_grads`. Returns the copies' event (None on the CPU). The caller
        makes sure the host tensors are final (no host update of them still running)."""
        self.slot = slot
        after = slot.released
        event = self._zero_grads(link, after) if with_grads else None  # after the last borrower's grads went down
        for t in self.tensors:
            view = t.weight_in(slot.weights)
            event = link.copy_up(view, t.upload, after)
            if t.param is not None:
                t.param.data = view
            else:
                t.owner._buffers[t.attr] = view
        if with_grads:
            self._set_grads()
        return event

    def attach_grads(self, link: Link) -> object:
        """For tensors bound without: zeroed gradient views become .grad; returns the zeroing's event."""
        event = self._zero_grads(link)
        self._set_grads()
        return event

    def _zero_grads(self, link: Link, after: object = None) -> object:
        event = None
        for t in self.tensors:
            if t.trainable:
                event = link.zero(t.grad_in(self.slot.grads), after)
        return event

    def _set_grads(self) -> None:
        """The slot's gradient views become the trainable parameters' .grad (autograd adds into them)."""
        for t in self.tensors:
            if t.trainable:
                t.param.grad = t.grad_in(self.slot.grads)
        self.grads_bound = True

    def unbind(self) -> Slot:
        """Point the modules back at the host tensors; returns the slot."""
        for t in self.tensors:
            if t.param is not None:
                t.param.data = t.host
                t.param.grad = None
            else:
                t.owner._buffers[t.attr] = t.host
        slot, self.slot, self.grads_bound = self.slot, None, False
        return slot

    def download_grads(self, link: Link, staging: torch.Tensor) -> object:
        """The slot's gradients into the host `staging` buffer (same layout); returns the event."""
        event = None
        for t in self.tensors:
            if t.trainable:
                event = link.copy_down(t.grad_in(staging), t.grad_in(self.slot.grads))
        return event


def card_index(device: torch.device) -> int:
    """A CUDA device's index; an index-less one's is the current device's."""
    return torch.cuda.current_device() if device.index is None else device.index


def one_thread(name: str, device: torch.device | None) -> ThreadPoolExecutor:
    """A pool of one thread (its jobs run in submission order). `device`: a CUDA device the jobs wait on
    (events) is made the thread's own, so a rank's thread never touches another rank's card (a new
    thread starts on cuda:0, where it would make a context of its own)."""
    if device is None or device.type != "cuda":
        return ThreadPoolExecutor(1, thread_name_prefix=name)
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=torch.cuda.set_device,
                              initargs=(card_index(device),))


class HostWorker:
    """Host work in submission order on one thread; `barrier` waits for it and re-raises errors."""

    def __init__(self, inline: bool = False, device: torch.device | None = None):
        """`device`: the card the jobs wait on (one_thread)."""
        self.inline = inline
        self.executor = None if inline else one_thread("slimtune-host", device)
        self.pending: list[Future] = []

    def submit(self, fn, *args) -> Future:
        if self.inline:
            from torch.utils._python_dispatch import _disable_current_modes

            job = Future()
            with _disable_current_modes():
                job.set_result(fn(*args))
            return job
        job = self.executor.submit(fn, *args)
        self.pending.append(job)
        return job

    def barrier(self) -> None:
        jobs, self.pending = self.pending, []
        for job in jobs:
            job.result()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


def _host_tag() -> str:
    """This machine, in a scratch folder's name: a pid means something only on the machine it runs on
    (ranks of several machines may share one output_dir)."""
    import hashlib
    import socket

    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # the disk, or this user's quota on it, is full


@dataclass(frozen=True)
class DiskUse:
    """A setting that keeps files on disk, as its refusal names it: `mode` (e.g. chunk.state=disk),
    `what` it keeps there, `setting` (the folder's key) and `instead` (the choice that needs no disk)."""

    mode: str
    what: str
    setting: str
    instead: str

    def check(self, root: Path, need: int, margin: int = 0) -> None:
        """Refuse unless `root`'s disk has `need` bytes free beside `margin`."""
        free = shutil.disk_usage(root).free
        if need + margin > free:
            raise self.no_room(root, need, free)

    def no_room(self, root: Path, need: int, free: int) -> UserError:
        return UserError(f"{self.mode} needs {human_bytes(need)} for {self.what} in '{root}', which has"
                         f" {human_bytes(free)} free; free space there, set {self.setting} elsewhere, or use"
                         f" {self.instead}.")


@dataclass
class ScratchFolder:
    """A folder of this process's files: a private one under `root` (scratch_folder), or any folder
    named as it is (`private` False: only the files reserved here are ever deleted). `use`: how its
    setting is named when the disk has no room (None: the folder is only named); `need`: the bytes
    its owner will reserve there in all, and `free`: the disk's free bytes before any of them (what
    that need met; files already mapped hold their blocks until unmapped), for that sentence; `made`:
    the folders from root up that this process created (deepest first), removed with a private folder
    when it leaves them empty."""

    path: Path
    root: Path
    use: DiskUse | None = None
    need: int = 0
    free: int | None = None
    made: tuple[Path, ...] = ()
    private: bool = False
    files: list[Path] = field(default_factory=list)
    reserved: int = 0

    def reserve(self, name: str, nbytes: int) -> Path:
        """A new file `name` of `nbytes` zeros whose blocks the disk has allocated: a memory map of a
        sparse file dies of SIGBUS at the first page the disk cannot back, this refuses at once. On
        any failure every file reserved here goes (its owner is not built) and one sentence says why."""
        path = self.path / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.files.append(path)
            try:
                _allocate(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as err:
            self.remove()
            raise self._refusal(err, self.reserved + nbytes) from None
        self.reserved += nbytes
        return path

    def _refusal(self, err: OSError, reserved: int) -> UserError:
        if err.errno in NO_ROOM and self.use is not None:
            free = self.free if self.free is not None else shutil.disk_usage(_existing(self.root)).free
            return self.use.no_room(self.root, max(self.need, reserved), free)
        named = self.use.setting + " " if self.use is not None else ""
        return UserError(f"{named}'{self.root}' cannot hold {self.use.what if self.use else 'state files'}"
                         f" ({err.strerror or err}).")

    def remove(self) -> None:
        """Delete the files reserved here; a private folder goes whole, then each folder above it this
        process made, while they are empty."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files, self.reserved = [], 0
        if not self.private:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:  # not empty (another run's files, or the run's own), or gone
                break


def _allocate(fd: int, nbytes: int) -> None:
    if nbytes <= 0:  # posix_fallocate refuses a length of 0 (EINVAL); an empty file needs no blocks
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno != errno.EOPNOTSUPP:
            raise
        os.ftruncate(fd, nbytes)  # a file system that cannot reserve (glibc emulates it on most): sparse, as before


def _existing(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def scratch_folder(root: Path, kind: str, setting: str, use: DiskUse | None = None, need: int = 0) -> ScratchFolder:
    """A new private folder `<kind>-<pid>@<host>-<random>` under `root` for this process's files.
    `setting`: the key that named `root`, for the sentence when it is not usable; `use` and `need`:
    see ScratchFolder."""
    root = Path(root)
    made = tuple(folder for folder in (root, *root.parents) if not folder.exists())
    try:
        root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}@{_host_tag()}-", dir=root))
        free = shutil.disk_usage(path).free
    except OSError as err:
        raise UserError(f"{setting} '{root}' is not a usable folder ({err}).") from None
    return ScratchFolder(path, root, use, need, free, made, private=True)


def remove_orphans(root: Path, kind: str) -> list[Path]:
    """Delete the `<kind>-<pid>@<host>-*` folders of this machine under `root` whose process is gone
    (a kill -9 runs no clean-up); those of live processes, e.g. another run sharing the folder, and
    those of other machines stay. Returns the removed."""
    removed = []
    for folder in sorted(root.glob(f"{kind}-*")) if root.is_dir() else []:
        found = re.fullmatch(rf"{re.escape(kind)}-(\d+)(?:@([0-9a-f]+))?-.+", folder.name)
        if not found or found.group(2) not in (None, _host_tag()):
            continue
        if folder.is_dir() and not _alive(int(found.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True

