"""streamed_ce (the slide engine's loss) with the final norm inside its token chunks equals the
plain way in float64: norm every row, F.cross_entropy on the logits, autograd. Loss, d(rows), the
head's and a trained norm's gradients; a frozen norm (LoRA); chunks and tiles that do not divide N
and V; a norm that computes in fp32 (Llama's), which must see the already scaled gradient."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slimtune.data.dataset import IGNORE_INDEX
from slimtune.engines.slide.streamed_ce import streamed_ce

from conftest import Fp32RMSNorm

N, D, V = 23, 6, 41
TOL = dict(rtol=0, atol=1e-12)


def _norm(kind: str) -> nn.Module:
    if kind == "fp32":
        return Fp32RMSNorm(D)
    norm = nn.RMSNorm(D, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return norm


def tiles_of(w: torch.Tensor, rows: int):
    return lambda: ((s, min(s + rows, V), w[s : s + rows]) for s in range(0, V, rows))


@pytest.mark.quick
@pytest.mark.parametrize("tile, chunk", [(7, 5), (41, 23), (16, 100)])
@pytest.mark.parametrize("norm_kind", ["rms", "fp32"])
@pytest.mark.parametrize("norm_trains", [False, True])
def test_norm_inside_equals_plain(tile, chunk, norm_kind, norm_trains):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, dtype=torch.float64, generator=g) * 3
    w = torch.randn(V, D, dtype=torch.float64, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::4] = IGNORE_INDEX
    norm = _norm(norm_kind).requires_grad_(norm_trains)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(norm(xr) @ wr.T, targets, reduction="sum", ignore_index=IGNORE_INDEX)
    (ref * 0.37).backward()
    norm_grad_ref = norm.weight.grad
    norm.weight.grad = None
    grad_w = torch.zeros_like(w)

    def sink(start, stop, grad):
        grad_w[start:stop] += grad

    seen = []
    norm.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    loss, grad_x = streamed_ce(x, targets, tiles_of(w, tile), chunk, scale=0.37, sink=sink, norm=norm)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    torch.testing.assert_close(grad_x, xr.grad, **TOL)
    torch.testing.assert_close(grad_w, wr.grad, **TOL)
    if norm_trains:
        torch.testing.assert_close(norm.weight.grad, norm_grad_ref, **TOL)
    else:
        assert norm.weight.grad is None
    assert max(seen) == min(chunk, N)  # the norm never sees more than a chunk of rows


def test_norm_inside_without_scale_only_the_loss():
    x, w = torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    targets = torch.randint(0, V, (N,))
    norm = _norm("rms")
    loss, grad_x = streamed_ce(x, targets, tiles_of(w, 9), 4, norm=norm)
    assert grad_x is None and norm.weight.grad is None
    plain = F.cross_entropy(norm(x) @ w.T, targets, reduction="sum")
    torch.testing.assert_close(loss, plain.detach(), **TOL)
