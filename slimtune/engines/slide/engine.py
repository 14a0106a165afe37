"""Engine `slide`: fine-tuning a model far larger than the device, with a sliding window of blocks
(SlideFormer; the team's spec is slide-window.md), on the offload runtime (runtime.py).

Where things live. Host: host units (host_unit.py), one per block (the last block with the final
norm), the LM head and the embedding (one unit for a tied pair), each with the fp32 masters of its
trainable tensors, their gradient accumulators and AdamW moments (a HostAdam: torch's fused CPU
AdamW), its frozen tensors (a LoRA base, 4-bit codes); and each block's input (the activations
store: host RAM, or disk). Device: a SlotPool of `slide.slots` slots sized to the
largest block (its weights in the compute dtype and their gradients), rotary tables, one block's
activations, and one LM-head tile at a time.

One micro-batch:
  forward   the embedding rows are gathered on the host and sent up; block i runs (no grad, MLP in
            token chunks) in its slot while block i+1 is copied into the next; its input goes to the
            store; the slot goes back. The last block keeps its slot through the loss and backward.
  loss      the final norm on the trained rows, then the exact cross-entropy with the head streamed
            up in vocabulary tiles (streamed_ce): once for the log-sum-exp, once for gradients; each
            tile's weight gradient goes down as soon as it is complete.
  backward  last block first: take a slot with zeroed gradients, copy the block in, fetch its input,
            restore the RNG, recompute and back-propagate, copy the gradients down; the host worker
            adds them to the accumulators and, on the last micro-batch without clipping, runs that
            unit's AdamW while the device goes on with the block below. The embedding's gradient
            rows are added on the host.
  step end  with clipping: the global norm over the host accumulators, then every unit's AdamW.
            A barrier ends the step, so the result is exactly synchronous AdamW.

Gradient accumulation: gradients of every micro-batch are summed on the host (each loss divided by
the step's trained-token count, as in resident); updates wait for the last micro-batch. Clipping
needs the global norm before any update, so with train.max_grad_norm > 0 every update runs after the
last backward (the host AdamW time is then not hidden behind the device; each unit's norm is noted
by its last host job, so only the sum of squares waits); with clipping off, each unit's update
overlaps the backward of the blocks below it.

A chunk working set (slide.working_set=chunk, ChunkFT's on the window): the units keep no HostAdam;
their trainable tensors rest on the host as bf16 weights (2 bytes a number), the blocks' gradients
come down as before, but only the active chunk's pieces of them are added up on the host
(chunk/host_gradients.py), and after backward one host AdamW updates that chunk (chunk/state.py:
masters and moments of every chunk, in RAM or files) and writes its new weights into the host
tensors the next upload reads. The device side is unchanged.

Ordering is explicit: a unit's next upload waits for its last update (`HostUnit.update_job`), a
staging buffer is refilled only after the host job that read it finished, and a slot is refilled
only after the device work on it (an event on CUDA). On the CPU every copy is synchronous and the
same code runs; host tensors are marked host-resident, so the meter counts what a GPU would hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.step import activations, block_stores
from slimtune.device import memory, runtime, speed
from slimtune.store.checkpoint import EngineState
from slimtune.config import RunConfig, TrainConfig, positive, setting
from slimtune.data.dataset import Batch
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.engines.base import Engine, NextStep, StepResult
from slimtune.step.forward import evaluate_batches, step_divisor, to_float
from slimtune.step.precision import autocast_for
from slimtune.store.checkpoint import check_resumable, copy_named
from slimtune.engines.registry import EngineSpec, register
from slimtune.errors import UserError
from slimtune.engines.slide.host_gradients import ActiveGradients
from slimtune.engines.chunk.state import ChunkState, axis_of, narrow
from slimtune.engines.chunk.state import open_settings as chunk_open_settings
from slimtune.engines.chunk.state import scratch as chunk_scratch
from slimtune.optim.host_unit import HostUnit, StepGuard, load_units_state, units_state
from slimtune.step.loss import chunk_tokens, head_inputs
from slimtune.model.stack import Stack
from slimtune.optim import rules
from slimtune.optim.host_adam import MOMENTS_ON_DISK, moments_bytes, moments_folder
from slimtune.engines.slide.streamed_ce import streamed_ce


@dataclass
class SlideConfig:
    slots: int = setting(2, "engine=slide: device slots, each the size of the largest block (2: one runs while the next loads).")
    head_tile_mb: float = setting(64.0, "engine=slide: MiB of the LM head streamed to the device per vocabulary tile.")
    moments: Literal["ram", "disk"] = setting(
        "ram", "engine=slide: AdamW moments in host RAM, or in memory-mapped files (8 B a weight off the RAM)."
    )
    moments_dir: str | None = setting(
        None, "slide.moments=disk: where the moment files go (default: output_dir/moments).")
    working_set: Literal["all", "chunk"] = setting(
        "all", "engine=slide: all: every tensor has gradients, fp32 masters and AdamW state on the host; chunk:"
               " only the active chunk's (ChunkFT, the chunk.* settings), the host holding bf16 weights besides.")

    def validate(self) -> None:
        if self.slots not in (2, 3):
            raise UserError(f"slide.slots must be 2 or 3, got {self.slots}.")
        positive("slide.head_tile_mb", self.head_tile_mb)


def validate(cfg: RunConfig) -> None:
    """What engine=slide does not do, refused in one sentence each."""
    if cfg.loss.mode != "exact":
        raise UserError("engine=slide streams the LM head for the exact loss; set loss.mode=exact.")
    if cfg.quant.embeddings:
        raise UserError("engine=slide keeps the embedding and LM head on the host in full precision;"
                        " set quant.embeddings=false.")
    if cfg.activations.checkpoint == "recompute":
        raise UserError("engine=slide keeps block inputs in host RAM or on disk; set activations.checkpoint=host"
                        " (or disk).")
    if cfg.activations.cache != "none":
        raise UserError("engine=slide keeps only each block's input; set activations.cache=none.")
    chunked = cfg.section("slide").working_set == "chunk"
    if chunked and cfg.method != "full":
        raise UserError("slide.working_set=chunk is full fine-tuning a chunk at a time; set method=full.")
    if cfg.train.on_nonfinite == "skip" and cfg.train.max_grad_norm == 0 and not chunked:
        raise UserError("engine=slide updates each block while backward runs when clipping is off, so a step cannot"
                        " be skipped whole; set train.max_grad_norm > 0 or train.on_nonfinite=stop.")


class SlideEngine(Engine):
    name = "slide"

    def __init__(self, stack: Stack, cfg: RunConfig, device: torch.device, precision: str, dist: Dist = SINGLE):
        self.stack, self.device, self.precision, self.dist = stack, device, precision, dist
        self.train_cfg, self.loss_cfg, self.activations_cfg = cfg.train, cfg.loss, cfg.activations
        self.slide_cfg = cfg.section("slide")
        self.store_dir = Path(cfg.output_dir) / "activations"  # checkpoint=disk without activations.disk_dir
        if getattr(stack.head, "bias", None) is not None:
            raise NotImplementedError("engine=slide streams an LM head without bias")
        weight_dtype = torch.bfloat16 if precision == "bf16" else None  # None: the master's dtype
        moments = self._moments_dir(cfg)
        self.names = {id(p): n for n, p in stack.model.named_parameters() if p.requires_grad}
        self.chunked = self.slide_cfg.working_set == "chunk"
        self.gradients = ActiveGradients(None, self.names) if self.chunked else None
        blocks, count = stack.blocks, len(stack.blocks)
        self.units = [HostUnit(f"block {i}", [blocks[i]] + ([stack.norm] if i == count - 1 else []), device,
                               weight_dtype, cfg.train, moments, self.gradients) for i in range(count)]
        self.edges = self._edge_units(cfg.train, weight_dtype, moments)
        for unit in self._all_units():
            unit.dist = dist  # each unit's complete gradients are summed across ranks on the host worker
        self.chunk_state = self._chunk_state(cfg) if self.chunked else None
        stack.rotary.to(device)
        self.link = runtime.Link(device)
        grad_bytes = max(u.binding.grad_bytes for u in self.units)
        self.pool = runtime.SlotPool(device, self.slide_cfg.slots, max(u.binding.weight_bytes for u in self.units),
                                     grad_bytes)
        self.staging = [runtime.host_empty((max(grad_bytes, 1),), torch.uint8, device) for _ in range(2)]
        self.staging_jobs: list = [None, None]
        self.staging_turn = 0
        self.head_tiles = self._make_head_tiles(weight_dtype)
        self.tiles_free: list = [None] * len(self.head_tiles)  # per tile buffer: its last reader is done
        self.worker = runtime.HostWorker(inline=any(is_fake(p) for p in stack.model.parameters()), device=device)
        weakref.finalize(self, self.worker.close)  # its thread goes with the engine
        self.step_count = 0
        self.meter = memory.meter_for(device, cfg.train.measure_memory)

    def _edge_units(self, train: TrainConfig, weight_dtype: torch.dtype | None,
                    moments: Path | None) -> list[HostUnit]:
        """The host-side units: the LM head (streamed up in tiles, so it gets a narrow shadow) and
        the embedding (never sent up: rows are gathered on the host, so no shadow); one unit when tied."""
        stack, device, sink = self.stack, self.device, self.gradients
        if stack.tied:
            return [HostUnit("embedding and LM head", [stack.embed, stack.head], device, weight_dtype, train, moments,
                             sink)]
        # Under a chunk working set the embedding rests in bf16 too: its rows are gathered in the
        # compute dtype, and a full-precision copy of it is what the working set exists not to keep.
        return [HostUnit("LM head", [stack.head], device, weight_dtype, train, moments, sink),
                HostUnit("embedding", [stack.embed], device, weight_dtype if sink else None, train, moments, sink)]

    def _chunk_state(self, cfg: RunConfig) -> ChunkState:
        """slide.working_set=chunk: the chunks' masters and AdamW state (chunk/state.py) over the
        trainable tensors, which rest on the host as weights."""
        host = self._host_weights()
        params = {n: p for n, p in self.stack.model.named_parameters() if p.requires_grad}
        axis = axis_of(self.stack.model)
        state = ChunkState(params, {n: axis(n, p) for n, p in params.items()}, cfg, self.device,
                           any(is_fake(t) for t in host.values()), host.__getitem__)
        self.gradients.state = state
        return state

    def _edge_tensor(self, param: torch.Tensor) -> tuple[HostUnit, runtime.SlotTensor] | tuple[None, None]:
        for unit in self.edges:
            found = unit.tensor_of(param)
            if found is not None:
                return unit, found
        return None, None

    def _moments_dir(self, cfg: RunConfig) -> runtime.ScratchFolder | None:
        """slide.moments=disk: a private folder for the moment files, removed with the engine (a chunk
        working set keeps no per-unit moments)."""
        folder = scratch(cfg).get("slide.moments_dir")
        trained = [p for p in self.stack.model.parameters() if p.requires_grad]
        need = 0 if self.slide_cfg.working_set == "chunk" else moments_bytes(trained)
        return moments_folder(self, Path(folder), MOMENTS_ON_DISK, need) if folder else None

    # ------------------------------------------------------------ the pieces of a step

    def _make_head_tiles(self, weight_dtype: torch.dtype | None) -> list[torch.Tensor]:
        vocab, width = self.edge_head_weight().shape
        dtype = weight_dtype or self.edge_head_weight().dtype
        per_row = runtime.nbytes_of((width,), dtype)
        rows = max(1, min(vocab, int(self.slide_cfg.head_tile_mb * 2**20) // per_row))
        # Two, so a tile's copy up overlaps the compute on the other; two on every device, so the
        # planner's step (fake tensors on the CPU) counts what a GPU holds.
        return [torch.empty((rows, width), dtype=dtype, device=self.device) for _ in range(2)]

    def edge_head_weight(self) -> torch.Tensor:
        """The LM head weight as it goes up: the narrow shadow of its master, or the host tensor."""
        weight = self.stack.head.weight
        _, found = self._edge_tensor(weight)
        return found.upload if found is not None else weight

    def _resident_tensors(self):
        yield from ((t, "weights") for t in self.pool.tensors())
        yield from ((t, "weights") for t in self.head_tiles)
        yield from ((b, "weights") for b in self.stack.rotary.buffers())

    def _load(self, index: int, with_grads: bool) -> None:
        unit = self.units[index]
        if unit.slot is None:
            unit.ready = unit.bind(self.pool.acquire(unit.name), self.link, with_grads)
        elif with_grads and not unit.binding.grads_bound:
            unit.ready = unit.binding.attach_grads(self.link)
        self.link.wait(unit.ready)  # compute waits for the copies (a prefetch's too)

    def _prefetch(self, index: int, with_grads: bool) -> None:
        """Start copying unit `index` in while the current one computes, if a slot is free."""
        if 0 <= index < len(self.units) and self.units[index].slot is None and self.pool.free:
            unit = self.units[index]
            unit.ready = unit.bind(self.pool.acquire(unit.name), self.link, with_grads)

    @contextlib.contextmanager
    def _window(self):
        """Every slot comes back, even when a step or an evaluation fails half-way."""
        try:
            yield
        finally:
            for index, unit in enumerate(self.units):
                if unit.slot is not None:
                    self._unload(index)

    def _compute_event(self) -> object:
        return torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" else None

    def _unload(self, index: int) -> None:
        self.pool.release(self.units[index].binding.unbind())

    def _staging_buffer(self) -> int:
        """The next host staging buffer's index, once the host job that read it last has finished."""
        turn, self.staging_turn = self.staging_turn, 1 - self.staging_turn
        if self.staging_jobs[turn] is not None:
            self.staging_jobs[turn].result()
        return turn

    def _finish_block(self, index: int, update: tuple | None, final: bool) -> None:
        """Gradients of block `index` down to the host, added up there (with their norms noted when
        `final`, and its AdamW when `update` = (lr, clip)); the slot goes back."""
        unit = self.units[index]
        turn = self._staging_buffer()
        event = unit.binding.download_grads(self.link, self.staging[turn])
        self.staging_jobs[turn] = self.worker.submit(unit.accumulate, self.staging[turn], event, final)
        if update is not None and unit.adam is not None:
            unit.update_job = self.worker.submit(unit.update, *update)
        self._unload(index)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows, gathered on the host (the V x D table never goes up)."""
        with torch.no_grad():
            rows = self.stack.embed(input_ids.cpu())
        return self.link.ready(self.link.to_device(rows.contiguous()))

    def _embed_backward(self, input_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Add d(loss)/d(embedding rows) into the embedding's host gradient (index_add, on the worker)."""
        weight = self.stack.embed.weight
        host, event = self.link.to_host(grad.reshape(-1, grad.shape[-1]))
        ids = input_ids.reshape(-1).cpu()
        padding = getattr(self.stack.embed, "padding_idx", None)
        if self.chunked:
            def add_active() -> None:
                if event is not None:
                    event.synchronize()
                self.gradients.add_indexed(weight, ids, host, padding)

            self.worker.submit(add_active)
            return
        unit, _ = self._edge_tensor(weight)
        accumulator = unit.accumulators[id(weight)]

        def add() -> None:
            if event is not None:
                event.synchronize()
            rows = host.to(accumulator.dtype)
            if padding is not None:  # as nn.Embedding: the padding row gets no gradient
                rows[ids == padding] = 0
            accumulator.index_add_(0, ids, rows)

        self.worker.submit(add)

    def _tiles(self):
        """Yields (start, stop, rows of the LM head on the device), one tile at a time."""
        host = self.edge_head_weight()  # at rest: the host master (or frozen host tensor)
        buffers, vocab = self.head_tiles, host.shape[0]
        rows = buffers[0].shape[0]
        for k, start in enumerate(range(0, vocab, rows)):
            stop, turn = min(start + rows, vocab), k % len(buffers)
            tile = buffers[turn][: stop - start]
            # the copy waits until the compute that read this buffer last (tile k - 2) is done
            self.link.wait(self.link.copy_up(tile, host[start:stop], self.tiles_free[turn]))
            yield start, stop, tile
            self.tiles_free[turn] = self._compute_event()

    def _head_sink(self):
        """streamed_ce's sink for a trainable head: each tile's gradient goes to its host rows."""
        weight = self.stack.head.weight
        unit, found = self._edge_tensor(weight)
        if found is None or not found.trainable:
            return None
        if self.chunked:
            def add_rows(start: int, stop: int, host: torch.Tensor) -> None:
                self.gradients.add_rows(weight, start, stop, host)
        else:
            accumulator = unit.accumulators[id(weight)]

            def add_rows(start: int, stop: int, host: torch.Tensor) -> None:
                accumulator[start:stop].add_(host)

        def sink(start: int, stop: int, grad: torch.Tensor) -> None:
            host, event = self.link.to_host(grad)

            def add() -> None:
                if event is not None:
                    event.synchronize()
                add_rows(start, stop, host)

            self.worker.submit(add)

        return sink

    def _store(self):
        checkpoint = self.activations_cfg.checkpoint
        cfg = dataclasses.replace(self.activations_cfg, checkpoint="host" if checkpoint == "none" else checkpoint)
        return block_stores.open_store(cfg, self.device, self.store_dir)

    # ------------------------------------------------------------ one micro-batch

    def _forward(self, batch: Batch, store, keep_grads: bool):
        """The blocks without grad; returns the last block's output (its unit stays loaded), the
        block inputs' store keys, RNG states, BlockInputs and the MLP chunk."""
        memory.mark("embed")
        device_batch = batch.to(self.device)
        hidden = self._embed(batch.input_ids)
        inputs = self.stack.prepare(hidden, device_batch.position_ids, batch.segmented)
        chunk = activations.mlp_chunk_tokens(self.stack, hidden.shape[1], self.activations_cfg)
        last = len(self.units) - 1
        keys, states = [], []
        for index in range(len(self.units)):
            memory.mark("forward", index)
            self._load(index, keep_grads and index == last)
            for ahead in range(1, self.slide_cfg.slots):
                self._prefetch(index + ahead, keep_grads and index + ahead == last)
            if keep_grads:
                keys.append(store.put(hidden))
                states.append(activations.dropout_rng_state(self.device))
            with torch.no_grad():
                hidden = activations.block_forward(self.stack, index, hidden, inputs, chunk)
            if index < last:
                self._unload(index)
        return device_batch, hidden, keys, states, inputs, chunk

    def _micro_step(self, batch: Batch, total: int, store, update: tuple | None, final: bool) -> torch.Tensor:
        with autocast_for(self.device, self.precision):
            device_batch, hidden, keys, states, inputs, chunk = self._forward(batch, store, keep_grads=True)
            memory.mark("loss")
            out = hidden.detach().requires_grad_()
            x, targets = head_inputs(out, self.stack.norm, device_batch.targets, self.loss_cfg,
                                        device_batch.trained_positions)
            loss_sum, grad_x = streamed_ce(x.detach(), targets, self._tiles, chunk_tokens(self.loss_cfg, self._vocab()),
                                           scale=1.0 / total, sink=self._head_sink())
        torch.autograd.backward(x, grad_x)  # the final norm's gradient lands in the last unit's slot
        grad = out.grad
        del hidden, out, x, grad_x  # only the gradient travels down the blocks
        _, embedding = self._edge_tensor(self.stack.embed.weight)
        wants_embed_grad = embedding is not None and embedding.trainable
        with torch.random.fork_rng([self.device] if self.device.type == "cuda" else []), \
                autocast_for(self.device, self.precision):
            for index in range(len(self.units) - 1, -1, -1):
                memory.mark("backward", index)
                self._load(index, with_grads=True)
                for ahead in range(1, self.slide_cfg.slots):
                    self._prefetch(index - ahead, with_grads=True)
                x_in = store.take(keys[index]).detach().requires_grad_(index > 0 or wants_embed_grad)
                if index > 0:
                    store.prefetch(keys[index - 1])  # the next input comes up while this block runs
                activations.restore_dropout_rng(states[index], self.device)
                activations.block_backward(self.stack, index, x_in, grad, inputs, chunk)
                grad = x_in.grad if x_in.requires_grad else None
                del x_in
                self._finish_block(index, update, final)
        memory.mark("edges")
        if wants_embed_grad and grad is not None:
            self._embed_backward(batch.input_ids, grad)
        for unit in self.edges if final else ():
            if unit.adam is not None:  # after its head-tile and embedding-row jobs, in order
                self.worker.submit(unit.note_norms)
                if update is not None:
                    unit.update_job = self.worker.submit(unit.update, *update)
        return loss_sum

    def _vocab(self) -> int:
        return self.edge_head_weight().shape[0]

    # ------------------------------------------------------------ the Engine interface

    def step(self, micro_batches: list[Batch], total_targets: int | None = None,
             then: NextStep | None = None) -> StepResult:
        self.stack.model.train()
        total = step_divisor(micro_batches, total_targets)
        active = self.chunk_state.active if self.chunked else None
        lr = self.chunk_state.lr(self.step_count) if self.chunked else rules.lr_at(self.train_cfg, self.step_count)
        clipping = self.train_cfg.max_grad_norm > 0
        link_before = self.link.bytes
        guard = StepGuard()
        if self.chunked:
            self.gradients.open(active)
        with self.meter.measure(self._resident_tensors()) as reading, self._store() as store, self._window():
            loss_sum = 0.0
            for k, batch in enumerate(micro_batches):
                final = k == len(micro_batches) - 1
                update_now = (lr, 1.0, guard) if final and not clipping and not self.chunked else None
                loss_sum = loss_sum + self._micro_step(batch, total, store, update_now, final)
            self.worker.barrier()
            memory.mark("update")
            if self.chunked:  # the worker is idle: the host group is this thread's until the next job
                self.dist.all_reduce_(self.chunk_state.adams[active].grads, host=True, what="the chunk's gradient sum")
            grad_norm = self.chunk_state.grad_norm(active) if self.chunked else self._grad_norm()
            applied = rules.is_finite(loss_sum) and rules.is_finite(grad_norm) and not guard.tripped
            if self.chunked:
                self._update_chunk(active, lr, grad_norm, applied)
            elif clipping:
                coefficient = rules.clip_coefficient(grad_norm, self.train_cfg.max_grad_norm)
                coef = 1.0 if is_fake(coefficient) else float(coefficient)
                for unit in self._all_units():
                    if unit.adam is not None:  # a step that may not update only empties the accumulators
                        job = (unit.update, lr, coef) if applied else (unit.discard,)
                        unit.update_job = self.worker.submit(*job)
            self.worker.barrier()
        self.step_count += 1
        if self.chunked and applied:
            self.chunk_state.advance()
        state_disk = self.chunk_state.disk_bytes() if self.chunked else 0
        return StepResult(
            loss=to_float(loss_sum) / total, tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches), lr=lr, grad_norm=to_float(grad_norm),
            device_peak_bytes=reading.peak, device_peak_breakdown=reading.peak_breakdown,
            host_link_bytes=self.link.bytes - link_before + store.link_bytes,
            host_peak_bytes=self.host_bytes() + (store.peak_bytes if self._store_kind() == "host" else 0),
            disk_peak_bytes=state_disk + (store.peak_bytes if self._store_kind() == "disk" else 0), applied=applied,
            extras={"chunk": active} if self.chunked else {},
        )

    def _update_chunk(self, k: int, lr: float, grad_norm: torch.Tensor, applied: bool) -> None:
        """slide.working_set=chunk: the active chunk's host AdamW (clipped by its own norm), its new
        weights written into the host tensors they go up from; or its gradients dropped."""
        if not applied:
            self.worker.submit(self.chunk_state.discard, k)
        else:
            coefficient = rules.clip_coefficient(grad_norm, self.train_cfg.max_grad_norm)
            host = self._host_weights()

            def write(piece, values: torch.Tensor) -> None:
                narrow(host[piece.name], piece).copy_(values)

            self.worker.submit(self.chunk_state.update, k, lr, 1.0 if is_fake(coefficient) else float(coefficient),
                               write)
        self.worker.barrier()

    def _host_weights(self) -> dict[str, torch.Tensor]:
        """Each trainable tensor's host tensor by name: where it rests, and what goes up."""
        return {self.names[id(t.param)]: t.host for u in self._all_units() for t in u.binding.tensors if t.trainable}

    def _grad_norm(self) -> torch.Tensor:
        """The global norm of this step's gradients, from the per-unit norms the host jobs noted
        when each unit's gradients were complete (before any update touched them)."""
        norms = [n for u in self._all_units() if u.adam is not None for n in u.norms]
        return torch.linalg.vector_norm(torch.stack(norms))

    def _all_units(self) -> list[HostUnit]:
        return [*self.units, *self.edges]

    def _store_kind(self) -> str:
        return "host" if self.activations_cfg.checkpoint == "none" else self.activations_cfg.checkpoint

    def host_bytes(self) -> int:
        """Host RAM held for the device: every unit's masters, accumulators, moments and frozen
        tensors, plus the staging buffers (block inputs are counted by the store); under a chunk
        working set the trainable tensors' host weights and the chunk state instead of masters."""
        held = sum(u.host_bytes() for u in self._all_units()) + sum(s.numel() for s in self.staging)
        if self.chunked:
            held += sum(runtime.nbytes(t) for t in self._host_weights().values()) + self.chunk_state.host_bytes()
        return held

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        self.stack.model.eval()
        return evaluate_batches(batches, self._eval_loss)

    def _eval_loss(self, batch: Batch) -> torch.Tensor:
        with autocast_for(self.device, self.precision), self._window():
            device_batch, hidden, *_ = self._forward(batch, None, keep_grads=False)
            x, targets = head_inputs(hidden, self.stack.norm, device_batch.targets, self.loss_cfg,
                                     device_batch.trained_positions)
            return streamed_ce(x, targets, self._tiles, chunk_tokens(self.loss_cfg, self._vocab()))[0]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The host masters by parameter name (what the modules point at between steps is not relied on)."""
        if self.chunked:
            return self.chunk_state.trainable_state()
        return {self.names[id(param)]: unit.adam.member(k, i).master
                for unit in self._all_units() for param, k, i in unit.members}

    def state_dict(self) -> EngineState:
        self.worker.barrier()
        if self.chunked:
            return self.chunk_state.state_dict(self.name, self.step_count)
        exp_avg, exp_avg_sq, steps = units_state(self._all_units(), self.names)
        return EngineState(engine=self.name, step=self.step_count, trainable=self.trainable_state(),
                           exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, adam_steps=steps)

    def load_state_dict(self, state: EngineState) -> None:
        """Masters and moments by parameter name, into the units' own buffers (RAM or mapped files)."""
        check_resumable(state, list(self.names.values()), self.name)
        self.worker.barrier()
        if self.chunked:
            self.chunk_state.load_state_dict(state)
            copy_named(self._host_weights(), state.trainable)
            self.step_count = state.step
            return
        copy_named(self.trainable_state(), state.trainable)
        load_units_state(self._all_units(), self.names, state)
        self.step_count = state.step


def scratch(cfg: RunConfig) -> dict[str, str]:
    """slide.moments=disk keeps the AdamW moments in files under slide.moments_dir; a chunk working
    set with chunk.state=disk its state under chunk.state_dir."""
    section, folders = cfg.section("slide"), {}
    if section.moments == "disk":
        folders["slide.moments_dir"] = str(section.moments_dir or Path(cfg.output_dir) / "moments")
    if section.working_set == "chunk":
        folders.update(chunk_scratch(cfg))
    return folders


def step_time(model_config, cfg: RunConfig, counts: speed.StepCounts, gpu, batch_size: int,
              seq_len: int) -> speed.StepTime:
    """Copies overlap compute; every block is recomputed in backward; a 4-bit base is dequantized in
    the forward, the recompute and the input-gradient pass; the host AdamW is exposed under clipping."""
    accum = cfg.train.grad_accum
    flops = speed.step_flops(model_config, cfg.method, batch_size, seq_len, recompute=True) * accum
    dequant = speed.dequant_bytes(model_config, 3 * accum) if cfg.quant.scheme != "none" else 0.0
    if cfg.section("slide").working_set == "chunk":
        return _chunked_step_time(cfg, counts, gpu, flops)
    disk = 2 * counts.disk_bytes if cfg.activations.checkpoint == "disk" else 0.0
    return speed.overlapped_step_time(flops, counts.trainable_params, gpu, cfg.precision, counts.host_link_bytes,
                                      disk, updates_exposed=cfg.train.max_grad_norm > 0, memory_bytes=dequant)


def _chunked_step_time(cfg: RunConfig, counts: speed.StepCounts, gpu, flops: float) -> speed.StepTime:
    """A chunk working set (modelled): the host AdamW of the active chunk after backward, exposed;
    with its state in files, that chunk's masters and moments read and written once a step (the
    disk figure holds every chunk's state, 12 bytes a number, and the block inputs on disk)."""
    chunk = cfg.section("chunk")
    active = counts.trainable_params / chunk.n_chunks
    state_bytes = 12 * counts.trainable_params if chunk.state == "disk" else 0
    inputs = counts.disk_bytes - state_bytes if cfg.activations.checkpoint == "disk" else 0
    disk = 2 * inputs + 2 * 12 * active * (chunk.state == "disk")
    return speed.overlapped_step_time(flops, int(active), gpu, cfg.precision, counts.host_link_bytes, disk,
                                      updates_exposed=True)


def plans(method: str) -> list[dict]:
    """Full fine-tuning with block inputs in host RAM or on disk, and with a chunk working set (8
    chunks, their state in files: the smallest host RAM); LoRA over a 4-bit base."""
    if method == "lora":
        return [{"precision": "bf16", "quant.scheme": "nf4"}]
    chunked = {"precision": "bf16", "activations.checkpoint": "host", "slide.working_set": "chunk",
               "chunk.n_chunks": 8, "chunk.state": "disk"}
    return [*({"precision": "bf16", "activations.checkpoint": store} for store in ("host", "disk")), chunked]


register(EngineSpec(
    name="slide", summary="weights, gradients and AdamW state on the host, a window of blocks on the device"
    " (models far larger than the device).",
    build=SlideEngine, step_time=step_time, section=SlideConfig, validate=validate, plans=plans, model_on_host=True,
    scratch=scratch, block_margin=lambda cfg: cfg.section("slide").slots - 1,
    # A chunk working set's host share depends on the partition of the whole model.
    by_depth=lambda cfg: cfg.section("slide").working_set != "chunk",
    open_settings=lambda cfg: chunk_open_settings(cfg) if cfg.section("slide").working_set == "chunk" else []))
