"""Where host gradients go under a chunk working set (engine slide with slide.working_set=chunk,
working_set.OneChunk): only into the active chunk's accumulators (engines/chunk/state.py's Working
views), whatever arrives.

slide computes every gradient of a block on the device as usual and sends the block's gradients
down; the head's come a vocabulary tile at a time and the embedding's as rows with their token ids.
The parts of them inside the active chunk's pieces are added here, the rest is dropped: host RAM
holds gradients of one chunk only.
"""

from __future__ import annotations

import torch
from torch import nn

from slimtune.engines.chunk.partition import Piece
from slimtune.engines.chunk.state import ChunkState, narrow


class ActiveGradients:
    """The active chunk's host accumulators by parameter, for the three ways gradients arrive."""

    def __init__(self, state: ChunkState, names: dict[int, str]):
        self.state, self.names = state, names  # names: id(param) -> its name in the state
        self.by_name: dict[str, list[tuple[Piece, torch.Tensor]]] = {}

    def open(self, k: int) -> None:
        """Chunk k's accumulators receive from now on (they are zero: the last update emptied them)."""
        self.by_name = {}
        for (piece, _, _), grad in self.state.grad_views(k):
            self.by_name.setdefault(piece.name, []).append((piece, grad))

    def wants(self, param: nn.Parameter) -> bool:
        return self.names.get(id(param)) in self.by_name

    def add_dense(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """A whole tensor's gradient (a block's, staged on the host)."""
        for piece, target in self.by_name.get(self.names.get(id(param)), ()):
            target.add_(narrow(grad, piece))

    def add_rows(self, param: nn.Parameter, start: int, stop: int, grad: torch.Tensor) -> None:
        """Rows [start, stop) of a tensor sliced by rows (an LM-head tile's gradient)."""
        for piece, target in self.by_name.get(self.names.get(id(param)), ()):
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if lo < hi:
                target[lo - piece.start : hi - piece.start].add_(grad[lo - start : hi - start])

    def add_indexed(self, param: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor,
                    padding_idx: int | None) -> None:
        """Rows of an embedding's gradient by token id (ids (n,), rows (n, D)), the padding row
        excepted, as nn.Embedding does."""
        for piece, target in self.by_name.get(self.names.get(id(param)), ()):
            keep = (ids >= piece.start) & (ids < piece.stop)
            if padding_idx is not None:
                keep &= ids != padding_idx
            target.index_add_(0, torch.where(keep, ids - piece.start, 0), rows.to(target.dtype) * keep[:, None])
