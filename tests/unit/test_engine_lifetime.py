"""An engine goes with its last reference, weights and optimizer state included: autograd holds
tensor hooks from C++, where Python's collector cannot see a cycle through them, so an engine whose
hooks held it strongly stayed alive (a second engine in one process then shared the card with it)."""

import gc
import weakref

import pytest
import torch

from conftest import engine_config
from test_slide import batches, model_of
from slimtune import assembly
from slimtune.config import TrainConfig
from slimtune.engines.chunk.engine import ChunkConfig
from slimtune.engines.lsp.engine import LspConfig
from slimtune.engines.roundpipe.engine import RoundPipeConfig
from slimtune.model.stack import Stack

SECTIONS = {"resident": {}, "lsp": {"lsp": LspConfig(d=8, r=3, check_every=0, fit_iterations=3)},
            "chunk": {"chunk": ChunkConfig(n_chunks=2, gradients="host")}, "slide": {},
            "roundpipe": {"roundpipe": RoundPipeConfig(workers=2)}}


@pytest.mark.parametrize("engine", list(SECTIONS))
def test_an_engine_is_freed_with_its_last_reference_after_a_step(engine):
    cfg = engine_config(TrainConfig(steps=2, batch_size=2), engine=engine, method="full", sections=SECTIONS[engine])
    built = assembly.assemble(cfg, Stack(model_of(layers=2)), torch.device("cpu"), "fp64")
    built.step(batches(built.stack.model.config.vocab_size, 0))
    gone = weakref.ref(built)
    del built
    gc.collect()
    assert gone() is None
