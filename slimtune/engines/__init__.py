"""Engines: one interface (engines.base.Engine), one file per engine."""

from __future__ import annotations

import torch

from slimtune.config import RunConfig
from slimtune.model import Stack


def build(cfg: RunConfig, stack: Stack, device: torch.device, precision: str):
    if cfg.engine == "resident":
        from slimtune.engines.resident import ResidentEngine

        return ResidentEngine(stack, cfg.train, device, precision, cfg.loss)
    raise AssertionError(f"engine {cfg.engine!r} passed validation but has no builder")


def plan_options(method: str) -> list[dict]:
    """Every engine-and-options combination the planner weighs for `method`, as dotted-key
    RunConfig settings; each engine adds its own."""
    plans = [{"engine": "resident", "precision": precision} for precision in ("bf16", "fp32")]
    if method == "lora":
        plans.append({"engine": "resident", "precision": "bf16", "quant.scheme": "nf4"})
    return plans
