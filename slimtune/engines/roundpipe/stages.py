"""The schedule as data: what a partitioner produces, a runtime executes and the simulator plays.

A model is L sequential layers (for an LLM: the embedding, each decoder block, then the final
norm + LM head + loss). A stage is a contiguous layer range [start, stop). A partition has
  forward stages   ascending over [0, e), run without gradients (their outputs go to the host);
  the fused tail   [e, L): forward, loss and backward per micro-batch, nothing recomputed;
  backward stages  covering [0, e) deepest first: each recomputes its layers from the input saved
                   in the forward and back-propagates the gradient arriving from above.
A job is one stage over all M micro-batches of a step, on one worker. A tail that is the last layer
alone (the final norm + LM head + loss, which treat every token on its own) may be cut by tokens
into `shards` jobs: shard s runs the tail on the s-th of `shards` nearly equal token slices of
every micro-batch, so a large vocabulary's head, often several blocks' worth, need not be one job
whose length every other stage must match (roundpipe.md 2.6: W >= the largest layer). Jobs take
workers from one global cursor in stage order (forward, tail, backward), so job j of a step runs
on worker (c0 + j) mod N and the cursor carries on into the next step. Job j's micro-batch m waits
only for job j-1's micro-batch m (a tail shard: the last forward job's; the job after the shards:
every shard's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

StageKind = Literal["forward", "tail", "backward"]


@dataclass(frozen=True)
class LayerCost:
    """One layer's cost per micro-batch: `forward` (its forward, which is also its recompute),
    `backward` (its backward alone, the recompute not included), and `memory` (bytes its stage must
    hold for it on a worker: weights and buffers, plus its trainable gradients)."""

    forward: float
    backward: float
    memory: int = 0


@dataclass(frozen=True)
class Stage:
    kind: StageKind
    start: int
    stop: int  # layers [start, stop)
    shards: int = 1  # the tail only: jobs it is cut into by tokens, each taking 1/shards of the time

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def time(self, costs: Sequence[LayerCost]) -> float:
        """Per micro-batch: a forward stage runs its layers' forwards; the tail runs forward and
        backward; a backward stage recomputes (a forward) and back-propagates."""
        layers = costs[self.start:self.stop]
        if self.kind == "forward":
            return sum(c.forward for c in layers)
        return sum(c.forward + c.backward for c in layers) / self.shards

    def memory(self, costs: Sequence[LayerCost]) -> int:
        return sum(c.memory for c in costs[self.start:self.stop])


@dataclass(frozen=True)
class Partition:
    forward: tuple[Stage, ...]  # ascending, covering [0, e)
    tail: Stage  # [e, L)
    backward: tuple[Stage, ...]  # deepest first, covering [0, e)

    @property
    def layers(self) -> int:
        return self.tail.stop

    def stages(self) -> list[Stage]:
        """In the order their jobs run in a step (a sharded tail once a shard)."""
        return [*self.forward, *[self.tail] * self.tail.shards, *self.backward]

    def check(self) -> None:
        """Raise ValueError unless the stages are as the module docstring says."""
        e, count = self.tail.start, self.tail.stop
        if not 0 <= e < count or self.tail.kind != "tail":
            raise ValueError(f"the tail must be a non-empty tail stage ending the model, got {self.tail}")
        if self.tail.shards < 1 or (self.tail.shards > 1 and count - e != 1):
            raise ValueError(f"only a tail of the last layer alone may be cut by tokens, got {self.tail}")
        if any(s.shards != 1 for s in (*self.forward, *self.backward)):
            raise ValueError("only the tail may be cut by tokens")
        _check_cover(list(self.forward), "forward", e)
        _check_cover(list(reversed(self.backward)), "backward", e)


def _check_cover(stages: list[Stage], kind: str, stop: int) -> None:
    at = 0
    for stage in stages:
        if stage.kind != kind or stage.start != at or stage.stop <= stage.start:
            raise ValueError(f"{kind} stages must cover [0, {stop}) in order without gaps, got {stages}")
        at = stage.stop
    if at != stop:
        raise ValueError(f"{kind} stages must cover [0, {stop}), they end at {at}")


def uniform_partition(layers: int, forward_per_stage: int, backward_per_stage: int, tail_layers: int = 1,
                      tail_shards: int = 1) -> Partition:
    """A partition by layer counts (for tests and hand-made plans): the last `tail_layers` layers
    fused (in `tail_shards` token shards), the rest cut into forward stages of `forward_per_stage`
    and backward stages of `backward_per_stage` layers (the last of each may be shorter)."""
    e = layers - tail_layers
    forward = tuple(Stage("forward", a, min(a + forward_per_stage, e)) for a in range(0, e, forward_per_stage))
    backward = tuple(Stage("backward", a, min(a + backward_per_stage, e)) for a in range(0, e, backward_per_stage))
    partition = Partition(forward, Stage("tail", e, layers, tail_shards), tuple(reversed(backward)))
    partition.check()
    return partition


@dataclass(frozen=True)
class Job:
    index: int  # its place in the step's stage order
    stage: Stage
    worker: int
    shard: int = 0  # a sharded tail's job: which token slice (of stage.shards) it runs


def token_range(tokens: int, shard: int, shards: int) -> tuple[int, int]:
    """[a, b): shard `shard`'s slice of `tokens` positions cut into `shards` nearly equal slices
    (the first tokens % shards slices one longer, as torch.tensor_split cuts)."""
    size, extra = divmod(tokens, shards)
    a = shard * size + min(shard, extra)
    return a, a + size + (1 if shard < extra else 0)


def assign(partition: Partition, workers: int, cursor: int = 0) -> tuple[list[Job], int]:
    """The step's jobs on workers from the global cursor, and the cursor after them."""
    stages = partition.stages()
    first_tail = len(partition.forward)
    jobs = [Job(j, stage, (cursor + j) % workers, j - first_tail if stage.kind == "tail" else 0)
            for j, stage in enumerate(stages)]
    return jobs, (cursor + len(jobs)) % workers


def actions_by_worker(jobs: list[Job], workers: int) -> list[list[Job]]:
    """Each worker's action list: its jobs in the order it runs them."""
    lists: list[list[Job]] = [[] for _ in range(workers)]
    for job in jobs:
        lists[job.worker].append(job)
    return lists
