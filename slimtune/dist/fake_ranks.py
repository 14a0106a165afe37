"""One rank of an fsdp job, for the planner: torch's fake process group (backend "fake", the one torch's
own distributed tests use) stands in for the other ranks, so the real fsdp step (fully_shard on the
model, as sharding.shard_model does on every rank) runs in this one process on fake tensors: every
collective returns at once and moves nothing, and each buffer FSDP allocates to gather a block or
reduce-scatter its gradients is allocated as it is on a rank, where the planner's meter sees it.

It is rank 0: FSDP2 cuts a weight into ceil(rows / ranks)-row shards, so rank 0 holds the largest
share of every weight (the last ranks less), and its peak is the job's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from slimtune.dist.ranks import Counting, Dist, SINGLE


def needed(cfg, ranks: int) -> bool:
    """Whether an estimate of `cfg` on `ranks` ranks runs as one rank of a fake job (fsdp only: under
    ddp a rank holds what one device holds alone)."""
    return cfg.dist.strategy == "fsdp" and ranks > 1


def available() -> bool:
    """A fake job can start here: no process group exists in this process (a planner asked from inside
    a launched job, which has one, weighs its fsdp plans by rank_plan's formula instead)."""
    import torch.distributed as tdist

    return tdist.is_available() and not tdist.is_initialized()


@contextlib.contextmanager
def rank_of(ranks: int) -> Iterator[Dist]:
    """Rank 0 of a fake job of `ranks` ranks for the duration: a Dist whose device group is the fake
    world (FSDP's mesh is made over it), whose own sums are counted, not sent (ranks.Counting)."""
    if ranks <= 1:
        yield SINGLE
        return
    import torch.distributed as tdist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield Counting(rank=0, world_size=ranks, local_world_size=ranks, device_group=tdist.group.WORLD)
    finally:
        tdist.destroy_process_group()
