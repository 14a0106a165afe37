"""The layer-wise update schedule of engine `lsp` (spec lsp-offload.md 2.6), as data: which modules'
updates run while backward goes on, and how many module backwards after its own each action of a
module waits, derived from measured times instead of hand-tuned per model and machine.

Modules are the projected linears in forward order, 0..M-1; backward reaches them deepest first.
For a deep module (index >= k) whose gradient arrives as the n-th of the step:
  D2H      at once (the engine copies G_c down as it arrives)
  UPD      submitted to the host worker at arrival n + p
  H2D      at arrival n + h (the device loop waits for the worker's AdamW of it, then copies Z up)
  APPLY    at arrival n + u (the compute stream waits for that copy)
Shallow modules (index < k) finish backward last and are needed first by the next forward: their
updates are submitted when backward ends, in forward order, and each is uploaded and applied just
before the module's next forward. An action that would fall after the last arrival waits for the
module's next forward too. Nothing is ever stale: every pending update is applied before its
module's next forward, before evaluation and before a checkpoint. The schedule moves no number:
any k, p, h, u give bitwise the same weights as `sync` (every update after backward).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Schedule:
    k: int  # modules [0, k) are shallow
    p: int
    h: int
    u: int
    sync: bool = False  # every update after the backward, uploaded and applied at once

    def deep(self, index: int) -> bool:
        return not self.sync and index >= self.k

    def lags(self) -> tuple[tuple[str, int], ...]:
        return (("update", self.p), ("upload", self.h), ("apply", self.u))


def initial(modules: int, k: int, p: int, h: int, u: int, sync: bool) -> Schedule:
    """Before anything is measured: the knobs given (-1: not given); unset ones leave every module
    shallow (updates after backward, applied before the next forward) until `derive` has times."""
    if sync:
        return Schedule(modules, 0, 0, 0, sync=True)
    if -1 in (k, p, h, u):
        return Schedule(modules, 0, 0, 0)
    return Schedule(min(k, modules), p, h, u)


def derive(backward_s: list[float], update_s: list[float], copy_s: float, given: tuple[int, int, int, int]) -> Schedule:
    """k, p, h, u from one step's measured per-module backward times (arrival to arrival), the host
    AdamW times of its modules, and one matrix's copy time each way; `given` knobs (not -1) stay.
    p covers the copy down, h - p the host update, u - h the copy up (each in module backwards);
    deep modules must finish before the backward ends (k >= u), and no more of them than the worker
    can update during the whole backward."""
    modules = len(backward_s)
    per_module = max(statistics.median(backward_s), 1e-9)
    update = statistics.median(update_s) if update_s else 0.0
    p = math.ceil(copy_s / per_module)
    h = p + math.ceil(update / per_module)
    u = max(h + math.ceil(copy_s / per_module), 1)
    keeps_up = modules if update <= 0 else int(sum(backward_s) // update)
    k = min(modules, max(u, modules - keeps_up))
    derived = (k, p, h, u)
    k, p, h, u = (g if g != -1 else v for g, v in zip(given, derived))
    return Schedule(min(k, modules), p, max(h, p), max(u, h, p))


class Clock:
    """Times of one step's module backwards (CUDA events on a GPU, read after the step; wall time on
    the CPU) and of the host worker's updates."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.counts: list[int] = []
        self.updates: list[float] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks, self.counts, self.updates = [self._now()], [], []

    def arrived(self, modules: int) -> None:
        """A block's `modules` matrices completed together."""
        self.marks.append(self._now())
        self.counts.append(modules)

    def backward_seconds(self) -> list[float]:
        """Per matrix, in completion order: its block's backward time shared among its matrices."""
        if self.cuda:
            self.marks[-1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            spans = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return [span / count for span, count in zip(spans, self.counts) for _ in range(count)]
