"""Engine `chunk`: full fine-tuning on a working set of sub-tensors (ChunkFT; the team's spec is
chunkft.md).

The trainable tensors, in model order, are one stream of bytes cut into chunk.n_chunks chunks of
equal bytes (chunk/partition.py; a tensor may be split, each piece a contiguous range along its
axis: input columns of a linear weight, vocabulary rows of the embedding and the head, elements of a
norm gain or a bias). One chunk is active at a time, for chunk.switch_every optimizer steps (by
default derived from the run: chunk/state.py's derived_switch_every), in a fresh seeded random order
each sweep (the default) or round robin.

Where things live. Device: every weight in the run's dtype (bf16 on a GPU), the activations of full
fine-tuning from the active chunk's lowest block up, and the active chunk's gradient (fp32, allocated when the step begins: the
slice-aware ops of chunk/sliced.py add into it, so no dense .grad ever exists and input gradients
are exact). With chunk.gradients=host not even that: each op's contribution goes down to the host
accumulators as backward makes it (chunk/downlink.py), a window of 128 MiB (and the one being
made) held on the device, so the device peak no longer depends on N (the link carries the chunk's
gradient every micro-batch instead of once a step). Host: per chunk a HostAdam (the shared host
optimizer: torch's fused CPU AdamW) over
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
Either is multiplied by chunk.lr_scale, sqrt(N) unless set: a tensor is updated on 1/N of the steps,
and at train.lr chunk trained far short of resident at equal steps, while about sqrt(N) times the rate
brought it level (benchmarks/docs/smollm2_engines.md). N = 1 is plain AdamW at train.lr.

The backward stops at the active chunk (chunk/reach.py): the embedding and the blocks below the
lowest block holding one of the chunk's tensors run without autograd (no activation kept, no
backward through them); a chunk holding part of the embedding (or of a tied head) runs the whole
backward. So the chunks' steps hold different activations, and the planner's fake step runs each
chunk that can hold the most (planned_chunks: those whose backward reaches block 0, and the heaviest,
or with the gradient on the host the one with most of the LM head, whose tiles are made at the loss)
and reports the largest, at full depth: which blocks hold the active pieces differs with the depth,
so the estimate by depth does not apply.
chunk.n_chunks=0 is settled when a run starts: the fewest chunks whose step fits the card.

The same working set runs on the sliding window too (engine slide, slide.working_set=chunk): the
host side is chunk/state.py's, shared.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.step import block_stores
from slimtune.model import config_json
from slimtune.device import memory, runtime, speed
from slimtune.store.checkpoint import EngineState
from slimtune.engines.chunk import partition, reach, sliced
from slimtune.engines.chunk.downlink import Downlink
from slimtune.engines.chunk.state import ChunkState, Member, axis_of, narrow, open_settings, scratch
from slimtune.config import RunConfig, setting
from slimtune.data.dataset import Batch
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.engines.base import Engine, NextStep, StepResult
from slimtune.step.forward import evaluate_batches, model_loss, step_divisor, to_float
from slimtune.store.checkpoint import check_resumable, copy_named
from slimtune.engines.registry import EngineSpec, register
from slimtune.errors import UserError
from slimtune.model.stack import Stack
from slimtune.optim import rules


@dataclass
class ChunkConfig:
    n_chunks: int = setting(8, "chunk working set (engine=chunk, slide.working_set=chunk): chunks of equal bytes"
                               " the trainable tensors are cut into; one has gradients at a time. 0: the fewest (a"
                               " power of two up to 256) whose step fits the card, found by the planner at the start.")
    switch_every: int = setting(0, "chunk working set: optimizer steps on a chunk before the next one. 0: derived"
                                   " from the run, the largest that visits every chunk twice in train.steps, at most 50"
                                   " (printed at the start; 1 is the spec's and the reference's).")
    order: Literal["round_robin", "random"] = setting(
        "random", "chunk working set: visit the chunks in a new seeded random order each sweep, or in model order"
                  " (round_robin, the spec's and the reference's).")
    lr_schedule: Literal["per_step", "per_sweep"] = setting(
        "per_step", "chunk working set: the lr schedule advances every step, or is held over each sweep at its first"
                    " step's value (the same total-step schedule).")
    lr_scale: float = setting(0.0, "chunk working set: the learning rate of the chunks' AdamW is train.lr's schedule times"
                                   " this. 0: sqrt(n_chunks), since each tensor is updated on 1/n_chunks of the steps"
                                   " (benchmarks/docs/smollm2_engines.md; printed at the start); 1: train.lr as given.")
    state: Literal["ram", "disk"] = setting(
        "ram", "chunk working set: fp32 masters and AdamW moments of every chunk in host RAM, or in memory-mapped"
               " files (12 B a number off the RAM).")
    state_dir: str | None = setting(None, "chunk.state=disk: where the state files go (default: output_dir/chunk-state).")
    gradients: Literal["device", "host"] = setting(
        "device", "engine=chunk: the active chunk's gradient sums on the device (4 B a number of 1/N of them), or"
                  " goes to its host accumulators while backward makes it (a window of 128 MiB, and the one being made, on the"
                  " device; the link carries it every micro-batch). slide's working set always sends its gradients"
                  " to the host.")

    def unread_given(self, given: list[str]) -> list[tuple[list[str], str]]:
        """The given settings of this section that its other settings leave unread, each with why."""
        if "chunk.state_dir" in given and self.state != "disk":
            return [(["chunk.state_dir"], f"chunk.state is {self.state}, not disk")]
        return []

    def validate(self) -> None:
        if self.n_chunks < 0:
            raise UserError(f"chunk.n_chunks must be a count, or 0 for the planner to choose, got {self.n_chunks}.")
        if self.lr_scale < 0:
            raise UserError(f"chunk.lr_scale must be a positive factor, or 0 for sqrt(chunk.n_chunks), got {self.lr_scale}.")
        if self.switch_every < 0:
            raise UserError(f"chunk.switch_every must be a count of steps, or 0 to derive it from the run, got"
                            f" {self.switch_every}.")

    @staticmethod
    def read_by(cfg: RunConfig) -> bool:
        """Whether the run reads this section (config_sources.unread_sections): engine chunk, and slide's chunk
        working set."""
        return cfg.engine == "chunk" or (cfg.engine == "slide" and cfg.section("slide").working_set == "chunk")


def validate(cfg: RunConfig) -> None:
    if cfg.method != "full":
        raise UserError("engine=chunk is full fine-tuning of every trainable tensor, a chunk at a time; set"
                        " method=full (for LoRA use engine=resident or slide).")
    if cfg.quant.scheme != "none":
        raise UserError("engine=chunk trains the weights themselves, which a 4-bit base cannot hold; set"
                        " quant.scheme=none.")
    if cfg.loss.mode == "subset":
        raise UserError("engine=chunk trains the LM head, which loss.mode=subset cannot; set loss.mode=exact.")
    _refuse_more_chunks_than_slices(cfg)


def _refuse_more_chunks_than_slices(cfg: RunConfig) -> None:
    """chunk.n_chunks against the slices of the model config.json describes, before anything is loaded.
    A folder whose config.json cannot be read here is left to the model's loading, which says why."""
    n = cfg.section("chunk").n_chunks
    path = Path(cfg.model) / "config.json"
    try:
        described = json.loads(path.read_text())
        config_json.check_fields(described if isinstance(described, dict) else {}, path)
    except (OSError, UnicodeDecodeError, ValueError, UserError):
        return
    most = partition.most_slices(described)
    if n > most:
        raise UserError(partition.too_many_chunks(n, f"the model in '{cfg.model}'",
                                                  f"its trainable tensors hold at most {most:,} slices"))


class ChunkEngine(Engine):
    name = "chunk"

    def __init__(self, stack: Stack, cfg: RunConfig, device: torch.device, precision: str, dist: Dist = SINGLE):
        self.stack, self.device, self.precision, self.dist = stack, device, precision, dist
        self.train_cfg, self.loss_cfg, self.activations_cfg = cfg.train, cfg.loss, cfg.activations
        self.store_dir = Path(cfg.output_dir) / "activations"
        self.fake = stack.fake
        self.slices = sliced.install(stack.model, axis_of(stack.model))  # name -> ActiveSlice
        # In a step only the active chunk's parameters require grad (reach.only_these_require_grad), and
        # the sliced ops make gradients for nothing else: a block outside the chunk makes only its input's.
        stack.only_parameters_take_gradients = True
        self.state = ChunkState({n: s.param for n, s in self.slices.items()},
                                {n: s.axis for n, s in self.slices.items()}, cfg, device, self.fake,
                                lambda name: self.slices[name].param)
        self.link = runtime.Link(device)
        self.downlink = None
        if cfg.section("chunk").gradients == "host":
            worker = runtime.HostWorker(inline=self.fake, device=device)  # the additions into the host accumulators
            weakref.finalize(self, worker.close)
            self.downlink = Downlink(self.link, worker)
            self._plan_the_head_chunk()
        # Per chunk, the lowest block its backward must reach (chunk/reach.py): below it, no autograd.
        self.reaches = reach.reaches(stack, {n: s.param for n, s in self.slices.items()}, self.state.chunks)
        self.step_count = 0  # optimizer steps taken: the lr schedule's position
        self.meter = memory.meter_for(device, cfg.train.measure_memory)
        if not self.fake and dist.is_main:
            print(self.state.describe())

    def _plan_the_head_chunk(self) -> None:
        """With gradients on the host the planner's step runs the chunk with most of the LM head's
        rows, not the heaviest: no chunk-sized buffer is on the device, and the head's gradient tiles
        are made at the loss, where the step peaks (every block input still held); the blocks'
        contributions come as memory falls."""
        head = self.stack.model.get_output_embeddings()
        name = next((n for n, s in self.slices.items() if head is not None and s.param is head.weight), None)
        if name is not None:
            self.state.planned = self.state.most_of(name)

    # ------------------------------------------------------------ one step

    def _resident_tensors(self):
        yield from ((p, "weights") for p in self.stack.model.parameters())
        yield from ((b, "weights") for b in self.stack.model.buffers())

    def _open(self, k: int, reading) -> None:
        """Chunk k's pieces become the active ranges, with zeroed gradients on the device, or with
        their host accumulators as where their gradients go (chunk.gradients=host)."""
        for active in self.slices.values():
            active.take()
            active.set(0, 0)
        for piece, _, _ in self.state.members[k]:
            self.slices[piece.name].set(piece.start, piece.stop)
        if self.downlink is not None:
            self.downlink.open([(self.slices[piece.name], grad) for (piece, _, _), grad in self.state.grad_views(k)],
                               retag=lambda t: reading.retag(t, "gradients"))
            return
        with reading.phase("gradients"):
            for piece, _, _ in self.state.members[k]:
                active = self.slices[piece.name]
                active.grad = torch.zeros(active.shape, dtype=self.state.dtype, device=self.device)

    def _gradients(self, k: int) -> list[tuple[Member, torch.Tensor]]:
        """After backward: chunk k's summed gradients, on the device or in the host accumulators."""
        if self.downlink is None:
            return [(member, self.slices[member[0].name].take()) for member in self.state.members[k]]
        self.downlink.close(self.slices.values())
        return self.state.grad_views(k)

    def planned_chunks(self) -> list[int]:
        """The chunks the planner's fake step runs, each (the estimate is the largest peak): every
        chunk whose backward reaches block 0 or the embedding (they keep every block's activations;
        their gradients, or the contributions in flight with chunk.gradients=host, differ) and the
        state's planned chunk (the heaviest; with the gradient on the host, the one with most of the LM
        head, whose tiles are made at the loss). A chunk of a higher reach keeps a subset of those
        activations and no larger gradient than the heaviest's (on every chunk of the test models, the
        largest of these is the largest of all: tests/unit/test_chunk_reach.py). Of chunks alike in
        reach and in the length of each of their pieces (the embedding's rows cut into several chunks)
        the first stands for all: a fake step reads shapes, and theirs are the same."""
        alike: dict[tuple, int] = {}
        for k in [*(k for k, r in enumerate(self.reaches) if r <= 0), self.state.planned]:
            shape = (self.reaches[k], tuple((p.name, p.stop - p.start) for p in self.state.chunks[k]))
            alike.setdefault(shape, k)
        return list(alike.values())

    def step(self, micro_batches: list[Batch], total_targets: int | None = None,
             then: NextStep | None = None) -> StepResult:
        if not self.fake:
            return self._step(self.state.active, micro_batches, total_targets)
        results = []
        for k in self.planned_chunks():
            results.append(self._step(k, micro_batches, total_targets))
            self.step_count -= 1
        self.step_count += 1
        return max(results, key=lambda r: r.device_peak_bytes)

    def _step(self, k: int, micro_batches: list[Batch], total_targets: int | None) -> StepResult:
        self.stack.model.train()
        total = step_divisor(micro_batches, total_targets)
        lr = self.state.lr(self.step_count)
        link_before = self.link.bytes
        with self.meter.measure(self._resident_tensors()) as reading:
            self._open(k, reading)
            with block_stores.open_store(self.activations_cfg, self.device, self.store_dir) as store:
                exact_sum = self._backward(k, micro_batches, total, reading, store)
            memory.mark("update")
            grads = self._gradients(k)
            on_host = self.downlink is not None
            self.dist.all_reduce_((grad for _, grad in grads), host=on_host, what="the active chunk's gradient sum")
            norm = torch.nn.utils.get_total_norm([grad for _, grad in grads], foreach=True)
            applied = rules.is_finite(norm) and rules.is_finite(exact_sum)
            if applied:
                self._update(k, [] if on_host else grads, lr, rules.clip_coefficient(norm, self.train_cfg.max_grad_norm))
            elif on_host:
                self.state.discard(k)
            del grads
        self.step_count += 1  # the schedule moves on, as on every engine; the chunk only after an update
        if applied:
            self.state.advance()
        return StepResult(
            loss=to_float(exact_sum) / total, tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches), lr=lr, grad_norm=to_float(norm),
            device_peak_bytes=reading.peak, device_peak_breakdown=reading.peak_breakdown,
            host_link_bytes=self.link.bytes - link_before + store.link_bytes,
            host_peak_bytes=self.host_bytes() + (store.peak_bytes if self.activations_cfg.checkpoint == "host" else 0),
            disk_peak_bytes=self.state.disk_bytes() + (
                store.peak_bytes if self.activations_cfg.checkpoint == "disk" else 0),
            extras={"chunk": k}, applied=applied)

    def _backward(self, k: int, micro_batches: list[Batch], total: int, reading, store) -> torch.Tensor | float:
        """Forward and backward of every micro-batch, the backward down to chunk k's reach; their exact
        loss sum. A step that raises with the gradient on the host leaves nothing in flight and empty
        accumulators behind it."""
        exact_sum = 0.0
        blocks = reach.runner(self.reaches[k], self.activations_cfg, store)
        params = [s.param for s in self.slices.values()]
        active = [self.slices[piece.name].param for piece, _, _ in self.state.members[k]]
        try:
            with reach.only_these_require_grad(params, active):
                for batch in micro_batches:
                    out = model_loss(self.stack, self.activations_cfg, self.loss_cfg, self.device, self.precision,
                                     batch.to(self.device), reading, store=store, run_blocks=blocks)
                    (out.loss_sum / total).backward()
                    exact_sum = exact_sum + out.exact_sum
        except BaseException:
            if self.downlink is not None:
                self.downlink.abandon(self.slices.values())
                with torch.no_grad():
                    self.state.working.grad.zero_()
            raise
        return exact_sum

    def _update(self, k: int, grads: list, lr: float, clip: torch.Tensor) -> None:
        """Device gradients (none when they are on the host already) down, host AdamW over chunk k,
        the rounded masters up into the weight slices."""
        adam = self.state.adams[k]
        events = [self.link.copy_down(adam.member(g, i).grad, grad) for (_, g, i), grad in grads]
        for event in events:
            if event is not None:
                event.synchronize()

        def write(piece, values: torch.Tensor) -> None:
            target = narrow(self.slices[piece.name].param.data, piece)  # read by the step's kernels
            self.link.wait(self.link.copy_up(target, values, after=self.link.compute_mark()))

        self.state.update(k, lr, 1.0 if is_fake(clip) else float(clip), write)

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        self.stack.model.eval()
        return evaluate_batches(batches, lambda b: model_loss(
            self.stack, self.activations_cfg, self.loss_cfg, self.device, self.precision, b.to(self.device),
            training=False).exact_sum)

    # ------------------------------------------------------------ accounting and state

    def host_bytes(self) -> int:
        return self.state.host_bytes()

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self.state.trainable_state()

    def state_dict(self) -> EngineState:
        return self.state.state_dict(self.name, self.step_count)

    def load_state_dict(self, state: EngineState) -> None:
        """Weights and per-(tensor, chunk) state by name; from another engine's checkpoint every chunk
        starts from its tensors' moments and step counts."""
        check_resumable(state, list(self.slices), self.name)
        self.state.load_state_dict(state)
        copy_named({n: s.param.data for n, s in self.slices.items()}, state.trainable)
        self.step_count = state.step


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
    """Full fine-tuning at 16 chunks, every block recomputed (the spec's default checkpointing), the
    gradient streamed to the host: at one micro-batch a step it crosses the link as often as from the
    device (bf16 where the device mode sends fp32), and the device holds no chunk-sized buffer. One
    plan, as each is estimated at full depth; the device mode and other N are a setting away
    (chunk.gradients, chunk.n_chunks)."""
    if method != "full":
        return []
    return [{"precision": "bf16", "activations.checkpoint": "recompute", "chunk.n_chunks": 16,
             "chunk.gradients": "host"}]


register(EngineSpec(
    name="chunk", summary="full fine-tuning a chunk of the weights at a time: only its gradient on the device,"
    " every chunk's AdamW state on the host (ChunkFT).",
    build=ChunkEngine, step_time=step_time, section=ChunkConfig, validate=validate, plans=plans,
    scratch=scratch, by_depth=lambda cfg: False, weight_dtype=weight_dtype,
    open_settings=open_settings))
