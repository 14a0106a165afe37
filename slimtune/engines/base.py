"""The engine interface every engine implements, and what one step reports."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from slimtune.data import Batch


@dataclass
class StepResult:
    loss: float  # mean exact cross-entropy per trained token over the step's micro-batches
    tokens: int  # trained (target) tokens in the step
    seen_tokens: int  # input positions processed, padding included (as HF Trainer counts them)
    lr: float
    grad_norm: float  # global norm before clipping
    device_peak_bytes: int | None  # measured by the device meter; None when measuring is off
    host_link_bytes: int  # counted bytes moved between host and device
    device_peak_breakdown: dict[str, int] | None = None  # by memory.CATEGORIES, where the meter can tell
    excluded_mass: float = 0.0  # loss.mode=subset: mean probability mass outside the candidates
    host_peak_bytes: int = 0  # host RAM the step held for the device (offloaded activations, ...)
    disk_peak_bytes: int = 0  # disk the step held (activations.checkpoint=disk)


class Engine(Protocol):
    name: str

    def step(self, micro_batches: list[Batch]) -> StepResult: ...

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        """Summed loss and trained-token count over `batches`, without gradients."""
        ...

    def state_dict(self) -> dict:
        """Everything exact resume needs: trainable weights, optimizer, scheduler."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained weights by parameter name (what export writes)."""
        ...


def to_float(value: torch.Tensor) -> float:
    """A step's scalar for the log; NaN for a fake tensor (memory.estimate runs steps without values)."""
    from torch._subclasses.fake_tensor import is_fake

    return float("nan") if is_fake(value) else float(value)


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast for precision bf16 (the default on CUDA only: fp32 is the CPU's fast dtype)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
