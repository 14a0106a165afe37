"""Sparse projectors and the projected linear against dense PyTorch in float64 (spec lsp-offload.md 5):
the compressed gradient equals P_o^T (dense autograd gradient) P_i, the input gradient equals dense
autograd's, no n_o x n_i tensor is saved; every row holds r distinct non-zeros; E[P P^T] = I; the
d x d error identity equals the dense e(G); the moment transfer equals the dense formulas; fitting
lowers the held-out error below random sparse projectors."""

import math

import pytest
import torch
from torch import nn

from slimtune.optim import projectors as pj
from slimtune.optim import value_fit as vf
from slimtune.engines.lsp.projected_linear import ProjectedLinear

F64 = torch.float64
CPU = torch.device("cpu")


def pair(n_o=24, n_i=40, d=8, r=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (pj.SparseProjector.random(n_o, d, r, g, F64, CPU), pj.SparseProjector.random(n_i, d, r, g, F64, CPU))


def test_rows_hold_r_distinct_nonzeros_and_storage_is_n_times_r():
    p = pj.SparseProjector.random(500, 16, 4, torch.Generator().manual_seed(1), F64, CPU)
    assert p.pos.shape == p.val.shape == (500, 4)
    assert all(len(set(row.tolist())) == 4 for row in p.pos)
    dense = p.dense()
    assert ((dense != 0).sum(1) == 4).all()
    assert set(p.val.abs().unique().tolist()) == {0.5}  # 1/sqrt(r)
    assert 0 < (p.val > 0).float().mean() < 1  # random signs, never one constant


def test_the_mean_of_p_p_transpose_tends_to_the_identity():
    g = torch.Generator().manual_seed(2)
    total = torch.zeros(6, 6, dtype=F64)
    draws = 4000
    for _ in range(draws):
        dense = pj.SparseProjector.random(6, 12, 4, g, F64, CPU).dense()
        total += dense @ dense.T
    mean = total / draws
    assert torch.allclose(mean, torch.eye(6, dtype=F64), atol=0.06)


def test_products_equal_dense_ones():
    p_o, p_i = pair()
    x = torch.randn(3, 5, 40, dtype=F64)
    a = torch.randn(3, 5, 8, dtype=F64)
    assert torch.allclose(p_i.right(x), x @ p_i.dense(), atol=1e-12)
    assert torch.allclose(p_i.right_t(a), a @ p_i.dense().T, atol=1e-12)
    assert torch.allclose(pj.cross_gram(p_o, p_o), p_o.dense().T @ p_o.dense(), atol=1e-12)
    c = torch.randn(8, 8, dtype=F64)
    assert torch.allclose(pj.decompress(c, p_o, p_i), p_o.dense() @ c @ p_i.dense().T, atol=1e-12)


@pytest.mark.parametrize("dtype,csr,atol", [(F64, True, 1e-12), (torch.float32, True, 1e-5), (torch.bfloat16, False, 0.1)])
@pytest.mark.parametrize("rows", [0, 1, 15])
def test_the_csr_and_term_routes_equal_the_dense_products(dtype, csr, atol, rows):
    """CPU fp32/fp64 take one CSR product read from pos as it is, each row's columns unsorted; bf16 (no CPU
    sparse product) the index terms. Both equal the dense products, for any number of rows."""
    p = pj.SparseProjector.random(300, 24, 4, torch.Generator().manual_seed(5), F64, CPU)
    assert bool((p.pos[:, 1:] < p.pos[:, :-1]).any())  # unsorted rows exist: the CSR route must not need them sorted
    x, a = torch.randn(rows, 2, 300, dtype=F64), torch.randn(rows, 2, 24, dtype=F64)
    low = pj.SparseProjector(p.pos, p.val.to(dtype), p.d)
    assert pj._through_csr(x.to(dtype)) is csr
    right, right_t = low.right(x.to(dtype)), low.right_t(a.to(dtype))
    assert right.shape == (rows, 2, 24) and right_t.shape == (rows, 2, 300) and right.dtype == right_t.dtype == dtype
    dense = p.val.to(dtype).to(F64)
    expected = torch.zeros(300, 24, dtype=F64).scatter(1, p.pos, dense)
    assert torch.allclose(right.to(F64), x.to(dtype).to(F64) @ expected, atol=atol, rtol=atol)
    assert torch.allclose(right_t.to(F64), a.to(dtype).to(F64) @ expected.T, atol=atol, rtol=atol)


def test_the_planners_fake_step_takes_the_term_route():
    """Fake CPU tensors stand for a GPU run in the planner: they take the GPU's route (its transient counted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 300)
        assert not pj._through_csr(x)
        p = pj.SparseProjector(torch.zeros(300, 4, dtype=torch.long), torch.empty(300, 4), 24)
        assert p.right(x).shape == (4, 24) and p.right_t(torch.empty(4, 24)).shape == (4, 300)


def test_the_d_by_d_error_identity_equals_the_dense_error():
    p_o, p_i = pair()
    grad = torch.randn(24, 5, dtype=F64) @ torch.randn(5, 40, dtype=F64)
    assert pj.relative_error(grad, p_o, p_i) == pytest.approx(pj.dense_relative_error(grad, p_o, p_i), rel=1e-10)


def projected(seed=0, bias=True):
    torch.manual_seed(seed)
    linear = nn.Linear(40, 24, bias=bias, dtype=F64)
    p_o, p_i = pair(seed=seed)
    module = ProjectedLinear(linear, 0, p_o, p_i)
    with torch.no_grad():
        module.z.copy_(torch.randn(8, 8, dtype=F64) * 0.1)
    return module


def test_compressed_gradient_and_input_gradient_equal_dense_autograd():
    module = projected()
    x = torch.randn(2, 7, 40, dtype=F64, requires_grad=True)
    dense_w = (module.weight + module.p_o.dense() @ module.z.detach() @ module.p_i.dense().T).detach().requires_grad_()
    dense_b = module.bias.detach().clone().requires_grad_()
    x_dense = x.detach().clone().requires_grad_()
    target = torch.randn(2, 7, 24, dtype=F64)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = module(x)
    ((y - target) ** 2).sum().backward()
    y_dense = torch.nn.functional.linear(x_dense, dense_w, dense_b)
    ((y_dense - target) ** 2).sum().backward()

    assert torch.allclose(y, y_dense, atol=1e-12)
    assert torch.allclose(x.grad, x_dense.grad, atol=1e-12)
    expected = module.p_o.dense().T @ dense_w.grad @ module.p_i.dense()
    assert torch.allclose(module.z.grad, expected, atol=1e-12)
    assert module.weight.grad is None
    # nothing of W's shape is saved but W itself (a parameter, not an activation), and no X
    assert torch.Size([2, 7, 40]) not in saved and saved.count(torch.Size([24, 40])) == 1


def test_probe_mode_hands_the_full_gradient_of_the_effective_weight_in_two_halves_of_its_rows():
    """The halves are the gradients of rows [0, 4) and [4, 9) (the fit holds one out), each as its
    factors dY, X of those rows; they sum to the dense gradient."""
    module = projected(bias=False)
    seen = []
    module.probe = seen.append
    x = torch.randn(9, 40, dtype=F64)
    dense_w = module.effective_weight().detach().requires_grad_()
    (module(x).sin().sum()).backward()
    torch.nn.functional.linear(x, dense_w).sin().sum().backward()
    assert len(seen) == 1
    first, second = (half.dense() for half in seen[0])
    assert seen[0][0].rows == 4 and seen[0][1].rows == 5
    torch.testing.assert_close(first + second, dense_w.grad, atol=1e-12, rtol=0)
    rows = torch.autograd.grad(torch.nn.functional.linear(x[:4], dense_w).sin().sum(), dense_w)[0]
    torch.testing.assert_close(first, rows, atol=1e-12, rtol=0)
    assert module.z.grad is None


def test_fold_keeps_the_effective_weight_and_empties_z():
    module = projected()
    before = module.effective_weight()
    module.fold()
    assert torch.count_nonzero(module.z) == 0
    assert torch.allclose(module.weight, before, atol=1e-14)


def test_moment_transfer_equals_the_dense_formulas():
    old, new = pair(seed=3), pair(seed=4)
    m, v = torch.randn(8, 8, dtype=F64), torch.rand(8, 8, dtype=F64)
    m2, v2 = pj.reproject_moments(m, v, old, new)
    left = new[0].dense().T @ old[0].dense()
    right = old[1].dense().T @ new[1].dense()
    assert torch.allclose(m2, left @ m @ right, atol=1e-12)
    assert torch.allclose(v2, (left ** 2) @ v @ (right ** 2), atol=1e-12)


def test_moments_stay_when_the_projectors_do_not_change_and_are_orthonormal():
    # one non-zero per row at distinct columns, value 1: P^T P = I
    n, d = 8, 8
    eye = pj.SparseProjector(torch.randperm(n).view(n, 1), torch.ones(n, 1, dtype=F64), d)
    m, v = torch.randn(d, d, dtype=F64), torch.rand(d, d, dtype=F64)
    m2, v2 = pj.reproject_moments(m, v, (eye, eye), (eye, eye))
    assert torch.equal(m2, m) and torch.equal(v2, v)


def gradient_set(count, seed):
    """Gradients with a shared low-rank structure plus noise, as dY^T X of a layer has."""
    g = torch.Generator().manual_seed(0)
    basis_o, basis_i = torch.randn(24, 4, generator=g, dtype=F64), torch.randn(40, 4, generator=g, dtype=F64)
    h = torch.Generator().manual_seed(seed)
    return [basis_o @ torch.randn(4, 4, generator=h, dtype=F64) @ basis_i.T
            + 0.05 * torch.randn(24, 40, generator=h, dtype=F64) for _ in range(count)]


def test_fitting_lowers_the_held_out_error_below_random_projectors():
    random_pair = pair(seed=5)
    train, held_out = gradient_set(8, seed=1), gradient_set(8, seed=2)
    fit = vf.ValueFit(*random_pair, lr=0.05, steps=25, generator=torch.Generator().manual_seed(6))
    for grad in train:
        fit.observe(grad)
    learned = fit.pair()
    assert torch.equal(learned[0].pos, random_pair[0].pos)  # positions fixed: no collisions possible

    def error(p):
        return math.sqrt(sum(float(pj.squared_residual(g, *p)) for g in held_out) / sum(float(g.pow(2).sum()) for g in held_out))

    assert error(learned) < 0.8 * error(random_pair)


def test_a_non_finite_gradient_leaves_the_fit_as_it_was():
    fit = vf.ValueFit(*pair(seed=7), lr=0.05, steps=3, generator=torch.Generator().manual_seed(8))
    start = [v.detach().clone() for v in fit.values]
    bad = torch.randn(24, 40, dtype=F64)
    bad[0, 0] = float("nan")
    fit.observe(bad)
    assert all(torch.equal(v, s) for v, s in zip(fit.values, start))
    fit.observe(torch.randn(24, 40, dtype=F64))
    assert not torch.equal(fit.values[0], start[0]) and all(torch.isfinite(v).all() for v in fit.values)


@pytest.mark.parametrize("transposed", [False, True], ids=["x-P", "a-P-transposed"])
def test_product_gradients_in_the_values_and_the_input_equal_dense_autograd(transposed):
    """Fitting differentiates the products in P's values; the engine never does (its products run
    under no_grad)."""
    p = pair()[1]
    val = p.val.clone().requires_grad_()
    x = torch.randn(3, 5, p.d if transposed else p.n, dtype=F64, requires_grad=True)
    sparse = pj.SparseProjector(p.pos, val, p.d)
    out = sparse.right_t(x) if transposed else sparse.right(x)
    weights = torch.randn(out.shape, dtype=F64)
    (out * weights).sum().backward()
    val_dense = val.detach().clone().requires_grad_()
    x_dense = x.detach().clone().requires_grad_()
    dense = torch.zeros(p.n, p.d, dtype=F64).scatter(1, p.pos, val_dense)
    expected = x_dense @ dense.T if transposed else x_dense @ dense
    (expected * weights).sum().backward()
    assert torch.allclose(out, expected, atol=1e-12)
    assert torch.allclose(x.grad, x_dense.grad, atol=1e-12)
    assert torch.allclose(val.grad, val_dense.grad, atol=1e-12)


def test_the_sparse_transposed_product_equals_the_dense_one():
    p = pair(seed=11)[1]
    m = torch.randn(40, 7, dtype=F64)
    torch.testing.assert_close(pj.Transposed(p.pos, p.d).times(p.val, m), p.dense().T @ m, atol=1e-12, rtol=0)


def test_the_sparse_row_product_equals_the_dense_one():
    p = pair(seed=11)[1]
    m = torch.randn(8, 7, dtype=F64)
    torch.testing.assert_close(pj.Rows(p.pos, p.d).times(p.val, m), p.dense() @ m, atol=1e-12, rtol=0)


ROUTES = [((False, False), (False, False)), ((True, True), (True, True)), ((True, False), (False, True)),
          ((False, True), (True, False))]


@pytest.mark.parametrize("sparse_gram, sparse_rows", ROUTES)
def test_the_fit_gradient_in_closed_form_equals_autograd_of_the_error_identity(sparse_gram, sparse_rows):
    """ValueFit.gradient (two sparse products over G and d x d algebra) against autograd through
    squared_residual / |G|^2, float64, both projectors' values; every route the shapes can choose (each
    side's Gram products dense or through the non-zeros, each side's P X read through the non-zeros or
    the d x d X C^T read at the position pairs), whatever these small shapes would choose."""
    fit = vf.ValueFit(*pair(seed=9), lr=0.05, steps=1, generator=torch.Generator().manual_seed(10))
    fit.sparse_gram, fit.sparse_rows = list(sparse_gram), list(sparse_rows)
    g = gradient_set(1, seed=3)[0]
    values = [v.detach().clone().requires_grad_() for v in fit.values]
    total = g.pow(2).sum()
    loss = pj.squared_residual(g, *(pj.SparseProjector(pos, v, 8) for pos, v in zip((fit.pos_o, fit.pos_i), values)),
                               total) / total
    loss.backward()
    got = fit.gradient(g, g.t().contiguous(), total)
    assert float(got) == pytest.approx(float(loss.detach()), abs=1e-12)
    for value, expected in zip(fit.values, values):
        torch.testing.assert_close(value.grad, expected.grad, atol=1e-12, rtol=0)
    assert float(fit.error_sq(g)) == pytest.approx(float(loss.detach()), abs=1e-12)
    assert float(pj.fast_squared_residual(g, *fit.pair()) / total) == pytest.approx(float(loss.detach()), abs=1e-12)


def test_the_fit_reads_b_d_transpose_at_the_nonzeros_as_the_dense_product_does():
    """_rows_dot (D's rows gathered at each row's non-zeros) against the dense b D^T read at them, float64,
    b row-major and D a transposed view (the input side's D^T), r = 3 of d = 8."""
    p = pair(seed=12)[1]
    g = torch.Generator().manual_seed(13)
    b, d_c = torch.randn(40, 8, generator=g, dtype=F64), torch.randn(8, 8, generator=g, dtype=F64)
    for matrix in (d_c, d_c.t()):
        expected = torch.gather(b @ matrix.t(), 1, p.pos)
        torch.testing.assert_close(vf._rows_dot(b, matrix, p.pos), expected, atol=1e-13, rtol=0)


def test_the_fit_stops_when_the_held_out_error_stops_falling_and_keeps_its_best_values():
    """Held out: a gradient of the same structure, and pure noise. Each stops before the 400 steps
    offered, where two readings in a row fell by less than 0.1% below the best before them, keeps the
    values of its best reading and takes no step on a later gradient; without a held-out gradient all
    400 run."""
    train = gradient_set(1, seed=1)[0]
    like = gradient_set(1, seed=2)[0]
    noise = torch.randn(24, 40, generator=torch.Generator().manual_seed(4), dtype=F64)
    taken = {}
    for name, held_out in (("like", like), ("noise", noise)):
        fit = vf.ValueFit(*pair(seed=5), lr=0.05, steps=400, generator=torch.Generator().manual_seed(6))
        readings = []
        reading = vf._HeldOut.stalled

        def recorded(self, reading=reading, readings=readings):
            readings.append(float(self.h.error_sq()))
            return reading(self)

        vf._HeldOut.stalled = recorded
        try:
            fit.observe(train, held_out)
        finally:
            vf._HeldOut.stalled = reading
        taken[name] = fit.iterations
        assert fit.iterations < 400 and fit.iterations == vf.ValueFit.CHECK_EVERY * (len(readings) - 1)
        assert min(readings[-2:]) >= min(readings[:-2]) * (1 - vf.ValueFit.FALLING)  # why it stopped
        if name == "like":  # it fell first
            assert min(readings[:-2]) < readings[0] * (1 - 10 * vf.ValueFit.FALLING)
        assert fit.held_out_error ** 2 == pytest.approx(min(readings), rel=1e-9)
        assert float(fit.error_sq(held_out)) == pytest.approx(min(readings), rel=1e-9)
        done = fit.iterations
        fit.observe(train, held_out)  # done: later gradients take no steps
        assert fit.done and fit.iterations == done
    assert taken["noise"] < taken["like"]
    plain = vf.ValueFit(*pair(seed=5), lr=0.05, steps=400, generator=torch.Generator().manual_seed(6))
    plain.observe(train)
    assert plain.iterations == 400
