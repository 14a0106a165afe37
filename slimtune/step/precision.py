"""The compute precision of a step: bf16 autocast where the run asks for it."""

from __future__ import annotations

import contextlib

import torch


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast for precision bf16 (the default on CUDA only: fp32 is the CPU's fast dtype)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
