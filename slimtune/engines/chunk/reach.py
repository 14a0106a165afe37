"""How far down the backward of engine chunk has to go (spec chunkft.md 6, open decision 1: the
truncation half).

A chunk's gradient needs the backward only down to the lowest block holding one of its tensors:
below it no weight is active, so no input gradient is wanted there. Those blocks (and the
embedding) run without autograd, keeping no activation, and the backward ends at that block. Only a
chunk holding part of the embedding (or of a tied head, the same tensor) runs the whole backward.

Within and above that block, only the chunk's own tensors require grad while its step runs
(`only_these_require_grad`): an op whose input and weight need none then joins no graph, so the ops of
the lowest block that come before the chunk's first tensor keep nothing and get no backward either
(the q, k and v projections' input gradients, when only the block's MLP is active). The sliced ops
never hand a weight gradient to autograd, so nothing else changes.

A chunk's reach is that lowest block's index: EMBEDDING (-1) for a chunk that holds the embedding
or any tensor outside the blocks, the final norm and the head; len(blocks) for a chunk of the final
norm and head only (no block needs a backward at all).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from slimtune.device import memory
from slimtune.engines.chunk.partition import Piece
from slimtune.model.stack import Stack
from slimtune.step import activations

EMBEDDING = -1  # the whole backward, to the embedding


def _positions(stack: Stack) -> dict[int, int]:
    """id(parameter) -> the block it sits in, or len(blocks) for the final norm's and the head's.
    The embedding's, and any other tensor's, are left out: they reach the embedding. A tied head is
    the embedding's tensor, so it is left out too."""
    blocks = len(stack.blocks)
    after = {id(p): blocks for module in (stack.norm, stack.head) for p in module.parameters()}
    found = {id(p): i for i, block in enumerate(stack.blocks) for p in block.parameters()}
    found.update(after)
    for p in stack.embed.parameters():
        found.pop(id(p), None)
    return found


def reaches(stack: Stack, params: dict[str, torch.nn.Parameter], chunks: list[list[Piece]]) -> list[int]:
    """Each chunk's reach: the lowest block holding one of its pieces (see the module's docstring)."""
    positions = _positions(stack)
    return [min(positions.get(id(params[piece.name]), EMBEDDING) for piece in pieces) for pieces in chunks]


def runner(reach: int, activations_cfg, store):
    """Stack.body_hidden's `run_blocks` for a chunk of this reach; None (the usual runner) when the
    whole backward is needed. The embedding's output is detached (its backward is not needed), the
    blocks below `reach` run without grad as the checkpointed forward runs them (in tiles of tokens
    where it would tile), and the rest as activations_cfg says."""
    if reach == EMBEDDING:
        return None

    def run(stack: Stack, hidden: torch.Tensor, inputs) -> torch.Tensor:
        hidden = hidden.detach()
        checkpointed = activations_cfg.checkpoint != "none"
        tile = activations.tile_tokens(stack, hidden.shape[1], activations_cfg, inputs.segmented) \
            if checkpointed else hidden.shape[1]
        if tile >= hidden.shape[1]:
            inputs.masks  # made before block 0's segment, as the other runners make them
        with torch.no_grad():
            for index in range(min(reach, len(stack.blocks))):
                memory.mark("forward", index)
                hidden = activations.block_forward(stack, index, hidden, inputs, tile)
        return activations.run_blocks(stack, hidden, inputs, activations_cfg, store, first=reach)
    return run


@contextlib.contextmanager
def only_these_require_grad(params: Iterable[torch.nn.Parameter], active: Iterable[torch.nn.Parameter]):
    """Inside: of `params`, only those in `active` require grad; after: all of them again (what the
    rest of slimtune reads as trainable)."""
    params, wanted = list(params), {id(p) for p in active}
    try:
        for p in params:
            p.requires_grad_(id(p) in wanted)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
