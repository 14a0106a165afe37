"""A batch cut by rows into micro-batches (the pipeline's unit of work), and a micro-batch cut by
tokens (a sharded tail's slice of it)."""

from __future__ import annotations

from torch._subclasses.fake_tensor import is_fake

from slimtune.data.dataset import Batch


def split_rows(batch: Batch, pieces: int) -> list[Batch]:
    """`batch` as min(pieces, rows) micro-batches of consecutive rows, as even as they come (the first
    ones a row longer). Under fake tensors (the planner's estimate) the trained positions cannot be
    read: each piece then gets its share of them by rows, which is exact for the estimate's
    synthetic batch, whose rows are alike."""
    rows = batch.input_ids.shape[0]
    count = max(1, min(pieces, rows))
    sizes = [rows // count + (i < rows % count) for i in range(count)]
    out, start = [], 0
    for size in sizes:
        stop = start + size
        out.append(_rows(batch, start, stop))
        start = stop
    return out


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    cut = [t[start:stop] for t in (batch.input_ids, batch.targets, batch.position_ids)]
    return _piece(batch, cut, stop - start, batch.input_ids.shape[0])


def token_slice(batch: Batch, start: int, stop: int) -> Batch:
    """Positions [start, stop) of every row. Under fake tensors the slice gets its share of the
    trained positions by tokens (exact for the estimate's synthetic batch, trained everywhere alike)."""
    cut = [t[:, start:stop] for t in (batch.input_ids, batch.targets, batch.position_ids)]
    return _piece(batch, cut, stop - start, batch.input_ids.shape[1])


def _piece(batch: Batch, cut: list, part: int, whole: int) -> Batch:
    """A batch of the cut tensors; under fake tensors, whose trained positions cannot be read, with
    `part` / `whole` of the batch's trained positions."""
    if not is_fake(batch.targets):
        return Batch(*cut, segmented=batch.segmented)
    share = batch.num_targets * part // max(whole, 1)
    trained = batch.trained_positions[:share] if batch.trained_positions is not None else None
    return Batch(*cut, trained_positions=trained, num_targets=share, segmented=batch.segmented)
