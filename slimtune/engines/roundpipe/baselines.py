"""Classic pipeline schedules with stages bound to workers, on the same engine as RoundPipe.

GPipe: every forward, then every backward. 1F1B (non-interleaved): rank r runs N - 1 - r warm-up
forwards, then one forward and one backward in turn, then the cool-down backwards. Interleaved 1F1B:
v chunks a rank (virtual stage s on rank s mod N), micro-batches in rounds of N, rank r warms up
with (v - 1) x N + 2 (N - 1 - r) forwards and then alternates, chunk order as in Megatron-LM and
PyTorch's ScheduleInterleaved1F1B; micro-batches must be a multiple of the rounds. Each rank runs
its list in order as soon as its inputs are there (no lock-step), so this is the schedule's best
case.

Modelling assumptions:
- Binding: the decoder blocks split evenly by count over the N x v stages, the extra blocks to the
  first stages; the prefix (embedding) joins the first stage, the LM head + loss the last. Any
  other binding can be given (`sizes`); balanced_sizes finds the one with the smallest largest stage.
- Full activation recompute: a backward reruns its stage's forward (after its output gradient
  arrives, inside the backward call) and then back-propagates; the LM head + loss keeps its
  activations (no recompute), as the RoundPipe tail.
- A hop (activation or gradient between consecutive stages on different ranks) costs costs.hop_s;
  the saved activations stay on the rank.
- "With offload" (ZeRO-Offload style): fp32 masters and AdamW state live on the host. After the
  flush each rank sends its gradients down (its own link), the host AdamW runs over every weight
  once all gradients are down (a global step: clipping needs every gradient), and each rank gets
  its updated bf16 weights back up before its first operation of the next step. None of this
  overlaps compute. Without offload the step ends at the flush and the optimizer takes no time
  (as the paper's simulator; the model would not fit a 24 GB card anyway).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Sequence

from slimtune.errors import UserError
from slimtune.engines.roundpipe.cost_model import Costs
from slimtune.engines.roundpipe.schedule import Engine, Schedule, measure


def bind_layers(costs: Costs, stages: int, sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The layer range [start, stop) of each of `stages` bound stages: `sizes` decoder blocks each
    (default the even split of the module docstring); the prefix joins the first, the head the last."""
    count, prefix = len(costs.layers), costs.prefix_layers
    blocks = count - prefix - 1
    if sizes is None:
        if blocks < stages:
            raise UserError(f"{stages} pipeline stages need at least as many decoder blocks; the model has {blocks}.")
        base, extra = divmod(blocks, stages)
        sizes = [base + (1 if s < extra else 0) for s in range(stages)]
    if len(sizes) != stages or sum(sizes) != blocks or min(sizes) < 0:
        raise UserError(f"a binding needs {stages} block counts >= 0 adding up to {blocks}, got {list(sizes)}.")
    bounds, at = [], prefix
    for s, size in enumerate(sizes):
        bounds.append((0 if s == 0 else at, count if s == stages - 1 else at + size))
        at += size
    return bounds


def balanced_sizes(costs: Costs, stages: int) -> list[int]:
    """Blocks a stage (>= 1 each) that minimise the largest stage time (forward + recompute +
    backward a micro-batch), the prefix in the first stage and the head in the last: a hand-tuned
    binding, to see how much of a baseline's bubble the even split costs. Exact, O(stages x blocks^2)."""
    count, prefix = len(costs.layers), costs.prefix_layers
    blocks = count - prefix - 1
    if blocks < stages:
        raise UserError(f"{stages} pipeline stages need at least as many decoder blocks; the model has {blocks}.")
    ends = list(itertools.accumulate((2 * c.forward + c.backward for c in costs.layers[prefix:count - 1]), initial=0.0))
    first = sum(2 * c.forward + c.backward for c in costs.layers[:prefix])
    head = costs.layers[-1].forward + costs.layers[-1].backward  # its activations are kept: no recompute

    def time(s: int, a: int, b: int) -> float:
        return ends[b] - ends[a] + (first if s == 1 else 0.0) + (head if s == stages else 0.0)

    best = {(0, 0): (0.0, [])}  # (stages placed, blocks placed) -> (largest stage time, sizes)
    for s in range(1, stages + 1):
        for b in range(s, blocks - (stages - s) + 1):
            best[(s, b)] = min((max(best[(s - 1, a)][0], time(s, a, b)), best[(s - 1, a)][1] + [b - a])
                               for a in range(s - 1, b) if (s - 1, a) in best)
    return best[(stages, blocks)][1]


def gpipe_order(rank: int, workers: int, micro_batches: int, chunks: int = 1) -> list[tuple[str, int, int]]:
    return [("F", rank, m) for m in range(micro_batches)] + [("B", rank, m) for m in range(micro_batches)]


def one_f_one_b_order(rank: int, workers: int, micro_batches: int, chunks: int = 1) -> list[tuple[str, int, int]]:
    warm = min(micro_batches, workers - 1 - rank)
    order = [("F", rank, m) for m in range(warm)]
    for m in range(warm, micro_batches):
        order += [("F", rank, m), ("B", rank, m - warm)]
    return order + [("B", rank, m) for m in range(micro_batches - warm, micro_batches)]


def _round_length(workers: int, micro_batches: int) -> int:
    rounds = max(1, micro_batches // workers)
    if micro_batches % rounds:
        raise UserError(f"interleaved 1F1B needs micro-batches in whole rounds of about {workers}: "
                        f"{micro_batches} does not split into {rounds} equal rounds.")
    return micro_batches // rounds


def interleaved_order(rank: int, workers: int, micro_batches: int, chunks: int) -> list[tuple[str, int, int]]:
    per_round = _round_length(workers, micro_batches)
    total = chunks * micro_batches
    warm = min(total, (chunks - 1) * per_round + 2 * (workers - 1 - rank))
    taken = {"F": [0] * chunks, "B": [0] * chunks}

    def op(kind: str, index: int) -> tuple[str, int, int]:
        local = (index // per_round) % chunks
        chunk = local if kind == "F" else chunks - 1 - local
        m = taken[kind][chunk]
        taken[kind][chunk] += 1
        return kind, chunk * workers + rank, m

    order = [op("F", i) for i in range(warm)]
    for i in range(warm, total):
        order += [op("F", i), op("B", i - warm)]
    return order + [op("B", i) for i in range(total - warm, total)]


ORDERS = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "interleaved": interleaved_order}


class _Bound:
    """One schedule's stages on their ranks, and how long each part takes."""

    def __init__(self, costs: Costs, workers: int, chunks: int, sizes: Sequence[int] | None = None):
        self.costs, self.workers = costs, workers
        self.bounds = bind_layers(costs, workers * chunks, sizes)
        head = len(costs.layers) - 1
        layers = costs.layers
        self.forward = [sum(c.forward for c in layers[a:b]) for a, b in self.bounds]
        self.recompute = [sum(layers[i].forward for i in range(a, b) if i != head) for a, b in self.bounds]
        self.backward = [sum(c.backward for c in layers[a:b]) for a, b in self.bounds]

    def rank_bytes(self, rank: int, which: tuple[int, ...]) -> int:
        return sum(sum(which[a:b]) for s, (a, b) in enumerate(self.bounds) if s % self.workers == rank)


def _add_op(engine: Engine, plan: _Bound, ops: dict, key: tuple[str, int, int], rank: int, step: int,
            barrier) -> int | None:
    """Add one forward or backward if its inputs are already added; None if not yet."""
    kind, s, m = key
    hop, last = plan.costs.hop_s, len(plan.bounds) - 1
    info = dict(step=step, stage=s, micro_batch=m)
    if kind == "F":
        feed = ops.get(("F", s - 1, m)) if s > 0 else -1
        if feed is None:
            return None
        data = (feed, hop if (s - 1) % plan.workers != rank else 0.0) if s > 0 else None
        return engine.add(("compute", rank), plan.forward[s], [data, barrier], label=f"F{s} m{m}", kind="forward", **info)
    grad = ops.get(("B", s + 1, m)) if s < last else -1
    if grad is None or ("F", s, m) not in ops:
        return None
    deps = [ops[("F", s, m)], barrier] + ([(grad, hop if (s + 1) % plan.workers != rank else 0.0)] if s < last else [])
    if plan.recompute[s] > 0:
        deps = [engine.add(("compute", rank), plan.recompute[s], deps, label=f"R{s} m{m}", kind="recompute", **info)]
    return engine.add(("compute", rank), plan.backward[s], deps, label=f"B{s} m{m}", kind="backward", **info)


def _play_step(engine: Engine, plan: _Bound, lists: list[list], step: int, barriers: list) -> list[int]:
    """Add one step's compute in an order where every input exists before its consumer; returns
    each rank's last operation."""
    pending = [deque(order) for order in lists]
    ops: dict = {}
    last = [None] * plan.workers
    while any(pending):
        progress = False
        for rank, queue in enumerate(pending):
            while queue:
                op = _add_op(engine, plan, ops, queue[0], rank, step, barriers[rank] if last[rank] is None else None)
                if op is None:
                    break
                ops[queue.popleft()] = last[rank] = op
                progress = True
        if not progress:
            raise RuntimeError("the per-rank orders deadlock: a bug in the schedule's construction")
    return last


def _end_step(engine: Engine, plan: _Bound, last: list[int], step: int, offload: bool) -> tuple[int, list]:
    """The optimizer at the step's end: returns the host operation and each rank's barrier for the next step."""
    costs, ranks = plan.costs, range(plan.workers)
    if offload:
        last = [engine.add(("down", r), costs.transfer_s(plan.rank_bytes(r, costs.grad_bytes)), [last[r]],
                           label="grads down", kind="download", step=step) for r in ranks]
    host = engine.add(("host", -1), costs.optimizer_s if offload else 0.0, last, label=f"AdamW step {step}",
                      kind="optimizer", step=step)
    if not offload:
        return host, [host] * plan.workers
    ups = [engine.add(("up", r), costs.transfer_s(plan.rank_bytes(r, costs.weight_bytes)), [host],
                      label="weights up", kind="upload", step=step) for r in ranks]
    return host, ups


def simulate_bound(schedule: str, costs: Costs, workers: int, micro_batches: int, chunks: int = 1,
                   offload: bool = True, sizes: Sequence[int] | None = None, steps: int = 4) -> Schedule:
    """GPipe ('gpipe'), 1F1B ('1f1b') or interleaved 1F1B ('interleaved', `chunks` a rank), stages
    of `sizes` blocks (default even), over `steps` steps; measured in its steady state (schedule.py):
    every step starts from the same state, so the second step is already steady."""
    if schedule not in ORDERS:
        raise ValueError(f"unknown bound schedule {schedule!r}; known: {', '.join(ORDERS)}")
    if schedule != "interleaved":
        chunks = 1
    plan = _Bound(costs, workers, chunks, sizes)
    lists = [ORDERS[schedule](r, workers, micro_batches, chunks) for r in range(workers)]
    engine, barriers, step_ops = Engine(), [None] * workers, []
    for k in range(steps):
        last = _play_step(engine, plan, lists, k, barriers)
        host, barriers = _end_step(engine, plan, last, k, offload)
        step_ops.append(host)
    names = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": f"interleaved 1F1B (v={chunks})"}
    name = names[schedule] + (" + offload" if offload else "")
    details = {"schedule": schedule, "offload": offload, "chunks": chunks,
               "stage_layers": [b - a for a, b in plan.bounds]}
    return measure(name, engine, workers, micro_batches, step_ops, costs.label, details)
