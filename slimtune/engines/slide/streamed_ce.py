"""Exact cross-entropy against an LM head that is never whole on the device (engine slide).

`streamed_ce` sees the (V, D) head only as vocabulary tiles from `tiles()`, each uploaded from the
host by the caller, and walks them twice: first for each position's log-sum-exp (an online
max / sum-of-exponentials over tiles) and target logit, then, given the upstream gradient `scale`
of the summed loss, for the gradients: d/dx accumulates tile by tile, and each tile's weight
gradient is handed to `sink(start, stop, grad_tile)` as soon as it is complete, so it can leave
the device. The device holds x, its gradient, one weight tile and its gradient, and one (c, tile)
block of logits. Token chunks run inside each tile so a tile is uploaded once per pass, not once
per chunk. Logits are formed in at least fp32.

Given the final norm, x is the rows before it: each token chunk is normed where it is used (again
in each tile, no grad: a chunk's norm costs c x D against the c x tile x D of its logits), and at the
end the gradient goes back through the norm a chunk at a time, so neither the normed (N, D) rows nor
the norm's whole-sequence temporaries (fp32 inside an RMSNorm) ever exist.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator

import torch
from torch import nn

from slimtune.device import memory
from slimtune.data.dataset import IGNORE_INDEX

Tiles = Callable[[], Iterator[tuple[int, int, torch.Tensor]]]
Sink = Callable[[int, int, torch.Tensor], None]


@torch.no_grad()
def streamed_ce(x: torch.Tensor, targets: torch.Tensor, tiles: Tiles, chunk: int, scale: float | None = None,
                sink: Sink | None = None, norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (N, D) hidden rows (normed, or before `norm` when it is given), targets (N,) with
    IGNORE_INDEX -> (summed loss, d(scale * loss)/dx (N, D) in x's dtype, or None when scale is None).
    `sink` (optional) receives d(scale * loss)/dW for rows [start, stop) of the head, in the compute
    dtype. A trainable norm's parameters get d(scale * loss)/dp added into their .grad."""
    normed = _Normed(x, norm)
    with torch.autocast(x.device.type, enabled=False):  # dtypes are chosen explicitly below
        return _streamed_ce(normed, targets, tiles, chunk, scale, sink)


class _Normed:
    """The rows x as the head sees them: x itself, or a chunk of it through the final norm, run under
    the autocast state of streamed_ce's caller (as the norm ran before it moved into the loss)."""

    def __init__(self, x: torch.Tensor, norm: nn.Module | None):
        self.x, self.norm, self.shape, self.device = x, norm, x.shape, x.device
        kind = x.device.type
        self.autocast = (kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind))

    def rows(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows `rows` normed (no grad), in `dtype`."""
        if self.norm is None:
            return self.x[rows].to(dtype)
        kind, cast, enabled = self.autocast
        with torch.autocast(kind, dtype=cast, enabled=enabled):
            return self.norm(self.x[rows]).to(dtype)

    def gradient(self, grad: torch.Tensor, chunk: int) -> torch.Tensor:
        """grad (N, D) with respect to the normed rows, in the compute dtype -> with respect to x, in
        x's dtype, a chunk at a time through the norm (its parameters' .grad accumulate)."""
        if self.norm is None:
            return grad.to(self.x.dtype)
        out = torch.empty_like(self.x)
        kind, cast, enabled = self.autocast
        for first in memory.representative(range(0, self.shape[0], chunk), self.x):
            rows = slice(first, first + chunk)
            r = self.x[rows].detach().requires_grad_()
            with torch.enable_grad(), torch.autocast(kind, dtype=cast, enabled=enabled):
                y = self.norm(r)
            # rounded to the normed rows' dtype first, as a whole (N, D) gradient of them would be
            torch.autograd.backward(y, grad[rows].to(y.dtype))
            out[rows] = r.grad
            del y, r
        return out


def _streamed_ce(x: _Normed, targets, tiles, chunk, scale, sink):
    dtype = torch.promote_types(x.x.dtype, torch.float32)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    lse, target_logit = _log_sum_exp(x, safe, tiles, chunk, dtype)
    loss = torch.where(valid, lse - target_logit, 0).sum()
    if scale is None:
        return loss, None
    grad_x = torch.zeros(x.shape, dtype=dtype, device=x.device)
    weight_of_row = valid.to(dtype) * scale  # ignored rows carry no gradient
    for start, stop, w in tiles():
        w = w.to(dtype)  # (tile, D)
        grad_w = torch.zeros_like(w) if sink is not None else None
        memory.replayed(_tile_key("gradient", w, x, chunk, grad_w is not None),
                        functools.partial(_tile_gradient, x, w, start, stop, lse, safe, weight_of_row, chunk, grad_x, grad_w))
        if sink is not None:
            sink(start, stop, grad_w)
    return loss, x.gradient(grad_x, chunk)


def _tile_gradient(x: _Normed, w, start, stop, lse, safe, weight_of_row, chunk, grad_x, grad_w) -> None:
    """One vocabulary tile's share of the rows' gradient (into grad_x) and of its own (into grad_w)."""
    for first in memory.representative(range(0, x.shape[0], chunk), x.x):
        rows = slice(first, first + chunk)
        x_c = x.rows(rows, w.dtype)
        g = (x_c @ w.T).sub_(lse[rows, None]).exp_()  # softmax on this tile: (c, tile)
        _subtract_target(g, safe[rows], start, stop)
        g.mul_(weight_of_row[rows, None])
        grad_x[rows].addmm_(g, w)
        if grad_w is not None:
            grad_w.addmm_(g.T, x_c)


def _tile_key(part: str, w: torch.Tensor, x: _Normed, chunk: int, *more) -> tuple:
    """What decides the transient of one vocabulary tile's pass over the rows (memory.replayed: the
    planner's estimate runs each key once; each tile writes into what exists, a shorter last one is
    its own key)."""
    return ("streamed_ce", part, tuple(w.shape), w.dtype, tuple(x.shape), x.x.dtype, x.norm is not None, x.autocast,
            chunk, *more)


def _log_sum_exp(x: _Normed, safe: torch.Tensor, tiles: Tiles, chunk: int, dtype: torch.dtype):
    """-> (N,) log-sum-exp of each row's logits over the whole vocabulary, and its target's logit."""
    n = x.shape[0]
    running_max = torch.full((n,), float("-inf"), dtype=dtype, device=x.device)
    running_sum = torch.zeros(n, dtype=dtype, device=x.device)
    target_logit = torch.zeros(n, dtype=dtype, device=x.device)
    for start, stop, w in tiles():
        w = w.to(dtype)
        memory.replayed(_tile_key("logits", w, x, chunk),
                        functools.partial(_tile_logits, x, w, start, stop, safe, chunk, running_max, running_sum, target_logit))
    return running_max + running_sum.log(), target_logit


def _tile_logits(x: _Normed, w, start, stop, safe, chunk, running_max, running_sum, target_logit) -> None:
    """One vocabulary tile's logits folded into the rows' running log-sum-exp and target logits."""
    for first in memory.representative(range(0, x.shape[0], chunk), x.x):
        rows = slice(first, first + chunk)
        z = x.rows(rows, w.dtype) @ w.T  # (c, tile)
        new_max = torch.maximum(running_max[rows], z.amax(dim=1))
        running_sum[rows] = running_sum[rows] * (running_max[rows] - new_max).exp() + (z - new_max[:, None]).exp().sum(1)
        running_max[rows] = new_max
        inside = (safe[rows] >= start) & (safe[rows] < stop)
        picked = z.gather(1, (safe[rows] - start).clamp(0, stop - start - 1)[:, None]).squeeze(1)
        target_logit[rows] = torch.where(inside, picked, target_logit[rows])


def _subtract_target(g: torch.Tensor, safe: torch.Tensor, start: int, stop: int) -> None:
    """g -= one-hot(target) where the target falls in columns [start, stop)."""
    inside = (safe >= start) & (safe < stop)
    column = (safe - start).clamp(0, stop - start - 1)[:, None]
    g.scatter_add_(1, column, -inside.to(g.dtype)[:, None])
