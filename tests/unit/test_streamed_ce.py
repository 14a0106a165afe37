"""streamed_ce (the slide engine's loss) equals F.cross_entropy(x @ W.T) in float64: loss, dx and
dW, with ignored labels, tiles and chunks that do not divide V and N, and one tile."""

import pytest
import torch
import torch.nn.functional as F

from slimtune.data.dataset import IGNORE_INDEX
from slimtune.engines.slide.streamed_ce import streamed_ce

N, D, V = 23, 6, 41


def tiles_of(w: torch.Tensor, rows: int):
    return lambda: ((s, min(s + rows, V), w[s : s + rows]) for s in range(0, V, rows))


@pytest.mark.parametrize("tile, chunk", [(7, 5), (41, 23), (1, 4), (16, 100)])
def test_equals_cross_entropy(tile, chunk):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, dtype=torch.float64, generator=g) * 3
    w = torch.randn(V, D, dtype=torch.float64, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::4] = IGNORE_INDEX
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(xr @ wr.T, targets, reduction="sum", ignore_index=IGNORE_INDEX)
    (ref * 0.37).backward()
    grad_w = torch.zeros_like(w)

    def sink(start, stop, grad):
        grad_w[start:stop] += grad

    loss, grad_x = streamed_ce(x, targets, tiles_of(w, tile), chunk, scale=0.37, sink=sink)
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_x, xr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_w, wr.grad, rtol=0, atol=1e-12)
    assert wr.grad.abs().sum() > 0


def test_without_scale_only_the_loss():
    x, w = torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    targets = torch.randint(0, V, (N,))
    loss, grad_x = streamed_ce(x, targets, tiles_of(w, 9), 4)
    assert grad_x is None
    torch.testing.assert_close(loss, F.cross_entropy(x @ w.T, targets, reduction="sum"), rtol=0, atol=1e-12)
