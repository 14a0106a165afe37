"""slimtune.engines.chunk.sliced and the sliced LM head of slimtune.step.loss against dense autograd (spec
chunkft.md 5 T1), in float64: for every op, axis and range (empty, partial, full, first and last
row or column) the side gradient equals the dense gradient's slice, dX equals the dense dX, and no
parameter ever gets a .grad. The dense reference is the original module, deep-copied before install.

Hugging Face's RMSNorm casts its input to float32 whatever its dtype, so in float64 it is a float32
computation; SlicedRMSNorm keeps float64 in float64 (and equals HF bitwise in float32 and bf16). The
float64 reference for its gradients is therefore HF's forward with float64 where HF writes float32
(`_hf_rmsnorm_in_float64`), and separate tests pin the real class in float32 and bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from slimtune.step import loss as L
from slimtune.engines.chunk.sliced import (
    ActiveSlice,
    SlicedEmbedding,
    SlicedLayerNorm,
    SlicedLinear,
    SlicedRMSNorm,
    install,
)
from slimtune.config import LossConfig
from slimtune.data.dataset import IGNORE_INDEX, trained_positions
from slimtune.errors import UserError

TOL = dict(rtol=1e-12, atol=1e-12)
RANGES = ("empty", "partial", "full", "first", "last")


def _range(name: str, n: int) -> tuple[int, int]:
    return {"empty": (2, 2), "partial": (1, n - 2), "full": (0, n), "first": (0, 1), "last": (n - 1, n)}[name]


def _sliced_copy(module: nn.Module, axes: dict[str, int]) -> tuple[nn.Module, dict[str, ActiveSlice]]:
    """A deep copy of module with slice-aware ops installed (axes by parameter name), and its slices."""
    holder = nn.ModuleDict({"m": copy.deepcopy(module)})
    slices = install(holder, lambda name, p: axes[name.rpartition(".")[2]])
    return holder["m"], {name.rpartition(".")[2]: s for name, s in slices.items()}


def _dense_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Plain autograd through the unwrapped module: (dX or None, {parameter name: dense grad})."""
    x = x.detach().requires_grad_(x.is_floating_point())
    module(x).backward(dy)
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return x.grad, grads


def _sliced_grads(module: nn.Module, slices: dict, x: torch.Tensor, dy: torch.Tensor):
    """The sliced module's (dX or None, {parameter name: side gradient or None}); checks p.grad is None."""
    x = x.detach().requires_grad_(x.is_floating_point())
    module(x).backward(dy)
    assert all(p.grad is None for p in module.parameters())
    return x.grad, {name: s.take() for name, s in slices.items()}


def _assert_slices_match(slices: dict, side: dict, dense: dict) -> None:
    for name, s in slices.items():
        if s.empty:
            assert side[name] is None  # nothing computed for an empty range
        else:
            torch.testing.assert_close(side[name], s.view(dense[name]), **TOL)


def _set(slices: dict, **ranges: tuple[int, int]) -> None:
    for name, (a, b) in ranges.items():
        slices[name].set(a, b)


# ---------------------------------------------------------------- ActiveSlice


def test_active_slice_accumulates_a_copy_in_fp32_for_bf16_and_hands_it_over_once():
    p = nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16))
    s = ActiveSlice(p, 1)
    s.set(2, 5)
    assert s.shape == (4, 3) and not s.empty
    g = torch.ones(4, 3, dtype=torch.float32)
    s.add(g)
    g.add_(1)  # the buffer is not the caller's tensor
    s.add(torch.ones(4, 3, dtype=torch.bfloat16))
    assert s.grad.dtype == torch.float32 and torch.equal(s.grad, torch.full((4, 3), 2.0))
    with pytest.raises(ValueError, match="take"):
        s.set(0, 1)
    assert s.take().shape == (4, 3) and s.take() is None
    assert torch.equal(s.view(torch.arange(24.0).reshape(4, 6)), torch.arange(24.0).reshape(4, 6)[:, 2:5])


def test_active_slice_of_fp64_stays_fp64_and_refuses_bad_ranges_and_shapes():
    s = ActiveSlice(nn.Parameter(torch.zeros(5, dtype=torch.float64)), 0)
    assert s.empty and s.shape == (0,)
    for bad in ((3, 2), (-1, 2), (0, 6)):
        with pytest.raises(ValueError, match="Range"):
            s.set(*bad)
    s.set(1, 3)
    with pytest.raises(ValueError, match="shape"):
        s.add(torch.zeros(3, dtype=torch.float64))
    s.add(torch.ones(2, dtype=torch.float32))
    assert s.grad.dtype == torch.float64
    with pytest.raises(ValueError, match="axis"):
        ActiveSlice(nn.Parameter(torch.zeros(5)), 1)


# ---------------------------------------------------------------- Linear


@pytest.mark.parametrize("bias_range", RANGES)
@pytest.mark.parametrize("weight_range", RANGES)
@pytest.mark.parametrize("axis", [0, 1])
def test_linear_slice_gradients_equal_dense_ones_with_weight_and_bias_in_their_own_ranges(
    axis, weight_range, bias_range
):
    torch.manual_seed(0)
    dense = nn.Linear(7, 6, dtype=torch.float64)
    sliced, slices = _sliced_copy(dense, {"weight": axis, "bias": 0})
    assert isinstance(sliced, SlicedLinear)
    _set(slices, weight=_range(weight_range, dense.weight.shape[axis]), bias=_range(bias_range, 6))
    x, dy = torch.randn(2, 3, 7, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64)
    dx_dense, dense_grads = _dense_grads(dense, x, dy)
    dx, side = _sliced_grads(sliced, slices, x, dy)
    torch.testing.assert_close(dx, dx_dense, **TOL)
    _assert_slices_match(slices, side, dense_grads)


def test_linear_forward_equals_nn_linear_bitwise_and_a_frozen_bias_gets_no_slice():
    torch.manual_seed(1)
    dense = nn.Linear(5, 4, dtype=torch.float64)
    dense.bias.requires_grad_(False)
    sliced, slices = _sliced_copy(dense, {"weight": 1})
    assert set(slices) == {"weight"} and set(sliced.slices) == {"weight"}
    x = torch.randn(3, 5, dtype=torch.float64)
    assert torch.equal(sliced(x), dense(x))
    assert sliced.weight is not dense.weight  # a copy; but it keeps its own Parameter objects:
    holder = nn.Sequential(dense)
    before = list(holder.named_parameters())
    install(holder, lambda name, p: 1)
    after = list(holder.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before] and all(a is b for (_, a), (_, b) in zip(after, before))


def test_gradient_accumulation_over_two_backward_passes_sums_exactly():
    torch.manual_seed(2)
    dense = nn.Linear(6, 5, dtype=torch.float64)
    sliced, slices = _sliced_copy(dense, {"weight": 1, "bias": 0})
    _set(slices, weight=(1, 4), bias=(2, 5))
    batches = [(torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)) for _ in range(2)]
    apart = []
    for x, dy in batches:
        apart.append(_sliced_grads(sliced, slices, x, dy)[1])
    for x, dy in batches:
        sliced(x).backward(dy)
    for x, dy in batches:
        dense(x).backward(dy)
    for name, s in slices.items():
        summed = s.take()
        assert torch.equal(summed, apart[0][name] + apart[1][name])
        torch.testing.assert_close(summed, s.view(getattr(dense, name).grad), **TOL)


# ---------------------------------------------------------------- Embedding

PAD = 3


@pytest.mark.parametrize("weight_range", [*RANGES, "around_padding"])
def test_embedding_rows_get_the_scattered_gradient_and_padding_idx_gets_none(weight_range):
    torch.manual_seed(3)
    dense = nn.Embedding(11, 4, padding_idx=PAD, dtype=torch.float64)
    sliced, slices = _sliced_copy(dense, {"weight": 0})
    assert isinstance(sliced, SlicedEmbedding)
    slices["weight"].set(*((2, 5) if weight_range == "around_padding" else _range(weight_range, 11)))
    ids = torch.tensor([[0, 3, 10, 2, 3], [4, 4, 10, 1, 5]])  # repeated ids, padding twice, both ends
    dy = torch.randn(2, 5, 4, dtype=torch.float64)
    assert torch.equal(sliced(ids), dense(ids))
    _, dense_grads = _dense_grads(dense, ids, dy)
    _, side = _sliced_grads(sliced, slices, ids, dy)
    _assert_slices_match(slices, side, dense_grads)
    assert torch.equal(dense_grads["weight"][PAD], torch.zeros(4, dtype=torch.float64))
    s = slices["weight"]
    if s.start <= PAD < s.stop:
        assert torch.equal(side["weight"][PAD - s.start], torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("option", [dict(max_norm=1.0), dict(scale_grad_by_freq=True), dict(sparse=True)])
def test_embedding_refuses_options_that_change_its_gradient(option):
    with pytest.raises(ValueError, match=next(iter(option))):
        _sliced_copy(nn.Embedding(5, 3, **option), {"weight": 0})


def test_embedding_refuses_to_be_sliced_by_columns():
    with pytest.raises(ValueError, match="axis"):
        _sliced_copy(nn.Embedding(5, 3), {"weight": 1})


# ---------------------------------------------------------------- RMSNorm

D = 6


def _hf_rmsnorm_in_float64(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward (transformers' own lines) with float64 where it writes float32."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float64)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden_states.to(input_dtype)


class _Float64LlamaRMSNorm(LlamaRMSNorm):
    """The dense float64 reference: the real class, its forward at float64 precision."""

    def forward(self, x):
        return _hf_rmsnorm_in_float64(self, x)


def _rmsnorm(cls=LlamaRMSNorm, dtype=torch.float64, seed=4) -> nn.Module:
    torch.manual_seed(seed)
    norm = cls(D, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def _off_centre(*shape, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).add(0.7).to(dtype)  # mean 0.7: LayerNorm's formulas fail


@pytest.mark.parametrize("weight_range", RANGES)
def test_rmsnorm_gradients_follow_the_rmsnorm_formula_not_layernorms(weight_range):
    dense = _rmsnorm()
    sliced, slices = _sliced_copy(dense, {"weight": 0})
    assert isinstance(sliced, SlicedRMSNorm) and sliced.variance_epsilon == dense.variance_epsilon
    slices["weight"].set(*_range(weight_range, D))
    reference = _Float64LlamaRMSNorm(D, eps=dense.variance_epsilon).double()
    reference.load_state_dict(dense.state_dict())
    x, dy = _off_centre(2, 5, D), torch.randn(2, 5, D, dtype=torch.float64)
    dx_dense, dense_grads = _dense_grads(reference, x, dy)
    dx, side = _sliced_grads(sliced, slices, x, dy)
    torch.testing.assert_close(dx, dx_dense, **TOL)
    _assert_slices_match(slices, side, dense_grads)
    # the input is one on which LayerNorm's formulas would be far off (pitfall 1)
    layernorm_dx = torch.func.vjp(lambda t: nn.functional.layer_norm(t, (D,), dense.weight.detach(), None,
                                                                     dense.variance_epsilon), x)[1](dy)[0]
    assert (layernorm_dx - dx_dense).norm() > 0.1 * dx_dense.norm()


def test_rmsnorm_forward_is_hf_bitwise_in_float64_at_float64_precision():
    dense, x = _rmsnorm(), _off_centre(3, 4, D)
    sliced, _ = _sliced_copy(dense, {"weight": 0})
    assert torch.equal(sliced(x), _hf_rmsnorm_in_float64(dense, x))
    # the real class in float64 computes in float32: equal to float32 rounding, not bitwise
    torch.testing.assert_close(sliced(x), dense(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"])
def test_rmsnorm_forward_equals_the_real_hf_class_bitwise_in_float32_and_bf16(dtype, weight_dtype):
    dense = _rmsnorm(dtype=dtype if weight_dtype == "same" else torch.float32)
    sliced, _ = _sliced_copy(dense, {"weight": 0})
    x = _off_centre(3, 4, D, dtype=dtype)
    out = sliced(x)
    assert out.dtype == dense(x).dtype and torch.equal(out, dense(x))


def test_rmsnorm_gradients_match_the_real_hf_class_in_float32():
    dense = _rmsnorm(dtype=torch.float32)
    sliced, slices = _sliced_copy(dense, {"weight": 0})
    slices["weight"].set(0, D)
    x, dy = _off_centre(4, D, dtype=torch.float32), torch.randn(4, D)
    dx_dense, dense_grads = _dense_grads(dense, x, dy)
    dx, side = _sliced_grads(sliced, slices, x, dy)
    torch.testing.assert_close(dx, dx_dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(side["weight"], dense_grads["weight"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm])
def test_rmsnorm_wraps_the_mistral_and_qwen_classes_too(cls):
    dense = _rmsnorm(cls)
    sliced, slices = _sliced_copy(dense, {"weight": 0})
    slices["weight"].set(1, 4)
    x, dy = _off_centre(3, D), torch.randn(3, D, dtype=torch.float64)
    assert torch.equal(sliced(x), _hf_rmsnorm_in_float64(dense, x))
    _, side = _sliced_grads(sliced, slices, x, dy)
    assert side["weight"].shape == (3,)


def test_rmsnorm_wrapper_refuses_a_class_it_does_not_know_by_name():
    class GemmaRMSNorm(nn.Module):  # (1 + weight): other numerics under the same attribute names
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.zeros(D)), 1e-6

    with pytest.raises(ValueError, match="GemmaRMSNorm"):
        SlicedRMSNorm(GemmaRMSNorm(), {})
    with pytest.raises(ValueError, match="RMSNorm"):
        SlicedRMSNorm(nn.RMSNorm(D), {})
    broken = LlamaRMSNorm(D)
    del broken.variance_epsilon
    with pytest.raises(ValueError, match="LlamaRMSNorm"):
        SlicedRMSNorm(broken, {})


# ---------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("bias_range", RANGES)
@pytest.mark.parametrize("weight_range", RANGES)
def test_layernorm_weight_and_bias_in_different_ranges_get_their_own_gradients(weight_range, bias_range):
    torch.manual_seed(5)
    dense = nn.LayerNorm(D, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.uniform_(0.5, 1.5)
        dense.bias.normal_()
    sliced, slices = _sliced_copy(dense, {"weight": 0, "bias": 0})
    assert isinstance(sliced, SlicedLayerNorm)
    _set(slices, weight=_range(weight_range, D), bias=_range(bias_range, D))
    x, dy = _off_centre(2, 3, D), torch.randn(2, 3, D, dtype=torch.float64)
    assert torch.equal(sliced(x), dense(x))
    dx_dense, dense_grads = _dense_grads(dense, x, dy)
    dx, side = _sliced_grads(sliced, slices, x, dy)
    torch.testing.assert_close(dx, dx_dense, **TOL)
    _assert_slices_match(slices, side, dense_grads)


def test_layernorm_without_bias_is_sliced_and_one_over_two_dims_is_refused():
    dense = nn.LayerNorm(D, bias=False, dtype=torch.float64)
    sliced, slices = _sliced_copy(dense, {"weight": 0})
    slices["weight"].set(2, 4)
    x, dy = _off_centre(3, D), torch.randn(3, D, dtype=torch.float64)
    dx_dense, dense_grads = _dense_grads(dense, x, dy)
    dx, side = _sliced_grads(sliced, slices, x, dy)
    torch.testing.assert_close(dx, dx_dense, **TOL)
    _assert_slices_match(slices, side, dense_grads)
    with pytest.raises(ValueError, match="last dim"):
        _sliced_copy(nn.LayerNorm((2, D)), {"weight": 0, "bias": 0})


# ---------------------------------------------------------------- install on a model


def _llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(6)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).double()


def _engine_axes(name: str, p: nn.Parameter) -> int:
    """The engine's split axes (spec 2.1): rows for 1-D, the embedding and the head; else columns."""
    return 0 if p.dim() == 1 or "embed_tokens" in name or "lm_head" in name else 1


def test_install_on_a_llama_keeps_state_dict_keys_and_gives_every_trainable_parameter_a_slice():
    model = _llama(tied=False)
    keys = list(model.state_dict())
    slices = install(model, _engine_axes)
    assert list(model.state_dict()) == keys
    assert list(slices) == [name for name, _ in model.named_parameters()]
    assert all(s.param is p for (name, p), s in zip(model.named_parameters(), slices.values()))
    assert slices["lm_head.weight"].axis == 0 and slices["model.layers.0.mlp.down_proj.weight"].axis == 1
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert type(module) in (SlicedLinear, SlicedEmbedding, SlicedRMSNorm), type(module)


def test_install_on_a_llama_gives_full_ranges_the_dense_gradients_and_no_grad():
    model = _llama(tied=False)
    dense = copy.deepcopy(model)
    slices = install(model, _engine_axes)
    for s in slices.values():
        s.set(0, s.param.shape[s.axis])
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    model(ids).logits.pow(2).sum().backward()
    dense(ids).logits.pow(2).sum().backward()
    dense_grads = dict(dense.named_parameters())
    for name, s in slices.items():
        assert s.param.grad is None
        # HF's RMSNorm computes in float32 even in a float64 model; the sliced one keeps float64
        torch.testing.assert_close(s.take(), dense_grads[name].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_sliced_bf16_llama_computes_the_same_logits_as_the_stock_one_with_and_without_autocast(autocast):
    model = _llama(tied=False).to(torch.bfloat16)
    dense = copy.deepcopy(model)
    slices = install(model, _engine_axes)
    for s in slices.values():
        s.set(0, s.param.shape[s.axis])
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, dense_logits = model(ids).logits, dense(ids).logits
    assert torch.equal(logits, dense_logits)
    logits.float().pow(2).sum().backward()
    assert all(s.take().dtype == torch.float32 for s in slices.values())


def test_install_on_a_tied_llama_shares_one_slice_between_embedding_and_head():
    model = _llama(tied=True)
    slices = install(model, _engine_axes)
    embed, head = model.model.embed_tokens, model.lm_head
    assert embed.slices["weight"] is head.slices["weight"] is slices["model.embed_tokens.weight"]
    assert "lm_head.weight" not in slices and embed.weight is head.weight
    shared = slices["model.embed_tokens.weight"]
    shared.set(10, 30)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    model(ids).logits.pow(2).sum().backward()
    reference = _llama(tied=True)  # the same weights, unsliced: its tied gradient sums embedding and head
    reference(ids).logits.pow(2).sum().backward()
    torch.testing.assert_close(shared.take(), reference.lm_head.weight.grad[10:30], rtol=1e-5, atol=1e-5)


def test_install_refuses_a_trainable_module_it_has_no_op_for_and_leaves_frozen_ones_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1))
    with pytest.raises(UserError, match=r"module 1 \(Conv1d\); freeze it"):
        install(model, lambda name, p: 0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1).requires_grad_(False))
    slices = install(model, lambda name, p: 0)
    assert list(slices) == ["0.weight", "0.bias"] and type(model[1]) is nn.Conv1d


def test_install_refuses_a_second_install():
    model = nn.Sequential(nn.Linear(4, 4))
    install(model, lambda name, p: 0)
    with pytest.raises(ValueError, match="already installed"):
        install(model, lambda name, p: 0)


# ---------------------------------------------------------------- the sliced LM head in the loss

B, T, V = 3, 7, 37


def _head_problem(seed: int):
    torch.manual_seed(seed)
    hidden = torch.randn(B, T, D, dtype=torch.float64)
    head = nn.Linear(D, V, dtype=torch.float64)
    with torch.no_grad():
        head.weight.mul_(4.0)
    targets = torch.randint(0, V, (B, T))
    targets[0, :3] = IGNORE_INDEX
    return hidden, head, targets


@pytest.mark.parametrize("chunk_size", [0, 4])
@pytest.mark.parametrize("bias_range", ["empty", "partial", "last"])
@pytest.mark.parametrize("weight_range", RANGES)
def test_sliced_head_in_the_loss_gets_the_dense_head_gradient_rows(weight_range, bias_range, chunk_size):
    hidden, dense, targets = _head_problem(7)
    sliced, slices = _sliced_copy(dense, {"weight": 0, "bias": 0})
    _set(slices, weight=_range(weight_range, V), bias=_range(bias_range, V))
    cfg = LossConfig(chunk_size=chunk_size)
    rows = trained_positions(targets)
    results = []
    for head in (dense, sliced):
        h = hidden.clone().requires_grad_()
        out = L.causal_lm_loss(h, nn.Identity(), head, targets, cfg, rows)
        (out.loss_sum * 0.5).backward()  # a scale, as the engine's division by the token count
        results.append((out.loss_sum.detach(), h.grad))
    torch.testing.assert_close(results[1], results[0], **TOL)
    assert sliced.weight.grad is None and sliced.bias.grad is None
    side = {name: s.take() for name, s in slices.items()}
    _assert_slices_match(slices, side, {"weight": dense.weight.grad, "bias": dense.bias.grad})


def test_loss_refuses_a_head_sliced_by_columns():
    hidden, dense, targets = _head_problem(8)
    sliced, _ = _sliced_copy(dense, {"weight": 1, "bias": 0})
    with pytest.raises(ValueError, match=r"vocabulary rows \(axis 0\)"):
        L.causal_lm_loss(hidden.requires_grad_(), nn.Identity(), sliced, targets, LossConfig(),
                         trained_positions(targets))


# ---------------------------------------------------------------- fake tensors (the planner)


@pytest.mark.parametrize("kind", ["linear0", "linear1", "embedding", "rmsnorm", "layernorm", "head"])
def test_every_wrapper_runs_under_fake_tensors_and_makes_a_side_grad_of_the_slice_shape(kind):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real_targets = torch.randint(0, V, (B, T))
    with FakeTensorMode() as fake:
        module, axis, x = {
            "linear0": lambda: (nn.Linear(D, 5), 0, torch.empty(B, T, D)),
            "linear1": lambda: (nn.Linear(D, 5), 1, torch.empty(B, T, D)),
            "embedding": lambda: (nn.Embedding(V, D, padding_idx=0), 0, torch.zeros(B, T, dtype=torch.long)),
            "rmsnorm": lambda: (LlamaRMSNorm(D), 0, torch.empty(B, T, D)),
            "layernorm": lambda: (nn.LayerNorm(D), 0, torch.empty(B, T, D)),
            "head": lambda: (nn.Linear(D, V), 0, torch.empty(B, T, D)),
        }[kind]()
        holder = nn.ModuleDict({"m": module})
        slices = install(holder, lambda name, p: axis if p.dim() == 2 else 0)
        for s in slices.values():
            s.set(1, 3)
        x.requires_grad_(x.is_floating_point())
        if kind == "head":
            targets = fake.from_tensor(real_targets)
            out = L.causal_lm_loss(x, nn.Identity(), holder["m"], targets, LossConfig(masking=False, chunk_size=4))
            out.loss_sum.backward()
        else:
            holder["m"](x).sum().backward()
        for s in slices.values():
            assert s.param.grad is None and s.take().shape == s.shape
