"""The gradient of a table a step touches only a few rows of: an embedding's (the tokens seen).

A dense accumulator for Llama-3.1-8B's embedding is 128K x 4096 fp32 numbers, 2 GiB, to receive at
most batch x seq rows a step. RowGrads keeps the touched rows only, summed in fp32 in the same
order a dense `index_add_` sums them (each row: what it held, then the new rows in order), so every
number equals the dense accumulator's bit for bit. It lends itself to the update a tile at a time
(`tile`), zeros elsewhere.

Its buffer holds one row per id received this step, duplicates included (the rows in use are the
distinct ids, at the front): the bytes then depend on the batch's shape, not its contents, so the
planner's step on fake tensors counts exactly what a real step holds. `nbytes` is the largest it grew.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.device import runtime
from slimtune.optim import tiled_adamw


class RowGrads:
    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.width, self.dtype, self.device = rows, width, dtype, device
        self.largest = 0
        self.zero_()

    def zero_(self) -> RowGrads:
        self.ids = torch.empty(0, dtype=torch.int64)  # sorted distinct ids, one per row of `values` in use
        self.received = 0  # ids received this step, duplicates included: the buffer's rows
        self.values = runtime.host_empty((0, self.width), self.dtype, self.device, pinned=False)
        return self

    def index_add_(self, dim: int, ids: torch.Tensor, rows: torch.Tensor) -> RowGrads:
        """As a dense (rows, width) accumulator's index_add_(0, ids, rows)."""
        assert dim == 0
        self.received += ids.numel()
        size = min(self.received, self.rows)
        grown = runtime.host_empty((size, self.width), self.dtype, self.device, pinned=False).zero_()
        self.largest = max(self.largest, runtime.nbytes(grown))
        if is_fake(grown) or is_fake(ids) or is_fake(rows):  # the planner's step: the bytes, not the values
            self.values = grown
            return self
        union = torch.cat([self.ids, ids.reshape(-1)]).unique(sorted=True)
        grown.index_copy_(0, torch.searchsorted(union, self.ids), self.values[: self.ids.numel()])  # what each row held,
        grown.index_add_(0, torch.searchsorted(union, ids.reshape(-1)),  # then the new rows in order
                         rows.reshape(-1, self.width).to(self.dtype))
        self.ids, self.values = union, grown
        return self

    def norm(self) -> torch.Tensor:
        """The gradient's 2-norm (the zero rows add nothing)."""
        return torch.linalg.vector_norm(self.values[: self.ids.numel()], dtype=torch.promote_types(self.dtype,
                                                                                                    torch.float32))

    def tile(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Numbers [start, stop) of the dense gradient (row-major) into `out`."""
        first, last = start // self.width, -(-stop // self.width)
        lo, hi = torch.searchsorted(self.ids, torch.tensor([first, last])).tolist()
        block = torch.zeros((last - first, self.width), dtype=self.dtype)
        block[self.ids[lo:hi] - first] = self.values[lo:hi]
        offset = start - first * self.width
        return out.copy_(block.view(-1)[offset : offset + stop - start])

    def nbytes(self) -> int:
        return self.largest

    def numel(self) -> int:
        """The dense gradient's numbers (what a sum across ranks would carry: planning counts it)."""
        return self.rows * self.width

    def element_size(self) -> int:
        return self.dtype.itemsize


class Rows(tiled_adamw.Form):
    """A RowGrads lent to the update a tile at a time, times the clipping coefficient."""

    def __init__(self, grads: RowGrads, clip: float):
        self.grads, self.clip = grads, clip

    def tile(self, start, stop, scratch):
        out = self.grads.tile(start, stop, scratch)
        return out.mul_(self.clip) if self.clip != 1.0 else out
