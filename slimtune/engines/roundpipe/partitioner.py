"""The partition of a sequential model into RoundPipe stages, from per-layer costs (roundpipe.md 2.6).

Costs. Layer i costs `forward` per micro-batch in a forward stage (which is also its recompute in a
backward stage) and `forward + backward` in the fused tail or a backward stage (stages.Stage.time).
A stage may hold at most `memory_cap` bytes (weights, buffers, trainable gradients) on a worker.

Objective. Micro-batches flow from job to job, so the slowest stage paces the rotation: with n
stages of largest time W a step keeps the N workers busy for about n * M * W / N, but with fewer
stages than workers some sit idle, so a partition costs max(n, min_stages) * W (min_stages
defaults to the worker count). Wider stages mean fewer jobs at a slower pace: the objective
trades the two.

Search. Let T be the largest single-layer time, the larger of its two kinds (forward + backward,
since every layer sits in the tail or in a backward stage). No partition has W below T. For each
candidate W, the contiguous-range sums (of forward costs and of forward + backward costs) that lie
in [T, threshold * T], we build the partition with the fewest stages whose stages all take <= W:
  tail      from the last layer (the LM head + loss) downwards while the fused range fits W and
            the cap; it always holds at least the last layer;
  forward   [0, e) cut greedily from layer e - 1 downwards, each stage as long as fits, then
            listed ascending;
  backward  [0, e) cut greedily from layer 0 upwards, then listed deepest first.
Greedy cutting of a prefix gives the fewest stages under a bound, and the fewest stages only grow
with e, so the longest tail is also right. The best partition's own W is one of the candidates,
and the greedy one built for it has no more stages and no larger W: so the cheapest candidate is
optimal among partitions whose stages all take <= threshold * T (brute_force checks this).
Ties go to fewer stages, then smaller W.

Token shards (max_tail_shards > 1). A tail of the last layer alone may be cut by tokens into k jobs
(stages.py), each of 1/k of its time. For each k the search above runs again with the last layer's
time divided by k (so T, the candidates and the bound are those of the cheaper head) and the tail
held to the last layer; a partition of k shards counts k tail stages. With a large vocabulary the
LM head + loss is several blocks' worth (modelled: 5.7 for Qwen3-1.7B): unsharded it fixes
W >= T, so few, long stages whose times cannot all match; sharded, W can come down to a block's.

Cost. O(L^2) candidate widths, an O(L) greedy pass for each, every range time computed once
(math.fsum, O(L)) and cached: O(L^3) in the worst case, far less when a stage holds few layers.
Range times use math.fsum because it is correctly rounded: a range has one time whichever end it
is grown from, and longer ranges never take less, which the optimality argument above needs in
floating point too. They may differ from Stage.time (a plain sum) in the last bit.

LayerTimes keeps the per-layer estimates the runtime measures; costs_from_bytes gives the
starting estimates before anything has been measured.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

from slimtune.engines.roundpipe.stages import LayerCost, Partition, Stage, StageKind


class _Spans:
    """Range times and memories of one cost vector, each range's time computed once."""

    def __init__(self, costs: Sequence[LayerCost]):
        _check_costs(costs)
        self.costs = list(costs)
        self.layers = len(self.costs)
        self._memory = list(itertools.accumulate((c.memory for c in self.costs), initial=0))
        self._times: dict[tuple[bool, int, int], float] = {}
        # every layer's time as its backward stage or the tail counts it: the lower bound on any W
        self.largest = max(self.time("backward", i, i + 1) for i in range(self.layers))

    def largest_of(self, kind: StageKind, end: int) -> float:
        """The largest single-layer time of `kind` in [0, end): no bound below it covers the range."""
        return max(self.time(kind, i, i + 1) for i in range(end))

    def time(self, kind: StageKind, start: int, stop: int) -> float:
        key = (kind == "forward", start, stop)
        if key not in self._times:
            layers = self.costs[start:stop]
            parts = [c.forward for c in layers] if key[0] else [x for c in layers for x in (c.forward, c.backward)]
            self._times[key] = math.fsum(parts)
        return self._times[key]

    def memory(self, start: int, stop: int) -> int:
        return self._memory[stop] - self._memory[start]

    def fits(self, kind: StageKind, start: int, stop: int, width: float, cap: int | None) -> bool:
        return self.time(kind, start, stop) <= width and (cap is None or self.memory(start, stop) <= cap)


def _check_costs(costs: Sequence[LayerCost]) -> None:
    if not costs:
        raise ValueError("the partitioner needs at least one layer cost, got none.")
    for i, c in enumerate(costs):
        # negative or NaN times would break the monotonicity the greedy relies on
        if not (0 <= c.forward < math.inf and 0 <= c.backward < math.inf and c.memory >= 0):
            raise ValueError(f"layer {i} has cost {c}: times must be finite and >= 0, memory >= 0.")


def _check_memory(costs: Sequence[LayerCost], memory_cap: int | None) -> None:
    if memory_cap is None:
        return
    for i, c in enumerate(costs):
        if c.memory > memory_cap:
            raise ValueError(
                f"layer {i} needs {c.memory} bytes (weights, buffers and trainable gradients), more than "
                f"the memory cap of {memory_cap} bytes per stage, so no partition fits."
            )


def _floor(workers: int, min_stages: int | None, threshold: float) -> int:
    """The stage count below which fewer stages stop paying (min_stages, else workers), the knobs checked."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}.")
    if not threshold >= 1:
        raise ValueError(f"threshold must be at least 1 (W is never below the largest layer), got {threshold}.")
    floor = workers if min_stages is None else min_stages
    if floor < 1:
        raise ValueError(f"min_stages must be at least 1, got {min_stages}.")
    return floor


def _job_time(spans: _Spans, stage: Stage) -> float:
    """A job of `stage`: its range time, a token shard's share of it for a sharded tail."""
    return spans.time(stage.kind, stage.start, stage.stop) / stage.shards


def width(partition: Partition, costs: Sequence[LayerCost]) -> float:
    """W: the partition's largest job time (range times as the partitioner computes them)."""
    spans = _Spans(costs)
    return max(_job_time(spans, s) for s in partition.stages())


def objective(partition: Partition, costs: Sequence[LayerCost], min_stages: int) -> float:
    """What plan_stages minimises: max(#stages, min_stages) * W."""
    return max(len(partition.stages()), min_stages) * width(partition, costs)


def _candidates(spans: _Spans, threshold: float) -> list[float]:
    """Every contiguous-range sum of either kind within [T, threshold * T], ascending."""
    low, high = spans.largest, threshold * spans.largest
    found: set[float] = set()
    for kind in ("forward", "backward"):
        for start in range(spans.layers):
            for stop in range(start + 1, spans.layers + 1):
                t = spans.time(kind, start, stop)
                if t > high:
                    break  # longer ranges from this start only take longer
                if t >= low:
                    found.add(t)
    return sorted(found)


def _cover_downward(spans: _Spans, end: int, bound: float, cap: int | None) -> list[Stage]:
    """Forward stages over [0, end), cut from the top: each as long as the bound allows."""
    stages, stop = [], end
    while stop > 0:
        start = stop - 1  # a single layer always fits: bound >= T and no layer exceeds the cap
        while start > 0 and spans.fits("forward", start - 1, stop, bound, cap):
            start -= 1
        stages.append(Stage("forward", start, stop))
        stop = start
    return stages[::-1]


def _cover_upward(spans: _Spans, end: int, bound: float, cap: int | None) -> list[Stage]:
    """Backward stages over [0, end), cut from layer 0 up, listed deepest first (their run order)."""
    stages, start = [], 0
    while start < end:
        stop = start + 1
        while stop < end and spans.fits("backward", start, stop + 1, bound, cap):
            stop += 1
        stages.append(Stage("backward", start, stop))
        start = stop
    return stages[::-1]


def _greedy(spans: _Spans, bound: float, cap: int | None, shards: int = 1) -> Partition:
    """The partition with the fewest stages whose stages all take <= bound; with shards > 1 the
    tail is the last layer alone, cut into that many token shards (the bound was chosen for them)."""
    count = spans.layers
    e = count - 1
    while shards == 1 and e > 0 and spans.fits("tail", e - 1, count, bound, cap):
        e -= 1
    forward = _cover_downward(spans, e, bound, cap)
    backward = _cover_upward(spans, e, bound, cap)
    return Partition(tuple(forward), Stage("tail", e, count, shards), tuple(backward))


def _score(spans: _Spans, partition: Partition, floor: int) -> tuple[float, int, float]:
    """(objective, #stages, W): compared as a tuple, so ties go to fewer stages, then smaller W."""
    stages = partition.stages()
    w = max(_job_time(spans, s) for s in stages)
    return max(len(stages), floor) * w, len(stages), w


def _head_sharded(spans: _Spans, shards: int) -> list[LayerCost]:
    """The costs with the last layer as one of `shards` token shards: its whole time (forward +
    backward, as the tail runs it) divided, so that its range time is bit for bit _job_time's."""
    last, whole = spans.costs[-1], spans.time("tail", spans.layers - 1, spans.layers)
    return [*spans.costs[:-1], LayerCost(whole / shards, 0.0, last.memory)]


def _shard_counts(spans: _Spans, max_tail_shards: int, min_tail_shards: int = 1) -> range:
    if not 1 <= min_tail_shards <= max_tail_shards:
        raise ValueError(f"min_tail_shards and max_tail_shards must satisfy 1 <= min <= max, got {min_tail_shards}"
                         f" and {max_tail_shards}.")
    if spans.layers <= 1:  # a one-layer model has no head alone to cut
        return range(1, 2)
    return range(min_tail_shards, max_tail_shards + 1)


def plan_stages(
    costs: Sequence[LayerCost],
    workers: int,
    memory_cap: int | None = None,
    min_stages: int | None = None,
    threshold: float = 1.1,
    max_tail_shards: int = 1,
    min_tail_shards: int = 1,
) -> Partition:
    """The partition minimising max(#stages, min_stages) * W over the candidate widths and tail
    shard counts from min_tail_shards to max_tail_shards (module docstring; both equal: that count
    only). Raises ValueError if a single layer exceeds memory_cap."""
    spans, floor = _Spans(costs), _floor(workers, min_stages, threshold)
    _check_memory(spans.costs, memory_cap)
    best: tuple[tuple[float, int, float], Partition] | None = None
    for shards in _shard_counts(spans, max_tail_shards, min_tail_shards):
        view = spans if shards == 1 else _Spans(_head_sharded(spans, shards))
        for bound in _candidates(view, threshold):  # never empty: T itself is a single-layer sum
            partition = _greedy(spans, bound, memory_cap, shards)
            key = _score(spans, partition, floor)
            if best is None or key < best[0]:
                best = key, partition
    assert best is not None
    partition = _evened(spans, best[1], memory_cap)
    partition.check()
    return partition


def _evened(spans: _Spans, partition: Partition, cap: int | None) -> Partition:
    """The same stage counts with the forward and the backward layers spread as evenly as they go.
    Greedy cutting leaves a short remainder stage (forward 1, 9, 9, 9 where 7, 7, 7, 8 fit as well);
    the objective does not see it, but a short stage is a hole in the rotation: each worker then
    waits for the long stage before it. For each of the two ranges: the smallest bound under which
    it still takes no more stages, then, under that bound, the cut with the least sum of squared
    stage times (an exact dynamic programme). No stage gets longer, so the objective is unchanged."""
    e = partition.tail.start
    forward = _even_cover(spans, "forward", e, len(partition.forward), cap)
    backward = _even_cover(spans, "backward", e, len(partition.backward), cap)
    return Partition(tuple(forward), partition.tail, tuple(reversed(backward)))


def _even_cover(spans: _Spans, kind: StageKind, end: int, count: int, cap: int | None) -> list[Stage]:
    """[0, end) in at most `count` stages of `kind`, ascending: least max stage time, then least sum
    of squares."""
    if end == 0:
        return []
    cover = _cover_downward if kind == "forward" else _cover_upward
    sums = sorted({spans.time(kind, a, b) for a in range(end) for b in range(a + 1, end + 1)})
    floor = spans.largest_of(kind, end)  # below it a single layer would not fit (cover assumes it does)
    low, high = 0, len(sums) - 1  # the smallest bound whose greedy cover needs <= count stages
    while low < high:
        mid = (low + high) // 2
        if sums[mid] >= floor and len(cover(spans, end, sums[mid], cap)) <= count:
            high = mid
        else:
            low = mid + 1
    bound = sums[low]
    return _least_squares(spans, kind, end, count, bound, cap)


def _least_squares(spans: _Spans, kind: StageKind, end: int, count: int, bound: float,
                   cap: int | None) -> list[Stage]:
    """The cut of [0, end) into at most `count` stages, each within `bound` and the cap, with the
    least sum of squared stage times: best[j][i] covers layers [0, i) with j stages."""
    inf = (math.inf, None)
    best = [[inf] * (end + 1) for _ in range(count + 1)]
    best[0][0] = (0.0, None)
    for j in range(1, count + 1):
        for i in range(1, end + 1):
            for a in range(i - 1, -1, -1):
                if not spans.fits(kind, a, i, bound, cap):
                    break  # longer ranges ending at i only take longer (or hold more)
                if best[j - 1][a][0] < math.inf:
                    t = spans.time(kind, a, i)
                    value = best[j - 1][a][0] + t * t
                    if value < best[j][i][0]:
                        best[j][i] = (value, a)
    j = min(range(1, count + 1), key=lambda k: best[k][end][0])
    stages, i = [], end
    while i > 0:
        a = best[j][i][1]
        stages.append(Stage(kind, a, i))
        i, j = a, j - 1
    return stages[::-1]


def _cuts(kind: StageKind, end: int) -> Iterator[list[Stage]]:
    """Every way to cut [0, end) into contiguous stages, ascending."""
    inner = range(1, end)
    for r in range(len(inner) + 1):
        for chosen in itertools.combinations(inner, r):
            bounds = [0, *chosen, end] if end else [0]
            yield [Stage(kind, a, b) for a, b in zip(bounds, bounds[1:])]


def _valid_cuts(
    spans: _Spans, kind: StageKind, end: int, limit: float, cap: int | None
) -> list[tuple[list[Stage], float]]:
    """The cuts of [0, end) whose stages all fit, each with its largest stage time."""
    found = []
    for stages in _cuts(kind, end):
        if all(spans.fits(kind, s.start, s.stop, limit, cap) for s in stages):
            found.append((stages, max((spans.time(kind, s.start, s.stop) for s in stages), default=0.0)))
    return found


def brute_force(
    costs: Sequence[LayerCost],
    workers: int,
    memory_cap: int | None = None,
    min_stages: int | None = None,
    threshold: float = 1.1,
    max_tail_shards: int = 1,
) -> tuple[float, Partition]:
    """For tests: the minimal objective over every partition whose jobs all take <= threshold * T
    (T of its own shard count) and fit memory_cap, a tail of the last layer alone cut into up to
    max_tail_shards token shards, and a partition achieving it (ties as plan_stages breaks them).
    Exponential: about 4^L partitions, so keep L <= 10."""
    spans, floor = _Spans(costs), _floor(workers, min_stages, threshold)
    _check_memory(spans.costs, memory_cap)
    count = spans.layers
    best: tuple[tuple[float, int, float], Partition] | None = None
    for shards in _shard_counts(spans, max_tail_shards):
        limit = threshold * _Spans(_head_sharded(spans, shards)).largest
        for e in range(count) if shards == 1 else [count - 1]:
            tail = Stage("tail", e, count, shards)
            tail_time = _job_time(spans, tail)
            if tail_time > limit or not spans.fits("tail", e, count, math.inf, memory_cap):
                continue
            for (fwd, f_w), (bwd, b_w) in itertools.product(
                _valid_cuts(spans, "forward", e, limit, memory_cap), _valid_cuts(spans, "backward", e, limit, memory_cap)
            ):
                n, w = len(fwd) + shards + len(bwd), max(f_w, tail_time, b_w)
                key = (max(n, floor) * w, n, w)
                if best is None or key < best[0]:
                    best = key, Partition(tuple(fwd), tail, tuple(reversed(bwd)))
    assert best is not None  # the all-single-layer partition always fits
    return best[0][0], best[1]


def costs_from_bytes(layer_bytes: Sequence[int], trainable: Sequence[bool] | None = None) -> list[LayerCost]:
    """Starting estimates before any timing (roundpipe.md 2.6): forward proportional to the layer's
    bytes, backward twice its forward, memory its bytes plus, for a trainable layer, as many bytes
    again for its gradients (gradients are assumed the same dtype and size as the weights).
    trainable None means every layer is trainable."""
    flags = [True] * len(layer_bytes) if trainable is None else list(trainable)
    if len(flags) != len(layer_bytes):
        raise ValueError(f"trainable has {len(flags)} entries for {len(layer_bytes)} layers; give one per layer.")
    for i, n in enumerate(layer_bytes):
        if n < 0:
            raise ValueError(f"layer {i} has {n} bytes; sizes must be >= 0.")
    # the unit is arbitrary: only ratios matter to the partitioner until measured times replace these
    return [LayerCost(float(n), 2.0 * n, n * (2 if t else 1)) for n, t in zip(layer_bytes, flags)]


class LayerTimes:
    """Per-layer times the runtime measures, smoothed: an exponential moving average of decay 0.9,
    bias-corrected (divided by 1 - 0.9^k after k kept observations, so early estimates are not
    pulled towards zero), the first observation of each layer dropped (it pays one-off warm-up:
    allocator growth, kernel selection). Until a layer has a kept observation its initial cost
    stands; the runtime observes every layer each step, so all layers switch from the initial
    (modelled) units to seconds in the same step."""

    DECAY = 0.9

    def __init__(self, layers: int, initial: Sequence[LayerCost]):
        if len(initial) != layers:
            raise ValueError(f"LayerTimes got {len(initial)} initial costs for {layers} layers; give one per layer.")
        self._initial = list(initial)
        self._seen = [0] * layers  # observations so far, the dropped first one included
        self._forward = [0.0] * layers  # biased averages, corrected in costs()
        self._backward = [0.0] * layers

    def observe(self, layer: int, forward_s: float, backward_s: float) -> None:
        """One measured step of `layer`: its forward (= recompute) and its backward alone, seconds
        per micro-batch."""
        if not 0 <= layer < len(self._initial):
            raise ValueError(f"layer {layer} is out of range for {len(self._initial)} layers.")
        if not (0 <= forward_s < math.inf and 0 <= backward_s < math.inf):
            raise ValueError(f"layer {layer} timings must be finite and >= 0, got {forward_s}, {backward_s}.")
        self._seen[layer] += 1
        if self._seen[layer] == 1:
            return
        d = self.DECAY
        self._forward[layer] = d * self._forward[layer] + (1 - d) * forward_s
        self._backward[layer] = d * self._backward[layer] + (1 - d) * backward_s

    def costs(self) -> list[LayerCost]:
        """Current estimates, memory as in the initial costs."""
        out = []
        for i, initial in enumerate(self._initial):
            kept = self._seen[i] - 1
            if kept < 1:
                out.append(initial)
                continue
            correction = 1 - self.DECAY**kept
            out.append(LayerCost(self._forward[i] / correction, self._backward[i] / correction, initial.memory))
        return out
