"""Engine `chunk`: full fine-tuning on a working set of sub-tensors (ChunkFT; the team's spec is
chunkft.md).

The trainable tensors, in model order, are one stream of bytes cut into chunk.n_chunks chunks of
equal bytes (chunk/partition.py; a tensor may be split, each piece a contiguous range along its
axis: input columns of a linear weight, vocabulary rows of the embedding and the head, elements of a
norm gain or a bias). One chunk is active at a time, for chunk.switch_every optimizer steps, in
round-robin order or a fresh random order each sweep.

Where things live. Device: every weight in the run's dtype (bf16 on a GPU), the activations of full
fine-tuning, and the active chunk's gradient (fp32, allocated when the step begins: the
slice-aware ops of chunk/sliced.py add into it, so no dense .grad ever exists and input gradients
are exact). Host: per chunk a HostAdam (the shared host optimizer: torch's fused CPU AdamW) over
its pieces: fp32 masters, AdamW moments and a step count of its own, in RAM or memory-mapped files
(chunk.state=disk; masters too), made when the engine is built and filled from the weights on the
chunk's first visit. One set of gradient accumulators and bf16 shadows, sized for the largest
chunk, serves every chunk in turn.

One step: forward and backward (gradient accumulation sums into the side buffers); the global norm
is the active chunk's (clipping scales it: documented, spec 2.5); the gradient goes down (4 bytes a
number, counted by runtime.Link), the host AdamW updates the chunk's masters, and their bf16
rounding goes up into the weight slices (2 bytes a number). A step whose loss or norm is not finite
updates nothing and does not advance the chunk (spec 2.3).

Why AdamW on the host, not on the device as in the reference: the state of the active slice would
cross the link twice a step (masters and two moments, 12 bytes a number each way) and sit on the
device beside the gradient; the host update moves 6 bytes a number and leaves only the gradient on
the device, which is what the device budget of this engine is for.

Learning rate: per_step follows the run's schedule step by step; per_sweep holds each sweep at the
lr of its first step, on the same total-step schedule (the reference stretched it by N: pitfall 8).

The planner's fake step runs the chunk with the most numbers (ChunkEngine.heaviest), at full depth: which blocks hold the active pieces differs with the depth, so the estimate by depth
does not apply.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from slimtune import block_stores, memory, runtime, speed
from slimtune.checkpoint import EngineState
from slimtune.chunk import partition as chunk_partition
from slimtune.chunk import sliced
from slimtune.config import RunConfig, positive, setting
from slimtune.data import Batch
from slimtune.engines.base import StepResult, check_resumable, copy_named, evaluate_batches, model_loss, to_float
from slimtune.engines.registry import EngineSpec, register
from slimtune.errors import UserError
from slimtune.model import Stack
from slimtune.optim import rules
from slimtune.optim.host_adam import MOMENTS, Group, HostAdam, Working, moments_folder

STATE_BYTES = 8  # two fp32 AdamW moments a number: what each number costs beside its own bytes


@dataclass
class ChunkConfig:
    n_chunks: int = setting(8, "engine=chunk: chunks of equal bytes the trainable tensors are cut into; one has"
                               " gradients and AdamW state at a time.")
    switch_every: int = setting(1, "engine=chunk: optimizer steps on a chunk before the next one.")
    order: Literal["round_robin", "random"] = setting(
        "round_robin", "engine=chunk: visit the chunks in model order, or in a new random order each sweep (seeded).")
    lr_schedule: Literal["per_step", "per_sweep"] = setting(
        "per_step", "engine=chunk: the lr schedule advances every step, or is held over each sweep at its first"
                    " step's value (the same total-step schedule).")
    state: Literal["ram", "disk"] = setting(
        "ram", "engine=chunk: fp32 masters and AdamW moments of every chunk in host RAM, or in memory-mapped"
               " files (12 B a number off the RAM).")
    state_dir: str | None = setting(None, "chunk.state=disk: where the state files go (default: output_dir/chunk-state).")

    def validate(self) -> None:
        positive("chunk.n_chunks", self.n_chunks)
        positive("chunk.switch_every", self.switch_every)


def validate(cfg: RunConfig) -> None:
    if cfg.method != "full":
        raise UserError("engine=chunk is full fine-tuning of every trainable tensor, a chunk at a time; set"
                        " method=full (for LoRA use engine=resident or slide).")
    if cfg.quant.scheme != "none":
        raise UserError("engine=chunk trains the weights themselves, which a 4-bit base cannot hold; set"
                        " quant.scheme=none.")
    if cfg.loss.mode == "subset":
        raise UserError("engine=chunk trains the LM head, which loss.mode=subset cannot; set loss.mode=exact.")


def axis_of(model: nn.Module):
    """The split axis of each trainable tensor (spec 2.1): vocabulary rows of the token embedding and
    of the causal-LM head, elements of 1-D tensors, input columns of every other matrix."""
    by_rows = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        by_rows.add(id(head.weight))

    def axis(name: str, param: nn.Parameter) -> int:
        del name
        return 0 if param.ndim == 1 or id(param) in by_rows else 1
    return axis


class ChunkEngine:
    name = "chunk"

    def __init__(self, stack: Stack, cfg: RunConfig, device: torch.device, precision: str):
        self.stack, self.device, self.precision = stack, device, precision
        self.train_cfg, self.loss_cfg, self.activations_cfg = cfg.train, cfg.loss, cfg.activations
        self.chunk = cfg.section("chunk")
        self.store_dir = Path(cfg.output_dir) / "activations"
        self.fake = any(is_fake(p) for p in stack.model.parameters())
        self.slices = sliced.install(stack.model, axis_of(stack.model))  # name -> ActiveSlice
        self.names = {id(s.param): n for n, s in self.slices.items()}
        streams = [self._stream(n, s) for n, s in self.slices.items()]
        self.streams = {s.name: s for s in streams}
        self.chunks = chunk_partition.partition(streams, self.chunk.n_chunks)
        self.link = runtime.Link(device)
        self.state_dir = None
        if self.chunk.state == "disk" and not self.fake:
            root = Path(self.chunk.state_dir or Path(cfg.output_dir) / "chunk-state")
            self.state_dir = moments_folder(self, root, "chunk.state_dir")
        self.adams = self._optimizers(cfg)
        self.visited = [False] * len(self.chunks)
        self.step_count = 0  # optimizer steps taken: the lr schedule's position
        self.position = 0  # index into the sweep's order of the active chunk
        self.done_on_active = 0  # successful steps on the active chunk so far
        self.sweep = 0
        self.meter = memory.meter_for(device, cfg.train.measure_memory)
        self.seed = cfg.train.seed

    # ------------------------------------------------------------ building

    def _stream(self, name: str, active: sliced.ActiveSlice) -> chunk_partition.Stream:
        param = active.param
        master = 4 if param.element_size() < 4 else 0  # an fp32 master beside narrower weights
        return chunk_partition.Stream(name, tuple(param.shape), active.axis,
                                      param.element_size() + master + STATE_BYTES)

    def _groups(self, pieces: list[chunk_partition.Piece]) -> list[tuple[list[chunk_partition.Piece], float]]:
        """A chunk's pieces by weight decay: matrices decay, 1-D tensors do not (rules.decays)."""
        decay = self.train_cfg.weight_decay
        decayed = [p for p in pieces if rules.decays(self.slices[p.name].param)]
        plain = [p for p in pieces if not rules.decays(self.slices[p.name].param)]
        return [(group, wd) for group, wd in ((decayed, decay), (plain, 0.0)) if group]

    def _piece_shape(self, piece: chunk_partition.Piece) -> torch.Size:
        shape = list(self.slices[piece.name].param.shape)
        shape[piece.axis] = piece.stop - piece.start
        return torch.Size(shape)

    def _optimizers(self, cfg: RunConfig) -> list[HostAdam]:
        """One HostAdam per chunk, sharing one set of accumulators and shadows sized for the largest."""
        param = next(iter(self.slices.values())).param
        dtype = torch.promote_types(param.dtype, torch.float32)
        shadow = param.dtype if param.dtype != dtype else None
        largest = max(sum(self._piece_shape(p).numel() for p in pieces) for pieces in self.chunks)
        self.working = Working(largest, dtype, self.device, shadow)
        self.members: list[list[tuple[chunk_partition.Piece, int, int]]] = []  # per chunk: (piece, group, member)
        adams = []
        for k, pieces in enumerate(self.chunks):
            grouped = self._groups(pieces)
            groups = [Group(tuple(self._piece_shape(p) for p in group), wd) for group, wd in grouped]
            adams.append(HostAdam(f"chunk {k}", groups, dtype, self.device, rules.adamw_settings(cfg.train),
                                  shadow_dtype=shadow, moments_dir=self.state_dir,
                                  masters_on_disk=self.state_dir is not None, working=self.working))
            self.members.append([(p, g, i) for g, (group, _) in enumerate(grouped) for i, p in enumerate(group)])
        return adams

    # ------------------------------------------------------------ which chunk

    def order(self, sweep: int) -> list[int]:
        """The chunks in visiting order in `sweep`: model order, or a permutation drawn from the seed
        and the sweep (no RNG state to keep: resume draws the same)."""
        ks = list(range(len(self.chunks)))
        if self.chunk.order == "random":
            random.Random(self.seed * 1_000_003 + sweep).shuffle(ks)
        return ks

    @property
    def active(self) -> int:
        if self.fake:
            return self.heaviest()
        return self.order(self.sweep)[self.position]

    def heaviest(self) -> int:
        """The chunk the planner's fake step runs: every chunk's step holds the same activations and
        its own gradient (even the LM head's rows are made in backward, loss._ExactCE), so the one
        with the most numbers. Other chunks' steps differ from it by small transients only (a norm's
        or a bias's weight-gradient sums while its range is live: within 0.1% on the test model)."""
        return max(range(len(self.chunks)), key=lambda k: sum(g.numel for g in self.adams[k].groups))

    def _advance(self) -> None:
        self.done_on_active += 1
        if self.done_on_active < self.chunk.switch_every:
            return
        self.done_on_active, self.position = 0, self.position + 1
        if self.position == len(self.chunks):
            self.position, self.sweep = 0, self.sweep + 1

    def _lr(self) -> float:
        if self.chunk.lr_schedule == "per_sweep":
            sweep_steps = len(self.chunks) * self.chunk.switch_every
            return rules.lr_at(self.train_cfg, self.step_count // sweep_steps * sweep_steps)
        return rules.lr_at(self.train_cfg, self.step_count)

    # ------------------------------------------------------------ one step

    def _resident_tensors(self):
        yield from ((p, "weights") for p in self.stack.model.parameters())
        yield from ((b, "weights") for b in self.stack.model.buffers())

    def _open(self, k: int, reading) -> None:
        """Chunk k's pieces become the active ranges, with zeroed gradients on the device."""
        for active in self.slices.values():
            active.take()
            active.set(0, 0)
        with reading.phase("gradients"):
            for piece, _, _ in self.members[k]:
                active = self.slices[piece.name]
                active.set(piece.start, piece.stop)
                active.grad = torch.zeros(active.shape, dtype=self.working.grad.dtype, device=self.device)

    def step(self, micro_batches: list[Batch]) -> StepResult:
        self.stack.model.train()
        total = max(sum(b.num_targets for b in micro_batches), 1)
        k, lr = self.active, self._lr()
        link_before = self.link.bytes
        with self.meter.measure(self._resident_tensors()) as reading:
            self._open(k, reading)
            exact_sum = 0.0
            with block_stores.open_store(self.activations_cfg, self.device, self.store_dir) as store:
                for batch in micro_batches:
                    out = model_loss(self.stack, self.activations_cfg, self.loss_cfg, self.device, self.precision,
                                     batch.to(self.device), reading, store=store)
                    (out.loss_sum / total).backward()
                    exact_sum = exact_sum + out.exact_sum
            memory.mark("update")
            grads = [(piece, g, i, self.slices[piece.name].take()) for piece, g, i in self.members[k]]
            norm = torch.nn.utils.get_total_norm([grad for *_, grad in grads], foreach=True)
            applied = rules.is_finite(norm) and rules.is_finite(exact_sum)
            if applied:
                self._update(k, grads, lr, rules.clip_coefficient(norm, self.train_cfg.max_grad_norm))
            del grads
        self.step_count += 1  # the schedule moves on, as on every engine; the chunk only after an update
        if applied and not self.fake:
            self._advance()
        return StepResult(
            loss=to_float(exact_sum) / total, tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches), lr=lr, grad_norm=to_float(norm),
            device_peak_bytes=reading.peak, device_peak_breakdown=reading.peak_breakdown,
            host_link_bytes=self.link.bytes - link_before + store.link_bytes,
            host_peak_bytes=self.host_bytes() + (store.peak_bytes if self.activations_cfg.checkpoint == "host" else 0),
            disk_peak_bytes=self.disk_bytes() + (store.peak_bytes if self.activations_cfg.checkpoint == "disk" else 0),
            extras={"chunk": k}, applied=applied)

    def _update(self, k: int, grads: list, lr: float, clip: torch.Tensor) -> None:
        """Gradients down, host AdamW over chunk k, the rounded masters up into the weight slices."""
        adam = self.adams[k]
        if not self.visited[k]:
            self._first_visit(k)
        events = [self.link.copy_down(adam.member(g, i).grad, grad) for _, g, i, grad in grads]
        for event in events:
            if event is not None:
                event.synchronize()
        adam.update(lr, 1.0 if is_fake(clip) else float(clip))
        for piece, g, i, _ in grads:
            views = adam.member(g, i)
            target = self.slices[piece.name].view(self.slices[piece.name].param.data)
            self.link.wait(self.link.copy_up(target, views.shadow if views.shadow is not None else views.master))

    def _first_visit(self, k: int) -> None:
        """The chunk's masters start as its weights (made lazily, spec 2.3)."""
        for piece, g, i in self.members[k]:
            active = self.slices[piece.name]
            source = active.param.detach().narrow(piece.axis, piece.start, piece.stop - piece.start)
            event = self.link.copy_down(self.adams[k].member(g, i).master, source)
            if event is not None:
                event.synchronize()
        self.visited[k] = True

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        self.stack.model.eval()
        return evaluate_batches(batches, lambda b: model_loss(
            self.stack, self.activations_cfg, self.loss_cfg, self.device, self.precision, b.to(self.device),
            training=False).exact_sum)

    # ------------------------------------------------------------ accounting and state

    def host_bytes(self) -> int:
        return sum(a.host_bytes() for a in self.adams) + self.working.host_bytes()

    def disk_bytes(self) -> int:
        if self.chunk.state != "disk":
            return 0
        return sum(3 * m.numel() * m.element_size() for a in self.adams for m in a.masters)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights by name at full precision: the masters where a chunk was visited."""
        state = {name: active.param.detach().to(self.working.grad.dtype) for name, active in self.slices.items()}
        for k, adam in enumerate(self.adams):
            if self.visited[k]:
                for piece, g, i in self.members[k]:
                    state[piece.name].narrow(piece.axis, piece.start, piece.stop - piece.start).copy_(
                        adam.member(g, i).master)
        return state

    def state_dict(self) -> EngineState:
        moments = {m: {n: torch.zeros(s.param.shape, dtype=self.working.grad.dtype) for n, s in self.slices.items()}
                   for m in MOMENTS}
        steps = {}
        for k, adam in enumerate(self.adams):
            for piece, g, i in self.members[k]:
                views = adam.member(g, i)
                for m in MOMENTS:
                    moments[m][piece.name].narrow(piece.axis, piece.start, piece.stop - piece.start).copy_(
                        getattr(views, m))
                steps.setdefault(piece.name, float(adam.state(g)["step"]))
        extra = {"n_chunks": len(self.chunks), "visited": list(self.visited), "sweep": self.sweep,
                 "position": self.position, "done_on_active": self.done_on_active,
                 "chunk_steps": [[float(adam.state(g)["step"]) for g in range(len(adam.groups))]
                                 for adam in self.adams]}
        return EngineState(engine=self.name, step=self.step_count, trainable=self.trainable_state(),
                           exp_avg=moments["exp_avg"], exp_avg_sq=moments["exp_avg_sq"], adam_steps=steps,
                           extra={"chunk": extra})

    def load_state_dict(self, state: EngineState) -> None:
        """Weights and per-(tensor, chunk) state by name; from another engine's checkpoint every chunk
        starts from its tensors' moments and step counts."""
        check_resumable(state, list(self.slices), self.name)
        mine = state.extra.get("chunk") if state.engine == self.name else None
        if mine is not None and mine["n_chunks"] != len(self.chunks):
            raise UserError(f"the checkpoint was cut into {mine['n_chunks']} chunks and this run into"
                            f" {len(self.chunks)}: set chunk.n_chunks={mine['n_chunks']} to resume it.")
        copy_named({n: s.param.data for n, s in self.slices.items()}, state.trainable)
        for k, adam in enumerate(self.adams):
            for piece, g, i in self.members[k]:
                views, length = adam.member(g, i), piece.stop - piece.start
                for m in ("master", *MOMENTS):
                    source = state.trainable if m == "master" else getattr(state, m)
                    getattr(views, m).copy_(source[piece.name].narrow(piece.axis, piece.start, length))
            for g in range(len(adam.groups)):
                step = mine["chunk_steps"][k][g] if mine else state.adam_steps[self.members[k][0][0].name]
                adam.state(g)["step"].fill_(step)
            adam.refresh_shadows()
        self.visited = list(mine["visited"]) if mine else [True] * len(self.chunks)
        if mine:
            self.sweep, self.position, self.done_on_active = mine["sweep"], mine["position"], mine["done_on_active"]
        self.step_count = state.step


def scratch(cfg: RunConfig) -> dict[str, str]:
    section = cfg.section("chunk")
    if section.state != "disk":
        return {}
    return {"chunk.state_dir": str(section.state_dir or Path(cfg.output_dir) / "chunk-state")}


def step_time(model_config, cfg: RunConfig, counts: speed.StepCounts, gpu, batch_size: int,
              seq_len: int) -> speed.StepTime:
    """Modelled: the compute of full fine-tuning (every weight gradient of the active chunk only is
    left in, at 1/N of the weight-gradient matmuls), then, not overlapped, the gradient down, the host
    AdamW over the chunk and the weights up."""
    n = cfg.section("chunk").n_chunks
    recompute = cfg.activations.checkpoint != "none"
    accum = cfg.train.grad_accum
    full = speed.step_flops(model_config, "full", batch_size, seq_len, recompute)
    frozen = speed.step_flops(model_config, "lora", batch_size, seq_len, recompute)
    flops = (frozen + (full - frozen) / n) * accum
    disk = counts.host_link_bytes if cfg.activations.checkpoint == "disk" else 0.0
    compute = speed.compute_seconds(flops, gpu, cfg.precision)
    optimizer = counts.trainable_params / n * speed.ADAMW_BYTES_PER_PARAM / (speed.HOST_ADAMW_GBPS * 1e9)
    link = speed.link_seconds(counts.host_link_bytes, disk, gpu)
    return speed.StepTime(compute + optimizer + link, compute, optimizer, link, flops)


def weight_dtype(precision: str, method: str) -> torch.dtype:
    """The device weights are in the compute dtype (bf16 under bf16): their fp32 masters are on the host."""
    del method
    return {"bf16": torch.bfloat16, "fp64": torch.float64}.get(precision, torch.float32)


def plans(method: str) -> list[dict]:
    """Full fine-tuning, every block recomputed (the spec's default), at 4 and 16 chunks."""
    if method != "full":
        return []
    return [{"precision": "bf16", "activations.checkpoint": "recompute", "chunk.n_chunks": n} for n in (4, 16)]


register(EngineSpec(
    name="chunk", summary="full fine-tuning a chunk of the weights at a time: only its gradient on the device,"
    " every chunk's AdamW state on the host (ChunkFT).",
    build=ChunkEngine, step_time=step_time, section=ChunkConfig, validate=validate, plans=plans,
    scratch=scratch, by_depth=False, weight_dtype=weight_dtype))
