"""slimtune.step.loss against plain PyTorch: F.cross_entropy on materialised logits (float64, 1e-12),
the subset-softmax identities of specs/peak-memory-lora.md 2.5, what is saved for backward,
and a run under fake tensors (the planner's estimate)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slimtune.step import loss as L
from slimtune.model import quant
from slimtune.config import LossConfig, QuantConfig
from slimtune.data.dataset import IGNORE_INDEX, trained_positions
from slimtune.errors import UserError

from conftest import Fp32RMSNorm

pytestmark = pytest.mark.quick  # the losses' exactness, cheap

B, T, D, V = 3, 7, 8, 37
TOL = dict(rtol=0, atol=1e-12)


def _targets(pattern: str, seed: int = 0) -> torch.Tensor:
    """(B, T): 'segments' has several response segments per row and a row with none."""
    t = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    trained = torch.zeros(B, T, dtype=torch.bool)
    if pattern == "all":
        trained[:] = True
    elif pattern == "segments":
        trained[0, 1:3] = trained[0, 4:6] = True
        trained[1, 0:2] = trained[1, 3:5] = trained[1, 6:] = True
    return t.masked_fill(~trained, IGNORE_INDEX)


def _model(seed: int, head_grad: bool, bias: bool = False, dtype=torch.float64):
    """A leaf hidden (B, T, D), an RMSNorm with a random gain, and a (V, D) head."""
    torch.manual_seed(seed)
    hidden = torch.randn(B, T, D, dtype=dtype, requires_grad=True)
    norm = nn.RMSNorm(D, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    head = nn.Linear(D, V, bias=bias, dtype=dtype)
    with torch.no_grad():
        head.weight.mul_(4.0)  # a spread of logits, so the softmax is not near uniform
    head.requires_grad_(head_grad)
    return hidden, norm, head


def _grads(tensors) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def _reference(hidden, norm, head, targets) -> torch.Tensor:
    """Standard masked cross-entropy on materialised logits: every row, label -100 on prompts."""
    logits = head(norm(hidden)).reshape(-1, V)
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def _ours(hidden, norm, head, targets, **cfg) -> L.LossOutput:
    config = LossConfig(**cfg)
    rows = trained_positions(targets) if config.masking else None
    return L.causal_lm_loss(hidden, norm, head, targets, config, trained_positions=rows, training=True)


def _check_against_reference(hidden, norm, head, targets, leaves, **cfg) -> L.LossOutput:
    out = _ours(hidden, norm, head, targets, **cfg)
    (out.loss_sum * 0.37).backward()  # a grad_output other than 1, as the engine's 1/total is
    ours = _grads(leaves)
    ref = _reference(hidden, norm, head, targets)
    (ref * 0.37).backward()
    for mine, theirs in zip(ours, _grads(leaves)):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, theirs, **TOL)
    torch.testing.assert_close(out.loss_sum.detach(), ref.detach(), **TOL)
    return out


# ---------------------------------------------------------------- mode=exact and masking


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("pattern", ["segments", "all", "none"])
@pytest.mark.parametrize("head_kind", ["frozen", "trainable", "trainable_bias"])
def test_exact_equals_cross_entropy(chunk, masking, pattern, head_kind):
    hidden, norm, head = _model(1, head_kind != "frozen", bias=head_kind == "trainable_bias")
    leaves = [hidden, norm.weight] + [p for p in head.parameters() if p.requires_grad]
    targets = _targets(pattern)
    out = _check_against_reference(hidden, norm, head, targets, leaves, chunk_size=chunk, masking=masking)
    torch.testing.assert_close(out.exact_sum, out.loss_sum.detach(), **TOL)
    assert float(out.excluded_mass_sum) == 0.0
    if pattern == "none":
        assert float(out.loss_sum.detach()) == 0.0


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("norm_bias", [False, True])
def test_exact_with_frozen_final_norm(chunk, masking, norm_bias):
    """LoRA: the final norm is frozen (its parameters get no gradient), the hidden's gradient still
    goes through it chunk by chunk. A LayerNorm with a bias stands for a norm with two parameters."""
    hidden, _, head = _model(11, head_grad=False)
    norm = nn.LayerNorm(D, bias=norm_bias, dtype=torch.float64) if norm_bias else nn.RMSNorm(D, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm.requires_grad_(False)
    _check_against_reference(hidden, norm, head, _targets("segments"), [hidden], chunk_size=chunk, masking=masking)
    assert all(p.grad is None for p in norm.parameters())


@pytest.mark.parametrize("chunk", [3, 5])
def test_trained_layernorm_gets_weight_and_bias_gradients(chunk):
    """Full fine-tuning: a norm's parameters' gradients are summed over the chunks (5 and 3 do not
    divide 21 rows), equal to one norm over every row."""
    hidden, _, head = _model(12, head_grad=True)
    norm = nn.LayerNorm(D, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    leaves = [hidden, norm.weight, norm.bias, head.weight]
    _check_against_reference(hidden, norm, head, _targets("all"), leaves, chunk_size=chunk, masking=False)


@pytest.mark.parametrize("norm_grad", [False, True])
def test_norm_computing_in_fp32_sees_the_scaled_gradient(norm_grad):
    hidden, _, head = _model(14, head_grad=False)
    norm = Fp32RMSNorm(D).requires_grad_(norm_grad)
    leaves = [hidden] + ([norm.weight] if norm_grad else [])
    _check_against_reference(hidden, norm, head, _targets("segments"), leaves, chunk_size=4, masking=True)


@pytest.mark.parametrize("mode", ["exact", "subset"])
def test_final_norm_runs_per_loss_chunk(mode):
    """The norm sees one loss chunk of rows at a time (never all N): once per chunk in forward (no
    grad) and once again in backward (with grad, for that chunk's gradient); in both loss modes."""
    hidden, norm, head = _model(13, head_grad=mode == "exact")
    targets = _targets("segments")
    seen = []
    norm.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    _ours(hidden, norm, head, targets, mode=mode, subset_k=4, masking=True, chunk_size=3).loss_sum.backward()
    n = int((targets != IGNORE_INDEX).sum())
    assert seen == 2 * [min(3, n - s) for s in range(0, n, 3)]


@pytest.mark.parametrize("masking", [False, True])
def test_exact_tied_trainable_embedding_gets_both_gradients(masking):
    torch.manual_seed(2)
    embed = nn.Embedding(V, D, dtype=torch.float64)
    head = nn.Linear(D, V, bias=False, dtype=torch.float64)
    head.weight = embed.weight  # tied, as Llama-3.2 and Qwen-2.5 are
    ids = torch.randint(0, V, (B, T))
    base = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    norm = nn.RMSNorm(D, dtype=torch.float64)
    targets = _targets("segments", seed=3)

    def run(fn):
        fn(base + 2.0 * embed(ids)).mul(0.5).backward()
        return _grads([base, embed.weight, norm.weight])

    ours = run(lambda h: _ours(h, norm, head, targets, chunk_size=3, masking=masking).loss_sum)
    ref = run(lambda h: _reference(h, norm, head, targets))
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine, theirs, **TOL)
    assert ours[1].abs().sum() > 0


@pytest.mark.parametrize("scheme", ["int4", "nf4"])
@pytest.mark.parametrize("mode", ["exact", "subset"])
def test_4bit_head_is_dequantized_tile_by_tile(mode, scheme, monkeypatch):
    """A 4-bit head (quant.QuantLinear) gives the loss and gradients of a dense head holding its
    dequantized weight, read in tiles of 8 vocabulary rows (37 = 4 x 8 + 5), never whole."""
    monkeypatch.setattr(quant, "DEQUANT_TILE_ELEMENTS", 8 * D)
    hidden, norm, head = _model(4, head_grad=False)
    qhead = quant.quantize(head, QuantConfig(scheme=scheme, group_size=4))
    dense = nn.Linear(D, V, bias=False, dtype=torch.float64).requires_grad_(False)
    dense.weight.copy_(qhead.dequantized_weight())
    targets = _targets("segments")
    cfg = dict(mode=mode, chunk_size=5, subset_k=V)
    plain = _ours(hidden, norm, dense, targets, **cfg)
    plain.loss_sum.backward()
    expected = _grads([hidden, norm.weight])
    shapes = []
    original = quant.dequantize_row_range
    monkeypatch.setattr(quant, "dequantize_row_range", lambda *a: shapes.append(a[4] - a[3]) or original(*a))
    tiled = _ours(hidden, norm, qhead, targets, **cfg)
    tiled.loss_sum.backward()
    torch.testing.assert_close(tiled.loss_sum, plain.loss_sum, **TOL)
    for mine, theirs in zip(_grads([hidden, norm.weight]), expected):
        torch.testing.assert_close(mine, theirs, **TOL)
    assert shapes and max(shapes) == 8 and V not in shapes


def test_masking_needs_rows():
    hidden, norm, head = _model(5, head_grad=False)
    with pytest.raises(ValueError, match="trained_positions"):
        L.causal_lm_loss(hidden, norm, head, _targets("all"), LossConfig(masking=True), trained_positions=None)


def test_masking_runs_norm_and_head_on_trained_rows_only():
    hidden, norm, head = _model(6, head_grad=False)
    targets = _targets("segments")
    seen = []
    norm.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    _ours(hidden, norm, head, targets, masking=True)
    assert seen == [(int((targets != IGNORE_INDEX).sum()), D)]


def test_bf16_autocast_logits_in_fp32():
    hidden, norm, head = _model(7, head_grad=True, dtype=torch.float32)
    targets = _targets("segments")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _ours(hidden, norm, head, targets, chunk_size=4)
    out.loss_sum.backward()
    assert out.loss_sum.dtype == torch.float32 and head.weight.grad.dtype == torch.float32
    ref = _reference(hidden, norm, head, targets)
    torch.testing.assert_close(out.loss_sum.detach(), ref.detach(), rtol=2e-2, atol=0)


@pytest.mark.parametrize("mode", ["exact", "subset"])
def test_narrow_head_is_cast_in_tiles(mode, monkeypatch):
    """A bf16 head (the frozen base of bf16 LoRA) is widened tile by tile: same numbers as a full cast."""
    monkeypatch.setattr(L, "CAST_TILE_ROWS", 5)
    hidden, norm, head = _model(8, head_grad=False, dtype=torch.float32)
    head.to(torch.bfloat16)
    targets = _targets("segments")
    out = _ours(hidden, norm, head, targets, mode=mode, chunk_size=4, subset_k=V)
    out.loss_sum.backward()
    grad = _grads([hidden])[0]
    wide = nn.Linear(D, V, bias=False).requires_grad_(False)
    wide.weight.copy_(head.weight.float())
    ref = _reference(hidden, norm, wide, targets)
    ref.backward()
    torch.testing.assert_close(out.loss_sum.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, _grads([hidden])[0], rtol=1e-5, atol=1e-6)


def test_eval_is_exact_without_graph():
    hidden, norm, head = _model(9, head_grad=False)
    targets = _targets("segments")
    rows = trained_positions(targets)
    out = L.causal_lm_loss(hidden, norm, head, targets, LossConfig(mode="subset", subset_k=3), rows, training=False)
    assert not out.loss_sum.requires_grad
    torch.testing.assert_close(out.loss_sum, _reference(hidden, norm, head, targets).detach(), **TOL)
    assert float(out.excluded_mass_sum) == 0.0


# ---------------------------------------------------------------- mode=subset


def _subset_setup(seed: int, k: int):
    """Logits as hidden: an identity head and norm, so dL/dhidden is dL/dz. Half the targets
    are each row's smallest logit, so they lie outside the top-k and must be forced in."""
    torch.manual_seed(seed)
    z = (3.0 * torch.randn(1, 16, V, dtype=torch.float64)).requires_grad_(True)
    targets = torch.randint(0, V, (1, 16))
    targets[0, ::2] = z[0, ::2].argmin(-1)
    head = nn.Linear(V, V, bias=False, dtype=torch.float64).requires_grad_(False)
    head.weight.copy_(torch.eye(V, dtype=torch.float64))
    return z, targets, head


def test_select_subset_keeps_target_and_top_k():
    torch.manual_seed(11)
    z = torch.randn(50, V, dtype=torch.float64)
    targets = torch.randint(0, V, (50,))
    targets[::3] = z[::3].argmin(-1)
    ids = L.select_subset(z, targets, 6)
    assert ids.shape == (50, 6)
    assert (ids == targets[:, None]).any(-1).all()
    assert all(len(set(row.tolist())) == 6 for row in ids)
    top = z.topk(5, dim=-1).indices  # the top k-1 always survive
    assert all(set(t.tolist()) <= set(r.tolist()) for t, r in zip(top, ids))
    assert L.select_subset(z, targets, 10 * V).shape == (50, V)


def test_subset_loss_identities_per_position():
    """L_full - L_S = -log p(S); exact_sum = L_full; excluded mass = 1 - p(S) (spec 2.5)."""
    k = 5
    z, targets, head = _subset_setup(12, k)
    for i in range(z.shape[1]):
        rows = torch.tensor([i])
        out = L.causal_lm_loss(z, nn.Identity(), head, targets, LossConfig(mode="subset", subset_k=k), rows)
        zi, yi = z[0, i].detach(), targets[0, i]
        p_s = zi.softmax(-1)[L.select_subset(zi[None], yi[None], k)[0]].sum()
        full = F.cross_entropy(zi[None], yi[None], reduction="sum")
        torch.testing.assert_close(full - out.loss_sum.detach(), -p_s.log(), **TOL)
        torch.testing.assert_close(out.exact_sum, full, **TOL)
        torch.testing.assert_close(out.excluded_mass_sum, 1 - p_s, **TOL)
        assert p_s < 1 - 1e-6  # the subset really leaves mass out


def test_subset_logit_gradient_l1_error():
    """||dL_S/dz - dL/dz||_1 = 2 (1 - p(S)) per position (spec 2.5)."""
    k = 4
    z, targets, head = _subset_setup(13, k)
    cfg = LossConfig(mode="subset", subset_k=k, chunk_size=3, masking=False)
    L.causal_lm_loss(z, nn.Identity(), head, targets, cfg).loss_sum.backward()
    grad_s = _grads([z])[0][0]
    F.cross_entropy(z[0], targets[0], reduction="sum").backward()
    grad_full = _grads([z])[0][0]
    ids = L.select_subset(z[0].detach(), targets[0], k)
    p_s = z[0].detach().softmax(-1).gather(1, ids).sum(-1)
    torch.testing.assert_close((grad_s - grad_full).abs().sum(-1), 2 * (1 - p_s), **TOL)


def test_subset_hidden_gradient_matches_formula_and_bound():
    """dL/dh = sum_{j in S}(q_j - 1[j=y]) w_j exactly, and its error <= 2 (1 - p(S)) max_j ||w_j||."""
    k = 6
    hidden, _, head = _model(14, head_grad=False)
    targets = _targets("all", seed=15)
    cfg = LossConfig(mode="subset", subset_k=k, chunk_size=4, masking=False)
    L.causal_lm_loss(hidden, nn.Identity(), head, targets, cfg).loss_sum.backward()
    grad_s = _grads([hidden])[0].reshape(-1, D)
    _reference(hidden, nn.Identity(), head, targets).backward()
    grad_full = _grads([hidden])[0].reshape(-1, D)
    x, w = hidden.detach().reshape(-1, D), head.weight
    for i, (row, y) in enumerate(zip(x, targets.reshape(-1))):
        ids = L.select_subset((row @ w.T)[None], y[None], k)[0]
        xi = row.clone().requires_grad_(True)
        F.cross_entropy((xi @ w[ids].T)[None], (ids == y).nonzero()[0], reduction="sum").backward()
        torch.testing.assert_close(grad_s[i], xi.grad, **TOL)
        p_s = (row @ w.T).softmax(-1)[ids].sum()
        bound = 2 * (1 - p_s) * w.norm(dim=1).max()
        assert (grad_s[i] - grad_full[i]).norm() <= bound + 1e-12
    assert (grad_s - grad_full).abs().max() > 1e-6  # k < V really approximates


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("pattern", ["segments", "none"])
def test_subset_with_k_equal_v_is_cross_entropy(chunk, masking, pattern):
    hidden, norm, head = _model(16, head_grad=False)
    cfg = dict(mode="subset", subset_k=V, chunk_size=chunk, masking=masking)
    out = _check_against_reference(hidden, norm, head, _targets(pattern), [hidden, norm.weight], **cfg)
    torch.testing.assert_close(out.exact_sum, out.loss_sum.detach(), **TOL)
    torch.testing.assert_close(out.excluded_mass_sum, torch.zeros((), dtype=torch.float64), **TOL)


def test_subset_masking_is_exact():
    """Masking changes which rows are computed, not the subset loss or its gradients."""
    hidden, norm, head = _model(17, head_grad=False)
    targets = _targets("segments")
    results = []
    for masking in (False, True):
        out = _ours(hidden, norm, head, targets, mode="subset", subset_k=4, chunk_size=3, masking=masking)
        out.loss_sum.backward()
        results.append([out.loss_sum.detach(), out.exact_sum, out.excluded_mass_sum] + _grads([hidden, norm.weight]))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL)


def test_subset_refuses_trainable_head():
    hidden, norm, head = _model(18, head_grad=True)
    with pytest.raises(UserError, match="loss.mode=subset"):
        _ours(hidden, norm, head, _targets("all"), mode="subset", subset_k=4)


# ---------------------------------------------------------------- memory shape and fake tensors


@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("mode,head_grad", [("exact", False), ("exact", True), ("subset", False)])
def test_nothing_vocabulary_wide_is_saved(mode, head_grad, masking):
    hidden, norm, head = _model(19, head_grad=head_grad)
    targets = _targets("segments")
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _ours(hidden, norm, head, targets, mode=mode, subset_k=5, chunk_size=4, masking=masking)
    out.loss_sum.backward()
    n = int((targets != IGNORE_INDEX).sum()) if masking else B * T
    assert (n, D) in saved  # the hook sees the loss's own saves
    assert all(shape[-1:] != (V,) for shape in saved), saved


@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("mode,tied", [("exact", False), ("exact", True), ("subset", False)])
def test_runs_under_fake_tensors(mode, tied, masking):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real_targets = _targets("segments")
    real_rows = trained_positions(real_targets)  # built with the batch, on real tensors
    with FakeTensorMode() as fake:
        hidden = torch.empty(B, T, D, requires_grad=True)
        norm = nn.RMSNorm(D)
        head = nn.Linear(D, V, bias=False)
        embed = nn.Embedding(V, D)
        if tied:
            head.weight = embed.weight
        head.requires_grad_(mode == "exact")
        targets, rows = fake.from_tensor(real_targets), fake.from_tensor(real_rows)
        cfg = LossConfig(mode=mode, subset_k=5, chunk_size=4, masking=masking)
        out = L.causal_lm_loss(hidden, norm, head, targets, cfg, rows if masking else None, training=True)
        (out.loss_sum / 10).backward()
        assert out.loss_sum.shape == out.exact_sum.shape == ()
        assert hidden.grad.shape == (B, T, D) and norm.weight.grad.shape == (D,)
        assert (head.weight.grad is not None) == (mode == "exact")
