"""One AdamW step over a flat run of numbers, whatever form they rest in, with torch's bits.

A host optimizer's numbers rest in the narrowest form that still updates exactly: the master as a
bf16 weight plus a 16-bit residual (split_master.py), the gradient in the dtype it came down in,
the moments as fp32 or as 8-bit blockwise codes (moments8.py). AdamW itself is torch's fused CPU
kernel (`torch._fused_adamw_`, what torch.optim.AdamW(fused=True) runs), by one of two paths:
- native: where the forms allow it (an fp32 master, split or whole with at most one bf16 shadow; a
  gradient in fp32 or bf16 from one flat tensor; fp32 or 8-bit moments), one C loop over the whole run
  (native/adamw.c) reads each number's pieces, updates them and writes them back in one pass, with
  the fused kernel's bits (native/adamw.py checks them on the machine before first use);
- tiled: everywhere else (fp64 masters, gradients in pieces, no C compiler, SLIMTUNE_NATIVE=0), the fused
  kernel on one tile of TILE numbers at a time: the tile is rebuilt into fp32 scratch that stays in
  the cache, updated, and written back in its resting form, so each number crosses memory once
  each way, at the cost of a few torch calls a tile.
With `empty_grad` both paths empty (zero) the gradient while its numbers are in cache: an accumulator
the step consumes needs no pass of its own. Without it the native path only reads the gradient (the
tile path scales an fp32 one in place, as it always did).

Tiles start at multiples of TILE from the run's start. The fused kernel computes the last
`numel % 8` numbers of a call on a scalar path whose rounding can differ from its vector path
(the second moment's, by an ulp); tiles that are multiples of the vector width put exactly the
same numbers on each path as one call over the whole run does, so tiled and whole agree bit for bit
(and the native loop takes the scalar formula for the same last numbers).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from slimtune.device import runtime
from slimtune.optim import moments8, split_master
from slimtune.optim.native import adamw as native

TILE = 1 << 16  # numbers a tile: a multiple of 256 (an 8-bit block) and of every vector width


@dataclass(frozen=True)
class Hyper:
    """AdamW's settings for one call (the group's weight decay, the step's lr)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


class Scratch(threading.local):
    """fp32 (or fp64) tiles for the worker thread running an update: a master, a gradient and two
    moments. Host-resident, so no device meter counts them; TILE x 16 bytes (1 MiB) a thread."""

    def tiles(self, dtype: torch.dtype) -> list[torch.Tensor]:
        held = self.__dict__.setdefault("held", {})
        if dtype not in held:
            held[dtype] = [runtime.host_empty((TILE,), dtype, None, pinned=False) for _ in range(4)]
        return held[dtype]


SCRATCH = Scratch()


def adamw(hyper: Hyper, step: torch.Tensor, numel: int, dtype: torch.dtype, master: "Form", grad: "Form",
          exp_avg: "Form", exp_avg_sq: "Form", threads: int = 1, empty_grad: bool = False) -> None:
    """One AdamW step over [0, numel) in `dtype` (the masters'); `step` is already advanced;
    `empty_grad`: zero the gradient too. Natively where the forms allow it (on `threads` threads),
    else a tile at a time: each Form then lends a tile, a view where it rests in `dtype` (no copy), or
    a copy read into scratch and written back."""
    parts = (master, grad, exp_avg, exp_avg_sq)
    if dtype == torch.float32 and _native(hyper, step, numel, *parts, threads=threads, empty_grad=empty_grad):
        return
    scratch = SCRATCH.tiles(dtype)
    for start in range(0, numel, TILE):
        stop = min(start + TILE, numel)
        p, g, m, v = (form.tile(start, stop, buffer[: stop - start])
                      for form, buffer in zip((master, grad, exp_avg, exp_avg_sq), scratch))
        torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=hyper.lr, beta1=hyper.beta1,
                            beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=False)
        master.write(start, stop, p)
        exp_avg.write(start, stop, m)
        exp_avg_sq.write(start, stop, v)
        if empty_grad:
            grad.clear(start, stop)


def _native(hyper: Hyper, step: torch.Tensor, numel: int, master: "Form", grad: "Form", exp_avg: "Form",
            exp_avg_sq: "Form", threads: int, empty_grad: bool) -> bool:
    """The step by the native loop, if every form lends it whole tensors; False (nothing done) if not."""
    parts = (master.native("master"), grad.native("grad"), exp_avg.native("exp_avg"),
             exp_avg_sq.native("exp_avg_sq"))
    if any(part is None for part in parts):
        return False
    tensors = {role: t for part in parts for role, t in part.items()}
    return native.step(hyper, float(step), numel, tensors, clip=grad.clip, threads=threads, empty_grad=empty_grad)


class Form:
    """How one flat run of numbers rests, lent to the update a tile at a time."""

    def tile(self, start: int, stop: int, scratch: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write(self, start: int, stop: int, tile: torch.Tensor) -> None:
        """The updated tile back into its resting form (nothing to do for a view)."""
        del start, stop, tile

    def clear(self, start: int, stop: int) -> None:
        """Empty [start, stop) after the update (a gradient's accumulator; nothing for other forms)."""
        del start, stop

    def native(self, role: str) -> dict[str, torch.Tensor | None] | None:
        """This form's tensors by native.step's roles, when it plays `role` ("master", "grad",
        "exp_avg", "exp_avg_sq") in a form the native loop reads; None otherwise (the tile path)."""
        del role
        return None


class Whole(Form):
    """Numbers resting in the compute dtype: the tile is a view. `shadows`: narrower copies (what
    goes up to the device) refreshed from each updated tile."""

    def __init__(self, flat: torch.Tensor, shadows: tuple[torch.Tensor, ...] = ()):
        self.flat, self.shadows = flat, shadows

    def tile(self, start, stop, scratch):
        return self.flat[start:stop]

    def write(self, start, stop, tile):
        for shadow in self.shadows:
            shadow[start:stop].copy_(tile)

    def native(self, role):
        if role != "master":
            return None if self.shadows else {role: self.flat}
        if len(self.shadows) > 1:
            return None
        return {"master": self.flat, "shadow": self.shadows[0] if self.shadows else None}


class Scaled(Form):
    """A gradient times the clipping coefficient: in place when it rests in the compute dtype (its
    accumulator is emptied after the update anyway), else widened into scratch first."""

    def __init__(self, pieces: list[tuple[int, torch.Tensor]], clip: float):
        self.pieces, self.clip = pieces, clip  # (offset in the run, flat tensor) in order

    def tile(self, start, stop, scratch):
        inside = [(offset, flat) for offset, flat in self.pieces if offset < stop and offset + flat.numel() > start]
        if len(inside) == 1 and inside[0][1].dtype == scratch.dtype:
            offset, flat = inside[0]
            out = flat[start - offset : stop - offset]
        else:
            out = scratch
            for offset, flat in inside:
                a, b = max(start, offset), min(stop, offset + flat.numel())
                out[a - start : b - start].copy_(flat[a - offset : b - offset])
        return out.mul_(self.clip) if self.clip != 1.0 else out

    def clear(self, start, stop):
        for offset, flat in self.pieces:
            a, b = max(start, offset), min(stop, offset + flat.numel())
            if a < b:
                flat[a - offset : b - offset].zero_()

    def native(self, role):
        one = len(self.pieces) == 1 and self.pieces[0][0] == 0
        return {"grad": self.pieces[0][1]} if role == "grad" and one else None


class Split(Form):
    """A master resting as its bf16 weight and a 16-bit residual (split_master.py): rebuilt into
    scratch, split again after the update; `copies` get the new weights too (a pipeline's version)."""

    def __init__(self, weights: torch.Tensor, residuals: torch.Tensor, copies: tuple[torch.Tensor, ...] = ()):
        self.weights, self.residuals, self.copies = weights, residuals, copies

    def tile(self, start, stop, scratch):
        split_master.combine(self.weights[start:stop], self.residuals[start:stop], scratch)
        return scratch

    def write(self, start, stop, tile):
        split_master.split(tile, self.weights[start:stop], self.residuals[start:stop])
        for copy in self.copies:
            copy[start:stop].copy_(self.weights[start:stop])

    def native(self, role):
        if role != "master" or len(self.copies) > 1:
            return None
        return {"weight": self.weights, "residual": self.residuals, "shadow": self.copies[0] if self.copies else None}


class Coded(Form):
    """A moment resting as 8-bit blockwise codes (moments8.py): decoded into scratch, coded again."""

    def __init__(self, moment: moments8.Moment8):
        self.moment = moment

    def tile(self, start, stop, scratch):
        self.moment.dequantize(start, stop, scratch)
        return scratch

    def write(self, start, stop, tile):
        self.moment.quantize(start, stop, tile)

    def native(self, role):
        if self.moment.signed != (role == "exp_avg"):  # m codes on the signed map, v on the unsigned one
            return None
        return {f"{role}_codes": self.moment.codes, f"{role}_absmax": self.moment.absmax}


class SplitOver(Form):
    """A split master whose bf16 half is other tensors' pieces (strided views: a chunk's columns of
    slide's host weights): gathered into a tile with the residuals, scattered back after the update."""

    def __init__(self, members: list[tuple[int, torch.Tensor]], residuals: torch.Tensor):
        self.members, self.residuals = members, residuals  # (offset in the group, bf16 view)

    def tile(self, start, stop, scratch):
        self.top = torch.empty(stop - start, dtype=torch.bfloat16)
        for dst, src in _ranges(self.members, start, stop):
            self.top[dst].view(src.shape).copy_(src)
        split_master.combine(self.top, self.residuals[start:stop], scratch)
        return scratch

    def write(self, start, stop, tile):
        split_master.split(tile, self.top, self.residuals[start:stop])
        for dst, src in _ranges(self.members, start, stop):
            src.copy_(self.top[dst].view(src.shape))


def _ranges(members: list[tuple[int, torch.Tensor]], start: int, stop: int):
    """(slice of the tile [start, stop), the members' numbers there as a view), row by row runs of
    strided 2-D views (a partial first row, whole middle rows, a partial last row)."""
    for offset, view in members:
        a, b = max(start, offset) - offset, min(stop, offset + view.numel()) - offset
        if a >= b:
            continue
        base = offset - start
        if view.is_contiguous():
            yield slice(base + a, base + b), view.reshape(-1)[a:b]
            continue
        width = view.shape[-1]
        rows = view.reshape(-1, width) if view.dim() != 2 else view
        first, last = a // width, (b - 1) // width
        if first == last:
            yield slice(base + a, base + b), rows[first, a % width : a % width + b - a]
            continue
        yield slice(base + a, base + (first + 1) * width), rows[first, a % width :]
        if last > first + 1:
            yield slice(base + (first + 1) * width, base + last * width), rows[first + 1 : last]
        yield slice(base + last * width, base + b), rows[last, : b - last * width]


class Shifted(Form):
    """A form lent from `offset` on: a span's tiles in a form that rests over the whole group."""

    def __init__(self, form: tiled_adamw.Form, offset: int):
        self.form, self.offset = form, offset

    def tile(self, start, stop, scratch):
        return self.form.tile(self.offset + start, self.offset + stop, scratch)

    def write(self, start, stop, tile):
        self.form.write(self.offset + start, self.offset + stop, tile)
