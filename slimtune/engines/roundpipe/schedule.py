"""A small discrete-event engine for pipeline schedules, and the measured result of one schedule.

Resources are lanes: each worker has a compute lane, an up-link lane (host -> device copies) and a
down-link lane (device -> host), and the host has one optimizer lane. A lane runs its operations
one at a time in the order they were added; an operation starts when its lane is free and every
operation it depends on has ended, plus that dependency's latency (an activation hop between two
workers). So every start time is a longest path in a DAG, computed once per operation (Kahn's
order); a cycle (an impossible schedule) is reported as a bug, not a hang.

A schedule is several consecutive optimizer steps. A step ends when its host optimizer operation
ends; the steady-state window runs from the end of the warm-up steps to the end of a step that
every step able to run before its end follows (the first steps fill the pipeline, the last ones
drain it with nothing after them; measure's `after`), and
everything reported is measured in that window: step time = window / steps in it, a worker's idle = window - its compute
busy time, bubble = sum of idle / (workers x window).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

COMPUTE_KINDS = ("forward", "recompute", "backward", "tail")


@dataclass(frozen=True)
class Event:
    """One operation as it ran: on `worker` (-1: the host), lane compute | up | down | host."""

    worker: int
    start: float
    end: float
    label: str
    kind: str  # forward | recompute | backward | tail | upload | download | optimizer
    lane: str = "compute"
    step: int = 0
    stage: int = 0  # the job's index in its step (RoundPipe) or the virtual stage (baselines)
    micro_batch: int = 0


@dataclass
class _Op:
    lane: tuple
    duration: float
    deps: list[tuple[int, float]]
    prev: int  # the operation before it on its lane, -1 for none
    event: dict
    start: float | None = None
    end: float | None = None


class Engine:
    """Operations on lanes with dependencies; run() times every operation added so far."""

    def __init__(self):
        self._ops: list[_Op] = []
        self._last: dict[tuple, int] = {}
        self._timed = 0

    def add(self, lane: tuple, duration: float, deps=(), **event) -> int:
        """Append an operation to `lane` (("compute" | "up" | "down", worker) or ("host", -1)); deps
        are operation ids or (id, latency) pairs. Returns its id."""
        pairs = [d if isinstance(d, tuple) else (d, 0.0) for d in deps if d is not None]
        self._ops.append(_Op(lane, max(0.0, duration), pairs, self._last.get(lane, -1), event))
        self._last[lane] = len(self._ops) - 1
        return len(self._ops) - 1

    def end(self, op: int) -> float:
        value = self._ops[op].end
        if value is None:
            raise RuntimeError(f"operation {op} has not been timed: call run() first")
        return value

    def lane_free(self, lane: tuple) -> float:
        last = self._last.get(lane, -1)
        return 0.0 if last < 0 else self.end(last)

    def run(self) -> None:
        """Time every operation added since the last run (Kahn's order over lane and data edges)."""
        new = range(self._timed, len(self._ops))
        waiting, after = {}, {i: [] for i in new}
        for i in new:
            preds = [p for p in [self._ops[i].prev, *(d for d, _ in self._ops[i].deps)] if p >= self._timed]
            waiting[i] = len(preds)
            for p in preds:
                after[p].append(i)
        ready = deque(i for i in new if waiting[i] == 0)
        done = 0
        while ready:
            i = ready.popleft()
            self._time(self._ops[i])
            done += 1
            for j in after[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    ready.append(j)
        if done != len(new):
            raise RuntimeError("the schedule deadlocks: its operations wait on each other in a cycle")
        self._timed = len(self._ops)

    def _time(self, op: _Op) -> None:
        start = self._ops[op.prev].end if op.prev >= 0 else 0.0
        for d, latency in op.deps:
            start = max(start, self._ops[d].end + latency)
        op.start, op.end = start, start + op.duration

    def events(self) -> list[Event]:
        out = []
        for op in self._ops:
            if op.end is None:
                continue
            kind, worker = op.lane
            out.append(Event(worker=worker, start=op.start, end=op.end, lane=kind, **op.event))
        return out


@dataclass
class Schedule:
    """A simulated schedule and what it measured in its steady-state window (module docstring)."""

    name: str
    workers: int
    micro_batches: int
    events: list[Event]
    step_ends: list[float]
    step_time: float = 0.0
    bubble: float = 0.0
    busy: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    costs_label: str = ""
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Everything but the events, JSON-ready."""
        return {"name": self.name, "workers": self.workers, "micro_batches": self.micro_batches,
                "step_time_s": self.step_time, "bubble": self.bubble, "busy_s": self.busy, "idle_s": self.idle,
                "window_s": list(self.window), "steps": len(self.step_ends), "costs": self.costs_label,
                **self.details}


def measure(name: str, engine: Engine, workers: int, micro_batches: int, step_ops: list[int],
            costs_label: str, details: dict, warmup: int = 1, after: int = 1) -> Schedule:
    """The schedule's steady-state numbers over the window from the end of step `warmup` to the end
    of the step `after` steps before the last (the steps that may run before a step's end must
    follow it, or the window ends in a drain); step ends are the ends of the steps' host operations."""
    engine.run()
    ends = [engine.end(op) for op in step_ops]
    first, last = warmup, len(ends) - 1 - after
    if first < 1 or last <= first:
        raise ValueError(f"{len(ends)} simulated steps leave no window after {warmup} warm-up steps")
    low, high = ends[first], ends[last]
    events = engine.events()
    busy = [0.0] * workers
    for e in events:
        if e.lane == "compute":
            busy[e.worker] += max(0.0, min(e.end, high) - max(e.start, low))
    span = high - low
    idle = [span - b for b in busy]
    bubble = sum(idle) / (workers * span) if span > 0 else 0.0
    details = {**details, "intra_bubble": _intra(events, workers, range(first + 1, last + 1), span)}
    return Schedule(name, workers, micro_batches, events, ends, span / (last - first), bubble, busy, idle,
                    (low, high), costs_label, details)


def _intra(events: list[Event], workers: int, steps: range, span: float) -> float:
    """The paper's "switch + intra" bubble: each worker's idle between its first and last compute
    of a step (fill and drain left out), over the steps in the window, per workers x window. As in
    the paper's simulator a recompute counts as placed right before its backward (the runtime
    starts it earlier; the idle is the same, only where it falls differs). For a sync schedule this
    is the paper simulator's "RoundPipe async" figure (roundpipe.md section 3)."""
    lanes: dict[tuple[int, int], list[Event]] = {}
    for e in events:  # events come in lane order
        if e.lane == "compute" and e.step in steps:
            lanes.setdefault((e.step, e.worker), []).append(e)
    idle = 0.0
    for ops in lanes.values():
        first = ops[0].start
        if ops[0].kind == "recompute" and len(ops) > 1:
            first = ops[1].start - (ops[0].end - ops[0].start)
        idle += max(e.end for e in ops) - first - sum(e.end - e.start for e in ops)
    return idle / (workers * span) if span > 0 else 0.0
