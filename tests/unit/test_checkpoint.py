"""One checkpoint format for every engine: what an engine writes is read back whole from disk, a
checkpoint of one engine resumes under another exactly (resident <-> slide, float64), and what
cannot be resumed ends in one sentence."""

import copy
import json

import pytest
import torch

from conftest import engine_config
from slimtune.store import checkpoint
from slimtune.config import LoraConfig, TrainConfig
from slimtune.engines.resident import ResidentEngine
from slimtune.engines.slide.engine import SlideEngine
from slimtune.errors import UserError
from slimtune.model.stack import Stack
from test_slide import batches, model_of

CPU = torch.device("cpu")
TRAIN = TrainConfig(steps=4, batch_size=2, grad_accum=2, lr=1e-2, weight_decay=0.1, warmup_steps=1,
                    schedule="cosine", max_grad_norm=0.5)


def through_disk(tmp_path, state: checkpoint.EngineState) -> checkpoint.EngineState:
    checkpoint.save(tmp_path, 2, state, {"epoch": 0, "cursor": 4}, keep_last=1)
    step, loaded, stream, _ = checkpoint.load(checkpoint.latest(tmp_path))
    assert step == 2 and stream == {"epoch": 0, "cursor": 4}
    return loaded


@pytest.mark.quick
def test_the_format_round_trips_through_disk(tmp_path):
    engine = ResidentEngine(Stack(model_of()), engine_config(TRAIN), CPU, "fp64")
    engine.step(batches(300, 0, 2))
    state = engine.state_dict()
    loaded = through_disk(tmp_path, state)
    assert (loaded.engine, loaded.step, loaded.adam_steps) == ("resident", 1, state.adam_steps)
    for field in ("trainable", "exp_avg", "exp_avg_sq"):
        mine, back = getattr(state, field), getattr(loaded, field)
        assert mine.keys() == back.keys() and len(mine) > 0
        assert all(torch.equal(mine[k], back[k]) for k in mine), field


@pytest.mark.quick  # slide steps once from resident's state and lands on resident's weights
@pytest.mark.parametrize("first, second", [(ResidentEngine, SlideEngine), (SlideEngine, ResidentEngine)],
                         ids=["resident-then-slide", "slide-then-resident"])
def test_a_checkpoint_resumes_exactly_under_the_other_engine(tmp_path, first, second):
    model, cfg = model_of(), engine_config(TRAIN)
    straight = first(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    losses = [straight.step(batches(300, seed, 2)).loss for seed in range(3)]
    before = first(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    for seed in range(2):
        before.step(batches(300, seed, 2))
    after = second(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    after.load_state_dict(through_disk(tmp_path, before.state_dict()))
    assert after.step(batches(300, 2, 2)).loss == pytest.approx(losses[2], abs=1e-10, rel=0)
    want = straight.trainable_state()
    got = after.trainable_state()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-10, rtol=0, msg=name)


def test_a_checkpoint_of_other_trained_tensors_is_refused_in_one_sentence():
    from slimtune.model import lora

    full = ResidentEngine(Stack(model_of()), engine_config(TRAIN), CPU, "fp64")
    full.step(batches(300, 0, 2))
    adapted = model_of()
    for p in adapted.parameters():
        p.requires_grad_(False)
    lora.apply(adapted, LoraConfig(rank=2))
    for engine_class in (ResidentEngine, SlideEngine):
        engine = engine_class(Stack(copy.deepcopy(adapted)), engine_config(TRAIN), CPU, "fp64")
        said = r"other tensors than this run .*(the method, lora\.\* or freeze settings|engine=resident)"
        with pytest.raises(UserError, match=said):
            engine.load_state_dict(full.state_dict())


def test_a_checkpoint_in_an_older_format_is_refused_in_one_sentence(tmp_path):
    folder = tmp_path / "checkpoints" / "step-00000002"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": 2, "stream": {}}))  # no "format": the old layout
    with pytest.raises(UserError, match="older format"):
        checkpoint.load(folder)


def test_a_run_saved_on_more_cards_resumes_on_fewer(monkeypatch):
    """The RNG state holds every card's generator of the saving machine; a machine with fewer cards
    restores the ones it has (torch.cuda.set_rng_state_all would index past them), and its own card
    takes the saving rank's own card's state. torch.cuda stood in for: this machine has no card."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, index: restored.append((int(state[0]), index)))
    state = {"python": checkpoint.random.getstate(), "torch": torch.get_rng_state(),
             "cuda": [torch.tensor([card], dtype=torch.uint8) for card in range(8)],
             "cuda_own": torch.tensor([5], dtype=torch.uint8)}
    checkpoint.set_process_rng_state(state)
    assert restored == [(0, 0), (5, 0)]


def test_a_copy_of_a_checkpoint_beside_the_others_is_not_one_of_them(tmp_path):
    """step-00000004.bak or "step-00000004 copy" (a user's backup) beside the checkpoints: every resume ended in
    a ValueError reading its step from the name."""
    root = tmp_path / "checkpoints"
    for name in ("step-00000002", "step-00000004", "step-00000004.bak", "step-00000004 copy", "step-00000006.tmp",
                 "step-", "step-١٢"):  # (Arabic-Indic digits: str.isdigit, not ASCII)
        (root / name).mkdir(parents=True)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step-00000002", "step-00000004"]
