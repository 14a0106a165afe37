"""Causal-LM loss from final hidden states.

Targets arrive already shifted (data.Example), so position t is scored against
targets[t] and IGNORE_INDEX rows cost nothing. The loss of an optimizer step is the
sum over every trained token of its micro-batches divided by their total count, so
gradient accumulation gives exactly the gradient of one large batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimtune.data import IGNORE_INDEX


def token_loss_sum(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """hidden (B, T, D), targets (B, T) -> summed cross-entropy over trained positions (at least fp32)."""
    logits = head(hidden)  # (B, T, V)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the softmax in half precision loses the small probabilities
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
