"""The engine interface the training loop relies on, what one step reports, and the helpers every
engine shares (evaluation, loading trainable state, scalars that may be fake)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.step import activations
from slimtune.device import memory
from slimtune.store.checkpoint import EngineState
from slimtune.data.dataset import Batch
from slimtune.errors import UserError
from slimtune.step.loss import causal_lm_loss


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
    host_peak_bytes: int = 0  # host RAM the step held for the device (host state, offloaded activations)
    disk_peak_bytes: int = 0  # disk the step held (activations.checkpoint=disk)
    extras: dict[str, float] = field(default_factory=dict)  # engine-specific figures; the loop logs them
    # False: the loss or gradient norm was not finite (rules.is_finite) and no update was applied.
    # An engine that updates while backward still runs may have updated some weights (finite ones)
    # first: its config check then refuses train.on_nonfinite=skip, and the run stops.
    applied: bool = True


class Engine(Protocol):
    """What train.fit, checkpoints, export and the planner's estimate use of an engine. Every engine
    is built as `Engine(stack, cfg: RunConfig, device, precision, dist)` (see registry.EngineSpec.build);
    under data parallelism it sums its gradients across dist's ranks before its optimizer."""

    name: str
    meter: object  # memory.meter_for(...): the device meter its steps read (the estimate swaps it)

    def step(self, micro_batches: list[Batch], total_targets: int | None = None) -> StepResult:
        """One optimizer step over `micro_batches` (gradient accumulation). `total_targets`: the
        step's trained-token count over every rank (data parallelism; step_divisor), else None.
        An engine whose `starts_ahead` attribute is true also takes `then=(micro_batches,
        total_targets)` of the next step, which it may begin before this one ends; the loop passes
        it only where nothing reads the engine between the two steps (train._next_starts_early),
        and the next call gets those same batches."""
        ...

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        """Summed exact loss and trained-token count over `batches`, without gradients."""
        ...

    def state_dict(self) -> EngineState:
        """Everything exact resume needs, in the format every engine shares."""
        ...

    def load_state_dict(self, state: EngineState) -> None:
        """Resume from a state this or another engine wrote; one sentence (UserError) if it cannot."""
        ...

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained weights by parameter name: what export writes (the model's own parameters may
        point elsewhere, e.g. at device slots)."""
        ...

    def host_bytes(self) -> int:
        """Host RAM the engine holds for the device (masters, moments, staging), for the planner."""
        ...


def weak_hook(method, *bound) -> Callable:
    """A tensor hook that calls an engine's bound `method` (with `bound` arguments first) while the
    engine lives. Autograd holds hooks from C++, where Python's collector cannot see the cycle
    engine -> model -> parameter -> hook -> engine: a hook holding the engine strongly keeps it,
    its weights and its optimizer state alive after the last reference (a second engine in one
    process, as device_checks and tests build, then shares the card with the first)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        target = ref()
        if target is not None:
            target(*bound, *args)
    return hook


def step_divisor(micro_batches: list[Batch], total_targets: int | None) -> int:
    """What every micro-batch's summed loss is divided by: the step's trained-token count, over every
    rank's micro-batches under data parallelism (the loop passes it), so that the gradients summed
    across ranks are the gradient of the mean loss over the whole global batch."""
    count = sum(b.num_targets for b in micro_batches) if total_targets is None else total_targets
    return max(count, 1)


def to_float(value: torch.Tensor | float) -> float:
    """A step's scalar for the log; NaN for a fake tensor (the estimate runs steps without values)."""
    if isinstance(value, torch.Tensor) and is_fake(value):
        return float("nan")
    return float(value)


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast for precision bf16 (the default on CUDA only: fp32 is the CPU's fast dtype)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_loss(stack, activations_cfg, loss_cfg, device: torch.device, precision: str, batch: Batch,
               reading=memory.NO_READING, training: bool = True, store=None):
    """The exact loss (loss.LossOutput) of `batch` (on the device) through the whole model as it sits
    on the device: the blocks as activations_cfg checkpoints them (`store`: their inputs' store),
    then the final norm, head and loss; the meter's phases and segments marked on the way."""
    blocks = activations.runner(activations_cfg, store)
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


def check_resumable(state: EngineState, names: list[str], engine: str,
                    decided_by: str = "the method, lora.* or freeze settings") -> None:
    """One sentence when a checkpoint trained other tensors than this run trains: nothing could be
    resumed exactly. It names what differs: the engine that wrote the checkpoint, or, under the same
    engine, `decided_by`: what decides which tensors this engine trains (a training run has already
    refused another method, adapter or freeze patterns, run_folder's identity: lsp names lsp.train_other)."""
    mine, theirs = set(names), set(state.trainable)
    if mine == theirs:
        return
    only = sorted(theirs - mine) or sorted(mine - theirs)
    side = "the checkpoint has" if theirs - mine else "this run trains"
    lacks = f"{side} {len(only)} trained tensor(s) the other lacks, e.g. '{only[0]}'"
    afresh = "or start afresh with train.overwrite=true or another output_dir."
    if state.engine != engine:
        raise UserError(f"the checkpoint was written by engine {state.engine} and trained other tensors than this run"
                        f" (engine {engine}) does ({lacks}); resume with the engine and settings it was written with"
                        f" (engine={state.engine}), {afresh}")
    raise UserError(f"the checkpoint trained other tensors than this run does ({lacks}): {decided_by} differ(s) from"
                    f" the checkpoint's; resume with the settings it was written with, {afresh}")


def copy_named(targets: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    """Copy source[name] into targets[name] for every name (dtype and device converted on the way)."""
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(source[name])
