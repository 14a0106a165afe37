"""The engine contract: what train.py, checkpoints, export and the planner use of an engine, and what
one step reports. Nothing else lives here; the parts engines share sit below them (step/, optim/,
store/, device/)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from slimtune.data.dataset import Batch
from slimtune.store.checkpoint import EngineState

# The next step's (micro_batches, total_targets), handed to step() ahead of time (`then=`).
NextStep = tuple[list[Batch], "int | None"]


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


class Engine(abc.ABC):
    """What train.fit, checkpoints, export and the planner's estimate use of an engine. Every engine
    is built as `Engine(stack, cfg: RunConfig, device, precision, dist)` (see registry.EngineSpec.build)
    and keeps `stack` and `device`; under data parallelism it sums its gradients across dist's ranks
    before its optimizer. The methods with a body are defaults an engine overrides where it differs."""

    name: str
    meter: object  # memory.meter_for(...): the device meter its steps read (the estimate swaps it)
    stack: object  # model.stack.Stack: the model it trains
    device: torch.device  # the device it was built for
    # True: step() may take the next step's batches (`then=`) and begin that step before this one ends.
    starts_ahead: bool = False
    # True: the training loop shows a progress bar; work inside a step long enough to need its own (lsp's
    # projector fit) shows one too. train.fit sets it.
    progress: bool = False
    # True: without a bar (--no-progress), such work says one line as it begins, so a log never sits
    # silent through it. train.fit sets it on rank 0.
    notes: bool = False

    @abc.abstractmethod
    def step(self, micro_batches: list[Batch], total_targets: int | None = None,
             then: NextStep | None = None) -> StepResult:
        """One optimizer step over `micro_batches` (gradient accumulation). `total_targets`: the
        step's trained-token count over every rank (data parallelism; step_divisor), else None.
        `then`: the next step's (micro_batches, total_targets), passed only to an engine that
        `starts_ahead`, and only where nothing reads the engine between the two steps
        (train._next_starts_early); the next call gets those same batches. Others never see it."""

    @abc.abstractmethod
    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        """Summed exact loss and trained-token count over `batches`, without gradients."""

    @abc.abstractmethod
    def state_dict(self) -> EngineState:
        """Everything exact resume needs, in the format every engine shares."""

    @abc.abstractmethod
    def load_state_dict(self, state: EngineState) -> None:
        """Resume from a state this or another engine wrote; one sentence (UserError) if it cannot."""

    @abc.abstractmethod
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained weights by parameter name: what export writes (the model's own parameters may
        point elsewhere, e.g. at device slots)."""

    @abc.abstractmethod
    def host_bytes(self) -> int:
        """Host RAM the engine holds for the device (masters, moments, staging), for the planner."""

    @property
    def devices(self) -> list[torch.device]:
        """Every device the engine computes on: its own device, unless it has several workers."""
        return [self.device]

    def trained_numel(self) -> int:
        """Trained weights: requires_grad's count, unless the engine trains weights autograd does not
        see (lsp's projected matrices are frozen parameters trained through their subspace)."""
        return sum(p.numel() for p in self.stack.model.parameters() if p.requires_grad)

    def use_sample(self, batches: list[Batch]) -> None:
        """The fit sample: `EngineSpec.sample_examples(cfg)` examples held out of training, as batches,
        handed over once before the first step (lsp fits its projectors on them). By default unused."""
        del batches
