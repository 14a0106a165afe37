"""RowGrads against the dense accumulator it stands for: every number bit for bit after several
index_add_ calls with repeated ids (as micro-batches add an embedding's rows), its tiles, its norm,
and bytes that depend on the ids' count only (the planner's fake step holds the same)."""

import pytest
import torch

from slimtune.optim.row_grads import RowGrads


@pytest.mark.quick
def test_touched_rows_sum_as_the_dense_accumulator_does_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    rows, width = 50, 24
    dense, sparse = torch.zeros(rows, width), RowGrads(rows, width, torch.float32, torch.device("cpu"))
    for n in (30, 7, 64):  # three micro-batches, ids repeated within and across them
        ids = torch.randint(0, rows, (n,), generator=g)
        values = torch.randn(n, width, generator=g) * 10 ** torch.randint(-3, 3, (n, 1), generator=g)
        dense.index_add_(0, ids, values)
        sparse.index_add_(0, ids, values)
    flat, out = dense.view(-1), torch.empty(rows * width)
    for start in range(0, rows * width, 100):  # tiles that start and stop inside rows
        stop = min(start + 100, rows * width)
        assert torch.equal(sparse.tile(start, stop, out[: stop - start]), flat[start:stop])
    # the zero rows add nothing, but the squares are summed in another order: equal to fp32 rounding
    torch.testing.assert_close(sparse.norm(), torch.linalg.vector_norm(dense), rtol=1e-6, atol=0)
    assert sparse.nbytes() == min(30 + 7 + 64, rows) * width * 4  # a row a received id, at most the table
    assert sparse.numel() == rows * width  # what a sum across ranks would carry
    sparse.zero_()
    assert torch.count_nonzero(sparse.tile(0, rows * width, out)) == 0
