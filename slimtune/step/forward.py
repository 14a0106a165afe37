"""The exact loss of a batch through the whole model as it sits on the device, what each micro-batch's
summed loss is divided by, evaluation sums, and a step's scalars (fake under the planner's estimate)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.data.dataset import Batch
from slimtune.device import memory
from slimtune.step import activations
from slimtune.step.loss import causal_lm_loss
from slimtune.step.precision import autocast_for


def step_divisor(micro_batches: list[Batch], total_targets: int | None) -> int:
    """What every micro-batch's summed loss is divided by: the step's trained-token count, over every
    rank's micro-batches under data parallelism (the loop passes it), so that the gradients summed
    across ranks are the gradient of the mean loss over the whole global batch."""
    count = sum(b.num_targets for b in micro_batches) if total_targets is None else total_targets
    return max(count, 1)


def model_loss(stack, activations_cfg, loss_cfg, device: torch.device, precision: str, batch: Batch,
               reading=memory.NO_READING, training: bool = True, store=None, run_blocks=None):
    """The exact loss (loss.LossOutput) of `batch` (on the device) through the whole model as it sits
    on the device: the blocks as activations_cfg checkpoints them (`store`: their inputs' store), or
    as `run_blocks` (Stack.body_hidden's hook) runs them, then the final norm, head and loss; the
    meter's phases and segments marked on the way."""
    blocks = run_blocks or activations.runner(activations_cfg, store)
    with autocast_for(device, precision):
        with reading.phase("activations"):
            hidden = stack.body_hidden(batch.input_ids, batch.position_ids, blocks, batch.segmented)
        with reading.phase("loss"):
            memory.mark("loss")
            return causal_lm_loss(hidden, stack.norm, stack.head, batch.targets, loss_cfg,
                                  trained_positions=batch.trained_positions, training=training)


def evaluate_batches(batches: list[Batch], exact_loss_sum: Callable[[Batch], torch.Tensor]) -> tuple[float, int]:
    """(summed exact loss, trained tokens) over `batches`; `exact_loss_sum(batch)` is the engine's
    loss of one batch, run without gradients."""
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            loss_sum += float(exact_loss_sum(batch))
            tokens += batch.num_targets
    return loss_sum, tokens


def to_float(value: torch.Tensor | float) -> float:
    """A step's scalar for the log; NaN for a fake tensor (the estimate runs steps without values)."""
    if isinstance(value, torch.Tensor) and is_fake(value):
        return float("nan")
    return float(value)
