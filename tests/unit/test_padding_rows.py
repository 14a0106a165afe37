"""The embedding's padding row trains as nn.Embedding(padding_idx=...) trains it: not at all. The
engines that add the embedding's gradient on the host by token id (roundpipe; slide, with its own
mask and with the chunk working set's; chunk with its gradient on the host) each mask that row
themselves. Every other engine test draws token ids from 3 up, so the pad id (0) never appears there:
here left-padded, mid-row and tail-padded rows, against resident (plain autograd of the Hugging Face
model) on the same batches."""

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import engine_config
from test_chunk import reference_of
from test_slide import batches, model_of
from slimtune.config import TrainConfig
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.engines import settings
from slimtune.engines.chunk.engine import ChunkConfig, ChunkEngine
from slimtune.engines.resident import ResidentEngine
from slimtune.engines.roundpipe.engine import RoundPipeConfig, RoundPipeEngine
from slimtune.engines.slide.engine import SlideConfig, SlideEngine
from slimtune.model.stack import Stack

CPU = torch.device("cpu")
PAD = 0  # the fixture models' pad_token_id, their embedding's padding_idx
EMBED = "model.embed_tokens.weight"
STEPS = 3
# weight_decay 0: the padding row, with no gradient, then stays exactly as it was.
TRAIN = dict(steps=STEPS, batch_size=4, grad_accum=2, lr=1e-2, weight_decay=0.0, warmup_steps=1, schedule="cosine",
             max_grad_norm=0.5, measure_memory=False)
ENGINES = {
    "roundpipe": (RoundPipeEngine, dict(engine="roundpipe", sections={"roundpipe": RoundPipeConfig(workers=2)})),
    "slide": (SlideEngine, dict(engine="slide", sections={"slide": SlideConfig()})),
    "slide_chunk": (SlideEngine, dict(engine="slide", sections={"slide": SlideConfig(working_set="chunk"),
                                                                "chunk": ChunkConfig(n_chunks=1)})),
    "chunk_host": (ChunkEngine, dict(engine="chunk", sections={"chunk": ChunkConfig(n_chunks=1, gradients="host")})),
}


def padded(vocab: int, seed: int) -> list[Batch]:
    """Two micro-batches of four rows holding the pad id: a left-padded row (its real tokens attend to
    the pads: the pad row's embedding reaches the loss), one with a pad mid-row and a padded tail."""
    found = []
    for batch in batches(vocab, seed, micro=2, rows=4):
        ids, targets = batch.input_ids.clone(), batch.targets.clone()
        ids[0, :3], targets[0, :3] = PAD, IGNORE_INDEX
        ids[1, 5], targets[1, 4] = PAD, IGNORE_INDEX
        ids[2, -3:], targets[2, -4:] = PAD, IGNORE_INDEX
        found.append(Batch(ids, targets, batch.position_ids))
    return found


def trained(engine_class, model, fields: dict) -> dict[str, torch.Tensor]:
    cfg = engine_config(TrainConfig(**TRAIN), method="full", **fields)
    settings.validate(cfg)
    engine = engine_class(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    for step in range(STEPS):
        engine.step(padded(model.config.vocab_size, step))
    return {n: t.detach().clone() for n, t in engine.trainable_state().items()}


@pytest.fixture(scope="module")
def model():
    return model_of(layers=2)


@pytest.fixture(scope="module")
def reference(model):
    return trained(ResidentEngine, model, dict(engine="resident"))


@pytest.fixture(scope="module")
def reference64(model):
    """The chunk engine's RMSNorms keep float64 where Hugging Face's compute in float32 (test_chunk):
    its reference is resident on the model with float64 RMSNorms."""
    return trained(ResidentEngine, reference_of(model), dict(engine="resident"))


def test_the_batches_reach_the_padding_row_and_plain_autograd_gives_it_nothing(model, reference):
    """What makes the comparison below able to fail: without padding_idx the pad row's gradient is not
    zero on these batches; with it (the model as loaded) it is, and resident leaves the row as it was."""
    embed = model.get_input_embeddings()
    assert embed.padding_idx == PAD
    plain = copy.deepcopy(model)
    total = sum(b.num_targets for b in padded(model.config.vocab_size, 0))
    for padding_idx in (None, PAD):
        plain.get_input_embeddings().padding_idx = padding_idx
        plain.zero_grad()
        for b in padded(model.config.vocab_size, 0):
            logits = plain(input_ids=b.input_ids, position_ids=b.position_ids).logits
            (F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
             / total).backward()
        row = plain.get_input_embeddings().weight.grad[PAD]
        assert (row.abs().max() > 1e-6) if padding_idx is None else not row.any(), padding_idx
    assert torch.equal(reference[EMBED][PAD], embed.weight[PAD].detach())
    assert not torch.equal(reference[EMBED], embed.weight.detach())  # the other rows trained


@pytest.mark.parametrize("name", list(ENGINES))
def test_the_padding_row_gets_no_gradient_and_the_rest_trains_as_resident(model, reference, reference64, name):
    engine_class, fields = ENGINES[name]
    found = trained(engine_class, model, fields)
    reference = reference64 if engine_class is ChunkEngine else reference
    assert torch.equal(found[EMBED][PAD], model.get_input_embeddings().weight[PAD].detach())
    assert found.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(found[key], value, atol=1e-10, rtol=0, msg=f"{name}: {key}")
