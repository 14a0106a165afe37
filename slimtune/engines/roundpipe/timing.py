"""Per-layer times measured in the step's jobs, for the partitioner's EMA (partitioner.LayerTimes).

A worker's clock marks points on its compute stream (CUDA events with timing) or reads the host
clock (the CPU, where every op is synchronous). A job notes what it timed:
  forward   a layer's forward (a forward job's no-grad forward, or the tail's forward with grad);
  backward  a backward-type micro-batch: the backward of a range of layers as one autograd call,
            timed alone, with the recompute of each of its layers (the tail: its forwards) timed
            before it.
The backward of several layers is one autograd call, so its time is shared among them in
proportion to their recomputes (their forwards, in the tail). Under grain=layer each layer's
recompute and backward is one call: its backward is that time less its forward.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(start, stop) -> float:
        if isinstance(start, float):
            return stop - start
        return start.elapsed_time(stop) / 1000.0  # the step has ended: both events are complete


@dataclass
class BackwardTiming:
    layers: tuple[int, ...]
    start: object = None
    stop: object = None
    recomputes: list[tuple[int, object, object]] = field(default_factory=list)  # (layer, start, stop)


@dataclass
class StepTimes:
    forwards: list[tuple[int, object, object]] = field(default_factory=list)
    backwards: list[BackwardTiming] = field(default_factory=list)

    def complete(self) -> None:
        """Wait for the step's own marks (CUDA events; each start precedes its stop on one stream),
        not for the work a step begun early has queued behind them."""
        stops = [b for _, _, b in self.forwards]
        for timing in self.backwards:
            stops += [timing.stop, *(b for _, _, b in timing.recomputes)]
        for stop in stops:
            if isinstance(stop, torch.cuda.Event):
                stop.synchronize()

    def layer_seconds(self, micro_batches: int) -> dict[int, tuple[float, float]]:
        """layer -> (forward, backward) seconds per micro-batch."""
        forward, backward = defaultdict(float), defaultdict(float)
        for layer, a, b in self.forwards:
            forward[layer] += Clock.seconds(a, b) / micro_batches
        for timing in self.backwards:
            total = Clock.seconds(timing.start, timing.stop)
            recomputes = {layer: Clock.seconds(a, b) for layer, a, b in timing.recomputes}
            if not recomputes:  # grain=layer: one layer's recompute and backward together
                (layer,) = timing.layers
                backward[layer] += max(0.0, total / micro_batches - forward[layer])
                continue
            spent = sum(recomputes.values()) or 1.0
            for layer, seconds in recomputes.items():  # the autograd call alone was timed: share it
                backward[layer] += total * seconds / spent / micro_batches
        return {layer: (forward[layer], backward[layer]) for layer in forward.keys() | backward.keys()}
