"""One AdamW step over a flat run of numbers, a tile at a time, whatever form they rest in.

A host optimizer's numbers rest in the narrowest form that still updates exactly: the master as a
bf16 weight plus a 16-bit residual (split_master.py), the gradient in the dtype it came down in,
the moments as fp32 or as 8-bit blockwise codes (moments8.py). AdamW itself is torch's fused CPU
kernel (`torch._fused_adamw_`, what torch.optim.AdamW(fused=True) runs), applied to one tile of
TILE numbers at a time: the tile is rebuilt into fp32 scratch that stays in the cache, updated, and
written back in its resting form, so each number crosses memory once each way.

Tiles start at multiples of TILE from the run's start. The fused kernel computes the last
`numel % 8` numbers of a call on a scalar path whose rounding can differ from its vector path
(the second moment's, by an ulp); tiles that are multiples of the vector width put exactly the
same numbers on each path as one call over the whole run does, so tiled and whole agree bit for bit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from slimtune.device import runtime
from slimtune.optim import moments8, split_master

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
          exp_avg: "Form", exp_avg_sq: "Form") -> None:
    """One AdamW step over [0, numel) in `dtype` (the masters'); `step` is already advanced. Each Form
    lends a tile: a view where it rests in `dtype` (no copy), or a copy read into scratch and
    written back."""
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


class Form:
    """How one flat run of numbers rests, lent to the update a tile at a time."""

    def tile(self, start: int, stop: int, scratch: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write(self, start: int, stop: int, tile: torch.Tensor) -> None:
        """The updated tile back into its resting form (nothing to do for a view)."""
        del start, stop, tile


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


class Coded(Form):
    """A moment resting as 8-bit blockwise codes (moments8.py): decoded into scratch, coded again."""

    def __init__(self, moment: moments8.Moment8):
        self.moment = moment

    def tile(self, start, stop, scratch):
        self.moment.dequantize(start, stop, scratch)
        return scratch

    def write(self, start, stop, tile):
        self.moment.quantize(start, stop, tile)
