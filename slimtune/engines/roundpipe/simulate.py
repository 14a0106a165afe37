"""RoundPipe's schedule as a discrete-event simulation, beside GPipe, 1F1B and interleaved 1F1B.

    python -m slimtune.engines.roundpipe.simulate --model Qwen3-8B --gpu rtx4090 --workers 8 --png timeline.png
    slimtune simulate --costs spec:1.7B --reference

RoundPipe plays exactly the jobs of stages.assign, the action list the runtime executes: per step
(and per call when a step accumulates several calls) the partition's jobs take workers from the
global cursor, which carries on across calls and steps. On worker w, job j:
- upload: its stage's weights (+ the gradients so far when a step accumulates calls) go up on w's
  link; at most two stages are resident, so it starts once w's job before last has finished and
  sent its gradients down (the runtime's double buffering), and once the weights it needs exist;
- micro-batch m starts when w is free and job j-1's micro-batch m is done, plus a hop when j-1 ran
  on another worker (GPU -> host -> GPU); a backward job recomputes first (needing only its saved
  input, so the recompute overlaps the wait) and back-propagates when the gradient is there;
- tail and backward jobs send their parameter gradients down after their last micro-batch; a tail
  cut into token shards is that many jobs in a row, each 1/shards of the tail's time a micro-batch
  and each with the head's weights up and its gradients down.
The host AdamW of step k starts when step k's gradients are all down (the clipping norm needs them
all). Sync: step k+1's uploads wait for all of it. Async (staleness 1): step k+1 needs only step
k-1's update, so its forward jobs start on the cursor while step k's optimizer runs; the update goes
layer by layer in the runtime's order (Costs.update_order: forward, a tied table first; each layer
its share of the AdamW time, Costs.update_shares), and a job's upload waits only for its own
layers' update, as the runtime's per-unit updates do (engines/roundpipe/engine.py: each writes its result
into the host version of the weights that step reads, so there is no copy to play). Several steps
are simulated and the steady state measured (schedule.py). Baselines (stages bound to workers, with
offload) are in baselines.py, per-layer costs in cost_model.py, the timeline picture in timeline.py.

`reference=True` plays the paper's simulator instead (roundpipe.md section 3): no weight or
gradient transfers, no optimizer time, baselines without offload, and each step dispatched in
rounds of <= N micro-batches, each round starting on the earliest-free worker.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from slimtune.errors import UserError
from slimtune.engines.roundpipe import baselines, cost_model
from slimtune.engines.roundpipe.cost_model import Costs
from slimtune.engines.roundpipe.schedule import Engine, Schedule, measure
from slimtune.engines.roundpipe.stages import Partition, Stage, assign

OPTIMIZERS = ("async", "sync")


def plan(costs: Costs, workers: int) -> Partition:
    """The partitioner's plan (roundpipe.md 2.6) for these costs, capped by the card's memory share."""
    from slimtune.engines.roundpipe.partitioner import plan_stages

    try:
        return plan_stages(costs.layers, workers, memory_cap=costs.memory_cap, max_tail_shards=workers)
    except ValueError as err:
        raise UserError(str(err)) from None


def partition_from_text(text: str, layers: int) -> Partition:
    """'7,7,7,7/1/3,3,2': forward stage sizes ascending, the tail's layer count, backward stage
    sizes deepest first (each list covering the layers below the tail); '7,7/1x3/3,3' cuts a tail
    of one layer into 3 token shards."""
    try:
        forward, tail, backward = (part.split(",") for part in text.split("/"))
        tail_n, _, shards = tail[0].partition("x") if len(tail) == 1 else ("", "", "")
        sizes_f, sizes_b, tail_n, shards = ([int(x) for x in forward], [int(x) for x in backward], int(tail_n),
                                            int(shards or 1))
    except (ValueError, TypeError):
        raise UserError(f"--partition must look like 7,7,7,7/1/3,3,3,2 (forward/tail/backward layer counts; a tail "
                        f"of one layer in 3 token shards: 1x3), got '{text}'.") from None
    e = layers - tail_n
    if tail_n < 1 or min(sizes_f + sizes_b) < 1 or sum(sizes_f) != e or sum(sizes_b) != e:
        raise UserError(f"--partition '{text}': the tail needs >= 1 layer and the forward and backward counts must "
                        f"each add up to the {e} layers below it (the model has {layers}).")
    if shards < 1 or (shards > 1 and tail_n != 1):
        raise UserError(f"--partition '{text}': only a tail of one layer may be cut into token shards (1xK, K >= 1).")
    starts_f = [sum(sizes_f[:i]) for i in range(len(sizes_f))]
    starts_b = [e - sum(sizes_b[:i + 1]) for i in range(len(sizes_b))]
    return Partition(tuple(Stage("forward", a, a + n) for a, n in zip(starts_f, sizes_f)),
                     Stage("tail", e, layers, shards),
                     tuple(Stage("backward", a, a + n) for a, n in zip(starts_b, sizes_b)))


def _calls(micro_batches: int, round_size: int | None) -> list[tuple[int, int]]:
    size = round_size or micro_batches
    return [(first, min(size, micro_batches - first)) for first in range(0, micro_batches, size)]


class _Worker:
    """What the double buffering needs to know of a worker: its jobs' last operations, in order."""

    def __init__(self):
        self.jobs: list[tuple[int, int | None]] = []  # (last compute op, gradient download op)

    def slot_free(self) -> list:
        return list(self.jobs[-2]) if len(self.jobs) >= 2 else []


def _job_ops(engine: Engine, costs: Costs, job, step: int, first: int, count: int, upload: int,
             sources: list[tuple[list[int], int]]) -> list[int]:
    """Job `job`'s micro-batches on its worker's compute lane; returns each micro-batch's last op.
    `sources`: (each micro-batch's op, worker) of the jobs it takes its input from (none for the
    first job, every tail shard for the backward job after a sharded tail), a hop from another."""
    stage, w, lane = job.stage, job.worker, ("compute", job.worker)
    layers = costs.layers[stage.start:stage.stop]
    letter = {"forward": "F", "tail": "T", "backward": "B"}[stage.kind]
    out = []
    for m in range(count):
        info = dict(step=step, stage=job.index, micro_batch=first + m, label=f"{letter}{job.index} m{first + m}")
        data = [(ops[m], costs.hop_s if worker != w else 0.0) for ops, worker in sources]
        start = [upload] if m == 0 else []
        if stage.kind == "backward":
            engine.add(lane, sum(c.forward for c in layers), start, kind="recompute", **info)
            out.append(engine.add(lane, sum(c.backward for c in layers), data, kind="backward", **info))
        else:
            out.append(engine.add(lane, stage.time(costs.layers), start + data, kind=stage.kind, **info))
    return out


def _play_call(engine: Engine, costs: Costs, jobs, step: int, first: int, count: int,
               weights_ready: list[int] | None, workers: list[_Worker], accumulated: bool) -> list[int]:
    """One call's jobs (all its micro-batches through every stage); returns its gradient downloads.
    `weights_ready`: per layer, the op after which its weights for this step exist (None: at once).
    Each job takes its input from the job before, but every shard of a sharded tail from the last
    forward job, and the backward job after them from all the shards (jobs.py)."""
    before: list[tuple[list[int], int]] = []  # the sources of the next job
    tail: list[tuple[list[int], int]] = []  # (ops, worker) of this call's tail shards so far
    downloads = []
    for job in jobs:
        stage, w = job.stage, job.worker
        up = sum(costs.weight_bytes[stage.start:stage.stop])
        if accumulated and stage.kind != "forward":
            up += sum(costs.grad_bytes[stage.start:stage.stop])
        ready = [] if weights_ready is None else [weights_ready[stage.stop - 1]]  # updated in layer order
        upload = engine.add(("up", w), costs.transfer_s(up), [*ready, *workers[w].slot_free()],
                            label=f"W{job.index}", kind="upload", step=step, stage=job.index)
        sharded = stage.kind == "tail" and stage.shards > 1
        feed = _job_ops(engine, costs, job, step, first, count, upload, before)
        if sharded:
            tail.append((feed, w))
            before = before if len(tail) < stage.shards else tail
        else:
            before = [(feed, w)]
        download = None
        if stage.kind != "forward":
            download = engine.add(("down", w), costs.transfer_s(sum(costs.grad_bytes[stage.start:stage.stop])),
                                  [feed[-1]], label=f"G{job.index}", kind="download", step=step, stage=job.index)
            downloads.append(download)
        workers[w].jobs.append((feed[-1], download))
    return downloads


def _host_update(engine: Engine, costs: Costs, downloads: list[int], step: int,
                 by_layer: bool) -> tuple[list[int], int]:
    """Step `step`'s host AdamW once its gradients are down: per layer, the op after which that
    layer is updated, and the update's last op (the step's end). By layer (async): one op a layer
    in the runtime's order (Costs.update_order), each its share of the AdamW (Costs.update_shares);
    else one op for all, every layer ready when it ends."""
    layers = len(costs.layers)
    if not by_layer:
        whole = engine.add(("host", -1), costs.optimizer_s, downloads, label=f"AdamW step {step}", kind="optimizer",
                           step=step)
        return [whole] * layers, whole
    shares, ops = costs.update_shares(), [0] * layers
    for n, layer in enumerate(costs.update_order()):
        ops[layer] = engine.add(("host", -1), costs.optimizer_s * shares[layer], downloads if n == 0 else [],
                                label=f"AdamW step {step} layer {layer}", kind="optimizer", step=step)
    return ops, ops[costs.update_order()[-1]]


def _check_counts(workers: int, micro_batches: int) -> None:
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}.")
    if micro_batches < 1:
        raise UserError(f"--micro-batches must be at least 1, got {micro_batches}.")


def simulate_roundpipe(costs: Costs, workers: int, micro_batches: int, partition: Partition | None = None,
                       optimizer: str = "async", round_size: int | None = None, cursor: str = "carry",
                       window: int | None = None, update_by_layer: bool = True) -> Schedule:
    """RoundPipe over steps of `micro_batches` (in calls of `round_size`, default all); cursor
    'carry' (the runtime) or 'earliest' (each call starts on the earliest-free worker). Measured
    over `window` steps (default: N async, 2 sync) after the warm-up: async N + 1 steps, since a
    start-up ripple walks one worker a step before the rotation settles; sync 1 (every step
    starts from idle workers, so the second is already the steady state). `update_by_layer` (async):
    the AdamW layer by layer as the runtime does; False: one whole update that every upload of the
    step after next waits for (what the runtime did before)."""
    _check_counts(workers, micro_batches)
    if optimizer not in OPTIMIZERS or cursor not in ("carry", "earliest"):
        raise ValueError(f"optimizer must be one of {OPTIMIZERS} and cursor 'carry' or 'earliest'")
    partition = partition or plan(costs, workers)
    partition.check()
    warmup = workers + 1 if optimizer == "async" else 1
    lag = 2 if optimizer == "async" else 1  # step k needs step k - lag's update
    # The window ends with step `last`'s update, and steps up to last + lag may run before it ends
    # (async: step last + 2's first jobs need only step last's first layers): they must exist, or
    # the window's end shows workers idle for want of work no real run lacks.
    steps = warmup + (window or (workers if optimizer == "async" else 2)) + lag + 1
    engine, state, at, updates, step_ops = Engine(), [_Worker() for _ in range(workers)], 0, [], []
    for k in range(steps):
        weights_ready = updates[k - lag] if k >= lag else None
        downloads = []
        for i, (first, count) in enumerate(_calls(micro_batches, round_size)):
            if cursor == "earliest" and (k or i):
                engine.run()
                at = min(range(workers), key=lambda w: (engine.lane_free(("compute", w)), w))
            jobs, at = assign(partition, workers, at)
            downloads += _play_call(engine, costs, jobs, k, first, count, weights_ready, state, i > 0)
        ready, last = _host_update(engine, costs, downloads, k, by_layer=optimizer == "async" and update_by_layer)
        updates.append(ready)
        step_ops.append(last)
    details = {"schedule": "roundpipe", "optimizer": optimizer, "round_size": round_size, "cursor": cursor,
               "forward_stages": [s.stop - s.start for s in partition.forward],
               "tail_layers": partition.tail.stop - partition.tail.start, "tail_shards": partition.tail.shards,
               "backward_stages": [s.stop - s.start for s in partition.backward]}
    name = "RoundPipe " + ("async (staleness 1)" if optimizer == "async" else "sync")
    return measure(name, engine, workers, micro_batches, step_ops, costs.label, details, warmup, after=lag)


def compare(costs: Costs, workers: int = 8, micro_batches: int = 16, partition: Partition | None = None,
            chunks: int = 2, optimizers: Sequence[str] = OPTIMIZERS, accumulate: int = 1,
            reference: bool = False) -> list[Schedule]:
    """RoundPipe (each optimizer mode) and GPipe, 1F1B, interleaved 1F1B on the same costs; each
    schedule's details get `speedup`: 1F1B's step time over its own. A step is `accumulate` calls
    of `micro_batches` for RoundPipe, and accumulate x micro_batches in one flush for the baselines."""
    if accumulate < 1 or chunks < 1:
        raise UserError(f"--accumulate and --chunks must be at least 1, got {accumulate} and {chunks}.")
    _check_counts(workers, micro_batches)
    offload = not reference
    if reference:
        costs = costs.ideal()
    per_step = micro_batches * accumulate
    round_size = workers if reference else (micro_batches if accumulate > 1 else None)
    found = [simulate_roundpipe(costs, workers, per_step, partition, mode, round_size,
                                "earliest" if reference else "carry") for mode in optimizers]
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", chunks)):
        found.append(baselines.simulate_bound(kind, costs, workers, per_step, v, offload))
    base = next(s for s in found if s.details["schedule"] == "1f1b")
    for s in found:
        s.details["speedup"] = base.step_time / s.step_time if s.step_time > 0 else float("inf")
    return found


def table(schedules: list[Schedule], title: str) -> str:
    base = next(s.name for s in schedules if s.details["schedule"] == "1f1b")
    rows = [title, f"  {'schedule':<34} {'step time':>11} {'bubble':>8}   speed-up over {base}"]
    for s in schedules:
        ms = s.step_time * 1e3
        rows.append(f"  {s.name:<34} {f'{ms:,.0f}' if ms >= 100 else f'{ms:.3g}':>8} ms {s.bubble:>8.1%}   "
                    f"{s.details['speedup']:.2f}x")
    return "\n".join(rows)


def _costs(args: argparse.Namespace) -> tuple[Costs, str]:
    """The costs the options name, and the name of the spec inputs (if used) for --partition reference."""
    if args.costs and args.costs.startswith("spec:"):
        name = args.costs[len("spec:"):]
        return cost_model.spec_costs(name, args.gpu), name
    if args.costs:
        return cost_model.file_costs(args.costs, args.gpu), ""
    if not args.model:
        raise UserError("give --model PRESET (costs modelled) or --costs FILE | spec:1.7B | spec:8B | spec:32B.")
    return cost_model.modelled_costs(args.model, args.gpu, args.seq_len, args.batch_size), ""


def _partition(args: argparse.Namespace, costs: Costs, spec: str) -> Partition | None:
    if not args.partition:
        return None
    if args.partition == "reference":
        if not spec:
            raise UserError("--partition reference needs --costs spec:1.7B, spec:8B or spec:32B.")
        return partition_from_text(cost_model.REFERENCE_PARTITIONS[spec], len(costs.layers))
    return partition_from_text(args.partition, len(costs.layers))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `slimtune simulate` and `python -m slimtune.engines.roundpipe.simulate`."""
    parser.add_argument("--model", help="a preset (e.g. Qwen3-8B) or HF folder: per-layer costs modelled")
    parser.add_argument("--gpu", default="rtx4090", help="the card the costs are modelled on (default rtx4090)")
    parser.add_argument("--costs", help="measured costs instead: a JSON file (slimtune/engines/roundpipe/"
                        "cost_model.py has its format) or spec:1.7B | spec:8B | spec:32B (the paper simulator's inputs, roundpipe.md 3)")
    parser.add_argument("--workers", type=int, default=8, help="GPUs (default 8)")
    parser.add_argument("--micro-batches", type=int, help="micro-batches a step (default 2 x workers)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens a row, modelled costs (default 2048)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows a micro-batch, modelled costs (default 4)")
    parser.add_argument("--optimizer", choices=("sync", "async", "both"), default="both", help="RoundPipe's optimizer")
    parser.add_argument("--optimizer-ms", type=float, help="host AdamW time a step (default: modelled or from the file)")
    parser.add_argument("--accumulate", type=int, default=1, help="calls a step (gradient accumulation, default 1)")
    parser.add_argument("--chunks", type=int, default=2, help="interleaved 1F1B's chunks a worker (default 2)")
    parser.add_argument("--partition", help="RoundPipe stages as forward/tail/backward layer counts, e.g. "
                        "7,7,7,7/1/3,3,3,3,3,3,3,3,2,2, a one-layer tail in k token shards 1xk ('reference': the paper's, "
                        "with spec costs); default: planned, the head cut into up to --workers shards")
    parser.add_argument("--reference", action="store_true", help="as the paper's simulator: no transfers, no optimizer, "
                        "no offload, rounds of <= N micro-batches from the earliest-free worker")
    parser.add_argument("--png", help="write the timelines (one panel a schedule) to this PNG")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> list[Schedule]:
    """Simulate and print what the options ask for; UserError for a bad option."""
    from dataclasses import replace

    costs, spec = _costs(args)
    if args.optimizer_ms is not None:
        if args.optimizer_ms < 0:
            raise UserError(f"--optimizer-ms must be >= 0, got {args.optimizer_ms}.")
        costs = replace(costs, optimizer_s=args.optimizer_ms / 1e3)
    micro_batches = args.micro_batches if args.micro_batches is not None else 2 * max(args.workers, 1)
    modes = OPTIMIZERS if args.optimizer == "both" else (args.optimizer,)
    found = compare(costs, args.workers, micro_batches, _partition(args, costs, spec), args.chunks, modes,
                    args.accumulate, args.reference)
    if args.png:
        from slimtune.engines.roundpipe import timeline

        timeline.write_png(found, args.png)
    if args.json:
        print(json.dumps({"costs": found[0].costs_label, "schedules": [s.to_dict() for s in found]}, indent=2))
    else:
        steps = f"{micro_batches} micro-batches" + (f" x {args.accumulate} calls" if args.accumulate > 1 else "")
        print(table(found, f"{args.workers} workers, {steps} a step; costs {found[0].costs_label}"))
        sync = next((s for s in found if s.details.get("optimizer") == "sync"), None)
        if args.reference and sync:
            print(f"  RoundPipe sync without fill and drain (the paper's 'async' column): "
                  f"{sync.details['intra_bubble']:.1%}")
        if args.png:
            print(f"timelines written to {args.png}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimtune.engines.roundpipe.simulate", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except UserError as err:
        print(f"slimtune simulate: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
