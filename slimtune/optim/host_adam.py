"""AdamW on the host over flat tensors: the optimizer of every engine that keeps its trainable state
off the device (slide's units, lsp's d x d coordinates, chunk's slices, roundpipe's stages).

A HostAdam owns, for each group (a flat run of numbers with one weight decay, cut into members of
given shapes), what the layout (`Layout`, from train.master and train.moments) keeps:
- the master. When weights go up in bf16 and the masters are fp32, under the split layout (the
  default) it rests as the bf16 weight that goes up plus a 16-bit residual (split_master.py): 4 bytes
  a number where a whole fp32 master and its bf16 shadow took 6, and the same updates bit for bit.
  Otherwise a whole master (fp32; fp64 stays fp64), with a narrower shadow when weights go up narrower;
- a gradient accumulator that callers add into, in the layout's gradient dtype (the compute dtype
  when a step's gradients arrive whole, once: no fp32 copy of a bf16 gradient);
- the AdamW moments, fp32 or 8-bit blockwise codes (moments8.py), in host RAM or in memory-mapped
  files (`moments_dir`: the page cache keeps as much of them as RAM allows). Each file's blocks are
  reserved before it is mapped, so a full disk is refused in one sentence, not met as SIGBUS mid-step.
`update(lr, clip)` runs torch's fused CPU AdamW a tile at a time over each group (tiled_adamw.py:
the tile is rebuilt in cache-resident scratch, so each number crosses memory once each way; it
releases the GIL, so a worker thread runs it beside the device loop), then empties the accumulators.
`member(k, i)` gives every per-member view, so module parameters can live in the flat buffers. Host
storage is marked host-resident, so the device meter leaves it out.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.device import memory, runtime
from slimtune.optim import moments8, row_grads, split_master, tiled_adamw

MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_KINDS = ("fp32", "8bit")  # train.moments
# An update's numbers per thread at least: a thread started for fewer would cost about as much to
# start and join (tens of microseconds) as its share takes (about 1 ns a number).
NUMBERS_A_THREAD = 1 << 16


def host_threads(train, device: torch.device) -> int:
    """The threads a host update runs on: train.host_threads, or where it is 0, on a GPU the cores
    this process may use, shared among the machine's ranks (torchrun's LOCAL_WORLD_SIZE), less one
    for the thread driving the device; on a CPU run 1, the step's own compute taking the rest."""
    if train.host_threads > 0:
        return train.host_threads
    if device.type == "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, cores // ranks - 1)


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


@dataclass(frozen=True)
class Layout:
    """How a HostAdam keeps its numbers. `split`: a bf16 weight plus a residual stands for an fp32
    master (applies only where weights go up in bf16 over fp32 masters); `grad_dtype`: the
    accumulators' (None: the masters'); `moments`: "fp32" or "8bit"."""

    split: bool = True
    grad_dtype: torch.dtype | None = None
    moments: str = "fp32"
    row_grads: bool = False  # a table's gradient keeps only the rows a step touches (row_grads.py)
    accumulate: bool = True  # False: no accumulators; each update is handed its gradients (update's grads=)

    @classmethod
    def for_run(cls, train, whole_grads_dtype: torch.dtype | None, row_grads: bool = False) -> Layout:
        """The layout train.master and train.moments ask for. `whole_grads_dtype`: the dtype a unit's
        gradients come down in whole (None: they arrive otherwise); with one micro-batch a step the
        accumulator keeps that dtype (the gradient is the step's, held once as it came). With
        accumulation it stays fp32: micro-batches are summed on the host, exactly as before."""
        narrow = whole_grads_dtype if train.grad_accum == 1 else None
        return cls(split=train.master == "split", grad_dtype=narrow, moments=train.moments, row_grads=row_grads)


@dataclass
class MemberViews:
    """One member's place in each flat tensor of its group (None where the layout keeps no such
    tensor: no whole master under the split layout, no fp32 moments when they are 8-bit)."""

    master: torch.Tensor | None
    grad: torch.Tensor
    shadow: torch.Tensor | None
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None


class Working:
    """Gradient accumulators and shadows for optimizers that take turns (engine chunk's chunks):
    sized for the largest, each optimizer's groups are views from the start, so only one
    optimizer's worth of them exists in host RAM. No shadows are kept when `shadow_dtype` is None."""

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
        return sum(runtime.nbytes(t) for t in (self.grad, self.shadow) if t is not None)


class HostAdam:
    def __init__(self, name: str, groups: list[Group], dtype: torch.dtype, device: torch.device,
                 settings: dict, shadow_dtype: torch.dtype | None = None,
                 moments_dir: runtime.ScratchFolder | Path | None = None,
                 masters_on_disk: bool = False, working: Working | None = None, layout: Layout = Layout(),
                 weights: list[list[torch.Tensor]] | None = None, threads: int = 1):
        """`dtype`: the masters'; `device`: the device they feed (pinning on CUDA); `settings`:
        AdamW's lr, betas, eps (rules.adamw_settings); `shadow_dtype`: a narrower dtype to upload in,
        or None; `moments_dir`: a folder for memory-mapped moments (moments_folder's, or any
        existing one), or None for RAM; `masters_on_disk`: the masters (or residuals) are
        memory-mapped there too (they then read as zeros until set); `working`: gradient
        accumulators (and shadows, under a whole master) shared with other optimizers that never
        update at the same time (engine chunk's chunks), instead of buffers of its own. `weights`:
        under the split layout, per group and member, the bf16 tensors (views, strided or not) that
        are the masters' top half already: another owner's weights, not copies (slide's host weights
        under a chunk working set). `threads`: how many the native loop splits an update over
        (host_threads; the same bits at any count)."""
        self.name, self.groups, self.device, self.dtype, self.layout = name, groups, device, dtype, layout
        self.threads = threads
        self.settings = settings
        self.shadow_dtype = shadow_dtype if shadow_dtype not in (None, dtype) else None
        self.split = layout.split and self.shadow_dtype == torch.bfloat16 and dtype == torch.float32
        self.moments_dir = runtime.ScratchFolder(moments_dir, moments_dir) if isinstance(moments_dir, Path) \
            else moments_dir
        self.masters_on_disk = masters_on_disk and moments_dir is not None
        self.fake = is_fake(runtime.host_empty((0,), dtype, device, pinned=False))
        self.working = working
        self.weights = weights if self.split else None
        self._rest_masters(working)
        if not layout.accumulate:
            self.grads = [None] * len(groups)
        elif working is not None:
            self.grads = working.views(groups, False)[0]
        else:
            self.grads = [self._accumulator(g, layout.grad_dtype or dtype) for g in groups]
        self.steps = [memory.mark_host_resident(torch.zeros((), dtype=torch.float32)) for _ in groups]
        self.moments = [{moment: self._moment(g.numel, f"{k}-{moment}", moment == "exp_avg")
                         for moment in MOMENTS} for k, g in enumerate(groups)]

    def _accumulator(self, group: Group, dtype: torch.dtype):
        """A group's gradient accumulator: dense, or (layout.row_grads, a lone table) its touched rows."""
        if self.layout.row_grads and len(group.shapes) == 1 and len(group.shapes[0]) == 2:
            return row_grads.RowGrads(*group.shapes[0], dtype, self.device)
        return runtime.host_empty((group.numel,), dtype, self.device, pinned=False).zero_()

    def _rest_masters(self, working: Working | None) -> None:
        """Masters, shadows and residuals as the layout keeps them."""
        groups, dtype = self.groups, self.dtype
        # A Working set's shadows serve whole masters that take turns (chunks); else each keeps its own.
        self.shared_shadows = working is not None and working.shadow is not None and not self.split \
            and self.shadow_dtype is not None
        if self.split:  # the bf16 weight goes up (pinned); the residual stays (a file with the masters)
            self.masters = [None] * len(groups)
            self.shadows = [None] * len(groups) if self.weights is not None else [
                self._resting((g.numel,), torch.bfloat16, f"{k}-weight", self.masters_on_disk, pinned=True)
                for k, g in enumerate(groups)]
            self.residuals = [self._resting((g.numel,), torch.int16, f"{k}-residual", self.masters_on_disk)
                              for k, g in enumerate(groups)]
            return
        self.residuals = [None] * len(groups)
        # Pinned only where the master itself crosses the link (no narrower shadow goes up in its place).
        self.masters = [self._resting((g.numel,), dtype, f"{k}-master", self.masters_on_disk,
                                      pinned=self.shadow_dtype is None) for k, g in enumerate(groups)]
        if self.shared_shadows:
            self.shadows = working.views(groups, True)[1]
        else:
            self.shadows = [runtime.host_empty((g.numel,), self.shadow_dtype, self.device) if self.shadow_dtype
                            else None for g in groups]

    def _resting(self, shape, dtype: torch.dtype, tag: str, on_disk: bool, pinned: bool = False) -> torch.Tensor:
        """A tensor in host RAM, or (`on_disk`, real tensors) a memory-mapped file that reads as zeros."""
        if on_disk and not self.fake:
            return self._file(shape, dtype, tag)
        return runtime.host_empty(shape, dtype, self.device, pinned=pinned)

    def _file(self, shape, dtype: torch.dtype, tag: str) -> torch.Tensor:
        """A memory-mapped tensor in moments_dir (a new file reads as zeros), marked host-resident."""
        numel = math.prod(shape)
        path = self.moments_dir.reserve(f"{self.name.replace(' ', '-')}-{tag}.bin", numel * dtype.itemsize)
        return memory.mark_host_resident(torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape))

    def _moment(self, numel: int, tag: str, signed: bool):
        """A zeroed moment, fp32 (the masters' dtype) or 8-bit, in host RAM or memory-mapped files.
        Fake tensors (the planner's estimate) never touch a disk."""
        on_disk = self.moments_dir is not None

        def alloc(shape, dtype: torch.dtype) -> torch.Tensor:
            part = {torch.uint8: "-codes", torch.float32: "-absmax"}[dtype] if self.layout.moments == "8bit" else ""
            made = self._resting(shape, dtype, tag + part, on_disk)
            return made if on_disk and not self.fake else made.zero_()

        if self.layout.moments == "8bit":
            return moments8.Moment8(numel, signed, alloc)
        return alloc((numel,), self.dtype)

    # ------------------------------------------------------------ views

    def state(self, k: int) -> dict:
        """Group k's live AdamW state: step (a 0-dim tensor), exp_avg, exp_avg_sq (tensors, or
        moments8.Moment8 under 8-bit moments)."""
        return {"step": self.steps[k], **self.moments[k]}

    def member(self, k: int, i: int) -> MemberViews:
        """Member i's views (a RowGrads accumulator, a lone member's, is lent as it is)."""
        flat = [self.masters[k], self.grads[k], self.shadows[k],
                *(m if isinstance(m, torch.Tensor) else None for m in self.moments[k].values())]
        return MemberViews(*(self.cut(k, i, t) if not isinstance(t, row_grads.RowGrads) else t for t in flat))

    def cut(self, k: int, i: int, flat: torch.Tensor | None) -> torch.Tensor | None:
        """Member i of group k's place in `flat`, a tensor laid out as the group's masters."""
        start, numel, shape = self.groups[k].spans()[i]
        return None if flat is None else flat[start : start + numel].view(shape)

    def master_of(self, k: int, i: int) -> torch.Tensor:
        """Member i's master at full precision: a view of the whole master, or rebuilt from its split."""
        if not self.split:
            return self.cut(k, i, self.masters[k])
        out = torch.empty(self.groups[k].shapes[i], dtype=self.dtype)
        split_master.combine(self._weight(k, i), self.cut(k, i, self.residuals[k]), out)
        return out

    def _weight(self, k: int, i: int) -> torch.Tensor:
        """Member i's bf16 weight under the split layout: its place in the shadows, or another's tensor."""
        return self.weights[k][i] if self.weights is not None else self.cut(k, i, self.shadows[k])

    def moment_of(self, k: int, i: int, moment: str) -> torch.Tensor:
        """Member i's moment in fp32: a view, or decoded from its 8-bit blocks."""
        held = self.moments[k][moment]
        if isinstance(held, torch.Tensor):
            return self.cut(k, i, held)
        start, numel, shape = self.groups[k].spans()[i]
        return _decoded(held, start, start + numel).view(shape)

    def load_group(self, k: int, masters: list[torch.Tensor], moments: dict[str, list[torch.Tensor]],
                   step: float) -> None:
        """Group k's state from per-member tensors (any dtype; a checkpoint's): masters, moments
        (by name) and AdamW's step count. Shadows follow the masters."""
        with torch.no_grad():
            for i, values in enumerate(masters):
                self.set_master(k, i, values)
            for moment, members in moments.items():
                self._load_moment(k, moment, members)
            self.steps[k].fill_(step)
        self.refresh_shadows()

    def load_group_masters(self, masters: list[list[torch.Tensor]]) -> None:
        """Every group's masters from per-member tensors (a module's weights at the start)."""
        with torch.no_grad():
            for k, members in enumerate(masters):
                for i, values in enumerate(members):
                    self.set_master(k, i, values)
        self.refresh_shadows()

    def set_master(self, k: int, i: int, values: torch.Tensor) -> None:
        """Member i's master (and, under the split layout, its bf16 weight); a whole master's shadow
        follows at refresh_shadows. Fake tensors (the planner's) hold no values: nothing to split."""
        if self.split and self.fake:
            return
        if self.split:
            shape, weight = self.groups[k].shapes[i], self._weight(k, i)
            # values may be on the device (engine chunk's first visit reads a chunk's weights there): the
            # split's arithmetic runs beside the host buffers it writes
            split_master.split(values.to(device=weight.device, dtype=self.dtype).reshape(shape), weight,
                               self.cut(k, i, self.residuals[k]))
        else:
            self.cut(k, i, self.masters[k]).copy_(values)

    def rows(self, k: int, i: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of member i (a table) at full precision: an embedding's lookup on the host."""
        if not self.split:
            return self.cut(k, i, self.masters[k])[ids]
        weights = self.cut(k, i, self.shadows[k])[ids.reshape(-1)]
        residuals = self.cut(k, i, self.residuals[k])[ids.reshape(-1)]
        out = torch.empty((ids.numel(), self.groups[k].shapes[i][-1]), dtype=self.dtype)
        if not self.fake:  # the planner's step holds the same tensors, without values
            split_master.combine(weights, residuals, out)
        return out.view(*ids.shape, -1)

    def _load_moment(self, k: int, moment: str, members: list[torch.Tensor]) -> None:
        held, spans = self.moments[k][moment], self.groups[k].spans()
        if isinstance(held, torch.Tensor):
            for (start, numel, _), values in zip(spans, members):
                held[start : start + numel].copy_(values.reshape(-1))
            return
        pieces = [(start, values.reshape(-1).to(torch.float32)) for (start, _, _), values in zip(spans, members)]
        gathered = tiled_adamw.Scaled(pieces, 1.0)  # the members' values, a tile at a time
        scratch = tiled_adamw.SCRATCH.tiles(torch.float32)[0]
        for start in range(0, held.numel, tiled_adamw.TILE):
            stop = min(start + tiled_adamw.TILE, held.numel)
            held.quantize(start, stop, gathered.tile(start, stop, scratch[: stop - start]).contiguous())

    # ------------------------------------------------------------ host work

    def update(self, lr: float, clip: float = 1.0, shadows: list[torch.Tensor] | None = None,
               grads: list[list[tuple[int, torch.Tensor]]] | None = None) -> None:
        """AdamW on the masters with the accumulated gradients times `clip`; then empty them. The
        new weights go up from the shadows (or from `shadows`, per group: a pipeline's versions of
        the weights, engines/roundpipe/step_weights.py). `grads`: per group, the gradients as
        (offset in the group, flat tensor) pieces where they arrived, instead of accumulators."""
        betas = self.settings["betas"]
        with torch.no_grad():
            for k, group in enumerate(self.groups):
                self.steps[k].add_(1)
                if self.fake:  # the planner's step: nothing to compute, no bytes beyond the resting ones
                    continue
                hyper = tiled_adamw.Hyper(lr, betas[0], betas[1], self.settings["eps"], group.weight_decay)
                grad = tiled_adamw.Scaled(grads[k], clip) if grads is not None else self._grad_form(k, clip)
                own = grads is None and isinstance(self.grads[k], torch.Tensor)  # emptied in the same pass
                tiled_adamw.adamw(hyper, self.steps[k], group.numel, self.dtype, self._master_form(k, shadows),
                                  grad, *(self._moment_form(self.moments[k][m]) for m in MOMENTS),
                                  threads=self._threads_for(group.numel), empty_grad=own)
            for grad in self.grads:
                if grad is not None and (self.fake or not isinstance(grad, torch.Tensor)):
                    grad.zero_()  # a RowGrads (or the planner's step) is emptied here

    def update_span(self, k: int, start: int, stop: int, grad: torch.Tensor, lr: float, clip: float,
                    first: bool) -> None:
        """AdamW over numbers [start, stop) of group k with their gradient `grad` (flat, where it
        arrived): a table updated a tile of rows at a time as each tile's gradient is complete.
        `first`: the step's first span of the group (its step count advances). Spans start at
        multiples of 8 (the vector width: the same bits as one update of the whole group) and, under
        8-bit moments, of 256 (a block)."""
        if first:
            self.steps[k].add_(1)
        if self.fake:
            return
        assert start % (moments8.BLOCK if self.layout.moments == "8bit" else 8) == 0, start
        betas, group = self.settings["betas"], self.groups[k]
        hyper = tiled_adamw.Hyper(lr, betas[0], betas[1], self.settings["eps"], group.weight_decay)
        span = slice(start, stop)
        master = tiled_adamw.Split(self.shadows[k][span], self.residuals[k][span]) if self.split else \
            tiled_adamw.Whole(self.masters[k][span], () if self.shadows[k] is None else (self.shadows[k][span],))
        moments = [tiled_adamw.Whole(held[span]) if isinstance(held, torch.Tensor) else
                   tiled_adamw.Shifted(tiled_adamw.Coded(held), start) for held in self.moments[k].values()]
        with torch.no_grad():
            tiled_adamw.adamw(hyper, self.steps[k], stop - start, self.dtype, master,
                              tiled_adamw.Scaled([(0, grad.reshape(-1))], clip), *moments,
                              threads=self._threads_for(stop - start))

    def _threads_for(self, numel: int) -> int:
        """The threads an update of numel numbers runs on: self.threads, fewer for a short run."""
        return max(1, min(self.threads, numel // NUMBERS_A_THREAD))

    def _grad_form(self, k: int, clip: float) -> tiled_adamw.Form:
        grad = self.grads[k]
        return row_grads.Rows(grad, clip) if isinstance(grad, row_grads.RowGrads) else \
            tiled_adamw.Scaled([(0, grad)], clip)

    def _master_form(self, k: int, into: list[torch.Tensor] | None) -> tiled_adamw.Form:
        if self.weights is not None:
            members = [(start, w) for (start, _, _), w in zip(self.groups[k].spans(), self.weights[k])]
            return tiled_adamw.SplitOver(members, self.residuals[k])
        if self.split:
            return tiled_adamw.Split(self.shadows[k], self.residuals[k], () if into is None else (into[k],))
        shadow = self.shadows[k] if into is None else into[k]
        return tiled_adamw.Whole(self.masters[k], () if shadow is None else (shadow,))

    @staticmethod
    def _moment_form(held) -> tiled_adamw.Form:
        return tiled_adamw.Whole(held) if isinstance(held, torch.Tensor) else tiled_adamw.Coded(held)

    def discard(self) -> None:
        """Empty the accumulators without an update (a step that may not update the weights)."""
        with torch.no_grad():
            for grad in self.grads:
                grad.zero_()

    def refresh_shadows(self, into: list[torch.Tensor] | None = None) -> None:
        """The shadows become the masters rounded once (after loading masters). `into`: per group,
        other tensors laid out as the masters to write instead (a pipeline's versions). Under the
        split layout the shadows are the weights themselves: only `into` is written."""
        with torch.no_grad():
            for k, master in enumerate(self.masters):
                source = self.shadows[k] if self.split else master
                target = (None if self.split else self.shadows[k]) if into is None else into[k]
                if target is not None:
                    target.copy_(source)

    def state_dict(self) -> dict:
        """Per group: the master, the moments (fp32) and AdamW's step count (the live tensors where
        they rest whole, rebuilt copies otherwise)."""
        return {"masters": [self._flat_master(k) for k in range(len(self.groups))],
                **{m: [self._flat_moment(k, m) for k in range(len(self.groups))] for m in MOMENTS},
                "steps": [float(step) for step in self.steps], "coded": [self.coded(k) for k in range(len(self.groups))]}

    def coded(self, k: int) -> dict[str, torch.Tensor]:
        """Group k's 8-bit moments as they rest ({"exp_avg/codes": ..., "exp_avg/absmax": ...}; empty
        for fp32 moments). A resume must restore these, not re-code the decoded values: a block whose
        largest number is negative decodes to -0.993 of its absmax (the signed map has no -1), so coding
        the decoded block again changes its absmax."""
        held = self.moments[k]
        return {f"{m}/{part}": getattr(held[m], part) for m in MOMENTS if not isinstance(held[m], torch.Tensor)
                for part in ("codes", "absmax")}

    def load_coded(self, k: int, coded: dict[str, torch.Tensor]) -> None:
        """Group k's 8-bit moments exactly as coded() gave them (where both sides code them)."""
        with torch.no_grad():
            for key, value in coded.items():
                moment, part = key.split("/")
                held = self.moments[k][moment]
                if not isinstance(held, torch.Tensor):
                    getattr(held, part).copy_(value)

    def _flat_master(self, k: int) -> torch.Tensor:
        if not self.split:
            return self.masters[k]
        if self.weights is not None:
            return torch.cat([self.master_of(k, i).reshape(-1) for i in range(len(self.groups[k].shapes))])
        out = torch.empty(self.groups[k].numel, dtype=self.dtype)
        split_master.combine(self.shadows[k], self.residuals[k], out)
        return out

    def _flat_moment(self, k: int, moment: str) -> torch.Tensor:
        held = self.moments[k][moment]
        return held if isinstance(held, torch.Tensor) else _decoded(held, 0, self.groups[k].numel)

    def load_state_dict(self, state: dict) -> None:
        """Copy a state_dict() into this optimizer's own tensors (RAM or its memory-mapped files)."""
        for k, group in enumerate(self.groups):
            def members(flat: torch.Tensor) -> list[torch.Tensor]:
                return [flat[start : start + numel].view(shape) for start, numel, shape in group.spans()]

            self.load_group(k, members(state["masters"][k]), {m: members(state[m][k]) for m in MOMENTS},
                            state["steps"][k])
            self.load_coded(k, state.get("coded", [{}] * len(self.groups))[k])

    def grad_norms(self) -> list[torch.Tensor]:
        """Each group's gradient norm, summed in fp32 at least (a bf16 gradient's norm equals its
        fp32 copy's bit for bit)."""
        return [grad.norm() if isinstance(grad, row_grads.RowGrads) else
                torch.linalg.vector_norm(grad, dtype=torch.promote_types(grad.dtype, torch.float32))
                for grad in self.grads]

    def host_bytes(self) -> int:
        """Host RAM held: masters (or weights and residuals), accumulators, shadows, and the moments
        unless they are files."""
        shared = self.working is not None  # its accumulators (and shared shadows) are the owner's
        held = [*(() if self.masters_on_disk else (*self.masters, *self.residuals)),
                *(() if self.shared_shadows else self.shadows), *(() if shared else self.grads)]
        ram = sum(t.nbytes() if isinstance(t, row_grads.RowGrads) else runtime.nbytes(t) for t in held if t is not None)
        return ram + (0 if self.moments_dir is not None else self._moment_bytes())

    def _moment_bytes(self) -> int:
        return sum(runtime.nbytes(m) if isinstance(m, torch.Tensor) else m.nbytes()
                   for moments in self.moments for m in moments.values())

    def disk_bytes(self) -> int:
        """Disk held by memory-mapped moments (and masters or residuals kept there)."""
        if self.moments_dir is None:
            return 0
        masters = sum(runtime.nbytes(t) for t in (*self.masters, *self.residuals) if t is not None)
        return self._moment_bytes() + (masters if self.masters_on_disk else 0)


CODED = "moments8"  # EngineState.extra's key for 8-bit moments as they rest


def coded_state(adams: list[HostAdam]) -> dict[str, torch.Tensor]:
    """The optimizers' 8-bit moments as they rest, by "<name>/<group>/<moment>/<codes|absmax>"
    (empty with fp32 moments): what an exact resume restores (HostAdam.coded says why)."""
    return {f"{adam.name}/{k}/{key}": value for adam in adams for k in range(len(adam.groups))
            for key, value in adam.coded(k).items()}


def load_coded_state(adams: list[HostAdam], coded: dict[str, torch.Tensor]) -> None:
    """coded_state's tensors back into the optimizers of the same names (after their fp32 state)."""
    for adam in adams:
        for k in range(len(adam.groups)):
            prefix = f"{adam.name}/{k}/"
            adam.load_coded(k, {key.removeprefix(prefix): v for key, v in coded.items() if key.startswith(prefix)})


def _decoded(moment: moments8.Moment8, start: int, stop: int) -> torch.Tensor:
    """Numbers [start, stop) of an 8-bit moment as a new fp32 tensor (the blocks around them decoded)."""
    first = start // moments8.BLOCK * moments8.BLOCK
    last = min(-(-stop // moments8.BLOCK) * moments8.BLOCK, moment.numel)
    out = torch.empty(last - first, dtype=torch.float32)
    moment.dequantize(first, last, out)
    return out[start - first : stop - first]


def nbytes_8bit(numel: int) -> int:
    """An 8-bit moment's bytes: a code a number and an fp32 absmax a block."""
    return numel + 4 * -(-numel // moments8.BLOCK)


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


def moments_bytes(params, moments: str = "fp32") -> int:
    """Disk taken by the memory-mapped moments of `params`: two a number, in each one's master dtype
    (fp32 moments) or a byte and a 256th of an fp32 scale each (8-bit)."""
    if moments == "8bit":
        return sum(2 * nbytes_8bit(p.numel()) for p in params)
    return sum(2 * p.numel() * torch.promote_types(p.dtype, torch.float32).itemsize for p in params)
