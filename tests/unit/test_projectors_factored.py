"""The projector fit from the gradient's factors (optim/factored_gradient.py) against the dense formula in
float64: G = dY^T X given as dY (t x n_o) and X (t x n_i), e(G)^2 and its gradient in both projectors'
values equal autograd of projectors.squared_residual / |G|^2 on the formed G, with fewer rows than d and
with more; a whole fit (steps, held-out readings, early stop) from the factors ends where the fit from G
ends; a tiled block's parts are formed and summed."""

import pytest
import torch

from test_projectors import pair
from slimtune.engines.lsp import learning
from slimtune.optim import factored_gradient as fg
from slimtune.optim import projectors as pj
from slimtune.optim import value_fit as vf

F64 = torch.float64


def factors(t: int, seed: int, n_o: int = 24, n_i: int = 40, rank: int = 3) -> fg.Factors:
    """Rows with a shared low-rank structure plus noise, as a layer's dY and X have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(t, rank, generator=g, dtype=F64)
    dy = mix @ torch.randn(rank, n_o, generator=g, dtype=F64) + 0.1 * torch.randn(t, n_o, generator=g, dtype=F64)
    x = mix @ torch.randn(rank, n_i, generator=g, dtype=F64) + 0.1 * torch.randn(t, n_i, generator=g, dtype=F64)
    return fg.Factors(dy, x)


@pytest.mark.parametrize("t", [5, 13], ids=["t<d", "t>d"])
def test_the_factored_error_and_gradient_equal_autograd_of_the_identity_on_the_formed_gradient(t):
    fit = vf.ValueFit(*pair(seed=9), lr=0.05, steps=1, generator=torch.Generator().manual_seed(10))
    given = factors(t, seed=3)
    g = given.dense()
    values = [v.detach().clone().requires_grad_() for v in fit.values]
    total = g.pow(2).sum()
    loss = pj.squared_residual(g, *(pj.SparseProjector(pos, v, 8) for pos, v in zip((fit.pos_o, fit.pos_i), values)),
                               total) / total
    loss.backward()
    prepared = fg.FactoredGradient(given, fit)
    assert float(prepared.total) == pytest.approx(float(total), rel=1e-13)
    assert float(prepared.error_sq()) == pytest.approx(float(loss.detach()), abs=1e-12)
    prepared.gradient()
    for value, expected in zip(fit.values, values):
        torch.testing.assert_close(value.grad, expected.grad, atol=1e-12, rtol=0)
    assert float(pj.relative_error(g, *fit.pair())) ** 2 == pytest.approx(float(loss.detach()), abs=1e-12)


@pytest.mark.parametrize("factored", [True, False], ids=["from-factors", "formed"])
def test_a_fit_from_the_factors_ends_where_the_fit_from_the_formed_gradient_ends(monkeypatch, factored):
    """Three gradients with held-out halves, 60 steps each offered: the same Adam steps taken (the early
    stop reads the same held-out errors), values equal to float64 rounding. The fit from the factors
    takes the way the shapes say (monkeypatched both ways); formed, it works on dY^T X as given G."""
    monkeypatch.setattr(vf, "factored_is_cheaper", lambda *shape: factored)
    fits = [vf.ValueFit(*pair(seed=5), lr=0.05, steps=60, generator=torch.Generator().manual_seed(6))
            for _ in range(2)]
    chosen = []
    prepared = fits[0].prepare_all
    fits[0].prepare_all = lambda g, which: chosen.append(type(prepared(g, which))) or prepared(g, which)
    for seed in range(3):
        train, held = factors(6, seed=10 + seed), factors(6, seed=20 + seed)
        fits[0].observe(train, held)
        fits[1].observe(train.dense(), held.dense())
    assert set(chosen) == {fg.FactoredGradient if factored else vf._DenseGradient}
    assert fits[0].iterations == fits[1].iterations and 0 < fits[0].iterations < 180
    for mine, theirs in zip(fits[0].values, fits[1].values):
        torch.testing.assert_close(mine, theirs, atol=1e-10, rtol=0)
    assert fits[0].held_out_error == pytest.approx(fits[1].held_out_error, rel=1e-10)


def test_a_non_finite_factor_leaves_the_fit_as_it_was():
    fit = vf.ValueFit(*pair(seed=7), lr=0.05, steps=3, generator=torch.Generator().manual_seed(8))
    start = [v.detach().clone() for v in fit.values]
    bad = factors(6, seed=1)
    bad.dy[2, 3] = float("inf")
    fit.observe(bad)
    assert all(torch.equal(v, s) for v, s in zip(fit.values, start)) and fit.iterations == 0


def test_a_tiled_blocks_parts_are_formed_and_summed_half_by_half():
    """The Collector's parts (a checkpointed block's token tiles) arrive as factors: each is formed as
    dY^T X and summed per half, a part of one row joining the first half; whole() sums the halves."""
    seen = []
    collector = learning.Collector([0], {0: seen.append}, in_parts={0})
    parts = [(factors(3, seed=1), factors(4, seed=2)), (factors(1, seed=3), None)]
    for halves in parts:
        collector.take(0, halves)
    collector.finish()
    everything = parts[0][0].dense() + parts[1][0].dense() + parts[0][1].dense()
    assert len(seen) == 1 and seen[0][1] is None  # the one-row part had no second half: all in the first
    torch.testing.assert_close(seen[0][0], everything, atol=1e-12, rtol=0)
    torch.testing.assert_close(learning.whole(parts[0]), parts[0][0].dense() + parts[0][1].dense(), atol=1e-12, rtol=0)
