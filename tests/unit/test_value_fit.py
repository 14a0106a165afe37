"""Fits of several matrices of one shape side by side (value_fit.ValueFit with lists of pairs) against each
matrix's own fit: values, Adam steps, held-out errors and early stops equal bit for bit, on both routes
(from G and from its factors), in float64 and float32, when members stop at different gradients and
steps, and when one member's gradient is not finite."""

from __future__ import annotations

import math

import pytest
import torch

from test_projectors import pair
from slimtune.optim import factored_gradient as fg
from slimtune.optim import value_fit as vf

F64 = torch.float64


def factors(seed: int, members: int, dtype, t: int = 6, n_o: int = 24, n_i: int = 40):
    """Each member's gradient as factors dY, X with a structure of its own (rank 2, its own noise level), so
    the members' fits fall for different lengths and stop at different points."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for member in range(members):
        mix = torch.randn(t, 2, generator=g, dtype=F64)
        noise = (0.02, 0.3, 1.0)[member % 3]
        dy = mix @ torch.randn(2, n_o, generator=g, dtype=F64) + noise * torch.randn(t, n_o, generator=g, dtype=F64)
        x = mix @ torch.randn(2, n_i, generator=g, dtype=F64) + noise * torch.randn(t, n_i, generator=g, dtype=F64)
        out.append(fg.Factors(dy.to(dtype), x.to(dtype)))
    return out


def pairs(members: int, dtype) -> list:
    made = []
    for member in range(members):
        p_o, p_i = pair(seed=40 + member)
        p_o.val, p_i.val = p_o.val.to(dtype), p_i.val.to(dtype)
        made.append((p_o, p_i))
    return made


def fit_apart_and_together(members: int, dtype, factored: bool, monkeypatch, spoil=None, steps: int = 40):
    """Each member's fit alone and all in one fit, fresh draws from one generator in the same order, on
    five batches of (train, held-out) gradients; `spoil(batch, member)` True makes that gradient infinite."""
    monkeypatch.setattr(vf, "factored_is_cheaper", lambda *shape: factored)
    made = pairs(members, dtype)
    draws = torch.Generator().manual_seed(7)
    starts = [vf.start(p_o, p_i, draws, fresh=True, warm=False) for p_o, p_i in made]
    apart = [vf.ValueFit(p_o, p_i, 0.05, steps, None, starts=[tuple(v.clone() for v in start)])
             for (p_o, p_i), start in zip(made, starts)]  # (a fit takes its starts over: each its own)
    together = vf.ValueFit([p[0] for p in made], [p[1] for p in made], 0.05, steps, None, starts=starts)
    handed = []
    for batch in range(5):
        train, held = factors(100 + batch, members, dtype), factors(200 + batch, members, dtype)
        if spoil is not None:
            for member in range(members):
                if spoil(batch, member):
                    train[member].dy[0, 0] = math.inf
        given = {}
        for member, fit in enumerate(apart):
            gradient = train[member] if factored else train[member].dense()
            held_out = held[member] if factored else held[member].dense()
            fit.observe(gradient, held_out)
            if not together.stopped[member]:
                given[member] = (gradient, held_out)
        handed.append(sorted(given))
        together.observe_all(given)
    return apart, together, handed


def assert_same(apart, together):
    for member, fit in enumerate(apart):
        mine = together.params[member]
        assert torch.equal(mine[0], fit.values[0]) and torch.equal(mine[1], fit.values[1])
        assert together.held_out_errors[member] == fit.held_out_error
        assert together.stopped[member] == fit.done and together.misses[member] == fit.misses[0]
    assert together.iterations == sum(fit.iterations for fit in apart)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("factored", [True, False], ids=["from-factors", "formed"])
def test_members_fit_together_end_bit_for_bit_where_each_alone_ends(monkeypatch, factored, dtype):
    apart, together, handed = fit_apart_and_together(3, dtype, factored, monkeypatch)
    assert_same(apart, together)
    stops = [fit.iterations for fit in apart]
    assert len(set(stops)) > 1 and any(fit.done for fit in apart)  # the members stopped apart: the stack shrank
    assert handed[0] == [0, 1, 2] and len(handed[-1]) < 3


@pytest.mark.parametrize("factored", [True, False], ids=["from-factors", "formed"])
def test_a_members_non_finite_gradient_is_passed_over_and_the_others_step_on_it(monkeypatch, factored):
    apart, together, _ = fit_apart_and_together(3, F64, factored, monkeypatch, spoil=lambda batch, member: batch == 0 and member == 1)
    assert_same(apart, together)
    assert apart[1].iterations < apart[0].iterations or apart[1].done


def test_one_member_is_one_fit(monkeypatch):
    apart, together, _ = fit_apart_and_together(1, F64, True, monkeypatch)
    assert_same(apart, together)


def test_a_members_learned_pair_is_its_own_copy(monkeypatch):
    """Of several members, pair() copies the values (a view would keep the stack alive) and keeps the
    member's own positions tensor."""
    _, together, _ = fit_apart_and_together(2, F64, True, monkeypatch, steps=5)
    p_o, p_i = together.pair(1)
    assert torch.equal(p_o.val, together.params[1][0]) and p_o.val.untyped_storage().nbytes() == p_o.val.nbytes
    assert p_o.pos is together.given[0][1] and p_i.pos is together.given[1][1]
