"""Learning-rate schedules: linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based) of `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build(optimizer: torch.optim.Optimizer, total: int, warmup: int, kind: str) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup, kind))
