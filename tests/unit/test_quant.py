"""4-bit frozen weights (peak-memory-lora.md 2.3, section 5 "Quantization"): packing, error
bounds, bitsandbytes parity, exact forward/backward against a materialized dense weight,
nothing dense saved for backward, resident bytes, model-level apply, and the planner's
meta/fake path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from slimtune.model import lora, quant
from slimtune.config import LoraConfig, QuantConfig

OUT, IN = 48, 80  # IN is not a multiple of 64: a partial last group/block, and IN != OUT
SCHEMES = ("int4", "nf4")


def _linear(dtype=torch.float64, out=OUT, inp=IN, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(inp, out, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_()
    return lin


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


# ---------------------------------------------------------------- formats and error


def test_pack_unpack_round_trip_is_bit_exact():
    g = torch.Generator().manual_seed(0)
    for cols in (7, 8, 1):
        q = torch.randint(-8, 8, (5, cols), generator=g, dtype=torch.int8)
        packed = quant.pack(q)
        assert packed.dtype == torch.uint8 and packed.shape == (5, (cols + 1) // 2)
        assert torch.equal(quant.unpack(packed, cols), q)
    # Stored as q + 8, high nibble first: (-8, 7) -> 0x0F, (7, -8) -> 0xF0.
    assert quant.pack(torch.tensor([[-8, 7, 7, -8]])).tolist() == [[0x0F, 0xF0]]


def test_int4_error_is_at_most_half_a_scale():
    w = _linear().weight.detach().clone()
    w[0, :64] = 0.0  # an all-zero group: scale 0, codes 0, no NaN
    w[1] *= 1e-9  # scales far below fp16's normal range
    group = 16
    codes, scales = quant.int4_quantize(w, group)
    assert scales.dtype == torch.float16 and scales.shape == (OUT, IN // group)
    s = scales.double().repeat_interleave(group, dim=1)[:, :IN]
    deq = quant._int4_dequantize(codes, scales, IN, group, torch.float64)
    err = (w - deq).abs()
    assert torch.all(err <= s / 2 * (1 + 1e-12))
    assert torch.equal(deq[0, :64], torch.zeros(64, dtype=torch.float64))
    assert (err / s.clamp_min(1e-30)).max() > 0.4  # the bound is tight, not vacuous
    q = quant.unpack(codes, IN)
    assert q.min() >= -8 and q.max() <= 7 and (q.abs() == 7).any()


@pytest.mark.parametrize("cols", [70, 37])  # a last group of 6 / of 5 inputs (37: odd, a padding nibble)
@pytest.mark.parametrize("last", [100.0, 0.01])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)], ids=["f64", "f32"])
def test_int4_partial_last_group_uses_its_own_scale(cols, last, dtype, tol, monkeypatch):
    """Guards the partial last group (cols % group_size != 0): each element is within half of
    its own group's stored scale in every int4 path (whole matrix, row tiles, gathered rows,
    QuantLinear forward), so a last group that borrows the previous group's scale fails."""
    group, rows = 16, 9
    w = _linear(dtype, out=rows, inp=cols).weight.detach().clone()
    w[:, cols // group * group:] *= last  # the last group 100x / 0.01x its neighbour
    qw = quant.quantize_weight(w, QuantConfig(scheme="int4", group_size=group))
    assert qw.scales.shape == (rows, -(-cols // group))
    s = qw.scales.to(dtype).repeat_interleave(group, dim=1)[:, :cols]
    bound = s / 2 * (1 + tol)

    def within(deq, ref=w, half=bound):
        err = (ref - deq).abs()
        assert deq.dtype == dtype
        assert torch.all(err <= half), f"max err / bound = {(err / half).max().item():.3g}"

    within(qw.dequantize())
    monkeypatch.setattr(quant, "DEQUANT_TILE_ELEMENTS", 4 * cols)  # tiles of 4 rows, a short last one
    tiles = quant.row_tiles(qw.layout)
    assert len(tiles) == 3
    for start, stop in tiles:
        within(quant.dequantize_row_range(qw.layout, qw.codes, qw.scales, start, stop, dtype),
               w[start:stop], bound[start:stop])
    index = torch.tensor([[8, 0, 3], [3, 5, 8]])
    within(qw.rows(index), w[index], bound[index])
    x = torch.randn(3, cols, dtype=dtype)
    y = quant.QuantLinear(qw)(x)  # tiled forward
    torch.testing.assert_close(y, F.linear(x, qw.dequantize()), rtol=tol, atol=tol)
    assert torch.all((y - F.linear(x, w)).abs() <= x.abs() @ bound.T + tol)


def test_nf4_matches_bitsandbytes_and_has_the_expected_error():
    bnb = quant._bitsandbytes()
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    qw = quant.quantize_weight(w, QuantConfig(scheme="nf4"))
    ref_codes, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(qw.codes, ref_codes) and torch.equal(qw.scales, state.absmax)
    deq = qw.dequantize()
    assert torch.equal(deq, bnb.dequantize_4bit(ref_codes, state))
    rel = ((w - deq).norm() / w.norm()).item()
    assert 0.085 < rel < 0.097, rel


@pytest.mark.parametrize("shape", [(10, 32), (OUT, IN), (4, 96), (3, 43)])
def test_nf4_blocks_run_over_the_flattened_weight(shape):
    """bitsandbytes' CPU dequantize_4bit, given a 2-D shape whose rows are not whole blocks,
    scales rows with the wrong absmax; ours must match quantize_4bit's flat blocks."""
    torch.manual_seed(2)
    w = torch.randn(*shape)
    qw = quant.quantize_weight(w, QuantConfig(scheme="nf4"))
    n = w.numel()
    nibbles = quant._nibbles(qw.codes.view(-1))[:n].long()
    blocks = torch.arange(n) // 64
    flat = torch.tensor(quant.NF4_TABLE)[nibbles] * qw.scales[blocks]
    # An odd element count takes bitsandbytes' generic kernel, which it wraps in torch.compile: eager,
    # it computes the same elementwise products (bit for bit) without 20 to 35 s of C++ compiling.
    with torch.compiler.set_stance("force_eager"):
        dense = qw.dequantize()
    assert torch.equal(dense, flat.view(shape))
    assert ((w - dense).norm() / w.norm()) < 0.11


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cols", [128, 40, 32])  # rows own whole nf4 blocks / blocks straddle rows
def test_row_gather_equals_rows_of_the_dense_weight(scheme, cols):
    torch.manual_seed(1)
    qw = quant.quantize_weight(torch.randn(37, cols), QuantConfig(scheme=scheme, group_size=16))
    index = torch.tensor([[0, 36, 5], [5, 17, 2]])
    rows = qw.rows(index)
    assert rows.shape == (2, 3, cols)
    assert torch.equal(rows, qw.dequantize()[index])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", [(37, 40), (3, 42), (128, 64)])  # 1,480 and 126 weights: nf4's last block partial
def test_held_as_rows_a_weight_dequantizes_and_gathers_rows_as_before(scheme, shape):
    """Under fsdp (QuantWeight.hold_as_rows) the codes and scales are uint8 parameters a row per block
    (nf4's partial last block padded), and every kernel reads the same values as from the buffers."""
    torch.manual_seed(2)
    qw = quant.quantize_weight(torch.randn(*shape), QuantConfig(scheme=scheme, group_size=16))
    dense, index = qw.dequantize(), torch.tensor([0, shape[0] - 1, 1])
    qw.hold_as_rows()
    assert {n for n, _ in qw.named_parameters()} == {"codes", "scales"} and not list(qw.buffers())
    assert qw.codes.dtype == qw.scales.dtype == torch.uint8 and qw.codes.shape[0] == qw.scales.shape[0]
    assert torch.equal(qw.dequantize(), dense) and torch.equal(qw.rows(index), dense[index])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", [(OUT, IN), (3, 43), (128, 64)])
def test_meta_weight_gets_the_buffers_a_real_weight_gets(scheme, shape):
    cfg = QuantConfig(scheme=scheme, group_size=32)
    real = quant.quantize_weight(torch.randn(*shape), cfg)
    meta = quant.quantize_weight(torch.empty(*shape, device="meta"), cfg)
    for a, b in ((real.codes, meta.codes), (real.scales, meta.scales)):
        assert b.is_meta and a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("scheme", SCHEMES)
def test_resident_bytes_are_half_a_byte_per_weight_plus_scales(scheme):
    lin = _linear(torch.float32, out=256, inp=512)
    q = quant.quantize(lin, QuantConfig(scheme=scheme, group_size=64))
    n = 256 * 512
    scales = 256 * (512 // 64) * 2 if scheme == "int4" else n // 64 * 4  # fp16 per group / fp32 per block
    assert _buffer_bytes(q) == n // 2 + scales
    assert _buffer_bytes(q) / n < 0.57
    assert [p.numel() for p in q.parameters()] == [256]  # the bias only; no dense weight kept
    assert not any(p.requires_grad for p in q.parameters())


# ---------------------------------------------------------------- exact forward / backward


def _quant_lora(scheme: str, dtype: torch.dtype):
    lin = _linear(dtype)
    base = quant.quantize(lin, QuantConfig(scheme=scheme, group_size=16))
    layer = lora.LoRALinear(base, rank=4, alpha=8.0)
    layer.lora_A.to(dtype), layer.lora_B.to(dtype)  # LoRALinear picks fp32 over a non-float base
    with torch.no_grad():
        layer.lora_B.weight.normal_()  # B = 0 at init would hide B's influence on dA
    return layer


@pytest.mark.parametrize("tiled", [False, True], ids=["whole", "row-tiles"])
@pytest.mark.parametrize("scheme,dtype,tol", [
    ("int4", torch.float64, 1e-12), ("nf4", torch.float64, 1e-12),
    ("int4", torch.float32, 1e-6), ("nf4", torch.float32, 1e-6),
])
def test_output_and_grads_equal_dense_linear_on_dequantized_weight(scheme, dtype, tol, tiled, monkeypatch):
    if tiled:  # 5 rows a tile (int4, a short last one); nf4 rounds to 4 (80 inputs: 4 rows = 5 whole blocks)
        monkeypatch.setattr(quant, "DEQUANT_TILE_ELEMENTS", 5 * IN)
        assert len(quant.row_tiles(quant.Layout(scheme, (OUT, IN), 16))) == (10 if scheme == "int4" else 12)
    layer = _quant_lora(scheme, dtype)
    w = layer.base.dequantized_weight()
    assert w.dtype == dtype and w.shape == (OUT, IN)
    a = layer.lora_A.weight.detach().clone().requires_grad_()
    b = layer.lora_B.weight.detach().clone().requires_grad_()
    x = torch.randn(3, 5, IN, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    g = torch.randn(3, 5, OUT, dtype=dtype)

    y = layer(x)
    y.backward(g)
    y_ref = F.linear(x_ref, w, layer.base.bias) + F.linear(F.linear(x_ref, a), b) * layer.scaling
    y_ref.backward(g)

    close = dict(rtol=tol, atol=tol)
    torch.testing.assert_close(y, y_ref, **close)
    torch.testing.assert_close(x.grad, x_ref.grad, **close)
    torch.testing.assert_close(layer.lora_A.weight.grad, a.grad, **close)
    torch.testing.assert_close(layer.lora_B.weight.grad, b.grad, **close)
    assert all(buf.grad is None for buf in layer.base.buffers())


def _saved(module: nn.Module, x: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum().backward()
    return seen


@pytest.mark.parametrize("scheme", SCHEMES)
def test_backward_saves_codes_never_a_dense_weight(scheme):
    x = torch.randn(2, 3, IN, dtype=torch.float64, requires_grad=True)
    dense = {(OUT, IN), (IN, OUT)}
    # Control: a plain linear does save its (out, in) weight, so the hook would see one.
    assert any(s in dense and d.is_floating_point for s, d in _saved(_linear(), x))
    seen = _saved(_quant_lora(scheme, torch.float64), x)
    assert not any(s in dense and d.is_floating_point for s, d in seen), seen
    assert any(d == torch.uint8 for _, d in seen)  # the codes are what backward keeps


class _DenseDtypes(TorchDispatchMode):
    """Records the dtype of every (OUT, IN) tensor an op makes: the transient weights."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and tuple(t.shape) == (OUT, IN) and t.is_floating_point():
                self.dtypes.add(t.dtype)
        return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_autocast_bf16_dequantizes_in_bf16_and_returns_dx_in_the_input_dtype(scheme):
    base = quant.quantize(_linear(torch.float32), QuantConfig(scheme=scheme))
    x = torch.randn(4, IN, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _DenseDtypes() as seen:
            y = base(x)
        ref = F.linear(x, base.dequantized_weight(), base.bias)
    assert seen.dtypes == {torch.bfloat16}  # the transient weight is bf16, never fp32
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    with _DenseDtypes() as seen:
        y.float().sum().backward()
    assert seen.dtypes == {torch.bfloat16}
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, base.dequantized_weight().sum(0).expand(4, IN), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    from slimtune.model.stack import load_model

    return lambda: load_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def _block_linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")]


def test_scheme_none_changes_nothing(tiny_llama):
    model = tiny_llama()
    assert quant.apply(model, QuantConfig(scheme="none")) == []
    assert len(_block_linears(model)) == 14


@pytest.mark.parametrize("scheme", SCHEMES)
def test_apply_then_lora_trains_and_merges(tiny_llama, scheme):
    torch.manual_seed(0)
    model = tiny_llama()
    expected = _block_linears(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    dense_logits = model(input_ids=ids).logits.detach()

    names = quant.apply(model, QuantConfig(scheme=scheme, group_size=16))
    assert names == expected and len(names) == 14
    assert all(isinstance(model.get_submodule(n), quant.QuantLinear) for n in names)
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    logits = model(input_ids=ids).logits
    assert 0 < (logits - dense_logits).abs().max() < 0.5  # quantized, yet the same model

    assert lora.apply(model, LoraConfig(rank=4)) == expected
    codes = {n: b.clone() for n, b in model.named_buffers() if n.endswith("codes")}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in adapters)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert any(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if n.endswith("lora_B.weight"))
    assert all(torch.equal(b, codes[n]) for n, b in model.named_buffers() if n in codes)

    with torch.no_grad():
        before = model(input_ids=ids).logits
        lora.merge(model)
        after = model(input_ids=ids).logits
    assert not any(isinstance(m, (quant.QuantLinear, lora.LoRALinear)) for m in model.modules())
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_tied_embedding_and_head_share_one_set_of_codes():
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    from slimtune.model.stack import Stack

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    table = model.model.embed_tokens.weight.detach().clone()
    names = quant.apply(model, QuantConfig(scheme="nf4", embeddings=True))
    assert names[-2:] == ["model.embed_tokens", "lm_head"]
    embed, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embed, quant.QuantEmbedding) and isinstance(head, quant.QuantLinear)
    assert head.qweight is embed.qweight and Stack(model).tied
    # Module.buffers() lists a shared tensor once: the tied pair's codes are held once.
    held = sum(b.numel() for b in model.buffers() if b.dtype == torch.uint8)
    assert held == sum(model.get_submodule(n).qweight.codes.numel() for n in names[:-1])
    ids = torch.tensor([[3, 7, 7, 299]])
    torch.testing.assert_close(embed(ids), table[ids], rtol=0, atol=0.35 * table.abs().max().item())
    assert torch.equal(embed(ids), embed.dequantized_weight()[ids])
    h = torch.randn(1, 4, 32)
    torch.testing.assert_close(head(h), F.linear(h, embed.dequantized_weight()), rtol=1e-6, atol=1e-6)
    model(input_ids=ids).logits.sum().backward()  # still runs end to end


def test_untied_embedding_and_head_are_quantized_separately(tiny_llama):
    model = tiny_llama()
    quant.apply(model, QuantConfig(scheme="int4", embeddings=True))
    assert model.lm_head.qweight is not model.model.embed_tokens.qweight
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("order", ["meta_then_fake", "fake_then_quant"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_planner_path_runs_on_fake_tensors_and_counts_real_bytes(tiny_llama, scheme, order):
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from slimtune.planning import estimate

    cfg = QuantConfig(scheme=scheme, group_size=16, embeddings=True)
    real = tiny_llama()
    quant.apply(real, cfg)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = estimate.meta_model(real.config, torch.float32)
    if order == "meta_then_fake":  # quantize meta weights, then fake every buffer
        quant.apply(model, cfg)
        lora.apply(model, LoraConfig(rank=4))
        estimate.make_fake(model, mode)
    else:  # as estimate() does it: fake weights, quant and LoRA under the mode
        estimate.make_fake(model, mode)
        with mode:
            quant.apply(model, cfg)
            lora.apply(model, LoraConfig(rank=4))
    assert all(is_fake(b) for b in model.buffers() if b.dtype == torch.uint8)
    assert _buffer_bytes(model) == _buffer_bytes(real)
    with mode:
        ids = torch.randint(0, real.config.vocab_size, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and is_fake(g) for g in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_4bit_matmul_on_fake_tensors_runs_two_tiles_and_peaks_where_all_tiles_do(scheme, dtype, monkeypatch):
    """Under fake tensors the tile loops of forward and backward run the first tile and the last
    (memory.representative, alike_from=0): every tile is dropped before the next, so the step's
    peak is the same as the real run's over all nine tiles (the last one partial)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from slimtune.planning import estimate
    from slimtune.device import memory

    monkeypatch.setattr(quant, "DEQUANT_TILE_ELEMENTS", 8 * 64)  # 8 rows a tile
    layer = quant.QuantLinear(quant.quantize_weight(_linear(torch.float32, out=70, inp=64, bias=False).weight,
                                                    QuantConfig(scheme=scheme, group_size=16)))
    assert len(quant.row_tiles(layer.qweight.layout)) == 9
    tiles = []
    monkeypatch.setattr(quant, "dequantize_row_range", lambda *a, _f=quant.dequantize_row_range: tiles.append(a[3]) or _f(*a))

    def peak(x: torch.Tensor) -> int:
        meter = memory.LiveBytesMeter("cpu")
        meter.track([x, *layer.buffers()])
        with meter:
            layer(x).sum().backward()
        meter.close()
        return meter.peak

    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    real = peak(x)
    assert len(tiles) == 18
    tiles.clear()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    estimate.make_fake(layer, mode)
    with mode:
        fake = peak(mode.from_tensor(x.detach()).requires_grad_())
    assert tiles == [0, 64, 0, 64]  # first and last tile, forward then backward
    assert fake == real


@pytest.mark.parametrize("scheme", SCHEMES)
def test_state_dict_loads_into_a_module_built_on_the_meta_device(scheme):
    cfg = QuantConfig(scheme=scheme, group_size=16)
    src = quant.quantize(_linear(), cfg)
    assert set(src.state_dict()) == {"bias", "qweight.codes", "qweight.scales"}
    dst = quant.quantize(nn.Linear(IN, OUT, dtype=torch.float64, device="meta"), cfg).to_empty(device="cpu")
    dst.load_state_dict(src.state_dict())
    x = torch.randn(2, IN, dtype=torch.float64)
    assert torch.equal(dst(x), src(x))
