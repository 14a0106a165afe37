"""The estimate by depth (two shallow fake steps, extrapolated segment by segment) gives the same
bytes as the fake step at full depth: peak, breakdown, host RAM, disk, link bytes and parameter
counts, for every plan of every engine on three shapes and several depths, also where the peak sits
in another segment at full depth than in the shallow steps. And the planner's --max-seq, and its
host-RAM and disk sentences."""

import json

import pytest

from conftest import shapes_in_turn, tiny_config
from slimtune import cli, config, engines, presets
from slimtune.engines import settings
from slimtune.planning import estimate, planner

SHAPES = {
    "llama-untied": ("llama", {}),
    "qwen2-tied-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-gqa1": ("qwen3", {"num_key_value_heads": 1}),
}
PLANS = [(method, plan) for method in ("lora", "full") for plan in engines.plans_for(method)]
PLANS.append(("full", {"engine": "slide", "precision": "bf16", "activations.checkpoint": "host", "slide.slots": 3}))
FIELDS = ("device_peak_bytes", "breakdown", "host_bytes", "disk_bytes", "host_link_bytes", "trainable_params",
          "total_params")


def run_config(method: str, plan: dict):
    base = config.to_dict(planner.planning_config(method, rank=4))
    return settings.load(None, [f"{k}={v}" for k, v in plan.items()], base=base)


# A plan estimated at full depth only (EngineSpec.by_depth: chunk's) has nothing to compare.
PLANS = [(m, plan) for m, plan in PLANS if engines.get(plan["engine"]).by_depth(run_config(m, plan))]


def plan_id(v):
    return v if isinstance(v, str) else "-".join(map(str, v.values()))


ROTATED = shapes_in_turn(PLANS, list(SHAPES))


@pytest.mark.parametrize("shape, method, plan", ROTATED, ids=plan_id)
def test_the_estimate_by_depth_equals_the_full_depth_step(shape, method, plan):
    family, overrides = SHAPES[shape]
    cfg = run_config(method, plan)
    for depth in (7,):  # beyond both probes of every margin here (slide with 3 slots probes 5 and 6)
        model_config = tiny_config(family, 300, num_hidden_layers=depth, **overrides)
        fast = estimate.estimate(model_config, cfg, 2, 48)
        full = estimate.estimate(model_config, cfg, 2, 48, by_depth=False)
        assert {f: getattr(fast, f) for f in FIELDS} == {f: getattr(full, f) for f in FIELDS}, depth


def test_the_peak_may_move_to_another_segment_as_the_stack_deepens():
    """LoRA with recompute on a tiny vocabulary: at 3 blocks the loss holds the peak, at 24 a block's
    backward does (the adapters' gradients made by then grow with depth faster than the checkpoints)."""
    cfg = run_config("lora", {"engine": "resident", "precision": "bf16", "activations.checkpoint": "recompute"})
    batch = estimate.synthetic_batch(1, 48, 300)

    def peak_segment(depth: int) -> tuple:
        _, segments = estimate._step(tiny_config(num_hidden_layers=depth), cfg, batch, segments=True)
        return max(segments.items(), key=lambda item: item[1][0])[0]

    assert peak_segment(3)[0] == "loss" and peak_segment(24)[0] == "backward"
    deep = tiny_config(num_hidden_layers=24)
    assert estimate.estimate(deep, cfg, 1, 48).device_peak_bytes == \
        estimate.estimate(deep, cfg, 1, 48, by_depth=False).device_peak_bytes


PHASES = {
    # The loss forward (every block's activations live) against the tied embedding's backward (the
    # table's fp32 gradient, every block's gradients live): the estimate once saw one segment from
    # the loss to the end of backward (the uncheckpointed loop marked no block).
    "loss-vs-embedding-backward": ({"loss.chunk_size": 4}, {"vocab_size": 8000}),
    # Block 0's recomputed backward (autocast's bf16 copies of every block so far) against the
    # embedding's backward after it, and the subset loss's forward against its backward: one
    # segment each until the embedding's backward and the loss's backward were marked apart.
    "block0-vs-embedding-backward": ({}, {"vocab_size": 4000, "hidden_size": 128, "intermediate_size": 512}),
}


@pytest.mark.parametrize("phases, method, plan", shapes_in_turn(PLANS, list(PHASES)), ids=plan_id)
def test_phases_that_grow_with_depth_at_other_rates_are_segments_apart(phases, method, plan):
    """Two phases of the step hold the peak in turn as the stack deepens (tied Qwen2, depth 12); if
    one segment held both, its peak would be the larger of two lines and the estimate by depth
    would fall short at full depth. Each plan meets one pair of phases, in turn, and every engine
    meets both (shapes_in_turn), as the test above meets the shapes."""
    phase, shape = PHASES[phases]
    cfg = run_config(method, {**plan, **phase})
    model_config = tiny_config("qwen2", num_hidden_layers=12, tie_word_embeddings=True, **shape)
    fast = estimate.estimate(model_config, cfg, 2, 48)
    full = estimate.estimate(model_config, cfg, 2, 48, by_depth=False)
    assert {f: getattr(fast, f) for f in FIELDS} == {f: getattr(full, f) for f in FIELDS}


def test_mixed_layers_are_estimated_at_full_depth(monkeypatch):
    calls = []
    monkeypatch.setattr(estimate, "_by_depth", lambda *a: calls.append(a))
    mixed = tiny_config("qwen2", 300, num_hidden_layers=8, use_sliding_window=True, max_window_layers=4,
                        sliding_window=16)
    assert len(set(mixed.layer_types)) == 2
    estimate.estimate(mixed, run_config("lora", {"engine": "resident", "precision": "bf16"}), 1, 32)
    assert not calls


def test_max_seq_is_the_longest_that_fits_and_one_token_more_does_not(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(planner, "CUDA_OVERHEAD_BYTES", 0)  # a card of a few MiB, as a tiny model needs
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--gpu", "2MiB", "--seq", "64", "--method", "full",
                     "--max-seq", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    model_config = presets.model_config(str(tiny_model_dir))
    machine = planner.Machine.named("2MiB")
    checked, engines_seen = 0, set()
    for found in plans:
        cfg = run_config("full", {"engine": found["engine"], **found["options"]})
        longest = found["max_seq"]
        capped = longest == model_config.max_position_embeddings
        if capped and found["engine"] in engines_seen:
            continue  # fits at the model's own limit: one such plan an engine is checked
        engines_seen.add(found["engine"])
        if longest:
            assert not machine.shortfalls(estimate.estimate(model_config, cfg, 1, longest))
            checked += 1
        if not capped:
            assert machine.shortfalls(estimate.estimate(model_config, cfg, 1, longest + 1))
    assert checked >= 2


def test_the_no_fit_sentence_names_host_ram_and_disk_and_by_how_much(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(planner, "CUDA_OVERHEAD_BYTES", 0)
    args = ["plan", "--model", str(tiny_model_dir), "--gpu", "0.4MiB", "--seq", "32", "--method", "full"]
    assert cli.main([*args, "--host-ram", "0.1MiB"]) == 0  # below slide's, lsp's and chunk's host state
    out = capsys.readouterr().out
    assert "102.4 KiB host RAM" in out and "no plan fits: the smallest on the device, " in out
    assert "lacks host RAM: needs" in out and "short)" in out
    assert cli.main([*args, "--host-ram", "64GiB", "--disk", "0.001MiB"]) == 0
    table = capsys.readouterr().out
    assert "slide     precision=bf16 activations.checkpoint=disk" in table and "no (disk)" in table
    assert cli.main([*args, "--host-ram", "lots"]) == 2
    assert "--host-ram must be a size such as 64GiB" in capsys.readouterr().err
