"""Engines: one interface (engines.base.Engine), one file per engine."""

from __future__ import annotations

from pathlib import Path

import torch

from slimtune.config import RunConfig
from slimtune.model import Stack


def build(cfg: RunConfig, stack: Stack, device: torch.device, precision: str):
    if cfg.engine == "resident":
        from slimtune.engines.resident import ResidentEngine

        return ResidentEngine(stack, cfg.train, device, precision, cfg.loss, cfg.activations,
                              Path(cfg.output_dir) / "activations")
    if cfg.engine == "slide":
        from slimtune.engines.slide import SlideEngine

        return SlideEngine(stack, cfg.train, device, precision, cfg.loss, cfg.activations, cfg.slide,
                           Path(cfg.output_dir) / "activations")
    raise AssertionError(f"engine {cfg.engine!r} passed validation but has no builder")


def plan_options(method: str) -> list[dict]:
    """Every engine-and-options combination the planner weighs for `method`, as dotted-key
    RunConfig settings; each engine adds its own."""
    plans = [{"engine": "resident", "precision": precision} for precision in ("bf16", "fp32")]
    for store in ("recompute", "host", "disk"):
        plans.append({"engine": "resident", "precision": "bf16", "activations.checkpoint": store})
    if method == "lora":
        nf4 = {"engine": "resident", "precision": "bf16", "quant.scheme": "nf4"}
        plans += [nf4, *({**nf4, "activations.checkpoint": store} for store in ("recompute", "host", "disk"))]
        plans.append({**nf4, "activations.checkpoint": "disk", "loss.mode": "subset"})
        plans.append({"engine": "slide", "precision": "bf16", "quant.scheme": "nf4"})
    else:
        plans += [{"engine": "slide", "precision": "bf16", "activations.checkpoint": store} for store in ("host", "disk")]
    return plans
