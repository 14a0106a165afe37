"""The planner's estimate replays a tiled block's later forward tiles, and where the engine's gradients
add in place (Stack.gradients_accumulate_plainly) or the block makes none but its input's
(Stack.only_parameters_take_gradients) its later backward tiles (memory.replayed: one op that
allocates the transient measured for the same tile of an earlier block, or of the other depth of the
estimate by depth) instead of running them. The oracle: the same estimate with every tile run."""

import pytest

from conftest import tiny_config
from slimtune.device import memory
from slimtune.engines import settings
from slimtune.planning import estimate
from slimtune.step import seq_tiles

PLANS = [("lora", {"engine": "resident", "precision": "bf16", "quant.scheme": "nf4", "activations.checkpoint": "disk"}),
         ("lora", {"engine": "slide", "precision": "bf16", "quant.scheme": "nf4", "slide.head_tile_mb": 0.002}),
         ("full", {"engine": "resident", "precision": "fp32", "activations.checkpoint": "recompute"}),
         ("full", {"engine": "slide", "precision": "bf16", "activations.checkpoint": "host"}),
         ("full", {"engine": "slide", "precision": "bf16", "activations.checkpoint": "host", "slide.working_set": "chunk",
                   "chunk.n_chunks": 4}),
         # lsp: its step runs every backward tile (its hooks count Z's parts); its projector check's passes
         # (parts summed in place by learning.Collector) replay them. Held to the meter in test_estimate.py.
         ("full", {"engine": "lsp", "precision": "bf16", "activations.checkpoint": "recompute"})]


def _estimate(method, plan, tmp_path):
    cfg = settings.load(None, [f"{k}={v}" for k, v in plan.items()] + ["activations.seq_tile=8"],
                        base={"model": "(planned)", "data": "x.jsonl", "method": method, "lora": {"rank": 4},
                              "train": {"batch_size": 2}, "lsp": {"fit_iterations": 4, "d": 8},
                              "output_dir": str(tmp_path)})
    return estimate.estimate(tiny_config(num_hidden_layers=6), cfg, 2, 44)  # 6 tiles, the last of 4 tokens


@pytest.mark.parametrize("method, plan", PLANS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
def test_replayed_tiles_estimate_as_run_tiles(method, plan, tmp_path, monkeypatch):
    calls, making = [], []
    real, real_making = memory.replayed, memory.replayed_making
    monkeypatch.setattr(memory, "replayed", lambda key, fn, *leaves: (calls.append(key), real(key, fn, *leaves)))
    monkeypatch.setattr(memory, "replayed_making", lambda key, fn: (making.append(key), real_making(key, fn))[1])
    replayed = _estimate(method, plan, tmp_path)
    assert len(calls) > len(set(calls))  # tiles were replayed, not only measured
    assert len(making) > len(set(making))  # and first tiles, which make a block's output, K and V
    assert {"forward", "recompute_kv", "backward"} <= {key[0] for key in calls}
    assert {"first forward", "first recompute_kv"} == {key[0] for key in making}
    assert plan["engine"] != "slide" or "streamed_ce" in {key[0] for key in calls}  # the head's vocabulary tiles
    assert replayed.tiled_blocks
    _run_every_tile(monkeypatch)
    assert replayed == _estimate(method, plan, tmp_path)


def _run_every_tile(monkeypatch):
    monkeypatch.setattr(memory, "replayed", lambda key, fn, *leaves: fn())
    monkeypatch.setattr(memory, "replayed_making", lambda key, fn: tuple(fn()))


@pytest.mark.parametrize("gradients", ["device", "host"])
def test_chunk_runs_every_backward_tile_of_the_blocks_holding_its_active_chunk(gradients, tmp_path, monkeypatch):
    """chunk's sliced ops add each part of the active chunk's gradient into a side buffer or send it
    down the link (its bytes are counted): a block holding a piece of the chunk runs every backward
    tile. A block outside it makes only its input's gradient (none of its parameters requires grad in
    that step), and its later tiles are replayed like any others."""
    calls, ran = [], []
    real, real_tile = memory.replayed, seq_tiles._tile_backward
    monkeypatch.setattr(memory, "replayed", lambda key, fn, *leaves: (calls.append(key), real(key, fn, *leaves)))
    monkeypatch.setattr(seq_tiles, "_tile_backward", lambda block, start, *rest: (
        ran.append((id(block.layer), start, any(p.requires_grad for p in block.layer.parameters()))),
        real_tile(block, start, *rest))[1])
    plan = {"engine": "chunk", "precision": "fp32", "activations.checkpoint": "recompute", "chunk.n_chunks": 4,
            "chunk.gradients": gradients}
    replayed = _estimate("full", plan, tmp_path)
    holding, outside = {}, []
    for layer, start, trained in ran:
        (holding.setdefault(layer, set()).add(start) if trained else outside.append(start))
    every = set().union(*holding.values())
    assert 0 in every and all(starts == every for starts in holding.values())  # tile 0 too, in every such block
    assert outside and 0 not in outside  # outside: as plain, representative tiles only,
    assert len([key for key in calls if key[0] == "backward"]) > len(outside)  # and replayed after the first
    _run_every_tile(monkeypatch)
    assert replayed == _estimate("full", plan, tmp_path)


def test_the_estimate_says_whether_a_block_ran_in_tiles(tmp_path):
    plan = {"engine": "resident", "precision": "fp32"}
    assert not _estimate("full", plan, tmp_path).tiled_blocks  # no checkpoints: blocks run whole
    assert _estimate("full", {**plan, "activations.checkpoint": "recompute"}, tmp_path).tiled_blocks


def test_a_replayed_call_makes_the_same_gradients_and_one_that_keeps_more_always_runs():
    """memory.replayed's leaves on their own: a call that only gives leaves their first gradient is
    replayed (the gradients made again, through autograd), one that keeps anything else runs each time."""
    import torch

    mode = memory.MeteredFakeMode(allow_non_fake_inputs=True)
    runs, kept = [], []
    with mode, memory.LiveBytesMeter() as meter:
        first, second = (torch.ones(4, 4, requires_grad=True) for _ in range(2))

        def grads(w):
            runs.append("grads")
            (w * 2).sum().backward()

        memory.replayed("grads", lambda: grads(first), [first])
        before = meter.current
        memory.replayed("grads", lambda: grads(second), [second])
        assert runs == ["grads"] and second.grad is not None and second.grad.shape == (4, 4)
        assert meter.current - before == 64  # the gradient's bytes, as the call kept them

        def keeps_more(w):
            runs.append("more")
            (w * 3).sum().backward()
            kept.append(torch.ones(8))

        third, fourth = (torch.ones(4, 4, requires_grad=True) for _ in range(2))
        memory.replayed("more", lambda: keeps_more(third), [third])
        memory.replayed("more", lambda: keeps_more(fourth), [fourth])
        assert runs.count("more") == 2


def test_a_replayed_call_that_makes_tensors_makes_alike_ones_and_one_that_keeps_more_always_runs():
    """memory.replayed_making on its own: a replay gives tensors of the shapes, strides and dtypes the
    call made, the same bytes kept and the same peak; a call that keeps more than it returns runs each time."""
    import torch

    mode = memory.MeteredFakeMode(allow_non_fake_inputs=True)
    runs, kept = [], []

    def makes():
        runs.append("makes")
        scratch = torch.ones(1000)  # a transient of 4,000 bytes above what is kept
        out = torch.empty(10, 3, dtype=torch.bfloat16).t()  # a view of a whole storage, made here
        return out, scratch[:5].clone()

    with mode, memory.LiveBytesMeter() as meter:
        first = memory.replayed_making("makes", makes)
        before, meter.peak = meter.current, 0
        second = memory.replayed_making("makes", makes)
        assert runs == ["makes"]
        assert [(t.shape, t.stride(), t.dtype) for t in second] == [(t.shape, t.stride(), t.dtype) for t in first]
        assert meter.current - before == 60 + 20  # what the call kept
        assert meter.peak - before == 60 + 4000 + 20  # and its peak: the scratch with the first made

        def keeps_more():
            runs.append("more")
            kept.append(torch.ones(8))
            return (torch.ones(2),)

        memory.replayed_making("more", keeps_more)
        memory.replayed_making("more", keeps_more)
        assert runs.count("more") == 2
