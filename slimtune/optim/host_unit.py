"""Host units: modules that rest on the host and visit the device a slot at a time, with their own
AdamW on the host. Engines that keep a model's state off the device (slide's blocks; a pipeline's
stages) are built from them.

A unit's parameters point into its HostAdam's flat masters at rest and at slot views while it is
bound (`bind`). Two orderings are the unit's to keep: it is never uploaded while its last host update
is still running (`bind` waits for `update_job`), and its gradients reach the accumulators through a
host staging buffer (`accumulate`, run on the engine's host worker). Host storage is marked
host-resident, so the device meter counts only what a GPU would hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from slimtune.device import memory, runtime
from slimtune.config import TrainConfig
from slimtune.dist.ranks import SINGLE
from slimtune.optim import rules
from slimtune.optim.host_adam import (CODED, MOMENTS, Group, HostAdam, Layout, Working, coded_state, host_threads,
                                      load_coded_state)


class HostUnit:
    """Modules whose tensors live on the host and move to a device slot together: their slot binding,
    and for the trainable ones a HostAdam (fp32 masters in two flat groups, decayed matrices and
    undecayed vectors as in every engine, gradient accumulators, bf16 shadows when computing in bf16,
    moments in RAM or files). Frozen tensors stay on the host (pinned on CUDA) and go up as they are.
    `weight_dtype`: what trainable tensors go up in (None: their masters' dtype).

    With a `gradient_sink` (a chunk working set, chunk/host_gradients.py) the unit has no HostAdam:
    its trainable tensors rest on the host in `weight_dtype` as plain weights (2 bytes a number in
    bf16), their gradients go to the sink, and whoever owns the sink updates them."""

    def __init__(self, name: str, modules: list[nn.Module], device: torch.device, weight_dtype: torch.dtype | None,
                 train: TrainConfig, moments_dir: Path | None, gradient_sink=None, whole_grads: bool = False,
                 row_grads: bool = False, working: Working | None = None, direct: bool = False):
        """`whole_grads`: each micro-batch's gradients come down whole, in the compute dtype (a block's
        slot; not an LM head's fp32 tiles or an embedding's summed rows), so with one micro-batch a step
        the accumulators keep them in that dtype. `row_grads`: a table's gradient keeps only the rows
        a step touches (an embedding's, on one rank: optim/row_grads.py). `working`: an accumulator
        shared with other units whose updates never interleave with this one's gradients. `direct`:
        no accumulators at all: its AdamW reads each gradient where it arrives (update_from,
        update_rows: one micro-batch a step, no clipping, one rank)."""
        self.working, self.direct = working, direct
        self.name, self.device, self.whole_grads, self.row_grads = name, device, whole_grads, row_grads
        tensors = []
        for owner, attr, tensor, is_param in runtime.own_tensors(modules):
            if is_param and tensor.requires_grad:
                tensors.append(runtime.SlotTensor(owner, attr, tensor, tensor.data, weight_dtype or tensor.dtype, True))
            else:
                host = self._frozen_host(owner, attr, tensor, is_param)
                tensors.append(runtime.SlotTensor(owner, attr, tensor if is_param else None, host, tensor.dtype, False))
        self.accumulators: dict[int, torch.Tensor] = {}  # id(param) -> its host gradient accumulator
        self.members: list[tuple[nn.Parameter, int, int]] = []  # (param, group, member) in the HostAdam
        self.gradient_sink = gradient_sink
        trainable = [t for t in tensors if t.trainable]
        if gradient_sink is not None:
            self._rest_as_weights(trainable)
        self.adam = self._adopt(trainable, train, moments_dir) if trainable and gradient_sink is None else None
        self.binding = runtime.SlotBinding(tensors)
        self.update_job = None  # the last AdamW submitted for this unit
        self.norms: list[torch.Tensor] = []  # its step gradients' norms, noted once they are complete
        # The ranks its complete gradients are summed across (the engine sets it under data parallelism).
        self.dist = SINGLE
        self.ready = None  # the event of its last copy into the slot (None on the CPU)

    def _frozen_host(self, owner: nn.Module, attr: str, tensor: torch.Tensor, is_param: bool) -> torch.Tensor:
        if self.device.type != "cuda":
            return memory.mark_host_resident(tensor.data)
        host = runtime.to_host_storage(tensor.data, self.device)  # pinned, so uploads are DMA
        if is_param:
            tensor.data = host
        else:
            owner._buffers[attr] = host
        return host

    def _adopt(self, trainable: list[runtime.SlotTensor], train: TrainConfig, moments_dir: Path | None) -> HostAdam:
        """The trainable tensors move into a HostAdam's flat masters; their parameters point there."""
        groups = rules.decay_groups([t.param for t in trainable], train.weight_decay)
        by_param = {id(t.param): t for t in trainable}
        master_dtype = torch.promote_types(trainable[0].param.dtype, torch.float32)  # fp32 masters; fp64 stays
        device_dtype = trainable[0].device_dtype
        layout = dataclasses.replace(Layout.for_run(train, device_dtype if self.whole_grads else None, self.row_grads),
                                     accumulate=not self.direct)
        adam = HostAdam(self.name, [Group(tuple(p.shape for p in params), decay) for params, decay in groups],
                        master_dtype, self.device, rules.adamw_settings(train),
                        shadow_dtype=device_dtype, moments_dir=moments_dir, working=self.working, layout=layout,
                        threads=host_threads(train, self.device))
        adam.load_group_masters([[p.data for p in params] for params, _ in groups])
        with torch.no_grad():
            for k, (params, _) in enumerate(groups):
                for i, param in enumerate(params):
                    views, t = adam.member(k, i), by_param[id(param)]
                    # Between steps a parameter points at what rests on the host: its whole master, or
                    # under the split layout its bf16 weight (the master is rebuilt only to update).
                    rest = views.master if views.master is not None else views.shadow
                    param.data, t.host, t.shadow = rest, rest, views.shadow
                    self.accumulators[id(param)] = views.grad
                    self.members.append((param, k, i))
        return adam

    def _rest_as_weights(self, trainable: list[runtime.SlotTensor]) -> None:
        """Trainable tensors rest on the host in the dtype they go up in (pinned on CUDA)."""
        for t in trainable:
            if t.host.dtype != t.device_dtype or self.device.type == "cuda":
                t.host = runtime.to_host_storage(t.host, self.device, t.device_dtype)
            else:
                t.host = memory.mark_host_resident(t.host)
            t.param.data = t.host

    @property
    def slot(self) -> runtime.Slot | None:
        return self.binding.slot

    def host_bytes(self) -> int:
        """Host RAM this unit holds: its HostAdam's, and its frozen tensors."""
        frozen = sum(t.host.numel() * t.host.element_size() for t in self.binding.tensors if not t.trainable)
        return frozen + (self.adam.host_bytes() if self.adam is not None else 0)

    def rows(self, param: nn.Parameter, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a table this unit holds, at full precision (an embedding's lookup on the
        host: a trained table's rows from its master, not from the bf16 weight that goes up)."""
        found = next(((k, i) for p, k, i in self.members if p is param), None)
        return param.data[ids] if found is None else self.adam.rows(*found, ids)

    def tensor_of(self, param: torch.Tensor) -> runtime.SlotTensor | None:
        return next((t for t in self.binding.tensors if t.param is param), None)

    # ------------------------------------------------------------ device side

    def bind(self, slot: runtime.Slot, link: runtime.Link, with_grads: bool) -> object:
        """Copy the unit into `slot` (after its last AdamW: never upload a unit mid-update)."""
        if self.update_job is not None:
            self.update_job.result()
        return self.binding.bind(slot, link, with_grads)

    # ------------------------------------------------------------ host work (on the worker)

    def accumulate(self, staging: torch.Tensor, event: object, final: bool = False) -> None:
        """Add the staged gradients; on the step's last micro-batch also note their norms (on the
        worker, so the global norm for clipping costs the device loop nothing)."""
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            for t in self.binding.tensors:
                if t.trainable and self.gradient_sink is not None:
                    self.gradient_sink.add_dense(t.param, t.grad_in(staging))
                elif t.trainable:
                    self.accumulators[id(t.param)].add_(t.grad_in(staging))
        if final:
            self.note_norms()

    def note_norms(self) -> None:
        """The step's gradients are complete on this rank: summed across ranks (on the host worker, so
        the device goes on with the blocks below meanwhile), then their norms noted."""
        if self.adam is not None:
            self.dist.all_reduce_(self.adam.grads, host=True, what=f"the {self.name}'s gradient sum")
        self.norms = self.adam.grad_norms() if self.adam is not None else []

    def update(self, lr: float, clip: float, guard: StepGuard | None = None,
               shadows: list[torch.Tensor] | None = None) -> None:
        """This unit's AdamW, unless `guard` says the step may not update: then, or when its own
        gradients are not finite, its accumulators are emptied and the guard trips for the units after.
        `shadows`: where the updated weights go up from, if not the HostAdam's own (HostAdam.update)."""
        if guard is not None and (guard.tripped or not all(rules.is_finite(n) for n in self.norms)):
            guard.tripped = True
            self.adam.discard()
            return
        self.adam.update(lr, clip, shadows)

    def discard(self) -> None:
        """The step's gradients dropped without an update (its loss or gradient norm was not finite)."""
        self.adam.discard()

    def update_from(self, staging: torch.Tensor, event: object, lr: float, clip: float, guard: StepGuard) -> None:
        """(direct) This unit's AdamW straight from its gradients in the staging buffer, their norms
        noted first; the guard as in update."""
        if event is not None:
            event.synchronize()
        where = {id(t.param): t.grad_in(staging).reshape(-1) for t in self.binding.tensors if t.trainable}
        pieces: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.adam.groups]
        for param, k, i in self.members:
            pieces[k].append((self.adam.groups[k].spans()[i][0], where[id(param)]))
        self.norms = [_norm([g for _, g in group]) for group in pieces]
        if guard.tripped or not all(rules.is_finite(n) for n in self.norms):
            guard.tripped = True
            return
        self.adam.update(lr, clip, grads=pieces)

    def update_rows(self, param: nn.Parameter, start: int, stop: int, rows: torch.Tensor, lr: float, clip: float,
                    guard: StepGuard) -> None:
        """(direct) AdamW over rows [start, stop) of a table this unit holds, from their gradient as it
        arrived (an LM head's vocabulary tile): the tiles come in order, the first advances the step."""
        (k, i), = [(k, i) for p, k, i in self.members if p is param]
        if start == 0:
            self.norms = []
        self.norms.append(_norm([rows]))
        if guard.tripped or not rules.is_finite(self.norms[-1]):
            guard.tripped = True
            return
        offset, width = self.adam.groups[k].spans()[i][0], rows.shape[-1]
        self.adam.update_span(k, offset + start * width, offset + stop * width, rows, lr, clip, first=start == 0)


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of several tensors together, summed in fp32 at least."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(
        t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors]))


def units_state(units: list[HostUnit], names: dict[int, str]) -> tuple[dict, dict, dict]:
    """(exp_avg, exp_avg_sq, adam_steps) by parameter name over the units' HostAdams (fp32: the live
    tensors where they rest whole), for checkpoint.EngineState; `names`: id(parameter) -> its name."""
    exp_avg, exp_avg_sq, steps = {}, {}, {}
    for unit in units:
        for param, k, i in unit.members:
            name = names[id(param)]
            exp_avg[name], exp_avg_sq[name] = (unit.adam.moment_of(k, i, m) for m in MOMENTS)
            steps[name] = float(unit.adam.state(k)["step"])
    return exp_avg, exp_avg_sq, steps


def units_masters(units: list[HostUnit], names: dict[int, str]) -> dict[str, torch.Tensor]:
    """The units' masters at full precision by parameter name (views, or rebuilt from their split)."""
    return {names[id(param)]: unit.adam.master_of(k, i) for unit in units for param, k, i in unit.members}


def load_units_state(units: list[HostUnit], names: dict[int, str], state) -> None:
    """Masters, moments and step counts by parameter name (a checkpoint.EngineState) into the units'
    own buffers (RAM or mapped files), a group at a time (8-bit moments are coded over a whole
    group); a tensor the checkpoint has no moments for keeps its own. Shadows follow the masters."""
    for unit in units:
        groups: dict[int, list[tuple[int, str]]] = {}
        for param, k, i in unit.members:
            groups.setdefault(k, []).append((i, names[id(param)]))
        for k, members in groups.items():
            members.sort()
            moments = {m: [getattr(state, m)[n] if n in state.exp_avg else unit.adam.moment_of(k, i, m)
                           for i, n in members] for m in MOMENTS}
            saved = [n for _, n in members if n in state.adam_steps]
            step = state.adam_steps[saved[0]] if saved else float(unit.adam.state(k)["step"])  # one count a group
            unit.adam.load_group(k, [state.trainable[n] for _, n in members], moments, step)
    load_coded_state([u.adam for u in units if u.adam is not None], state.extra.get(CODED, {}))


def units_coded(units: list[HostUnit]) -> dict[str, torch.Tensor]:
    """The units' 8-bit moments as they rest, for EngineState.extra[CODED] (host_adam.coded_state)."""
    return coded_state([u.adam for u in units if u.adam is not None])


class StepGuard:
    """Shared by the units whose updates run while backward still goes on: once one finds its
    gradients non-finite, it and every unit after it skip their update (units before it already
    updated, with finite gradients)."""

    def __init__(self):
        self.tripped = False
