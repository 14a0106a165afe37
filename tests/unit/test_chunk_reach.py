"""Engine chunk's backward stops at the active chunk (chunk/reach.py), and its defaults: against the
plain way, in float64. Every chunk's gradient through the truncated backward equals dense autograd's
sliced (the embedding's chunk, a head-only chunk, chunks between; plain and recomputed blocks); the
blocks below a chunk's reach run no backward; the planner's estimate equals the CPU meter on every
chunk, and its figure is the worst chunk's; the derived switch_every and the random order resume
exactly mid-sweep."""

import pytest
import torch

from conftest import engine_config, tiny_config
from test_chunk import BASE, dense_gradients, engine_of, reference_of, run_cfg, step_batches
from test_slide import batches, model_of
from slimtune.config import ActivationsConfig, TrainConfig
from slimtune.device import memory
from slimtune.engines.chunk import reach
from slimtune.engines.chunk.engine import ChunkConfig, ChunkEngine
from slimtune.engines.chunk.state import derived_switch_every
from slimtune.planning import estimate

CPU = torch.device("cpu")


def truncated_gradients(engine: ChunkEngine, k: int, batch_list) -> dict:
    """Chunk k's gradients by the engine's own forward and backward (down to the chunk's reach)."""
    engine._open(k, memory.NO_READING)
    engine._backward(k, batch_list, sum(b.num_targets for b in batch_list), memory.NO_READING, None)
    got = {(p.name, p.start): g.clone() for (p, _, _), g in engine._gradients(k)}
    engine.state.discard(k)
    return got


def blocks_run_backward(engine: ChunkEngine, k: int, batch_list) -> set[int]:
    """The blocks whose backward ran in chunk k's step."""
    ran = set()
    hooks = [block.register_full_backward_pre_hook(lambda m, g, i=i: ran.add(i))
             for i, block in enumerate(engine.stack.blocks)]
    try:
        truncated_gradients(engine, k, batch_list)
    finally:
        for hook in hooks:
            hook.remove()
    return ran


def projections_in_the_graph(engine: ChunkEngine, k: int, batch_list) -> dict[str, bool]:
    """Of chunk k's lowest block: whether the q, k and v projections' outputs joined the graph."""
    attention = engine.stack.blocks[engine.reaches[k]].self_attn
    joined = {}

    def note(name: str):
        def hook(module, args, out) -> None:
            joined[name] = joined.get(name, False) or out.requires_grad  # recomputed blocks: in backward
        return hook
    hooks = [getattr(attention, name).register_forward_hook(note(name)) for name in ("q_proj", "k_proj", "v_proj")]
    try:
        truncated_gradients(engine, k, batch_list)
    finally:
        for hook in hooks:
            hook.remove()
    return joined


def chunk_cfg(n: int, checkpoint: str = "none", **chunk):
    return engine_config(TrainConfig(**BASE), engine="chunk", method="full",
                         activations=ActivationsConfig(checkpoint=checkpoint),
                         sections={"chunk": ChunkConfig(n_chunks=n, **chunk)})


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # block 0's input needs no gradient
@pytest.mark.parametrize("tied,checkpoint,gradients", [
    pytest.param(False, "none", "device", marks=pytest.mark.quick),
    (False, "recompute", "device"),
    (True, "none", "device"),
    (True, "recompute", "host"),
])
def test_the_truncated_backward_gives_every_chunk_the_dense_gradient_and_stops_at_its_reach(tied, checkpoint,
                                                                                           gradients):
    model = model_of(layers=3, tie_word_embeddings=tied)
    batch_list = batches(model.config.vocab_size, 0)
    dense = dense_gradients(reference_of(model), batch_list)
    engine = engine_of(model, chunk_cfg(7, checkpoint, gradients=gradients))
    blocks = len(engine.stack.blocks)
    reaches = engine.reaches
    # the cases the test is for: the embedding's chunk, chunks that start in blocks 1.. and, untied, a
    # chunk of the final norm and head alone
    assert reaches[0] == reach.EMBEDDING and any(0 < r < blocks for r in reaches)
    assert (reaches[-1] == blocks) != tied
    assert reaches == sorted(reaches)
    for k in range(len(engine.state.chunks)):
        got = truncated_gradients(engine, k, batch_list)
        for p, _, _ in engine.state.members[k]:
            want = dense[p.name].narrow(p.axis, p.start, p.stop - p.start)
            torch.testing.assert_close(got[(p.name, p.start)], want, rtol=1e-10, atol=1e-12, msg=f"{k} {p}")
        assert blocks_run_backward(engine, k, batch_list) == set(range(max(reaches[k], 0), blocks)), k
    # Only the chunk's own tensors require grad in its step: in its lowest block a projection joins the
    # graph (keeps its input, gets a backward) only when its weight or the norm before it is the chunk's.
    # The stream runs in each block's call order (the norm before the projections), so a chunk that
    # begins in a block's MLP leaves that block's attention out of its graph altogether.
    left_out, attention_skipped = 0, 0
    for k, r in enumerate(reaches):
        if 0 <= r < blocks:
            names = {p.name for p, _, _ in engine.state.members[k]}
            joined = projections_in_the_graph(engine, k, batch_list)
            for proj in joined:
                mine = {f"model.layers.{r}.self_attn.{proj}.weight", f"model.layers.{r}.input_layernorm.weight"}
                assert joined[proj] == bool(mine & names), (k, proj)
            left_out += list(joined.values()).count(False)
            attention_skipped += not any(joined.values())
    assert left_out > 0 and attention_skipped > 0
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_a_chunk_above_the_embedding_keeps_fewer_activations_and_the_embeddings_chunk_all():
    """The meter's activations at the peak: the embedding's chunk holds every block's, the chunk
    that reaches only the head none of the blocks'."""
    model = model_of(layers=3)
    engine = engine_of(model, chunk_cfg(7))
    batch_list = batches(model.config.vocab_size, 0)
    held = {k: engine._step(k, batch_list, None).device_peak_breakdown["activations"] for k in (0, 6)}
    assert engine.reaches[6] == 3 and held[6] < held[0] / 2, held


@pytest.mark.quick
def test_the_stream_follows_each_blocks_call_order():
    from slimtune.engines.chunk.state import in_call_order
    model = model_of(layers=2)
    names = in_call_order([n for n, _ in model.named_parameters()])
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    block = [n.removeprefix("model.layers.1.") for n in names if n.startswith("model.layers.1.")]
    assert block == ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                     "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    engine = engine_of(model, chunk_cfg(4))
    assert list(dict.fromkeys(p.name for chunk in engine.state.chunks for p in chunk)) == names


def test_a_checkpoint_cut_in_another_order_resumes_from_each_tensors_state_and_says_so(tmp_path, capsys):
    from slimtune.store import checkpoint
    cfg = run_cfg(ChunkConfig(n_chunks=3))
    first = engine_of(model_of(layers=2), cfg)
    for b in step_batches(first.stack.model.config.vocab_size, 2):
        first.step(b)
    state = first.state_dict()
    assert state.extra["chunk"]["pieces"] == first.state.pieces()
    del state.extra["chunk"]["pieces"]  # as a checkpoint written before the stream's order changed
    folder = checkpoint.save(tmp_path, 2, state, {}, keep_last=1)
    second = engine_of(model_of(layers=2, seed=7), cfg)
    capsys.readouterr()
    second.load_state_dict(checkpoint.load(folder)[1])
    assert "cut in another order" in capsys.readouterr().err
    assert second.state.visited == [True] * 3
    for name, want in first.trainable_state().items():
        assert torch.equal(second.trainable_state()[name], want), name


# ---------------------------------------------------------------- the planner


def planner_cfg(folder, n: int, gradients: str, checkpoint: str):
    from slimtune.engines import settings
    return settings.load(None, ["engine=chunk", "method=full", "precision=fp32", f"chunk.n_chunks={n}",
                                f"chunk.gradients={gradients}", f"activations.checkpoint={checkpoint}"],
                         base={"model": str(folder), "data": "x.jsonl", "train": {"batch_size": 2}})


@pytest.mark.parametrize("n,gradients,checkpoint", [
    (2, "device", "none"), (5, "device", "none"), (3, "host", "none"), (4, "host", "recompute")])
def test_the_estimate_equals_the_meter_on_every_chunk_and_the_planners_figure_is_the_worst(
        tmp_path, tokenizer, monkeypatch, n, gradients, checkpoint):
    from conftest import save_tiny_model
    from slimtune import assembly
    folder = save_tiny_model(tmp_path, tokenizer)
    cfg = planner_cfg(folder, n, gradients, checkpoint)
    config = tiny_config("llama", len(tokenizer))
    planned = estimate.estimate(config, cfg, 2, 48)
    batch = estimate.synthetic_batch(2, 48, len(tokenizer))
    engine = assembly.assemble(cfg, assembly.load_stack(cfg, CPU, "fp32"), CPU, "fp32")
    measured = {}
    for k in range(n):
        result = engine._step(k, [batch], None)
        measured[k] = (result.device_peak_bytes, result.device_peak_breakdown)
        monkeypatch.setattr(ChunkEngine, "planned_chunks", lambda self, k=k: [k])
        one = estimate.estimate(config, cfg, 2, 48)
        assert (one.device_peak_bytes, one.breakdown) == measured[k], k
    peaks = {peak for peak, _ in measured.values()}
    assert len(peaks) > 1  # the chunks' steps differ: the figure has a worst to find
    assert planned.device_peak_bytes == max(peaks)


# ---------------------------------------------------------------- the defaults


@pytest.mark.quick
def test_switch_every_is_derived_as_the_longest_stay_that_visits_every_chunk_twice():
    assert derived_switch_every(300, 4) == 37  # 4 x 37 x 2 = 296 steps: two sweeps
    assert derived_switch_every(1600, 16) == 50 and derived_switch_every(10_000, 4) == 50  # at most 50
    assert derived_switch_every(20, 16) == 1  # too short for two visits: a new chunk every step
    for steps, n in [(300, 4), (1600, 16), (97, 3), (64, 32)]:
        k = derived_switch_every(steps, n)
        assert 2 * n * k <= steps or k == 1
        assert k == 50 or 2 * n * (k + 1) > steps


@pytest.mark.quick
def test_the_defaults_are_a_random_order_and_a_derived_switch_every_said_at_the_start(capsys):
    model = model_of(layers=1)
    default = ChunkConfig(n_chunks=4)
    assert (default.order, default.switch_every) == ("random", 0)
    cfg = engine_config(TrainConfig(**{**BASE, "steps": 300}), engine="chunk", method="full",
                        sections={"chunk": default})
    engine = engine_of(model, cfg)
    assert engine.state.switch_every == 37
    said = capsys.readouterr().out
    assert "4 chunks in a new random order each sweep, 37 steps on each" in said and "train.steps=300" in said
    old = engine_of(model_of(layers=1), run_cfg(ChunkConfig(n_chunks=4, order="round_robin", switch_every=1)))
    assert old.state.switch_every == 1 and old.state.order(3) == [0, 1, 2, 3]


def test_the_derived_switch_every_and_random_order_resume_exactly_mid_sweep(tmp_path):
    """BASE's 20 steps over 3 chunks: K = 3, a sweep of 9 steps; saved after 5 (mid-chunk, mid-sweep)."""
    from slimtune.store import checkpoint
    cfg = run_cfg(ChunkConfig(n_chunks=3))

    def run(engine, seeds):
        return [engine.step(b).extras["chunk"] for b in step_batches(engine.stack.model.config.vocab_size, 20)[seeds]]

    straight = engine_of(model_of(layers=2), cfg)
    assert straight.state.switch_every == 3
    visited = run(straight, slice(0, 14))
    assert visited[:9] == [c for c in straight.state.order(0) for _ in range(3)]
    assert visited[9:] == [c for c in straight.state.order(1) for _ in range(3)][:5]
    first = engine_of(model_of(layers=2), cfg)
    run(first, slice(0, 5))
    folder = checkpoint.save(tmp_path, 5, first.state_dict(), {}, keep_last=1)
    second = engine_of(model_of(layers=2, seed=7), cfg)  # other weights: all must come from the checkpoint
    second.load_state_dict(checkpoint.load(folder)[1])
    assert run(second, slice(5, 14)) == visited[5:]
    for name, want in straight.trainable_state().items():
        assert torch.equal(second.trainable_state()[name], want), name
