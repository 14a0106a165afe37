"""roundpipe.optimizer's variants are objects (engines/roundpipe/optimizer.py), chosen once when the
engine is built: engine.py asks its variant and never which one it has. What each variant computes
is checked in test_roundpipe.py (sync against plain AdamW, async against the one-step-delayed
recurrence, resume, steps begun early); here the seam itself."""

import ast
import inspect

import pytest
import torch

from conftest import engine_config
from test_slide import model_of
from slimtune.config import TrainConfig
from slimtune.engines.roundpipe import engine as roundpipe_engine
from slimtune.engines.roundpipe import optimizer
from slimtune.engines.roundpipe.settings import RoundPipeConfig, validate
from slimtune.errors import UserError
from slimtune.model.stack import Stack

VARIANT_NAMES = {name for name, value in vars(optimizer).items()
                 if isinstance(value, type) and issubclass(value, optimizer.Update)} | {"VARIANTS"}


def branches_on_the_variant(source: str) -> set[str]:
    """Where `source` asks which variant it has: the setting's values ('sync', 'async'), the setting
    read (any `.optimizer` but the engine's own `self.optimizer`), a variant class or the table of
    them named (isinstance, a lookup), or a flag kept for it (`.asynchronous`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in ("sync", "async"):
            found.add(repr(node.value))
        elif isinstance(node, ast.Name) and node.id in VARIANT_NAMES:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr == "asynchronous":
            found.add(ast.unparse(node))
        elif isinstance(node, ast.Attribute) and node.attr == "optimizer" and ast.unparse(node.value) != "self":
            found.add(ast.unparse(node))
    return found


def test_the_guard_finds_each_way_of_branching_on_the_variant():
    source = ("if self.section.optimizer == 'async' or cfg.section('roundpipe').optimizer != 'sync':\n    pass\n"
              "if isinstance(self.optimizer, AsyncUpdate) or VARIANTS is None:\n    pass\n"
              "self.asynchronous = self.optimizer.starts_ahead\n")
    assert branches_on_the_variant(source) == {
        "self.section.optimizer", "cfg.section('roundpipe').optimizer", "'async'", "'sync'", "AsyncUpdate",
        "VARIANTS", "self.asynchronous"}


def test_engine_py_never_asks_which_optimizer_variant_it_has():
    assert branches_on_the_variant(inspect.getsource(roundpipe_engine)) == set()


@pytest.mark.parametrize("name", ["sync", "async"])
def test_the_setting_chooses_the_variant_once_and_it_says_whether_the_next_step_starts_ahead(name):
    cfg = engine_config(TrainConfig(), engine="roundpipe", method="full",
                        sections={"roundpipe": RoundPipeConfig(workers=2, optimizer=name)})
    engine = roundpipe_engine.RoundPipeEngine(Stack(model_of(2)), cfg, torch.device("cpu"), "fp64")
    variant = optimizer.VARIANTS[name]
    assert type(engine.optimizer) is variant and optimizer.variant_of(cfg) is variant
    assert engine.starts_ahead == variant.starts_ahead == (name == "async")
    assert variant.updates_exposed == (name == "sync")  # the modelled time hides only async's AdamW


def test_async_refuses_skipping_a_non_finite_step_in_one_sentence_and_sync_allows_it():
    def cfg(name: str):
        return engine_config(TrainConfig(on_nonfinite="skip"), engine="roundpipe", method="full",
                             sections={"roundpipe": RoundPipeConfig(optimizer=name)})

    validate(cfg("sync"))
    with pytest.raises(UserError, match=r"roundpipe.optimizer=async has already started the next step .* set "
                                        r"train.on_nonfinite=stop or roundpipe.optimizer=sync\.$"):
        validate(cfg("async"))
