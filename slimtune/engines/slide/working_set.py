"""Engine slide's working set: which trained numbers the host keeps, adds gradients into and
updates, as one object the engine calls (chosen once from slide.working_set). The engine moves
blocks, activations and gradients the same way under both; the working set decides what the host
does with what arrives, the learning rate, the gradient norm, the update and the checkpoint.

AllTensors (the default): every trainable tensor has an fp32 master, a gradient accumulator and
AdamW moments in its host unit's HostAdam (optim/host_unit.py). With clipping off each unit's AdamW
runs as soon as its gradients are complete, while the device goes on with the blocks below; with
clipping every update waits for the global norm, noted per unit by its last host job, and is then
submitted in the order the next step reads the units, each unit's `update_job` its own AdamW (the
next forward may overtake the rest).

OneChunk (slide.working_set=chunk: ChunkFT's working set on the window, spec chunkft.md): the units
keep no HostAdam; their trainable tensors rest on the host as weights in the compute dtype, only
the active chunk's pieces of the gradients that arrive are added up (host_gradients.py), and after
backward one host AdamW updates that chunk (engines/chunk/state.py: every chunk's masters and
moments, in RAM or files) and writes its new weights into the host tensors the next upload reads,
one host job per unit the chunk touches, in the order the next step reads them: each such unit's
`update_job` is its own write (behind the chunk's AdamW), the units outside the chunk wait for nothing.
"""

from __future__ import annotations

import abc

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from slimtune.config import RunConfig
from slimtune.device import runtime, speed
from slimtune.dist.ranks import Dist
from slimtune.engines.chunk.state import ChunkState, axis_of, narrow
from slimtune.engines.chunk.state import open_settings as chunk_open_settings
from slimtune.engines.chunk.state import scratch as chunk_scratch
from slimtune.engines.slide.host_gradients import ActiveGradients
from slimtune.errors import UserError
from slimtune.optim import host_adam, rules
from slimtune.optim.host_unit import (CODED, HostUnit, StepGuard, load_units_state, units_coded, units_masters,
                                      units_state)
from slimtune.store.checkpoint import EngineState, copy_named


class WorkingSet(abc.ABC):
    """The seam between engine slide and its working set. The class methods answer for a RunConfig
    before anything is built (config's check, scratch folders, the planner); an instance serves one
    engine: built before the host units (they take its `sink`), then `attach`ed to them."""

    # False: the estimate runs the step at full depth (what it holds depends on a partition of the model).
    by_depth = True
    # True: the units keep no gradient accumulators; each update reads its gradients where they arrive.
    direct = False
    # Where the host units send a block's gradients; None: into their own HostAdams' accumulators.
    sink: ActiveGradients | None = None

    # ------------------------------------------------------------ before anything is built

    @classmethod
    @abc.abstractmethod
    def refuse(cls, cfg: RunConfig) -> None:
        """What this working set does not do, refused in one sentence (UserError)."""

    @classmethod
    def scratch(cls, cfg: RunConfig) -> dict[str, str]:
        """Folders of its own it keeps files in: {setting: folder}."""
        del cfg
        return {}

    @classmethod
    def open_settings(cls, cfg: RunConfig) -> list[dict]:
        """Settings the run left to the planner, as candidates in order of preference."""
        del cfg
        return []

    @classmethod
    @abc.abstractmethod
    def modelled_time(cls, cfg: RunConfig, counts: speed.StepCounts, gpu, flops: float,
                      dequant: float) -> speed.StepTime:
        """The step's modelled time, given its FLOPs and a 4-bit base's dequantized bytes."""

    # ------------------------------------------------------------ building

    def embedding_dtype(self, weight_dtype: torch.dtype | None) -> torch.dtype | None:
        """What an untied embedding rests in on the host (None: its master's dtype); its rows are
        gathered there, never sent up, so it needs no narrow copy unless it rests narrow anyway."""
        del weight_dtype
        return None

    @abc.abstractmethod
    def moments_bytes(self, trained: list[nn.Parameter]) -> int:
        """Bytes of AdamW moments the host units keep (slide.moments=disk: the moment files' need)."""

    def block_accumulator(self, numel: int, dtype: torch.dtype, device: torch.device) -> host_adam.Working | None:
        """One gradient accumulator every block's HostAdam may share (sized for the largest block),
        when each block's update follows its own gradients at once on the FIFO worker; None: each
        keeps its own."""
        del numel, dtype, device
        return None

    @abc.abstractmethod
    def attach(self, units: list[HostUnit], worker: runtime.HostWorker, read_order: list[HostUnit]) -> None:
        """The engine's host units (blocks, then edges), the worker their host jobs run on, and the
        same units in the order a step first reads them (the order updates after backward go in)."""

    # ------------------------------------------------------------ one step

    @abc.abstractmethod
    def begin_step(self, step: int) -> float:
        """A step begins: its learning rate."""

    def backward_update(self, lr: float, guard: StepGuard) -> tuple | None:
        """The HostUnit.update arguments for the units to update as their last gradients arrive, in
        the last micro-batch's backward; None: nothing updates before the step's end."""
        del lr, guard
        return None

    @abc.abstractmethod
    def add_head_rows(self, weight: nn.Parameter, start: int, stop: int, rows: torch.Tensor) -> None:
        """Rows [start, stop) of the LM head's gradient (one vocabulary tile, on the host)."""

    @abc.abstractmethod
    def add_embedding_rows(self, weight: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor,
                           padding_idx: int | None) -> None:
        """The embedding's gradient rows by token id, the padding row excepted (as nn.Embedding)."""

    @abc.abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """After backward, the worker idle: the norm of the gradients the update will clip by."""

    @abc.abstractmethod
    def update(self, lr: float, grad_norm: torch.Tensor, applied: bool) -> None:
        """The step's updates submitted (or, not `applied`, its gradients dropped), not waited for:
        each unit's `update_job` is the last job that writes what it uploads or reads on the host."""

    def end_step(self, applied: bool) -> None:
        """After the step's updates finished."""
        del applied

    def extras(self) -> dict:
        """The step's own figures, for StepResult.extras."""
        return {}

    # ------------------------------------------------------------ accounting and checkpoints

    def host_bytes(self) -> int:
        """Host RAM held besides the units' own (their HostAdams and frozen tensors)."""
        return 0

    def disk_bytes(self) -> int:
        """Disk held by its state (block inputs on disk are the store's)."""
        return 0

    @abc.abstractmethod
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained weights at full precision by parameter name."""

    @abc.abstractmethod
    def state_dict(self, engine: str, step: int) -> EngineState:
        """Everything exact resume needs."""

    @abc.abstractmethod
    def load_state_dict(self, state: EngineState) -> None:
        """Weights, moments and step counts (the names were checked by the engine)."""


class AllTensors(WorkingSet):
    """Every trainable tensor's master, accumulator and moments in its host unit's HostAdam."""

    def __init__(self, cfg: RunConfig, names: dict[int, str], model: nn.Module, device: torch.device, dist: Dist):
        del model, device  # the units sum their own gradients across ranks
        self.train_cfg, self.names = cfg.train, names
        self.clipping = cfg.train.max_grad_norm > 0
        # Without clipping, one micro-batch a step and one rank, a gradient is complete where it
        # arrives: each unit's AdamW reads it from the staging buffer (a block) or the tile (the LM
        # head) at once, and nothing holds gradients between.
        self.direct = not self.clipping and cfg.train.grad_accum == 1 and not dist.active
        self.now: tuple | None = None  # the final micro-batch's (lr, clip, guard)

    @classmethod
    def refuse(cls, cfg: RunConfig) -> None:
        if cfg.train.on_nonfinite == "skip" and cfg.train.max_grad_norm == 0:
            raise UserError("engine=slide updates each block while backward runs when clipping is off, so a step cannot"
                            " be skipped whole; set train.max_grad_norm > 0 or train.on_nonfinite=stop.")

    @classmethod
    def modelled_time(cls, cfg: RunConfig, counts: speed.StepCounts, gpu, flops: float,
                      dequant: float) -> speed.StepTime:
        """Copies overlap compute, and so does the host AdamW: during backward and recompute without
        clipping (about 3/4 of the step), under the next step's forward with it (about 1/4: the loop
        hands step() the next batches). Whatever rests on disk (block inputs, moment files) is read and
        written once a step, no page cache assumed."""
        disk = 2 * counts.disk_bytes
        hidden_under = 0.25 if cfg.train.max_grad_norm > 0 else 0.75
        return speed.overlapped_step_time(flops, counts.trainable_params, gpu, cfg.precision, counts.host_link_bytes,
                                          disk, updates_exposed=False, memory_bytes=dequant, hidden_under=hidden_under)

    def moments_bytes(self, trained: list[nn.Parameter]) -> int:
        return host_adam.moments_bytes(trained, self.train_cfg.moments)

    def attach(self, units: list[HostUnit], worker: runtime.HostWorker, read_order: list[HostUnit]) -> None:
        self.units, self.worker, self.read_order = units, worker, read_order
        self.accumulators = {key: grad for unit in units for key, grad in unit.accumulators.items()}
        self.unit_of = {id(param): unit for unit in units for param, _, _ in unit.members}

    def begin_step(self, step: int) -> float:
        return rules.lr_at(self.train_cfg, step)

    def block_accumulator(self, numel: int, dtype: torch.dtype, device: torch.device) -> host_adam.Working | None:
        """Without clipping and with one micro-batch a step, a block's gradients are added and its
        AdamW runs at once (consecutive jobs on the FIFO worker, before the next block's arrive): one
        accumulator serves every block, so the blocks hold no gradients between steps."""
        if self.clipping or self.train_cfg.grad_accum != 1 or self.direct:
            return None
        return host_adam.Working(numel, dtype, device, None)

    def backward_update(self, lr: float, guard: StepGuard) -> tuple | None:
        """Without clipping, each unit's AdamW as soon as its gradients are complete (the guard stops
        the units after one whose gradients are not finite)."""
        self.now = None if self.clipping else (lr, 1.0, guard)
        return self.now

    def add_head_rows(self, weight: nn.Parameter, start: int, stop: int, rows: torch.Tensor) -> None:
        unit = self.unit_of[id(weight)]
        if unit.direct:  # the tile's rows are complete: their AdamW now
            unit.update_rows(weight, start, stop, rows, *self.now)
        else:
            self.accumulators[id(weight)][start:stop].add_(rows)

    def add_embedding_rows(self, weight: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor,
                           padding_idx: int | None) -> None:
        accumulator = self.accumulators[id(weight)]
        rows = rows.to(accumulator.dtype)
        if padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            rows[ids == padding_idx] = 0
        accumulator.index_add_(0, ids, rows)

    def grad_norm(self) -> torch.Tensor:
        """The global norm, from the per-unit norms the host jobs noted when each unit's gradients
        were complete (before any update touched them)."""
        norms = [n for u in self.units if u.adam is not None for n in u.norms]
        return torch.linalg.vector_norm(torch.stack(norms))

    def update(self, lr: float, grad_norm: torch.Tensor, applied: bool) -> None:
        """With clipping, every unit's AdamW now, in the order the next step reads them (a step that
        may not update only empties the accumulators); without, the updates ran during backward."""
        if not self.clipping:
            return
        coefficient = rules.clip_coefficient(grad_norm, self.train_cfg.max_grad_norm)
        coef = 1.0 if is_fake(coefficient) else float(coefficient)
        for unit in self.read_order:
            if unit.adam is not None:
                job = (unit.update, lr, coef) if applied else (unit.discard,)
                unit.update_job = self.worker.submit(*job)

    def disk_bytes(self) -> int:
        """The memory-mapped moment files (slide.moments=disk)."""
        return sum(u.adam.disk_bytes() for u in self.units if u.adam is not None)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The host masters (what the modules point at between steps is not relied on)."""
        return units_masters(self.units, self.names)

    def state_dict(self, engine: str, step: int) -> EngineState:
        exp_avg, exp_avg_sq, steps = units_state(self.units, self.names)
        return EngineState(engine=engine, step=step, trainable=self.trainable_state(), exp_avg=exp_avg,
                           exp_avg_sq=exp_avg_sq, adam_steps=steps, extra={CODED: units_coded(self.units)})

    def load_state_dict(self, state: EngineState) -> None:
        """Masters and moments by name, into the units' own buffers (RAM or mapped files)."""
        load_units_state(self.units, self.names, state)


class OneChunk(WorkingSet):
    """One chunk's masters, moments and gradients at a time (engines/chunk/state.py), the trainable
    tensors resting on the host as weights."""

    by_depth = False  # the host share depends on the partition of the whole model

    def __init__(self, cfg: RunConfig, names: dict[int, str], model: nn.Module, device: torch.device, dist: Dist):
        self.cfg, self.names, self.model, self.device, self.dist = cfg, names, model, device, dist
        self.train_cfg = cfg.train
        self.sink = ActiveGradients(None, names)  # its state comes with attach
        self.active = 0

    @classmethod
    def refuse(cls, cfg: RunConfig) -> None:
        if cfg.method != "full":
            raise UserError("slide.working_set=chunk is full fine-tuning a chunk at a time; set method=full.")

    @classmethod
    def scratch(cls, cfg: RunConfig) -> dict[str, str]:
        """chunk.state=disk keeps the chunks' state under chunk.state_dir."""
        return chunk_scratch(cfg)

    @classmethod
    def open_settings(cls, cfg: RunConfig) -> list[dict]:
        return chunk_open_settings(cfg)

    @classmethod
    def modelled_time(cls, cfg: RunConfig, counts: speed.StepCounts, gpu, flops: float,
                      dequant: float) -> speed.StepTime:
        """The host AdamW of the active chunk after backward, exposed; with its state in files, that
        chunk's masters and moments read and written once a step (the disk figure holds every chunk's
        state, 12 bytes a number, and the block inputs on disk)."""
        del dequant  # full fine-tuning only: no 4-bit base
        chunk = cfg.section("chunk")
        active = counts.trainable_params / chunk.n_chunks
        state_bytes = 12 * counts.trainable_params if chunk.state == "disk" else 0
        inputs = counts.disk_bytes - state_bytes if cfg.activations.checkpoint == "disk" else 0
        disk = 2 * inputs + 2 * 12 * active * (chunk.state == "disk")
        return speed.overlapped_step_time(flops, int(active), gpu, cfg.precision, counts.host_link_bytes, disk,
                                          updates_exposed=True)

    def embedding_dtype(self, weight_dtype: torch.dtype | None) -> torch.dtype | None:
        """The embedding rests narrow too: its rows are gathered in the compute dtype, and a
        full-precision copy of it is what the working set exists not to keep."""
        return weight_dtype

    def moments_bytes(self, trained: list[nn.Parameter]) -> int:
        del trained
        return 0  # the units keep no moments: the chunk state does

    def attach(self, units: list[HostUnit], worker: runtime.HostWorker, read_order: list[HostUnit]) -> None:
        """The chunks' masters and AdamW state over the trainable tensors, which rest on the host."""
        self.worker = worker
        self.host = {self.names[id(t.param)]: t.host for u in units for t in u.binding.tensors if t.trainable}
        # Per unit in read order, the names of its trainable tensors (a tied table once).
        self.unit_names = [(u, list(dict.fromkeys(self.names[id(t.param)] for t in u.binding.tensors if t.trainable)))
                           for u in read_order]
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        axis = axis_of(self.model)
        self.state = ChunkState(params, {n: axis(n, p) for n, p in params.items()}, self.cfg, self.device,
                                any(is_fake(t) for t in self.host.values()), self.host.__getitem__,
                                shares_weights=True)
        self.sink.state = self.state

    def begin_step(self, step: int) -> float:
        """The active chunk's accumulators receive this step's gradients."""
        self.active = self.state.active
        self.sink.open(self.active)
        return self.state.lr(step)

    def add_head_rows(self, weight: nn.Parameter, start: int, stop: int, rows: torch.Tensor) -> None:
        self.sink.add_rows(weight, start, stop, rows)

    def add_embedding_rows(self, weight: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor,
                           padding_idx: int | None) -> None:
        self.sink.add_indexed(weight, ids, rows, padding_idx)

    def grad_norm(self) -> torch.Tensor:
        """The chunk's gradients summed across ranks first (the worker is idle: the host group is
        this thread's until the next job)."""
        self.dist.all_reduce_(self.state.adams[self.active].grads, host=True, what="the chunk's gradient sum")
        return self.state.grad_norm(self.active)

    def update(self, lr: float, grad_norm: torch.Tensor, applied: bool) -> None:
        """The active chunk's host AdamW (clipped by its own norm), then its new weights written into
        the host tensors they go up from, a job per unit it touches in read order (that unit's
        `update_job`); or its gradients dropped (no weight changes: nothing to wait for)."""
        k = self.active
        if not applied:
            self.worker.submit(self.state.discard, k)
            return
        coefficient = rules.clip_coefficient(grad_norm, self.train_cfg.max_grad_norm)
        new_weights: dict[str, list] = {}  # name -> [(piece, its new weights)], filled by the AdamW job

        def note(piece, values: torch.Tensor) -> None:
            new_weights.setdefault(piece.name, []).append((piece, values))

        self.worker.submit(self.state.update, k, lr, 1.0 if is_fake(coefficient) else float(coefficient), note)
        touched = {piece.name for piece in self.state.chunks[k]}
        for unit, names in self.unit_names:
            mine = [n for n in names if n in touched]
            if mine:  # runs after the AdamW job (one worker, in order), before the next chunk's overwrites its views
                unit.update_job = self.worker.submit(self._write, new_weights, mine)

    def _write(self, new_weights: dict[str, list], names: list[str]) -> None:
        """On the worker: the named tensors' new pieces into the host tensors they go up from."""
        with torch.no_grad():
            for name in names:  # nothing noted when the update wrote the shared weights in place
                for piece, values in new_weights.get(name, ()):
                    narrow(self.host[name], piece).copy_(values)

    def end_step(self, applied: bool) -> None:
        if applied:
            self.state.advance()

    def extras(self) -> dict:
        return {"chunk": self.active}

    def host_bytes(self) -> int:
        """The trainable tensors' host weights and the chunk state (masters and moments in RAM, the
        active chunk's accumulators)."""
        return sum(runtime.nbytes(t) for t in self.host.values()) + self.state.host_bytes()

    def disk_bytes(self) -> int:
        return self.state.disk_bytes()

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self.state.trainable_state()

    def state_dict(self, engine: str, step: int) -> EngineState:
        return self.state.state_dict(engine, step)

    def load_state_dict(self, state: EngineState) -> None:
        self.state.load_state_dict(state)
        copy_named(self.host, state.trainable)


# slide.working_set's choices.
WORKING_SETS: dict[str, type[WorkingSet]] = {"all": AllTensors, "chunk": OneChunk}


def working_set_of(cfg: RunConfig) -> type[WorkingSet]:
    """The working set a run's settings choose."""
    return WORKING_SETS[cfg.section("slide").working_set]
