"""A non-finite loss or gradient norm never reaches the weights: the engine leaves that step's update
out (weights and AdamW state as they were, the schedule moves on), and the next steps train exactly as
if the bad batch had never been seen. resident, and slide and lsp with clipping (updates after the global
norm) and without (updates while backward runs, stopped by a shared guard)."""

import copy

import pytest
import torch

from conftest import engine_config
from slimtune.config import TrainConfig
from slimtune.engines.lsp.engine import LspConfig, LspEngine
from slimtune.engines.resident import ResidentEngine
from slimtune.engines.slide.engine import SlideEngine
from slimtune.model.stack import Stack
from test_slide import batches, model_of

CPU = torch.device("cpu")


def poisoned(vocab: int, seed: int):
    """A step's batches whose first micro-batch makes the loss non-finite (its embedding rows are inf)."""
    out = batches(vocab, seed, 2)
    out[0].input_ids[0, 3] = vocab - 1
    return out


def clean(vocab: int, seed: int):
    """A step's batches that never read the poisoned row (the last token)."""
    out = batches(vocab, seed, 2)
    for batch in out:
        batch.input_ids[batch.input_ids == vocab - 1] = 3
    return out


def poison_embedding_row(model, row: int):
    with torch.no_grad():
        model.model.embed_tokens.weight[row] = float("inf")


def snapshot(engine) -> dict:
    return {n: t.detach().clone() for n, t in engine.trainable_state().items()}


def run_config(engine_class, clip: float):
    """lsp trains without weight decay (it refuses it) and fits its projectors once, before step 1."""
    decay = 0.0 if engine_class is LspEngine else 0.1
    train = TrainConfig(steps=6, batch_size=2, grad_accum=2, lr=1e-2, weight_decay=decay, warmup_steps=1,
                        max_grad_norm=clip)
    if engine_class is LspEngine:
        return engine_config(train, engine="lsp", method="full",
                             sections={"lsp": LspConfig(d=8, r=2, check_every=0, fit_iterations=2)})
    return engine_config(train)


@pytest.mark.parametrize("engine_class, clip", [(ResidentEngine, 0.5), (SlideEngine, 0.5), (SlideEngine, 0.0),
                                                (LspEngine, 0.5), (LspEngine, 0.0)],
                         ids=["resident", "slide-clipped", "slide-overlapped", "lsp-clipped", "lsp-overlapped"])
def test_a_nonfinite_step_changes_no_weight_and_the_run_goes_on_exactly(engine_class, clip):
    model = model_of()
    vocab = model.config.vocab_size
    poison_embedding_row(model, vocab - 1)  # only the poisoned batch reads this row
    cfg = run_config(engine_class, clip)
    engine = engine_class(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    reference = engine_class(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    assert engine.step(clean(vocab, 0)).applied and reference.step(clean(vocab, 0)).applied
    before = snapshot(engine)
    result = engine.step(poisoned(vocab, 1))
    assert not result.applied
    after = snapshot(engine)
    frozen = {"model.embed_tokens.weight"}  # its poisoned row is inf from the start
    assert all(torch.equal(after[n], before[n]) for n in before if n not in frozen)
    assert all(torch.isfinite(t).all() for n, t in after.items() if n not in frozen)
    reference.step_count += 1  # the skipped step still moves the schedule on
    for seed in (2, 3):
        a, b = engine.step(clean(vocab, seed)), reference.step(clean(vocab, seed))
        assert a.applied and a.loss == b.loss
    assert all(torch.equal(t, snapshot(reference)[n]) for n, t in snapshot(engine).items())


@pytest.mark.parametrize("engine", ["slide", "lsp"])
def test_skip_is_refused_when_updates_run_during_backward(engine):
    from slimtune.engines import settings
    from slimtune.errors import UserError

    with pytest.raises(UserError, match="cannot be skipped whole"):
        settings.load(None, [f"engine={engine}", "method=full", "train.on_nonfinite=skip", "train.max_grad_norm=0"],
                    base={"model": "(test)", "data": "(test)"})
