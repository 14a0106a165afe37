"""Engine roundpipe's optimizer variants (roundpipe.optimizer), one object each, chosen once when
the engine is built: where a step's gradients are summed, which weights a step computes at, the
gradient norm, the learning rate, the update and what a checkpoint keeps of it. The engine asks its
variant and never which one it has.

  sync   after the last backward job, the global norm, clipping, every unit's AdamW on the host
         worker; the next step uploads the new weights. Exactly plain AdamW.
  async  the step's AdamW runs on a thread of its own while the next step computes, which therefore
         sees the weights from before it: step k (from 0) computes its gradient at the weights after
         k - 1 updates (steps 0 and 1 both at W0), and W_k = AdamW(W_{k-1}, gradient at W_{k-2}).
         Not exact: one step stale, as the spec's reference is by default. The weights that go up
         are two host versions of every trainable tensor: step s reads version s % 2, and step s's
         update writes its result straight into the version step s read, for step s + 2
         (step_weights.py: no copies, 2 bytes a number of host RAM more in bf16). The gradients land
         in buffers of their own (4 bytes a number more), since the update before still reads the
         accumulators. The AdamW goes unit by unit in the order a step first reads them (the
         embedding table, then layer by layer), and the step after next uploads a unit as soon as
         its own update is done, so its first jobs start before the whole update has ended.
         Checkpoints keep the version the next step reads, so resume is exact. Since the next step
         needs nothing of this one, it may begin before this one ends (`starts_ahead`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.config import RunConfig, TrainConfig
from slimtune.device import runtime
from slimtune.errors import UserError
from slimtune.optim import rules
from slimtune.optim.host_unit import HostUnit
from slimtune.store.checkpoint import copy_named
from slimtune.engines.roundpipe.step_weights import StepWeights, WeightVersions

Source = Callable[[runtime.SlotTensor], torch.Tensor]  # slot tensor -> the host tensor its upload reads
Trainables = list[tuple[torch.Tensor, str]]  # (parameter, its name) of every trained tensor


class Update(abc.ABC):
    """One optimizer variant over the engine's host units (`units`: every block, the final norm
    with the head, the untied embedding; `table_unit` the index of the one holding the embedding
    table, -1 for none). `host` is the engine's host worker, where the gradient additions run;
    `device` and `inline` (the planner's fake step) are for a variant that starts a thread of its
    own. Every variant is built with the same arguments, so the engine names none."""

    starts_ahead: bool = False  # the next step may begin before this one ends (the engine's then=)
    updates_exposed: bool = True  # the host AdamW adds to the step's time (speed.overlapped_step_time)

    def __init__(self, units: list[HostUnit], table_unit: int, train_cfg: TrainConfig, host: runtime.HostWorker,
                 device: torch.device, inline: bool):
        self.units, self.train_cfg = units, train_cfg
        self.thread = host  # the host worker its AdamW runs on
        # The units whose weights a step waits for, unit by unit (StepWeights); the rest are read in place.
        self.versioned: frozenset[int] = frozenset()

    @classmethod
    def refuse(cls, cfg: RunConfig) -> None:
        """What this variant does not do, refused in one sentence (before anything is built)."""

    def lr_at(self, step: int) -> float:
        return rules.lr_at(self.train_cfg, step)

    def grad_norm(self) -> torch.Tensor:
        """The global norm of the step's summed gradients, before clipping."""
        grads = self.gradients()
        if not grads:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))

    def apply(self, lr: float, grad_norm: torch.Tensor, applied: bool, weights: StepWeights) -> None:
        """The step's update (or, not `applied`, its gradients dropped), clipped to max_grad_norm."""
        coefficient = rules.clip_coefficient(grad_norm, self.train_cfg.max_grad_norm)
        self._apply(lr, 1.0 if is_fake(coefficient) else float(coefficient), applied, weights)

    @abc.abstractmethod
    def _apply(self, lr: float, coef: float, applied: bool, weights: StepWeights) -> None: ...

    @abc.abstractmethod
    def gradients(self) -> list[torch.Tensor]:
        """The step's summed gradients (what ranks sum and the norm reads)."""

    @abc.abstractmethod
    def accumulator(self, param: torch.Tensor) -> torch.Tensor:
        """Where a trainable tensor's downloaded gradient is added."""

    @abc.abstractmethod
    def source_at(self, step: int) -> Source:
        """slot tensor -> the host tensor step `step`'s uploads read."""

    def pending_for(self, step: int) -> dict[int, Future]:
        """Unit -> the update still running that writes the weights step `step` reads."""
        del step
        return {}

    def wait(self) -> None:
        """Until every submitted update is done (before the masters or moments are read)."""

    def host_bytes(self) -> int:
        """Host RAM it holds beside the units' own."""
        return 0

    def saved(self, step: int, trainables: Trainables) -> dict:
        """Its entries of a checkpoint's extra["roundpipe"] after `step` steps."""
        del step, trainables
        return {}

    def load(self, step: int, saved: dict, trainables: Trainables, trainable: dict[str, torch.Tensor]) -> None:
        """From a checkpoint after `step` steps: `saved` its entries (empty: another engine's or
        variant's), `trainable` the masters by name (already copied into the units)."""
        del step, saved, trainables, trainable

    def close(self) -> None:
        """Stop the threads it started."""


class SyncUpdate(Update):
    """Every unit's AdamW on the host worker once the step's gradients are summed: exact."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._accumulators = {key: grad for unit in self.units for key, grad in unit.accumulators.items()}

    def gradients(self) -> list[torch.Tensor]:
        return [g for unit in self.units if unit.adam is not None for g in unit.adam.grads]

    def accumulator(self, param: torch.Tensor) -> torch.Tensor:
        return self._accumulators[id(param)]

    def source_at(self, step: int) -> Source:
        return lambda t: t.upload  # where the tensor lives: the last update's weights

    def _apply(self, lr: float, coef: float, applied: bool, weights: StepWeights) -> None:
        for unit in self.units:
            if unit.adam is not None:
                self.thread.submit(unit.update, lr, coef) if applied else self.thread.submit(unit.discard)
        self.thread.barrier()


class AsyncUpdate(Update):
    """Each step's AdamW on a thread of its own while the next step computes at the weights from
    before it (one step stale), through two host versions of the weights (step_weights.py)."""

    starts_ahead = True
    updates_exposed = False  # hidden behind the next step

    def __init__(self, units: list[HostUnit], table_unit: int, train_cfg: TrainConfig, host: runtime.HostWorker,
                 device: torch.device, inline: bool):
        super().__init__(units, table_unit, train_cfg, host, device, inline)
        self.thread = runtime.HostWorker(inline=inline, device=device)  # waits on the workers' copy events
        self.versions = WeightVersions(units, device)
        self.incoming = {id(t.param): runtime.host_empty(t.host.shape, t.host.dtype, device, pinned=False).zero_()
                         for unit in units for t in unit.binding.tensors if t.trainable}
        self.versioned = frozenset(i for i, unit in enumerate(units) if any(t.trainable for t in unit.binding.tensors))
        self._order = _first_read_order(units, table_unit)
        self._updating: dict[int, Future] = {}  # per unit (units index), its last update submitted
        self._updating_step = -1  # the step whose update that is

    @classmethod
    def refuse(cls, cfg: RunConfig) -> None:
        if cfg.train.on_nonfinite == "skip":  # a step's update may not be left out once the next has begun
            raise UserError("roundpipe.optimizer=async has already started the next step when a step's gradient is"
                            " found not finite; set train.on_nonfinite=stop or roundpipe.optimizer=sync.")

    def gradients(self) -> list[torch.Tensor]:
        return list(self.incoming.values())

    def accumulator(self, param: torch.Tensor) -> torch.Tensor:
        return self.incoming[id(param)]  # the step's own: the update before still reads the accumulators

    def source_at(self, step: int) -> Source:
        return lambda t: self.versions.of(t.param, step % 2) if t.trainable else t.upload

    def pending_for(self, step: int) -> dict[int, Future]:
        """The update two steps before writes step `step`'s version: it may still be running if it
        is the last one submitted, and is done otherwise (the update after it waited for it first)."""
        return self._updating if self._updating_step == step - 2 else {}

    def _apply(self, lr: float, coef: float, applied: bool, weights: StepWeights) -> None:
        """The previous update must be done (it reads the accumulators), this step's sums move into
        them, and each unit's AdamW is queued in the order the step after next needs them, each
        writing its result into the version this step read."""
        self.wait()
        with torch.no_grad():
            for unit in self.units:
                for t in unit.binding.tensors:
                    if t.trainable:
                        unit.accumulators[id(t.param)].copy_(self.incoming[id(t.param)])
                        self.incoming[id(t.param)].zero_()
        parity = weights.step % 2
        for index in self._order:
            self._updating[index] = self.thread.submit(
                _update_unit, self.units[index], self.versions.flats(index, parity), weights.reads_of(index), lr,
                coef, applied)
        self._updating_step = weights.step

    def wait(self) -> None:
        updating, self._updating = self._updating, {}
        for future in updating.values():
            future.result()

    def host_bytes(self) -> int:
        """The second version of the weights and the incoming gradients."""
        return self.versions.extra_bytes() + sum(runtime.nbytes(t) for t in self.incoming.values())

    def saved(self, step: int, trainables: Trainables) -> dict:
        """The weights the next step computes at: one update behind the masters."""
        return {"compute": {name: self.versions.of(p, step % 2) for p, name in trainables}}

    def load(self, step: int, saved: dict, trainables: Trainables, trainable: dict[str, torch.Tensor]) -> None:
        """The next step's version as saved (a sync run's checkpoint: the masters), the one after's
        the masters."""
        compute = saved.get("compute", {})
        copy_named({n: self.versions.of(p, (step + 1) % 2) for p, n in trainables}, trainable)
        copy_named({n: self.versions.of(p, step % 2) for p, n in trainables},
                   {n: compute.get(n, trainable[n]) for _, n in trainables})

    def close(self) -> None:
        self.thread.close()


def _update_unit(unit: HostUnit, into: list[torch.Tensor], reads: list, lr: float, coef: float, applied: bool) -> None:
    """One unit's AdamW into the version its step read, once that step's uploads of it have left
    host memory; a step that may not update still writes the unchanged weights there, as the step
    after next reads them."""
    for event in reads:
        event.synchronize()
    if applied:
        unit.update(lr, coef, shadows=into)
    else:
        unit.discard()
        unit.adam.refresh_shadows(into)


def _first_read_order(units: list[HostUnit], table_unit: int) -> list[int]:
    """The units with an optimizer, in the order a step first reads them: the embedding table (its
    rows are gathered first), then layer by layer (the forward jobs), so that the step after next's
    first jobs need not wait for the whole update."""
    order = [table_unit, *range(len(units))]
    return [i for n, i in enumerate(order) if i >= 0 and i not in order[:n] and units[i].adam is not None]


VARIANTS: dict[str, type[Update]] = {"sync": SyncUpdate, "async": AsyncUpdate}  # roundpipe.optimizer's choices


def variant_of(cfg: RunConfig) -> type[Update]:
    """The variant a run's roundpipe.optimizer names."""
    return VARIANTS[cfg.section("roundpipe").optimizer]
