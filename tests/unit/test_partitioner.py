"""The RoundPipe partitioner (roundpipe.md 2.6 and 5): valid, bounded partitions; the objective of
an exhaustive search; the forward/backward asymmetry on an LLM; per-layer timing estimates."""

from __future__ import annotations

import random

import pytest

from slimtune.engines.roundpipe.partitioner import (
    LayerTimes,
    brute_force,
    costs_from_bytes,
    objective,
    plan_stages,
    width,
)
from slimtune.engines.roundpipe.stages import LayerCost, Partition, Stage

REL = 1e-12  # Stage.time is a plain sum, the partitioner's an exact one: they may differ in the last bit


def _largest_layer(costs, shards: int = 1):
    """T: the largest single-layer time, the last layer's as one of `shards` token shards."""
    whole = [c.forward + c.backward for c in costs]
    return max(whole[:-1] + [whole[-1] / shards])


def _random_costs(rng: random.Random, layers: int, integer: bool) -> list[LayerCost]:
    costs = []
    for _ in range(layers):
        if integer:  # small integers: many equal sums, so ties are exercised
            costs.append(LayerCost(rng.randint(0, 3), rng.randint(0, 6), rng.randint(0, 5)))
        else:
            f = rng.uniform(0.1, 2.0)
            costs.append(LayerCost(f, f * rng.uniform(1.0, 3.0), rng.randint(1, 100)))
    if rng.random() < 0.5:  # an LM head: heavier than the blocks
        f = max(c.forward for c in costs) * 3 or 1
        costs[-1] = LayerCost(f, 2 * f, costs[-1].memory)
    if all(c.forward + c.backward == 0 for c in costs):
        costs[0] = LayerCost(1, 1, costs[0].memory)
    return costs


def _random_cap(rng: random.Random, costs):
    if rng.random() < 0.4:
        return None
    memories = [c.memory for c in costs]
    return rng.randint(max(memories), max(max(memories), sum(memories)))


def _check_bounds(partition: Partition, costs, cap, threshold):
    partition.check()
    assert partition.layers == len(costs)
    t = _largest_layer(costs, partition.tail.shards)
    times = [s.time(costs) for s in partition.stages()]
    for stage, time in zip(partition.stages(), times):
        assert time <= threshold * t * (1 + REL), (stage, time, t)
        if cap is not None:
            assert stage.memory(costs) <= cap, stage
    assert t * (1 - REL) <= max(times) <= threshold * t * (1 + REL)
    assert width(partition, costs) == pytest.approx(max(times), rel=REL)


@pytest.mark.parametrize("threshold", [1.0, 1.1, 1.5])
def test_partitions_are_valid_and_bounded(threshold):
    rng = random.Random(1234)
    for case in range(60):
        costs = _random_costs(rng, rng.randint(1, 40), integer=case % 3 == 0)
        cap = _random_cap(rng, costs)
        workers = rng.choice([1, 2, 4, 8])
        _check_bounds(plan_stages(costs, workers, memory_cap=cap, threshold=threshold), costs, cap, threshold)


def _key(partition: Partition, costs, floor):
    """(objective, #stages, W) from Stage.time, independently of the partitioner's helpers."""
    n, w = len(partition.stages()), max(s.time(costs) for s in partition.stages())
    return max(n, floor) * w, n, w


@pytest.mark.parametrize("integer", [False, True])
def test_objective_equals_brute_force(integer):
    rng = random.Random(99 + integer)
    for _ in range(150):
        layers = rng.randint(1, 10)
        costs = _random_costs(rng, layers, integer)
        cap = _random_cap(rng, costs)
        workers = rng.choice([1, 2, 3, 4, 8])
        min_stages = rng.choice([None, None, 1, layers + 3])
        threshold = rng.choice([1.0, 1.1, 1.1, 1.3, 2.0])
        shards = rng.choice([1, 1, 2, 3, 4])  # how many token shards the tail may be cut into
        floor = workers if min_stages is None else min_stages

        best, exhaustive = brute_force(costs, workers, cap, min_stages, threshold, shards)
        plan = plan_stages(costs, workers, cap, min_stages, threshold, shards)
        assert plan.tail.shards == exhaustive.tail.shards <= shards
        _check_bounds(exhaustive, costs, cap, threshold)
        _check_bounds(plan, costs, cap, threshold)
        assert objective(exhaustive, costs, floor) == best
        # same objective, and the same tie-breaks: fewer stages, then the smaller W
        assert objective(plan, costs, floor) == best
        assert len(plan.stages()) == len(exhaustive.stages())
        assert width(plan, costs) == width(exhaustive, costs)
        assert _key(plan, costs, floor) == pytest.approx(_key(exhaustive, costs, floor), rel=REL)


def test_a_heavy_head_is_cut_into_token_shards_when_that_lowers_the_objective():
    costs = [LayerCost(1.0, 2.0)] * 8 + [LayerCost(6.0, 12.0)]  # the head: six blocks' worth
    whole = plan_stages(costs, workers=4)
    cut = plan_stages(costs, workers=4, max_tail_shards=8)
    assert whole.tail.shards == 1 and width(whole, costs) >= 18.0
    assert cut.tail.shards > 1 and cut.tail.stop - cut.tail.start == 1
    # six shards of 3.0 each, as long as a block's backward stage: W drops from 18 to 3, 17 jobs
    assert cut.tail.shards == 6 and width(cut, costs) == 3.0 and len(cut.stages()) == 17
    assert objective(cut, costs, 4) == 51.0 < objective(whole, costs, 4) == 72.0
    light = [LayerCost(1.0, 2.0)] * 9  # a head no heavier than a block gains nothing from a cut
    assert plan_stages(light, workers=4, max_tail_shards=8).tail.shards == 1


def test_only_a_one_layer_tail_may_be_cut_and_the_slices_cover_every_token():
    from slimtune.engines.roundpipe.stages import token_range, uniform_partition

    with pytest.raises(ValueError, match="last layer alone"):
        uniform_partition(6, 2, 1, tail_layers=2, tail_shards=2)
    with pytest.raises(ValueError, match="max_tail_shards"):
        plan_stages([LayerCost(1.0, 2.0)] * 3, workers=2, max_tail_shards=0)
    for tokens in (0, 1, 7, 12, 2048):
        for shards in (1, 2, 3, 5, 15):
            ranges = [token_range(tokens, s, shards) for s in range(shards)]
            assert ranges[0][0] == 0 and ranges[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [b - a for a, b in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_shard_count_pinned_by_min_and_max_is_the_one_planned():
    """roundpipe's replans keep the first cut's tail shard count (token shards change the order of the
    head's sums): min_tail_shards = max_tail_shards = k plans exactly k shards, whatever count the
    free choice would make; the free choice itself is one of those."""
    costs = [LayerCost(0.1, 0.2, 1), *[LayerCost(1, 2, 10)] * 4, LayerCost(3, 6, 5)]  # a heavy head
    free = plan_stages(costs, workers=3, max_tail_shards=3)
    for k in (1, 2, 3):
        pinned = plan_stages(costs, workers=3, max_tail_shards=k, min_tail_shards=k)
        assert pinned.tail.shards == k
        if k == free.tail.shards:
            assert pinned == free
    with pytest.raises(ValueError, match="min_tail_shards"):
        plan_stages(costs, workers=3, max_tail_shards=2, min_tail_shards=3)


def test_a_hand_planned_model():
    # embedding, two blocks, LM head; T = 9 (the head), and no range sum lies in (9, 9.9]
    costs = [LayerCost(0.1, 0.2, 1), LayerCost(1, 2, 10), LayerCost(1, 2, 10), LayerCost(3, 6, 5)]
    assert plan_stages(costs, workers=1) == Partition(
        (Stage("forward", 0, 3),), Stage("tail", 3, 4), (Stage("backward", 0, 3),)
    )
    # a cap of 15 bytes allows no two blocks together, nor the embedding with both
    assert plan_stages(costs, workers=1, memory_cap=15) == Partition(
        (Stage("forward", 0, 2), Stage("forward", 2, 3)),
        Stage("tail", 3, 4),
        (Stage("backward", 2, 3), Stage("backward", 0, 2)),
    )
    assert objective(plan_stages(costs, workers=1, memory_cap=15), costs, 1) == 5 * 9
    # eight workers: four stages still cost as eight, so W = 9 stands
    assert objective(plan_stages(costs, workers=8), costs, 8) == 8 * 9


def test_min_stages_decides_between_few_wide_and_many_narrow_stages():
    # eight blocks (5 each in backward), a head of 9 = T; W may reach 2T
    costs = [LayerCost(1, 4)] * 8 + [LayerCost(3, 6)]
    # one worker: W = 10 pairs the blocks in backward: 6 stages, 60 (W = 9 would take 10 stages, 90)
    few = plan_stages(costs, workers=1, threshold=2.0)
    assert (width(few, costs), len(few.stages())) == (10, 6)
    assert [len(s.layers) for s in few.backward] == [2, 2, 2, 2]
    # thirty workers: every plan costs 30 W, so the smallest W wins
    many = plan_stages(costs, workers=30, threshold=2.0)
    assert (width(many, costs), len(many.stages())) == (9, 10)
    # min_stages overrides the worker count
    assert plan_stages(costs, workers=30, min_stages=1, threshold=2.0) == few


def test_equal_objectives_go_to_fewer_stages():
    # with W up to 2T, W = 8 (5 stages) and W = 10 (4 stages) both cost 40 on one worker
    costs = [LayerCost(2, 0), LayerCost(1, 7), LayerCost(2, 4), LayerCost(4, 4)]
    plan = plan_stages(costs, workers=1, threshold=2.0)
    assert (objective(plan, costs, 1), len(plan.stages()), width(plan, costs)) == (40, 4, 10)
    best, exhaustive = brute_force(costs, workers=1, threshold=2.0)
    assert (best, len(exhaustive.stages())) == (40, 4)


def _llama(blocks: int = 28) -> list[LayerCost]:
    """Embedding (cheap), equal decoder blocks, the LM head + loss at 3x a block; backward 2x forward."""
    return [LayerCost(0.05, 0.1, 1)] + [LayerCost(1.0, 2.0, 10)] * blocks + [LayerCost(3.0, 6.0, 20)]


def test_llm_forward_stages_hold_about_three_times_the_layers():
    costs = _llama()
    plan = plan_stages(costs, workers=8)
    _check_bounds(plan, costs, None, 1.1)
    # the LM head alone in the tail: with any block beside it the tail would take 12 > 1.1 * 9
    assert plan.tail == Stage("tail", 29, 30)
    # the shape of the spec's Qwen3-1.7B example: 4 forward stages, head, 10 backward of 2-3 layers
    assert len(plan.forward) == 4 and len(plan.backward) == 10
    assert {len(s.layers) for s in plan.backward} <= {2, 3}
    per_forward = sum(len(s.layers) for s in plan.forward) / len(plan.forward)
    per_backward = sum(len(s.layers) for s in plan.backward) / len(plan.backward)
    assert 2.0 <= per_forward / per_backward <= 3.5
    assert width(plan, costs) == 9.0


def test_a_layer_over_the_cap_is_named():
    costs = [LayerCost(1, 2, 10), LayerCost(1, 2, 10), LayerCost(1, 2, 999), LayerCost(3, 6, 10)]
    with pytest.raises(ValueError, match=r"layer 2 needs 999 bytes.*cap of 500 bytes"):
        plan_stages(costs, workers=2, memory_cap=500)
    with pytest.raises(ValueError, match=r"layer 2 needs 999 bytes"):
        brute_force(costs, workers=2, memory_cap=500)
    plan_stages(costs, workers=2, memory_cap=999)  # exactly at the cap fits


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one layer"):
        plan_stages([], workers=2)
    with pytest.raises(ValueError, match="layer 1 has cost"):
        plan_stages([LayerCost(1, 1), LayerCost(-1, 1)], workers=2)
    with pytest.raises(ValueError, match="threshold"):
        plan_stages([LayerCost(1, 1)], workers=2, threshold=0.9)


def test_costs_from_bytes():
    costs = costs_from_bytes([100, 400, 50], trainable=[True, False, True])
    assert [c.forward for c in costs] == [100, 400, 50]
    assert [c.backward for c in costs] == [200, 800, 100]
    assert [c.memory for c in costs] == [200, 400, 100]  # the frozen layer carries no gradient
    assert [c.memory for c in costs_from_bytes([100, 400])] == [200, 800]
    with pytest.raises(ValueError, match="one per layer"):
        costs_from_bytes([1, 2], trainable=[True])


def test_layer_times_average_after_dropping_the_first_step():
    initial = [LayerCost(5.0, 10.0, 7), LayerCost(6.0, 12.0, 8)]
    times = LayerTimes(2, initial)
    times.observe(0, 100.0, 100.0)  # warm-up: dropped
    assert times.costs() == initial
    times.observe(0, 1.0, 3.0)
    # one kept step: (0.1 * 1) / (1 - 0.9) = 1 exactly, so the estimate is the measurement
    assert times.costs()[0] == LayerCost(pytest.approx(1.0), pytest.approx(3.0), 7)
    times.observe(0, 2.0, 5.0)
    # two kept: (0.9 * 0.1 * x1 + 0.1 * x2) / (1 - 0.81)
    assert times.costs()[0].forward == pytest.approx((0.09 * 1 + 0.1 * 2) / 0.19)
    assert times.costs()[0].backward == pytest.approx((0.09 * 3 + 0.1 * 5) / 0.19)
    assert times.costs()[0].memory == 7
    assert times.costs()[1] == initial[1]  # never measured
    times.observe(1, 50.0, 50.0)
    assert times.costs()[1] == initial[1]  # its first step, dropped
    with pytest.raises(ValueError, match="out of range"):
        times.observe(2, 1.0, 1.0)
    with pytest.raises(ValueError, match="one per layer"):
        LayerTimes(3, initial)


def test_layer_times_converge_to_a_steady_measurement():
    times = LayerTimes(1, [LayerCost(1.0, 2.0)])
    for _ in range(200):
        times.observe(0, 0.25, 0.5)
    assert times.costs()[0].forward == pytest.approx(0.25) and times.costs()[0].backward == pytest.approx(0.5)


def test_the_chosen_counts_are_spread_evenly_without_changing_the_objective():
    """28 equal blocks and a head 3x a block: greedy cutting leaves a short remainder stage
    (e.g. forward 1, 9, 9, 9); the plan spreads the same stage counts evenly (7, 7, 7, 7)."""
    from slimtune.engines.roundpipe import partitioner as p

    costs = [LayerCost(1.0, 2.0, 1)] * 28 + [LayerCost(3.0, 6.0, 1)]
    plan = plan_stages(costs, 8)
    spans = p._Spans(costs)
    greedy = min((p._greedy(spans, w, None) for w in p._candidates(spans, 1.1)),
                 key=lambda q: p._score(spans, q, 8))
    assert len(plan.forward) == len(greedy.forward) and len(plan.backward) == len(greedy.backward)
    assert p.objective(plan, costs, 8) == p.objective(greedy, costs, 8)
    for section in (plan.forward, plan.backward):
        sizes = [s.stop - s.start for s in section]
        assert max(sizes) - min(sizes) <= 1, sizes
    greedy_sizes = [s.stop - s.start for s in greedy.forward]
    assert max(greedy_sizes) - min(greedy_sizes) > 1  # what the evening-out is for
