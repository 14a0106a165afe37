"""Blocks tiled along the sequence (slimtune.step.seq_tiles) against the untiled block: float64, the
loss and every gradient equal to 1e-12 through resident's checkpointing and through slide, for Llama,
Qwen2 (biases, tied head), Qwen3 (q/k norms) and sliding-window layers (Mistral, Qwen2), LoRA and
full, with tiles that do not divide the sequence and packed rows whose examples cross tiles. With
dropout, against plain autograd through the same tiles. Then: no (T, T) mask is built, the estimate
equals the meter on a tiled step, and a run at 4K tokens resumes exactly."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import engine_config, save_tiny_model, tiny_config
from slimtune.config import ActivationsConfig, LoraConfig, TrainConfig
from slimtune.device import memory
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.engines.resident import ResidentEngine
from slimtune.engines.slide.engine import SlideEngine
from slimtune.model import lora
from slimtune.model.stack import Stack
from slimtune.step import activations, block_stores, seq_tiles

CPU = torch.device("cpu")
SEQ, TILE = 23, 5  # tiles of 3, 5, 5, 5 and 5 tokens (the short one first): the last query tile ends the sequence
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norms": ("qwen3", {}),
    "mistral-sliding": ("mistral", {"sliding_window": 4}),
    # layers 0 full, 1 and 2 sliding (window 6 < SEQ)
    "qwen2-sliding-mix": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1,
                                    "num_hidden_layers": 3}),
}


def stack_of(family: str, overrides: dict, method: str = "lora", dropout: float = 0.0) -> Stack:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float64,
                                             attn_implementation="sdpa")
    model.config.use_cache = False
    if method == "lora":
        lora.apply(model, LoraConfig(rank=4, alpha=8.0, dropout=dropout))
        for adapter in lora.adapters(model).values():  # B = 0 at init would make every A gradient zero
            nn.init.normal_(adapter.lora_B.weight, std=0.2)
    model.train()
    return Stack(model)


def positions(packed: bool, rows: int = 2, seq: int = SEQ) -> torch.Tensor:
    """Packed: row 0 holds examples of 9 and 14 tokens, row 1 of 4, 11 and 8: each crosses tiles."""
    plain = torch.arange(seq).expand(rows, seq).clone()
    if packed:
        for row, starts in ((0, (9,)), (1, (4, 15))):
            for start in starts:
                plain[row, start:] = torch.arange(seq - start)
    return plain


def step(stack: Stack, cfg: ActivationsConfig | None, packed: bool, seed: int | None = 0, store=None):
    """Loss and every trainable gradient; cfg None: plain autograd through the untiled model. seed
    None: the RNG goes on from where it is."""
    params = [p for p in stack.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    ids = torch.randint(3, stack.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    if seed is not None:
        torch.manual_seed(seed)
    runner = None if cfg is None else activations.runner(cfg, store)
    hidden = stack.norm(stack.body_hidden(ids, positions(packed), runner, segmented=packed))
    loss = F.cross_entropy(stack.head(hidden).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def max_diff(a, b) -> float:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert len(grads_a) == len(grads_b) > 0
    return max([(loss_a - loss_b).abs().item()] + [(x - y).abs().max().item() for x, y in zip(grads_a, grads_b)])


@pytest.fixture
def tiled_calls(monkeypatch):
    """Counts the tiled forwards and backwards that run: a test of tiles must run some."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        original = getattr(seq_tiles, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(seq_tiles, name, counted)
    return calls


# ---------------------------------------------------------------- exact against the untiled block


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiled_blocks_equal_the_untiled_model(name, method, packed, tiled_calls):
    family, overrides = FAMILIES[name]
    stack = stack_of(family, overrides, method)
    expected = step(stack, None, packed)
    got = step(stack, ActivationsConfig(checkpoint="recompute", seq_tile=TILE), packed)
    assert max_diff(got, expected) <= 1e-12
    assert min(g.abs().max().item() for g in got[1]) > 1e-6  # every gradient reached, none compared as zeros
    blocks = len(stack.blocks)
    assert tiled_calls == {"forward": blocks, "backward": blocks}


def test_the_cuda_lower_right_bias_equals_the_band(monkeypatch):
    """On CUDA a tile's plain causal band goes to SDPA as a lower-right CausalBias (seq_tiles.lower_right_bias),
    forced here on the CPU, where SDPA takes it too. In float64 it equals the untiled model. Under bf16
    autocast over fp32 weights (full fine-tuning on a GPU) q and k leave the fp32 rotary tables and v a bf16
    matmul, and SDPA under a CausalBias refuses mixed dtypes: cast as autocast casts, it gives the band's
    numbers."""
    stack = stack_of("llama", {}, "full")
    tiled = ActivationsConfig(checkpoint="recompute", seq_tile=TILE)
    expected = step(stack, None, False)
    monkeypatch.setattr(seq_tiles, "lower_right_bias", lambda keys: True)
    assert max_diff(step(stack, tiled, False), expected) <= 1e-12
    stack.model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        biased = step(stack, tiled, False)
        monkeypatch.setattr(seq_tiles, "lower_right_bias", lambda keys: False)
        band = step(stack, tiled, False)
    assert all(g.dtype == torch.float32 for g in biased[1])
    assert max_diff(biased, band) == 0.0


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp64", "bf16-autocast"])
def test_no_grouped_attention_call_a_card_would_run_in_its_math_kernel(monkeypatch, packed, autocast):
    """SDPA on a card takes fewer key heads than query heads (enable_gqa) only in flash attention: plain
    causal tiles in fp16/bf16. Every other tile's call has as many key heads as query heads: a masked
    tile (packed rows) folds its query heads onto the key heads, a plain causal one in fp64 repeats its
    keys and values. The gradients stay the untiled model's (fp64)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, enable_gqa=False, **kwargs):
        plain = attn_mask is None or memory.is_host_resident(attn_mask)  # the CPU's band: a CausalBias on a card
        calls.append((q.shape[1], k.shape[1], v.shape[1], plain, enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    stack = stack_of("llama", {}, "full")  # 4 query heads, 2 key heads
    tiled = ActivationsConfig(checkpoint="recompute", seq_tile=TILE)
    expected = step(stack, None, packed)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    if autocast:
        stack.model.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step(stack, tiled, packed)
    else:
        assert max_diff(step(stack, tiled, packed), expected) <= 1e-12
    assert calls and all(v_heads == k_heads for _, k_heads, v_heads, _, _ in calls)
    flash = {(4, 2, 2, True, True)}  # plain causal, fewer key heads
    folded = {(2, 2, 2, False, False)}  # the masked tile's query heads folded onto the key heads
    repeated = {(4, 4, 4, True, False)}  # plain causal with its keys and values repeated
    routes = set(calls)
    assert routes == (folded if packed else flash if autocast else repeated), routes


@pytest.mark.quick
def test_which_grouped_attention_a_card_fuses():
    q = torch.zeros(1, 4, 3, 8)
    mask = torch.ones(3, 3, dtype=torch.bool)
    bias = seq_tiles._attention_bias().causal_lower_right(3, 5)
    assert seq_tiles.fused_grouped_attention(q.bfloat16(), None)
    assert seq_tiles.fused_grouped_attention(q.half(), bias)
    assert not seq_tiles.fused_grouped_attention(q.bfloat16(), mask)  # an explicit mask: mem-efficient or math
    band = memory.mark_host_resident(torch.ones(3, 5, dtype=torch.bool))  # the CPU's stand-in for a CausalBias
    assert seq_tiles.fused_grouped_attention(q.bfloat16(), band)
    assert not seq_tiles.fused_grouped_attention(q, None)  # fp32: flash refuses it
    assert not seq_tiles.fused_grouped_attention(q.double(), None)
    assert not seq_tiles.fused_grouped_attention(torch.zeros(1, 4, 3, 512, dtype=torch.bfloat16), None)  # too wide
    with torch.autocast("cpu", dtype=torch.bfloat16):  # SDPA casts q, k, v to bf16 first
        assert seq_tiles.fused_grouped_attention(q, None)
        assert not seq_tiles.fused_grouped_attention(q, mask)


@pytest.mark.quick
def test_the_oracle_sees_what_tiles_must_respect():
    """The untiled reference is sensitive to the window and to the packing, so equality above means
    both are respected across tile boundaries."""
    family, overrides = FAMILIES["mistral-sliding"]
    tiled = ActivationsConfig(checkpoint="recompute", seq_tile=TILE)
    windowed = step(stack_of(family, overrides), tiled, packed=False)
    assert max_diff(windowed, step(stack_of(family, {}), None, packed=False)) > 1e-4
    assert max_diff(step(stack_of("llama", {}), tiled, packed=True),
                    step(stack_of("llama", {}), None, packed=False)) > 1e-4


def test_a_packed_row_never_builds_a_whole_mask(tiled_calls):
    stack = stack_of("llama", {})
    ids = torch.randint(3, stack.config.vocab_size, (2, SEQ))
    hidden = stack.embed(ids)
    inputs = stack.prepare(hidden, positions(packed=True), segmented=True)
    out = activations.run_blocks(stack, hidden, inputs, ActivationsConfig(checkpoint="recompute", seq_tile=TILE))
    out.square().sum().backward()
    assert inputs._masks is None  # the (B, 1, T, T) masks were never asked for
    assert tiled_calls["backward"] == len(stack.blocks)


@pytest.mark.parametrize("store_kind", ["recompute", "host", "disk"])
def test_every_store_and_cache_gives_the_untiled_gradients(tmp_path, store_kind):
    stack = stack_of("qwen2", {"tie_word_embeddings": True})
    expected = step(stack, None, packed=True)
    for cache in ("none", "small", "last_k"):
        cfg = ActivationsConfig(checkpoint=store_kind, cache=cache, last_k=1, seq_tile=TILE)
        with block_stores.open_store(cfg, CPU, tmp_path / "act") as store:
            assert max_diff(step(stack, cfg, packed=True, store=store), expected) <= 1e-12
        assert store.cache_hits == 0  # tiled blocks keep no small-op log (their recompute runs tiles in another order)


# ---------------------------------------------------------------- dropout


def tiled_reference(stack: Stack, packed: bool, seed: int):
    """Plain autograd through every block as seq_tiles runs it (tile by tile, each tile with its
    seed, keys and values concatenated as they come): the dropout masks a tiled run must repeat."""
    params = [p for p in stack.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    ids = torch.randint(3, stack.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    hidden = stack.embed(ids)
    inputs = stack.prepare(hidden, positions(packed), segmented=packed)
    for index in range(len(stack.blocks)):
        block = seq_tiles._Block(stack, index, hidden, inputs, TILE)
        ks, vs, outs = [], [], []
        for start in block.starts:
            with block.tile_rng(start):
                xi = hidden[:, start : block.stop(start)]
                n = block.layer.input_layernorm(xi)
                k, v = block.kv(n, start)
                ks.append(k), vs.append(v)
                first = block.first_key(start)
                keys, values = torch.cat(ks, dim=2)[:, :, first:], torch.cat(vs, dim=2)[:, :, first:]
                outs.append(block.rest(xi, block.q(n, start), keys, values, start))
        hidden = torch.cat(outs, dim=1)
    loss = F.cross_entropy(stack.head(stack.norm(hidden)).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("store_kind", ["recompute", "disk"])
def test_dropout_masks_repeat_in_the_recompute(tmp_path, store_kind):
    stack = stack_of("qwen3", {}, dropout=0.2)
    cfg = ActivationsConfig(checkpoint=store_kind, seq_tile=TILE)
    with block_stores.open_store(cfg, CPU, tmp_path / "act") as store:
        got = step(stack, cfg, packed=True, seed=5, store=store)
    assert max_diff(got, tiled_reference(stack, packed=True, seed=5)) <= 1e-12
    assert max_diff(got, step(stack, None, packed=True, seed=5)) > 1e-6  # dropout is on, and drawn per tile
    recompute = ActivationsConfig(checkpoint="recompute", seq_tile=TILE)
    assert max_diff(got, step(stack, recompute, packed=True, seed=6)) > 1e-6  # and from the step's RNG
    # which the tiles' seeds advance: the next step (the same weights here) draws other masks
    first = step(stack, recompute, packed=True, seed=None)
    assert max_diff(first, step(stack, recompute, packed=True, seed=None)) > 1e-6


# ---------------------------------------------------------------- slide


def slide_batches(seed: int, packed: bool) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        ids = torch.randint(3, 300, (2, SEQ), generator=g)
        targets = ids.roll(-1, 1)
        targets[:, -1] = IGNORE_INDEX
        out.append(Batch(ids, targets, positions(packed)))
    return out


@pytest.mark.parametrize("method", ["lora", "full"])
def test_slide_with_tiles_trains_like_untiled(method, tiled_calls):
    base = stack_of("qwen2", {"tie_word_embeddings": True, "num_hidden_layers": 3}, method).model
    train = TrainConfig(steps=3, batch_size=2, grad_accum=2, lr=1e-2, measure_memory=False)
    runs = {}
    for tile in (SEQ, TILE):
        cfg = engine_config(train, activations=ActivationsConfig(checkpoint="host", seq_tile=tile))
        engine = SlideEngine(Stack(copy.deepcopy(base)), cfg, CPU, "fp64")
        losses = [engine.step(slide_batches(seed, packed=seed == 1)).loss for seed in range(2)]
        runs[tile] = losses, engine.trainable_state()
    (untiled, want), (tiled, got) = runs[SEQ], runs[TILE]
    assert tiled == pytest.approx(untiled, abs=1e-12, rel=0)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=0, msg=name)
    assert tiled_calls["forward"] == tiled_calls["backward"] == 3 * 2 * 2  # blocks x micro-batches x steps


# ---------------------------------------------------------------- the planner's estimate


def unpacked_batch(rows: int, seq: int, vocab: int) -> Batch:
    ids = torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(2))
    targets = ids.roll(-1, 1)
    targets[:, : seq // 4] = IGNORE_INDEX
    targets[:, -1] = IGNORE_INDEX
    return Batch(ids, targets, torch.arange(seq).expand(rows, seq).clone())


@pytest.mark.parametrize("method, plan", [
    ("lora", {"engine": "resident", "precision": "bf16", "activations.checkpoint": "recompute"}),
    ("full", {"engine": "resident", "precision": "fp32", "activations.checkpoint": "host"}),
    ("lora", {"engine": "slide", "precision": "bf16", "activations.checkpoint": "host"}),
], ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_estimate_of_a_tiled_step_equals_the_meter(tmp_path, tokenizer, method, plan, packed):
    """Seven tiles of 7 tokens and one of 6 (the fake step runs three of each block's loops)."""
    from slimtune.engines import settings
    from slimtune.planning import estimate
    from test_estimate import measured_step

    folder = save_tiny_model(tmp_path, tokenizer, "qwen3")
    cfg = settings.load(None, [f"{k}={v}" for k, v in plan.items()] + ["activations.seq_tile=7"],
                        base={"model": str(folder), "data": "x.jsonl", "method": method, "lora": {"rank": 4},
                              "train": {"batch_size": 2}})
    vocab = len(tokenizer)
    batch = estimate.synthetic_batch(2, 55, vocab) if packed else unpacked_batch(2, 55, vocab)
    assert batch.segmented == packed
    predicted = estimate.estimate(tiny_config("qwen3", vocab), cfg, 2, 55, batch=batch)
    measured, _ = measured_step(folder, cfg, plan["precision"], batch)
    assert predicted.device_peak_bytes == measured.device_peak_bytes
    assert predicted.breakdown == measured.device_peak_breakdown


# ---------------------------------------------------------------- resume


def test_a_run_at_4k_tokens_resumes_exactly(tmp_path, tokenizer):
    """LoRA with dropout, blocks checkpointed in 16 tiles of 256 tokens (packed rows of 4,096):
    stopped after a step and resumed, the same losses and adapters as 2 steps straight (a constant
    rate: a cosine schedule over 1 step would be another run)."""
    import json

    from conftest import write_jsonl
    from slimtune import train
    from slimtune.engines import settings

    folder = save_tiny_model(tmp_path / "model", tokenizer, max_position_embeddings=4096)
    words = "one two three four five six seven eight nine ten".split()
    records = [{"text": " ".join(words[(i * j) % 10] for j in range(900))} for i in range(1, 7)]
    write_jsonl(tmp_path / "d.jsonl", records)

    def run(out: str, steps: int):
        base = {"model": str(folder), "data": {"path": str(tmp_path / "d.jsonl"), "format": "text",
                                               "max_length": 4096},
                "lora": {"rank": 4, "dropout": 0.1}, "activations": {"checkpoint": "recompute"},
                "train": {"steps": steps, "batch_size": 1, "save_every": 1, "schedule": "constant",
                          "measure_memory": False},
                "output_dir": str(tmp_path / out), "device": "cpu"}
        fitted, _ = train.fit(settings.load(None, [], base=base), progress=False)
        losses = [json.loads(line)["loss"] for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return losses, fitted.engine.trainable_state()

    straight, want = run("straight", 2)
    run("resumed", 1)
    resumed, got = run("resumed", 2)
    assert resumed == straight
    assert all(torch.equal(got[name], want[name]) for name in want)


# ---------------------------------------------------------------- roundpipe


def test_roundpipe_forward_jobs_and_layer_backward_in_tiles_train_like_resident(tiled_calls):
    """Rows of 12 tokens in tiles of 5, 5 and 2: roundpipe's forward jobs run block_forward and, with
    grain=layer, its backward jobs block_backward."""
    from test_roundpipe import TRAIN, run
    from test_slide import model_of
    from slimtune.engines.roundpipe.engine import RoundPipeConfig, RoundPipeEngine

    model = model_of(3, tie_word_embeddings=True)

    def cfg(engine: str):
        section = RoundPipeConfig(workers=2, micro_batches=2, grain="layer", replan=False)
        return engine_config(TrainConfig(**TRAIN, measure_memory=False), engine=engine, method="full",
                             activations=ActivationsConfig(seq_tile=TILE), sections={"roundpipe": section})

    expected = run(ResidentEngine, model, cfg("resident"), steps=2, rows=2)
    assert tiled_calls["forward"] == 0  # resident without checkpointing: plain autograd, untiled
    found = run(RoundPipeEngine, model, cfg("roundpipe"), steps=2, rows=2)
    assert found[0] == pytest.approx(expected[0], abs=1e-10, rel=0)
    for name, value in expected[2].items():
        torch.testing.assert_close(found[2][name], value, atol=1e-10, rtol=0, msg=name)
    assert tiled_calls["forward"] > 0 and tiled_calls["backward"] > 0


@pytest.mark.quick
def test_the_short_tile_comes_first_so_every_later_tile_is_whole():
    assert seq_tiles.tile_starts(23, 5) == [0, 3, 8, 13, 18]
    assert seq_tiles.tile_starts(20, 5) == [0, 5, 10, 15]
    assert seq_tiles.tile_starts(3, 5) == [0]
