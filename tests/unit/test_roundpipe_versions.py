"""roundpipe's async optimizer keeps two host versions of the weights: step s reads version s % 2,
which update s - 2 writes. With the next step begun early (as the loop does), step s starts while
update s - 2 may still run, and must wait for it unit by unit. Here every unit's first update is slow,
so step 2 is dispatched while update 0 still writes its version: a step that did not wait for the
update two steps before would compute at W0 instead of W1 (a difference of about the learning rate).
tests/unit/test_roundpipe.py meets this only where its delays (random ones, or the head's update
held for another reason) happen to order it so."""

import time

import pytest
import torch

from test_roundpipe import delayed_reference, run_cfg, run_early
from test_slide import model_of
from slimtune.engines.roundpipe.engine import RoundPipeConfig, RoundPipeEngine


def slow_first_updates(engine: RoundPipeEngine) -> None:
    for unit in engine._all_units():
        if unit.adam is None:
            continue
        update, calls = unit.update, []

        def slow(*args, update=update, calls=calls, **kwargs):
            if not calls:  # update 0 of this unit: still running when step 2 begins
                time.sleep(0.2)
            calls.append(True)
            return update(*args, **kwargs)

        unit.update = slow


def test_a_step_begun_while_the_update_two_steps_before_still_runs_waits_for_its_weights():
    model = model_of(4, tie_word_embeddings=True)  # the table, read first (the rows' gather), is the head too
    cfg = run_cfg(RoundPipeConfig(workers=2, micro_batches=2, optimizer="async", replan=False))
    losses, params = delayed_reference(model, cfg, steps=4)  # W_k = AdamW(W_{k-1}, gradient at W_{k-2})
    found = run_early(model, cfg, 4, setup=slow_first_updates)
    assert found[0] == pytest.approx(losses, abs=1e-10, rel=0)
    for name, value in params.items():
        torch.testing.assert_close(found[2][name], value, atol=1e-10, rtol=0, msg=name)
