"""AdamW on the host over flat tensors: the optimizer of every engine that keeps its trainable state
off the device (slide's units today; lsp's d x d coordinates, chunk's slices and roundpipe's stages
are flat tensors too).

A HostAdam owns, for each group (a flat run of numbers with one weight decay, cut into members of
given shapes):
- the master, fp32 (fp64 stays fp64), pinned on CUDA when it crosses the link itself;
- a gradient accumulator of the same size, which callers add into;
- optionally a shadow in a narrower dtype (bf16): what goes up to the device, refreshed after each
  update, so uploads move 2 bytes a number and the host casts once per step, not once per upload;
- the AdamW moments, in host RAM or in memory-mapped files (`moments_dir`: the page cache keeps as
  much of them as RAM allows; the files go with the optimizer). Each file's blocks are reserved
  before it is mapped, so a full disk is refused in one sentence, not met as SIGBUS mid-step.
`update(lr, clip)` runs torch's fused CPU AdamW (one kernel per group; it releases the GIL, so a
worker thread runs it beside the device loop) on the accumulated gradients times `clip`, then zeroes
them and refreshes the shadows. `member(k, i)` gives every per-member view, so module parameters can
live in the flat buffers. Host storage is marked host-resident, so the device meter leaves it out.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from slimtune.device import memory, runtime

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Group:
    """Members (their shapes, laid out one after another) sharing one weight decay."""

    shapes: tuple[torch.Size, ...]
    weight_decay: float

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    def spans(self) -> list[tuple[int, int, torch.Size]]:
        """(start, numel, shape) of each member in the flat run."""
        out, start = [], 0
        for shape in self.shapes:
            out.append((start, shape.numel(), shape))
            start += shape.numel()
        return out


@dataclass
class MemberViews:
    """One member's place in each flat tensor of its group."""

    master: torch.Tensor
    grad: torch.Tensor
    shadow: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class Working:
    """Gradient accumulators and shadows for optimizers that take turns (engine chunk's chunks):
    sized for the largest, each optimizer's groups are views from the start, so only one
    optimizer's worth of them exists in host RAM."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, shadow_dtype: torch.dtype | None):
        self.grad = runtime.host_empty((numel,), dtype, device, pinned=False).zero_()
        self.shadow = runtime.host_empty((numel,), shadow_dtype, device) if shadow_dtype not in (None, dtype) else None

    def views(self, groups: list[Group], shadows: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        grads, shadow_views, start = [], [], 0
        for group in groups:
            grads.append(self.grad[start : start + group.numel])
            shadow_views.append(self.shadow[start : start + group.numel] if shadows and self.shadow is not None
                                else None)
            start += group.numel
        return grads, shadow_views

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.grad, self.shadow) if t is not None)


class HostAdam:
    def __init__(self, name: str, groups: list[Group], dtype: torch.dtype, device: torch.device,
                 settings: dict, shadow_dtype: torch.dtype | None = None,
                 moments_dir: runtime.ScratchFolder | Path | None = None,
                 masters_on_disk: bool = False, working: Working | None = None):
        """`dtype`: the masters'; `device`: the device they feed (pinning on CUDA); `settings`:
        AdamW's lr, betas, eps (rules.adamw_settings); `shadow_dtype`: a narrower dtype to upload in,
        or None; `moments_dir`: a folder for memory-mapped moments (moments_folder's, or any
        existing one), or None for RAM;
        `masters_on_disk`: the masters are memory-mapped there too (they then read as zeros until
        set); `working`: gradient accumulators and shadows shared with other optimizers that never
        update at the same time (engine chunk's chunks), instead of buffers of its own."""
        self.name, self.groups, self.device = name, groups, device
        self.shadow_dtype = shadow_dtype if shadow_dtype not in (None, dtype) else None
        self.moments_dir = runtime.ScratchFolder(moments_dir, moments_dir) if isinstance(moments_dir, Path) \
            else moments_dir
        self.masters_on_disk = masters_on_disk and moments_dir is not None
        # Pinned only where the master itself crosses the link (no narrower shadow goes up in its place).
        self.masters = [self._master(g, k, dtype, pinned=self.shadow_dtype is None) for k, g in enumerate(groups)]
        self.working = working
        if working is not None:
            self.grads, self.shadows = working.views(groups, self.shadow_dtype is not None)
        else:
            self.grads = [runtime.host_empty((g.numel,), dtype, device, pinned=False).zero_() for g in groups]
            self.shadows = [runtime.host_empty((g.numel,), self.shadow_dtype, device) if self.shadow_dtype else None
                            for g in groups]
        self.flats = [nn.Parameter(master) for master in self.masters]
        for flat, grad in zip(self.flats, self.grads):
            flat.grad = grad
        self.optimizer = torch.optim.AdamW([{"params": [flat], "weight_decay": g.weight_decay}
                                            for flat, g in zip(self.flats, groups)], **settings, fused=True)
        for k, flat in enumerate(self.flats):  # made here, host-resident, not lazily on a worker thread
            self.optimizer.state[flat] = {
                "step": memory.mark_host_resident(torch.zeros((), dtype=torch.float32)),
                **{moment: self._moment(flat, f"{k}-{moment}") for moment in MOMENTS},
            }

    def _master(self, group: Group, k: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        if self.masters_on_disk:
            like = runtime.host_empty((0,), dtype, self.device, pinned=False)
            if not is_fake(like):
                return self._file((group.numel,), dtype, f"{k}-master")
        return runtime.host_empty((group.numel,), dtype, self.device, pinned=pinned)

    def _file(self, shape, dtype: torch.dtype, tag: str) -> torch.Tensor:
        """A memory-mapped tensor in moments_dir (a new file reads as zeros), marked host-resident."""
        numel = math.prod(shape)
        path = self.moments_dir.reserve(f"{self.name.replace(' ', '-')}-{tag}.bin", numel * dtype.itemsize)
        return memory.mark_host_resident(torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape))

    def _moment(self, flat: torch.Tensor, tag: str) -> torch.Tensor:
        """A zeroed moment: in host RAM, or a memory-mapped file (a new file reads as zeros). Fake
        tensors (the planner's estimate) never touch a disk."""
        if self.moments_dir is None or is_fake(flat):
            return runtime.host_empty(flat.shape, flat.dtype, self.device, pinned=False).zero_()
        return self._file(flat.shape, flat.dtype, tag)

    # ------------------------------------------------------------ views

    def state(self, k: int) -> dict[str, torch.Tensor]:
        """Group k's live AdamW state: step (a 0-dim tensor), exp_avg, exp_avg_sq."""
        return self.optimizer.state[self.flats[k]]

    def member(self, k: int, i: int) -> MemberViews:
        state = self.state(k)
        return MemberViews(*(self.cut(k, i, flat) for flat in (self.masters[k], self.grads[k], self.shadows[k],
                                                                state["exp_avg"], state["exp_avg_sq"])))

    def cut(self, k: int, i: int, flat: torch.Tensor | None) -> torch.Tensor | None:
        """Member i of group k's place in `flat`, a tensor laid out as the group's masters."""
        start, numel, shape = self.groups[k].spans()[i]
        return None if flat is None else flat[start : start + numel].view(shape)

    # ------------------------------------------------------------ host work

    def update(self, lr: float, clip: float = 1.0, shadows: list[torch.Tensor] | None = None) -> None:
        """AdamW on the masters with the accumulated gradients times `clip`; then zero them, and
        round the masters into the shadows (or into `shadows`, per group, refresh_shadows)."""
        with torch.no_grad():
            if clip != 1.0:
                for grad in self.grads:
                    grad.mul_(clip)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            for grad in self.grads:
                grad.zero_()
            self.refresh_shadows(shadows)

    def discard(self) -> None:
        """Empty the accumulators without an update (a step that may not update the weights)."""
        with torch.no_grad():
            for grad in self.grads:
                grad.zero_()

    def refresh_shadows(self, into: list[torch.Tensor] | None = None) -> None:
        """The shadows become the masters rounded once (after an update, or after loading masters).
        `into`: per group, other tensors laid out as the masters to write instead (a pipeline's
        versions of the weights, engines/roundpipe/step_weights.py), in the shadows' dtype or the masters'."""
        with torch.no_grad():
            for shadow, master in zip(self.shadows if into is None else into, self.masters):
                if shadow is not None:
                    shadow.copy_(master)

    def state_dict(self) -> dict:
        """Per group: the master, the moments and AdamW's step count (the live tensors, not copies)."""
        return {"masters": list(self.masters),
                **{moment: [self.state(k)[moment] for k in range(len(self.groups))] for moment in MOMENTS},
                "steps": [float(self.state(k)["step"]) for k in range(len(self.groups))]}

    def load_state_dict(self, state: dict) -> None:
        """Copy a state_dict() into this optimizer's own tensors (RAM or its memory-mapped files)."""
        with torch.no_grad():
            for k in range(len(self.groups)):
                self.masters[k].copy_(state["masters"][k])
                for moment in MOMENTS:
                    self.state(k)[moment].copy_(state[moment][k])
                self.state(k)["step"].fill_(state["steps"][k])
        self.refresh_shadows()

    def grad_norms(self) -> list[torch.Tensor]:
        return [torch.linalg.vector_norm(grad) for grad in self.grads]

    def host_bytes(self) -> int:
        """Host RAM held: masters, accumulators, shadows, and the moments unless they are files."""
        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        moments = 0 if self.moments_dir is not None else 2 * nbytes(self.masters)
        masters = 0 if self.masters_on_disk else nbytes(self.masters)
        working = 0 if self.working is not None else nbytes(self.grads) + nbytes(self.shadows)  # the owner's
        return masters + working + moments


SCRATCH_KIND = "adam"  # runtime.scratch_folder's name for a folder of memory-mapped moments


MOMENTS_ON_DISK = runtime.DiskUse("slide.moments=disk", "the AdamW moments", "slide.moments_dir", "slide.moments=ram")


def moments_folder(owner: object, root: Path, use: runtime.DiskUse, need: int = 0) -> runtime.ScratchFolder:
    """A private folder under `root` for memory-mapped moments (and masters), deleted when `owner` is
    collected or at exit, with `root` when this process made it and it is left empty (a killed run's
    is removed by the next run: runtime.remove_orphans). `use`: the setting that keeps them there;
    `need`: the bytes its files take in all, named when the disk has no room for them."""
    folder = runtime.scratch_folder(root, SCRATCH_KIND, use.setting, use, need)
    weakref.finalize(owner, folder.remove)
    return folder


def moments_bytes(params) -> int:
    """Disk taken by the memory-mapped moments of `params`: two a number, in each one's master dtype."""
    return sum(2 * p.numel() * torch.promote_types(p.dtype, torch.float32).itemsize for p in params)
