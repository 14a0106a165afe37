"""Engines: one interface (engines.base.Engine), one file per engine."""

from __future__ import annotations

import torch

from slimtune.config import RunConfig
from slimtune.model import Stack


def build(cfg: RunConfig, stack: Stack, device: torch.device, precision: str):
    if cfg.engine == "resident":
        from slimtune.engines.resident import ResidentEngine

        return ResidentEngine(stack, cfg.train, device, precision)
    raise AssertionError(f"engine {cfg.engine!r} passed validation but has no builder")
