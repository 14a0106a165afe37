"""The host update hidden under clipping (issue 30 item 6): with train.max_grad_norm set, the
per-unit AdamW of a step runs on the host worker while the next step's forward starts, and every
reader of a unit's host tensors waits for that unit's update. Each test slows the host updates
(a sleep before each) so the next forward really overtakes them, and compares against the
sequential order (a barrier after every step: slide's step without `then`, lsp's sync schedule)
bit for bit. The same runs with the waits made no-ops must differ: they prove the waits, not luck,
keep the order exact. Float64 tiny models, CPU."""

import copy
import threading
import time

import pytest
import torch

from test_chunk import slide_chunk_cfg
from test_lsp import fixed_projector_engine, run_cfg as lsp_cfg
from test_slide import batches, model_of, train_cfg
from slimtune.engines.chunk.engine import ChunkConfig
from slimtune.engines.chunk.state import ChunkState
from slimtune.engines.lsp.engine import LspConfig
from slimtune.engines.lsp.updates import UpdatePipeline
from slimtune.engines.slide.engine import SlideEngine
from slimtune.model.stack import Stack
from slimtune.optim.host_unit import HostUnit
from slimtune.step import activations

CPU = torch.device("cpu")
STEPS = 4


class Overtaking:
    """Counts host updates running now, and whether a block's forward began while one ran."""

    def __init__(self):
        self.running, self.lock, self.seen = 0, threading.Lock(), False

    def slowed(self, fn, seconds: float):
        def slow(*args, **kwargs):
            with self.lock:
                self.running += 1
            try:
                time.sleep(seconds)  # before the update: a reader that does not wait sees the old weights
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.running -= 1
        return slow

    def watch(self, fn):
        def watched(*args, **kwargs):
            self.seen = self.seen or self.running > 0
            return fn(*args, **kwargs)
        return watched


def slow_slide(monkeypatch, seconds: float) -> Overtaking:
    """Every host update (a unit's AdamW; a chunk's AdamW) sleeps first; block forwards are watched."""
    seen = Overtaking()
    monkeypatch.setattr(HostUnit, "update", seen.slowed(HostUnit.update, seconds))
    monkeypatch.setattr(ChunkState, "update", seen.slowed(ChunkState.update, seconds))
    monkeypatch.setattr(activations, "block_forward", seen.watch(activations.block_forward))
    return seen


def without_waits(monkeypatch, which: tuple[str, ...] = ("edges", "blocks")) -> None:
    """Guards against reading a unit before its update made no-ops: "edges", the engine's waits (the
    embedding rows, the head tiles); "blocks", bind's (a block's upload)."""
    if "edges" in which:
        monkeypatch.setattr(SlideEngine, "_await_update", staticmethod(lambda unit: None))
    if "blocks" in which:
        monkeypatch.setattr(HostUnit, "bind", lambda unit, slot, link, grads: unit.binding.bind(slot, link, grads))


def slide_run(model, cfg, overlapped: bool, steps: int = STEPS):
    """((loss, grad norm) per step, trained weights, engine) of `steps` steps; `overlapped`: each step
    but the last is handed the next one's batches (then=), as the loop does, so its updates run on
    into the next forward."""
    engine = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    data = [batches(model.config.vocab_size, seed, cfg.train.grad_accum) for seed in range(steps)]
    results = []
    for k in range(steps):
        then = (data[k + 1], None) if overlapped and k + 1 < steps else None
        results.append(engine.step(data[k], then=then))
    return [(r.loss, r.grad_norm) for r in results], engine.trainable_state(), engine


def assert_equal_runs(want, got) -> None:
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for name, value in want[1].items():
        assert torch.equal(got[1][name], value), name


def differs(want, got) -> bool:
    return got[0] != want[0] or any(not torch.equal(got[1][n], v) for n, v in want[1].items())


# ---------------------------------------------------------------- slide, every tensor's own AdamW


@pytest.mark.parametrize("tied", [pytest.param(False, id="untied", marks=pytest.mark.quick),
                                  pytest.param(True, id="tied")])
def test_slide_overlapped_updates_equal_the_sequential_order(monkeypatch, tied):
    model = model_of(tie_word_embeddings=tied)
    cfg = train_cfg(max_grad_norm=0.5)
    sequential = slide_run(model, cfg, overlapped=False)
    seen = slow_slide(monkeypatch, 0.01)
    overlapped = slide_run(model, cfg, overlapped=True)
    assert seen.seen  # a block's forward began while some update still ran
    assert max(norm for _, norm in sequential[0]) > 0.5  # clipping took effect
    assert_equal_runs(sequential, overlapped)


@pytest.mark.parametrize("which", [("edges",), ("blocks",)], ids=["no-edge-waits", "no-bind-wait"])
def test_slide_without_either_wait_reads_units_before_their_update(monkeypatch, which):
    """Each guard alone is what keeps its units right: without the engine's waits the embedding rows
    and head tiles are read before their update, without bind's the blocks are."""
    model = model_of()
    cfg = train_cfg(max_grad_norm=0.5)
    sequential = slide_run(model, cfg, overlapped=False)
    slow_slide(monkeypatch, 0.02)
    without_waits(monkeypatch, which)
    assert differs(sequential, slide_run(model, cfg, overlapped=True))


def test_the_updates_go_in_the_order_the_next_step_reads_the_units(monkeypatch):
    order = []
    update = HostUnit.update
    monkeypatch.setattr(HostUnit, "update", lambda unit, *args: (order.append(unit.name), update(unit, *args))[1])
    engine = SlideEngine(Stack(model_of()), train_cfg(max_grad_norm=0.5), CPU, "fp64")
    engine.step(batches(300, 0))
    assert order == ["embedding", "block 0", "block 1", "block 2", "LM head"]


def test_evaluation_and_a_checkpoint_right_after_a_step_see_the_updated_weights(monkeypatch):
    """A step handed then= returns with its updates running; evaluation and state_dict called right
    then (the loop never does, but any reader must be safe) see the weights after them."""
    model = model_of()
    cfg = train_cfg(max_grad_norm=0.5)
    held_out = batches(model.config.vocab_size, 99, micro=1)
    data = [batches(model.config.vocab_size, seed) for seed in range(3)]
    calm = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    for k in range(2):
        calm.step(data[k])
    want_eval, want_state = calm.evaluate(held_out), calm.state_dict()
    slow_slide(monkeypatch, 0.02)

    def in_flight() -> SlideEngine:
        engine = SlideEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
        for k in range(2):
            engine.step(data[k], then=(data[k + 1], None))
        assert not engine.edges[0].update_job.done()  # the head's update, the last, still runs
        return engine

    assert in_flight().evaluate(held_out) == want_eval
    state = in_flight().state_dict()
    for part in ("trainable", "exp_avg", "exp_avg_sq"):
        for name, value in getattr(want_state, part).items():
            assert torch.equal(getattr(state, part)[name], value), (part, name)


# ---------------------------------------------------------------- slide, the chunk working set


@pytest.mark.parametrize("waits", [True, False], ids=["with-waits", "waits-disabled"])
def test_slide_chunk_working_set_overlapped_equals_sequential(monkeypatch, waits):
    model = model_of(layers=3)
    cfg = slide_chunk_cfg(ChunkConfig(n_chunks=3))
    sequential = slide_run(model, cfg, overlapped=False, steps=6)
    seen = slow_slide(monkeypatch, 0.02)  # one chunk job a step: long enough for the blocks outside it
    if not waits:
        without_waits(monkeypatch)
    overlapped = slide_run(model, cfg, overlapped=True, steps=6)
    if waits:
        assert seen.seen
        assert_equal_runs(sequential, overlapped)
    else:
        assert differs(sequential, overlapped)


# ---------------------------------------------------------------- lsp, the deep matrices too


def lsp_run(model, lsp: LspConfig, steps: int = STEPS):
    engine = fixed_projector_engine(copy.deepcopy(model), lsp_cfg(lsp, max_grad_norm=0.05))
    results = [engine.step(batches(model.config.vocab_size, seed)) for seed in range(steps)]
    return [(r.loss, r.grad_norm) for r in results], engine.trainable_state(), engine


@pytest.mark.parametrize("waits", [True, False], ids=["with-waits", "waits-disabled"])
def test_lsp_clipped_updates_overlap_the_next_forward_and_equal_sync(monkeypatch, waits):
    """Every matrix, deep ones included (k=4, p=1, h=2, u=3 would update the deep ones during backward
    without clipping), updates after backward in forward order while the next forward runs."""
    model = model_of(layers=3)
    sync = lsp_run(model, LspConfig(d=8, r=3, check_every=0, schedule="sync"))
    seen = Overtaking()
    monkeypatch.setattr(UpdatePipeline, "_host_update", seen.slowed(UpdatePipeline._host_update, 0.005 if waits else 0.02))
    monkeypatch.setattr(UpdatePipeline, "complete", seen.watch(UpdatePipeline.complete))
    if not waits:
        monkeypatch.setattr(UpdatePipeline, "_await_update", staticmethod(lambda pending: None))
    pipelined = lsp_run(model, LspConfig(d=8, r=3, check_every=0, k=4, p=1, h=2, u=3))
    if waits:
        assert seen.seen  # a matrix's forward began while some update still ran
        assert max(norm for _, norm in sync[0]) > 0.05  # clipping took effect
        assert_equal_runs(sync, pipelined)
    else:
        assert differs(sync, pipelined)


def test_the_loop_leaves_updates_running_only_into_a_step_that_nothing_reads_before(tmp_path, tiny_model_dir):
    """train.fit with slide, clipping on: every step but a checkpoint's and the last is handed the
    next batches, and weights and logged losses equal a run whose steps never are (bit for bit)."""
    from test_train import fit_with_and_without_early_starts

    settings = {"engine": "slide", "method": "full", "train.steps": 6, "train.save_every": 3, "train.eval_every": 0,
                "train.max_grad_norm": 1.0}
    found = fit_with_and_without_early_starts(tmp_path, tiny_model_dir, settings)
    assert found[True][0] == [True, True, False, True, True, False] and not any(found[False][0])
    assert found[True][2] == found[False][2] and len(found[True][2]) == 6
    for name, value in found[False][1].items():
        assert torch.equal(found[True][1][name], value), name
