"""Exact cross-entropy against an LM head that is never whole on the device (engine slide).

`streamed_ce` sees the (V, D) head only as vocabulary tiles from `tiles()`, each uploaded from the
host by the caller, and walks them twice: first for each position's log-sum-exp (an online
max / sum-of-exponentials over tiles) and target logit, then, given the upstream gradient `scale`
of the summed loss, for the gradients: d/dx accumulates tile by tile, and each tile's weight
gradient is handed to `sink(start, stop, grad_tile)` as soon as it is complete, so it can leave
the device. The device holds x, its gradient, one weight tile and its gradient, and one (c, tile)
block of logits. Token chunks run inside each tile so a tile is uploaded once per pass, not once
per chunk. Logits are formed in at least fp32.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from slimtune.device import memory
from slimtune.data.dataset import IGNORE_INDEX

Tiles = Callable[[], Iterator[tuple[int, int, torch.Tensor]]]
Sink = Callable[[int, int, torch.Tensor], None]


@torch.no_grad()
def streamed_ce(x: torch.Tensor, targets: torch.Tensor, tiles: Tiles, chunk: int, scale: float | None = None,
                sink: Sink | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (N, D) normed hidden rows, targets (N,) with IGNORE_INDEX -> (summed loss, d(scale * loss)/dx
    (N, D) in x's dtype, or None when scale is None). `sink` (optional) receives d(scale * loss)/dW
    for rows [start, stop) of the head, in the compute dtype."""
    with torch.autocast(x.device.type, enabled=False):  # dtypes are chosen explicitly below
        return _streamed_ce(x, targets, tiles, chunk, scale, sink)


def _streamed_ce(x, targets, tiles, chunk, scale, sink):
    dtype = torch.promote_types(x.dtype, torch.float32)
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
        for first in memory.representative(range(0, x.shape[0], chunk), x):
            rows = slice(first, first + chunk)
            x_c = x[rows].to(dtype)
            g = (x_c @ w.T).sub_(lse[rows, None]).exp_()  # softmax on this tile: (c, tile)
            _subtract_target(g, safe[rows], start, stop)
            g.mul_(weight_of_row[rows, None])
            grad_x[rows].addmm_(g, w)
            if grad_w is not None:
                grad_w.addmm_(g.T, x_c)
        if sink is not None:
            sink(start, stop, grad_w)
    return loss, grad_x.to(x.dtype)


def _log_sum_exp(x: torch.Tensor, safe: torch.Tensor, tiles: Tiles, chunk: int, dtype: torch.dtype):
    """-> (N,) log-sum-exp of each row's logits over the whole vocabulary, and its target's logit."""
    n = x.shape[0]
    running_max = torch.full((n,), float("-inf"), dtype=dtype, device=x.device)
    running_sum = torch.zeros(n, dtype=dtype, device=x.device)
    target_logit = torch.zeros(n, dtype=dtype, device=x.device)
    for start, stop, w in tiles():
        w = w.to(dtype)
        for first in memory.representative(range(0, n, chunk), x):
            rows = slice(first, first + chunk)
            z = x[rows].to(dtype) @ w.T  # (c, tile)
            new_max = torch.maximum(running_max[rows], z.amax(dim=1))
            running_sum[rows] = running_sum[rows] * (running_max[rows] - new_max).exp() + (z - new_max[:, None]).exp().sum(1)
            running_max[rows] = new_max
            inside = (safe[rows] >= start) & (safe[rows] < stop)
            picked = z.gather(1, (safe[rows] - start).clamp(0, stop - start - 1)[:, None]).squeeze(1)
            target_logit[rows] = torch.where(inside, picked, target_logit[rows])
    return running_max + running_sum.log(), target_logit


def _subtract_target(g: torch.Tensor, safe: torch.Tensor, start: int, stop: int) -> None:
    """g -= one-hot(target) where the target falls in columns [start, stop)."""
    inside = (safe >= start) & (safe < stop)
    column = (safe - start).clamp(0, stop - start - 1)[:, None]
    g.scatter_add_(1, column, -inside.to(g.dtype)[:, None])
