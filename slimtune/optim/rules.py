"""The optimisation rules every engine follows, one helper each, so engines share their rules and
not their step bodies: which weights decay, the learning rate at a step, the clipping coefficient,
whether a step may update at all (a non-finite loss or gradient norm never reaches the weights),
and AdamW's settings. An engine's step is then the same optimizer step whatever the engine.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.config import TrainConfig

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm: kept, so clipping equals torch's.
CLIP_EPS = 1e-6


def decays(param: torch.Tensor) -> bool:
    """Matrices decay; biases and norm gains (1-D) do not, as is usual."""
    return param.ndim >= 2


def decay_groups(params: list[torch.Tensor], weight_decay: float) -> list[tuple[list[torch.Tensor], float]]:
    """(params, weight decay) groups, decayed first; an empty undecayed group is left out."""
    decayed = [p for p in params if decays(p)]
    plain = [p for p in params if not decays(p)]
    return [(decayed, weight_decay)] + ([(plain, 0.0)] if plain else [])


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based) of `total`: linear warmup, then
    cosine, linear or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def lr_at(train: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    return train.lr * lr_factor(step, train.steps, train.warmup_steps, train.schedule)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What every gradient is multiplied by before the update (1 when clipping is off or the norm is
    within max_norm): torch.nn.utils.clip_grad_norm_'s formula, so results equal torch's."""
    if max_norm <= 0:
        return torch.ones((), dtype=total_norm.dtype, device=total_norm.device)
    return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)


def is_finite(value: torch.Tensor | float) -> bool:
    """Whether a step's loss or gradient norm may update the weights: finite (a fake tensor, which
    the planner's estimate steps with, counts as finite: it has no value and must update)."""
    if isinstance(value, torch.Tensor):
        return is_fake(value) or bool(torch.isfinite(value).all())
    return math.isfinite(value)


def init_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Create every parameter's AdamW state now, as torch would at the first step (zeros; a float32
    step on the parameter's device for the fused kernel). Every step then holds the same state, the
    first included, so one step (the planner's fake one too) shows the steady state's memory."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def adamw_settings(train: TrainConfig) -> dict:
    """torch.optim.AdamW's hyper-parameters from the run (lr is set per step from lr_at)."""
    return {"lr": train.lr, "betas": tuple(train.betas), "eps": train.eps}
