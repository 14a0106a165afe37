"""The sequence tile the planner chooses for a plan whose blocks run in tiles (activations.seq_tile).

A plan leaves the tile to the auto rule (step.activations.tile_tokens: a tile's MLP activations about a
quarter of a block input, so its tiles grow with the sequence). Where that does not fit the card, a
fixed smaller tile may: a block then holds its input, its output, K and V and one tile's
intermediates, and the last no longer grow with the length. The planner offers TILES, largest first
(a longer tile wastes the device less), and takes the largest that fits. For --max-seq the smallest
(MIN_TILE, the auto rule's own floor) gives the longest sequence.

Whether a plan's blocks are tiled at all is its engine's business (resident tiles checkpointed blocks,
slide every block it recomputes); the planner asks the estimate with MIN_TILE-token tiles whether a
block ran in tiles (Estimate.tiled_blocks).
"""

from __future__ import annotations

from typing import Callable

from slimtune.step.activations import MIN_TILE

# Tile sizes offered where the auto rule's tile does not fit, largest first.
TILES = (4096, 2048, 1024, 512, MIN_TILE)


def largest_fitting(seq_len: int, fits: Callable[[int], bool]) -> int | None:
    """The largest of TILES below `seq_len` with which the plan fits (fits(tile)), by bisection: a
    smaller tile never needs more; None when even the smallest does not fit."""
    candidates = [tile for tile in TILES if tile < seq_len]
    if not candidates or not fits(candidates[-1]):
        return None
    low, high = -1, len(candidates) - 1  # candidates[high] fits; candidates[low] does not (or low = -1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(candidates[middle]) else (middle, high)
    return candidates[high]


def probe_length(known: int) -> int:
    """A length at which a tiled block runs in several MIN_TILE-token tiles (so its estimate says so)."""
    return max(known, 4 * MIN_TILE)
