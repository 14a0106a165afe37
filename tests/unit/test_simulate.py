"""The pipeline simulator (roundpipe.md 5): RoundPipe's rotation has no steady-state idle iff
M >= N, GPipe's bubble is (N-1)/(M+N-1), events are consistent, the paper's bubble table comes
out, and the CLI prints a table or refuses a bad option in one sentence."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

import pytest

from slimtune import cli
from slimtune.errors import UserError
from slimtune.engines.roundpipe import baselines, cost_model, simulate, timeline
from slimtune.engines.roundpipe.cost_model import Costs
from slimtune.engines.roundpipe.stages import LayerCost, uniform_partition

EPS = 1e-9


def uniform(layers: int, hop: float = 0.0, weight_bytes: int = 0, optimizer: float = 0.0, head=(1e-3, 2e-3)) -> Costs:
    """Every layer 1 ms forward, 2 ms backward (the last one `head`); no prefix layer."""
    costs = [LayerCost(1e-3, 2e-3)] * (layers - 1) + [LayerCost(*head)]
    nbytes = (weight_bytes,) * layers
    return Costs(tuple(costs), nbytes, nbytes, hop, 25.0, optimizer, label="test costs", kind="measured")


# 13 layers of (1, 2) ms: 4 forward stages of 3 layers, the tail and 12 one-layer backward stages
# all take 3 ms a micro-batch: the rotation of section 2.1 with t = 3 ms.
EVEN = uniform_partition(13, 3, 1)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_roundpipe_async_has_no_steady_state_idle_iff_micro_batches_at_least_workers(workers):
    costs = uniform(13)
    for m in (workers, workers + 1, 2 * workers):
        s = simulate.simulate_roundpipe(costs, workers, m, EVEN, "async")
        assert abs(s.bubble) < EPS and max(abs(i) for i in s.idle) < EPS * s.step_time, (workers, m, s.idle)
        assert s.step_time == pytest.approx(17 * m * 3e-3 / workers)  # all work, no gaps
    for m in range(1, workers):
        assert simulate.simulate_roundpipe(costs, workers, m, EVEN, "async").bubble > 1e-3, (workers, m)


def test_the_spare_micro_batch_absorbs_a_hop_uploads_and_the_optimizer():
    """M = N + 1 leaves t/N of slack a job: a hop below it, weight copies shorter than a job and an
    optimizer shorter than a step cost nothing in the async steady state; M = N has no slack."""
    costs = uniform(13, hop=0.3e-3, weight_bytes=25_000_000, optimizer=10e-3)  # 1 ms a layer's upload
    assert simulate.simulate_roundpipe(costs, 8, 9, EVEN, "async").bubble < EPS
    assert simulate.simulate_roundpipe(costs, 8, 8, EVEN, "async").bubble > 1e-3
    sync = simulate.simulate_roundpipe(costs, 8, 9, EVEN, "sync")
    assert sync.bubble > 0.1 and sync.step_time > 10e-3 + 17 * 9 * 3e-3 / 8


def test_an_update_layer_by_layer_hides_an_adamw_a_whole_update_cannot():
    """Async with a host AdamW of 40 ms against a 57 ms step: waiting for the whole update the step
    after next idles 5% of the time; with each upload waiting only for its own layers' update (the
    runtime's order) the same AdamW leaves none. Every upload still starts after its layers' update."""
    costs = uniform(13, weight_bytes=1_000_000, optimizer=40e-3)
    by_layer = simulate.simulate_roundpipe(costs, 8, 9, EVEN, "async")
    whole = simulate.simulate_roundpipe(costs, 8, 9, EVEN, "async", update_by_layer=False)
    assert by_layer.bubble < EPS < 0.05 < whole.bubble
    ends = {(e.step, e.label.rsplit(" ", 1)[-1]): e.end for e in by_layer.events if e.kind == "optimizer"}
    stage_end = {i: s.stop - 1 for i, s in enumerate(EVEN.stages())}
    early = 0
    for e in by_layer.events:
        if e.kind == "upload" and e.step >= 2:
            assert e.start >= ends[(e.step - 2, str(stage_end[e.stage]))] - EPS
            early += e.start < ends[(e.step - 2, "12")]
    assert early > 0  # some start before the whole update of the step before last has ended


@pytest.mark.parametrize("optimizer", ["async", "sync"])
def test_the_steady_state_figures_do_not_depend_on_the_window(optimizer):
    """Qwen3-1.7B's modelled costs (period 4 steps: 22 jobs on 8 workers): the window's bubble and
    step time are the same over 4, 8 and 16 steps. Async, step k + 2's first jobs run before step
    k's update ends, so a window ending two steps before the last simulated one shows a drain that
    no real run has (it read 2.04% over 8 steps where the steady state is 1.31%)."""
    costs = cost_model.modelled_costs("Qwen3-1.7B", "rtx4090")
    runs = [simulate.simulate_roundpipe(costs, 8, 16, optimizer=optimizer, window=w) for w in (4, 8, 16)]
    for s in runs[1:]:
        assert s.step_time == pytest.approx(runs[0].step_time, rel=1e-9)
        assert s.bubble == pytest.approx(runs[0].bubble, abs=1e-9)
    if optimizer == "async":  # and its 2.41 s AdamW hides wholly behind the 2.83 s step
        free = simulate.simulate_roundpipe(dataclasses.replace(costs, optimizer_s=0.0), 8, 16, optimizer=optimizer)
        assert runs[0].bubble == pytest.approx(free.bubble, abs=1e-9)


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 4, 16])
def test_gpipe_bubble_is_n_minus_one_over_m_plus_n_minus_one(workers, micro_batches):
    costs = uniform(workers + 1, head=(0.0, 0.0))  # one block a stage, the head free
    s = baselines.simulate_bound("gpipe", costs, workers, micro_batches, offload=False)
    assert s.bubble == pytest.approx((workers - 1) / (micro_batches + workers - 1), abs=EPS)
    one = baselines.simulate_bound("1f1b", costs, workers, max(micro_batches, workers), offload=False)
    assert one.bubble == pytest.approx((workers - 1) / (max(micro_batches, workers) + workers - 1), abs=EPS)


def _no_overlap(events):
    lanes = defaultdict(list)
    for e in events:
        lanes[(e.worker, e.lane)].append(e)
    for ops in lanes.values():
        ops.sort(key=lambda e: (e.start, e.end))
        for a, b in zip(ops, ops[1:]):
            assert b.start >= a.end - EPS, (a, b)


def test_roundpipe_events_are_consistent():
    costs = cost_model.spec_costs("1.7B")
    s = simulate.simulate_roundpipe(costs, 8, 9, None, "async", window=2)
    _no_overlap(s.events)
    compute = [e for e in s.events if e.lane == "compute"]
    done = defaultdict(float)
    where = {}
    for e in compute:
        key = (e.step, e.stage, e.micro_batch)
        done[key] = max(done[key], e.end)
        where[key] = e.worker
    forward, shards = len(s.details["forward_stages"]), s.details["tail_shards"]
    assert shards > 1  # the spec's 1.7B head is 3 blocks' worth: the plan cuts it by tokens
    tail = range(forward, forward + shards)
    waits = 0
    for e in compute:
        if e.kind != "recompute" and e.stage > 0:  # a recompute needs only its saved input
            sources = ([forward - 1] if e.stage in tail else list(tail) if e.stage == tail.stop
                       else [e.stage - 1])  # the shards take the last forward's output; the next job joins them
            for source in sources:
                before = (e.step, source, e.micro_batch)
                hop = costs.hop_s if where[before] != e.worker else 0.0
                assert e.start >= done[before] + hop - EPS, (e, done[before])
                waits += 1
    assert waits > 0
    uploads = {(e.step, e.stage): e for e in s.events if e.lane == "up"}
    jobs = defaultdict(list)  # per worker, its jobs in upload order
    for (step, stage), up in sorted(uploads.items(), key=lambda kv: kv[1].start):
        first = min(c.start for c in compute if (c.step, c.stage) == (step, stage))
        assert up.end <= first + EPS  # weights before the first micro-batch
        jobs[up.worker].append((up, max(c.end for c in compute if (c.step, c.stage) == (step, stage))))
    for worker_jobs in jobs.values():  # at most two stages resident: the job before last has ended
        for (up, _), (_, end_before_last) in zip(worker_jobs[2:], worker_jobs):
            assert up.start >= end_before_last - EPS


def test_cutting_a_heavy_head_by_tokens_removes_most_of_the_bubble():
    """Qwen3-1.7B modelled (a 151,936-token head, 5.7 blocks' worth), 4 calls of 16 micro-batches a
    step: the head whole fixes W and leaves 8 stages whose lengths cannot match; cut by tokens the
    plan has many short stages and its bubble is several times smaller."""
    from slimtune.engines.roundpipe.partitioner import plan_stages

    costs = cost_model.modelled_costs("Qwen3-1.7B", "rtx4090", 2048, 4)
    whole = plan_stages(costs.layers, 8, memory_cap=costs.memory_cap)
    cut = simulate.plan(costs, 8)
    assert whole.tail.shards == 1 and cut.tail.shards > 1
    found = [simulate.simulate_roundpipe(costs, 8, 64, p, "async", round_size=16) for p in (whole, cut)]
    assert found[1].bubble < found[0].bubble / 3
    assert found[1].step_time < found[0].step_time


def test_a_partition_text_may_cut_a_one_layer_tail_into_shards():
    p = simulate.partition_from_text("2,2/1x3/1,1,1,1", 5)
    assert p.tail.shards == 3 and len(p.stages()) == 2 + 3 + 4
    with pytest.raises(UserError, match="only a tail of one layer"):
        simulate.partition_from_text("2,1/2x3/1,1,1", 5)


def test_1f1b_events_are_consistent():
    costs = cost_model.spec_costs("1.7B")
    s = baselines.simulate_bound("1f1b", costs, 4, 8)
    _no_overlap(s.events)
    end = {(e.step, e.label[0], e.stage, e.micro_batch): e for e in s.events if e.kind in ("forward", "backward")}
    last = max(e.stage for e in s.events if e.lane == "compute")
    for (step, kind, stage, m), e in end.items():
        if kind == "F" and stage > 0:
            assert e.start >= end[(step, "F", stage - 1, m)].end + costs.hop_s - EPS
        if kind == "B":
            assert e.start >= end[(step, "F", stage, m)].end - EPS
            if stage < last:
                assert e.start >= end[(step, "B", stage + 1, m)].end + costs.hop_s - EPS


def test_balanced_binding_is_the_best_split():
    import itertools
    import random

    rng = random.Random(0)
    for trial in range(20):
        layers = tuple(LayerCost(rng.uniform(0.5, 2), rng.uniform(1, 4)) for _ in range(8))
        costs = Costs(layers, (0,) * 8, (0,) * 8, 0.0, 25.0, 0.0, prefix_layers=trial % 2)
        stages, blocks = 3, 8 - costs.prefix_layers - 1
        bound = baselines._Bound(costs, stages, 1, baselines.balanced_sizes(costs, stages))
        def largest(plan):
            return max(f + r + b for f, r, b in zip(plan.forward, plan.recompute, plan.backward))

        best = min(largest(baselines._Bound(costs, stages, 1, [b - a for a, b in zip((0, *cut), (*cut, blocks))]))
                   for cut in itertools.combinations(range(1, blocks), stages - 1))
        assert largest(bound) == pytest.approx(best)


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_interleaved_orders_run_every_micro_batch_once_without_deadlock(workers, chunks):
    costs = uniform(workers * chunks + 2)
    for m in (1, workers, workers + 1, 2 * workers, 3 * workers):
        orders = [baselines.interleaved_order(r, workers, m, chunks) for r in range(workers)]
        ops = sorted(op for order in orders for op in order)
        assert ops == sorted((k, s, i) for k in "FB" for s in range(workers * chunks) for i in range(m))
        s = baselines.simulate_bound("interleaved", costs, workers, m, chunks, offload=False)
        assert 0 <= s.bubble < 1


def test_roundpipe_beats_1f1b_and_reproduces_the_papers_bubble_table():
    """roundpipe.md section 3, 8 GPUs, 16 micro-batches, the paper's partitions and 1.7B binding:
    1F1B 35.2 / 42.1 / 34.9 %, RoundPipe sync 19.1 / 14.3 / 6.7 %, 'async' 4.0 / 1.3 / 2.6 %."""
    paper = {"1.7B": (35.2, 19.1, 4.0), "8B": (42.1, 14.3, 1.3), "32B": (34.9, 6.7, 2.6)}
    for name, (one_f_one_b, sync, intra) in paper.items():
        costs = cost_model.spec_costs(name)
        found = {s.name: s for s in simulate.compare(costs, 8, 16, chunks=2, reference=True)}
        assert found["RoundPipe async (staleness 1)"].bubble < found["RoundPipe sync"].bubble < found["1F1B"].bubble
        ideal = costs.ideal()
        part = simulate.partition_from_text(cost_model.REFERENCE_PARTITIONS[name], len(costs.layers))
        rp = simulate.simulate_roundpipe(ideal, 8, 16, part, "sync", round_size=8, cursor="earliest")
        sizes = [3, 3, 4, 4, 4, 4, 4, 2] if name == "1.7B" else None
        base = baselines.simulate_bound("1f1b", ideal, 8, 16, offload=False, sizes=sizes)
        assert base.bubble * 100 == pytest.approx(one_f_one_b, abs=0.1)
        assert rp.bubble * 100 == pytest.approx(sync, abs=0.3)
        assert rp.details["intra_bubble"] * 100 == pytest.approx(intra, abs=0.35)


def test_modelled_costs_follow_the_flops_and_are_labelled():
    costs = cost_model.modelled_costs("Qwen3-1.7B", "rtx4090", 2048, 1)
    assert len(costs.layers) == 28 + 2 and costs.prefix_layers == 1 and costs.label.startswith("modelled")
    block, head = costs.layers[1], costs.layers[-1]
    assert block.backward == pytest.approx(2 * block.forward) and head.backward == pytest.approx(2 * head.forward)
    assert head.forward == pytest.approx(2 * 2048 * 2048 * 151936 / (165.2e12 * 0.5))
    assert costs.hop_s == pytest.approx(2 * 2048 * 2048 * 2 / 25e9)
    assert sum(costs.weight_bytes) == pytest.approx(2 * (1.72e9 + 151936 * 2048), rel=0.02)  # tied head sent twice


def test_costs_file_and_its_mistakes(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"label": "bench", "hop_ms": 1, "layers": [
        {"forward_ms": 1, "backward_ms": 2, "weight_bytes": 1000, "repeat": 6}, {"forward_ms": 3, "backward_ms": 6}]}))
    costs = cost_model.file_costs(str(path))
    assert len(costs.layers) == 7 and costs.hop_s == 1e-3 and costs.grad_bytes[0] == 1000 and costs.label == "measured: bench"
    path.write_text(json.dumps({"layers": [{"forward_ms": -1, "backward_ms": 2}] * 3}))
    with pytest.raises(UserError, match=r"layers\[0\].forward_ms"):
        cost_model.file_costs(str(path))


def test_timeline_png_is_written(tmp_path):
    found = simulate.compare(uniform(13, hop=0.1e-3, weight_bytes=10_000_000, optimizer=5e-3), 4, 8)
    out = timeline.write_png(found, str(tmp_path / "timeline.png"))
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000
    assert not list(tmp_path.glob("*.part"))


def test_cli_prints_the_table(capsys):
    assert simulate.main(["--model", "Qwen3-1.7B", "--workers", "4", "--micro-batches", "8"]) == 0
    out = capsys.readouterr().out
    for text in ("modelled", "RoundPipe async", "RoundPipe sync", "GPipe + offload", "1F1B + offload",
                 "interleaved 1F1B (v=2) + offload", "speed-up over 1F1B + offload", "1.00x"):
        assert text in out
    assert cli.main(["simulate", "--costs", "spec:8B", "--reference", "--partition", "reference", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sync = next(s for s in result["schedules"] if s["name"] == "RoundPipe sync")
    assert result["costs"].startswith("measured") and sync["bubble"] == pytest.approx(0.143, abs=0.003)


@pytest.mark.parametrize("argv, words", [
    (["--model", "Qwen3-1.7B", "--workers", "0"], "--workers"),
    (["--costs", "spec:70B"], "spec inputs"),
    (["--costs", "/no/such/file.json"], "/no/such/file.json"),
    (["--model", "Qwen3-1.7B", "--partition", "7,7/1/9"], "--partition"),
    (["--model", "Qwen3-1.7B", "--chunks", "40"], "decoder blocks"),
    ([], "--model"),
])
def test_cli_refuses_a_bad_option_in_one_sentence(capsys, argv, words):
    assert simulate.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].endswith(".") and words in lines[0]
    assert lines[0].startswith("slimtune simulate: error: ")
