"""Engine `slide`: fine-tuning a model far larger than the device, with a sliding window of blocks
(SlideFormer; the team's spec is slide-window.md), on the offload runtime (device/runtime.py).

Where things live. Host: host units (optim/host_unit.py), one per block (the last block with the final
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
  step end  with clipping: the global norm over the host accumulators, then every unit's AdamW,
            submitted in the order the next step reads the units (below).

Gradient accumulation: gradients of every micro-batch are summed on the host (each loss divided by
the step's trained-token count, as in resident); updates wait for the last micro-batch. Clipping
needs the global norm before any update, so with train.max_grad_norm > 0 every update is submitted
after the last backward (each unit's norm is noted by its last host job, so only the sum of squares
waits), in the order the next step reads the units: the embedding (its rows are gathered first),
blocks 0..N-1, the LM head (read at the loss). When the loop hands step() the next step's batches
(`then=`: nothing reads the engine in between) the step returns with those updates still running, and
the next forward overtakes them: block i waits only for block i's update (`HostUnit.update_job`, in
`bind`), the embedding rows for the embedding's, the head tiles for the head's; a prefetch skips a
unit still updating rather than hold up the block before it. The weights are those of the sequential
order bit for bit: each unit's update is its own, and the next step's host jobs (gradient additions)
queue behind the updates on the one worker thread. Without `then`, a barrier ends the step. With
clipping off, each unit's update overlaps the backward of the blocks below it
(`WorkingSet.backward_update`).

What the host keeps, adds gradients into and updates is the working set's (working_set.py, chosen
once from slide.working_set): every tensor's master and AdamW state in its unit (the default, as
above), or one chunk's at a time (ChunkFT's on the window; the trainable tensors rest on the host as
weights). The device side is the same under both: the engine never asks which it has.

Ordering is explicit: a unit's next upload or host read waits for its last update
(`HostUnit.update_job`; evaluation, trainable_state and state_dict wait for the whole worker), a
staging buffer is refilled only after the host job that read it finished, and a slot is refilled
only after the device work on it (an event on CUDA). On the CPU every copy is synchronous and the
same code runs; host tensors are marked host-resident, so the meter counts what a GPU would hold.
"""


from __future__ import annotations

import contextlib
import dataclasses
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.config import RunConfig, TrainConfig
from slimtune.data.dataset import Batch
from slimtune.device import memory, runtime
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.engines.base import Engine, NextStep, StepResult
from slimtune.engines.registry import EngineSpec, register
from slimtune.engines.slide.settings import SlideConfig, plans, scratch, validate
from slimtune.engines.slide.speed import step_time
from slimtune.engines.slide.streamed_ce import streamed_ce
from slimtune.engines.slide.working_set import WorkingSet, working_set_of
from slimtune.model.stack import Stack
from slimtune.optim.host_adam import MOMENTS_ON_DISK, moments_folder
from slimtune.optim import rules
from slimtune.optim.host_unit import HostUnit, StepGuard
from slimtune.step import activations, block_stores
from slimtune.step.forward import evaluate_batches, step_divisor, to_float
from slimtune.step.loss import chunk_tokens, trained_rows
from slimtune.step.precision import autocast_for
from slimtune.store.checkpoint import EngineState, check_resumable


class SlideEngine(Engine):
    name = "slide"

    def __init__(self, stack: Stack, cfg: RunConfig, device: torch.device, precision: str, dist: Dist = SINGLE):
        self.stack, self.device, self.precision, self.dist = stack, device, precision, dist
        self.train_cfg, self.loss_cfg, self.activations_cfg = cfg.train, cfg.loss, cfg.activations
        self.slide_cfg = cfg.section("slide")
        self.store_dir = Path(cfg.output_dir) / "activations"  # checkpoint=disk without activations.disk_dir
        if stack.head.bias is not None:
            raise NotImplementedError("engine=slide streams an LM head without bias")
        weight_dtype = torch.bfloat16 if precision == "bf16" else None  # None: the master's dtype
        self.names = {id(p): n for n, p in stack.model.named_parameters() if p.requires_grad}
        self.working_set: WorkingSet = working_set_of(cfg)(cfg, self.names, stack.model, device, dist)
        moments = self._moments_dir(cfg)
        blocks, count = stack.blocks, len(stack.blocks)
        block_modules = [[blocks[i]] + ([stack.norm] if i == count - 1 else []) for i in range(count)]
        self.shared_grads = self.working_set.block_accumulator(
            max(sum(p.numel() for m in ms for p in m.parameters() if p.requires_grad) for ms in block_modules),
            weight_dtype or torch.promote_types(next(stack.model.parameters()).dtype, torch.float32), device)
        self.units = [HostUnit(f"block {i}", block_modules[i], device, weight_dtype, cfg.train, moments,
                               self.working_set.sink, whole_grads=True, working=self.shared_grads,
                               direct=self.working_set.direct) for i in range(count)]
        self.edges = self._edge_units(cfg.train, weight_dtype, moments)
        # A block's gradients add into its slot's accumulator; chunk's working set takes them from
        # there once the block's backward is done (HostUnit.accumulate), not a tile at a time.
        stack.gradients_accumulate_plainly = True
        for unit in self._all_units():
            unit.dist = dist  # each unit's complete gradients are summed across ranks on the host worker
        self.worker = runtime.HostWorker(inline=any(is_fake(p) for p in stack.model.parameters()), device=device)
        weakref.finalize(self, self.worker.close)  # its thread goes with the engine
        # The loop may hand step() the next step's batches (then=): the step's updates then run on
        # while the next forward starts. The planner's fake step runs its host jobs inline: nothing to overlap.
        self.starts_ahead = not self.worker.inline
        self.working_set.attach(self._all_units(), self.worker, self._read_order())
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
        self.step_count = 0
        self.meter = memory.meter_for(device, cfg.train.measure_memory)

    def _edge_units(self, train: TrainConfig, weight_dtype: torch.dtype | None,
                    moments: Path | None) -> list[HostUnit]:
        """The host-side units: the LM head (streamed up in tiles, so it gets a narrow shadow) and
        the embedding (never sent up: rows are gathered on the host; it rests as the working set says);
        one unit when tied."""
        stack, device, sink = self.stack, self.device, self.working_set.sink
        if stack.tied:
            return [HostUnit("embedding and LM head", [stack.embed, stack.head], device, weight_dtype, train, moments,
                             sink)]
        return [HostUnit("LM head", [stack.head], device, weight_dtype, train, moments, sink, whole_grads=True,
                         direct=self.working_set.direct),
                HostUnit("embedding", [stack.embed], device, self.working_set.embedding_dtype(weight_dtype), train,
                         moments, sink, row_grads=not self.dist.active)]  # only the rows of the tokens seen

    def _edge_tensor(self, param: torch.Tensor) -> runtime.SlotTensor | None:
        return next((found for unit in self.edges if (found := unit.tensor_of(param)) is not None), None)

    def _edge_unit(self, param: torch.Tensor) -> HostUnit | None:
        return next((unit for unit in self.edges if unit.tensor_of(param) is not None), None)

    def _read_order(self) -> list[HostUnit]:
        """The units in the order a step first reads them: the embedding (its rows are gathered
        before block 0; a tied table with the head), the blocks, the LM head (read at the loss)."""
        embedding = self._edge_unit(self.stack.embed.weight)
        return [*([embedding] if embedding else []), *self.units,
                *(u for u in self.edges if u is not embedding)]

    @staticmethod
    def _await_update(unit: HostUnit | None) -> None:
        """Wait for the unit's last AdamW before reading its host tensors (it may still run on the
        worker while the next step's forward goes on)."""
        if unit is not None and unit.update_job is not None:
            unit.update_job.result()

    def _moments_dir(self, cfg: RunConfig) -> runtime.ScratchFolder | Path | None:
        """slide.moments=disk: a private folder for the moment files, removed with the engine (sized
        by the working set: a chunk working set keeps no per-unit moments)."""
        folder = scratch(cfg).get("slide.moments_dir")
        if folder and any(is_fake(p) for p in self.stack.model.parameters()):
            return Path(folder)  # the planner's step: the files are counted, never made
        need = self.working_set.moments_bytes([p for p in self.stack.model.parameters() if p.requires_grad])
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
        found = self._edge_tensor(weight)
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
        """Start copying unit `index` in while the current one computes, if a slot is free and its
        last update is done (waiting for it here would hold up the block that computes now)."""
        if 0 <= index < len(self.units) and self.units[index].slot is None and self.pool.free:
            unit = self.units[index]
            if unit.update_job is not None and not unit.update_job.done():
                return
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
        if unit.direct and update is not None:  # its AdamW reads the gradients from the staging buffer
            self.staging_jobs[turn] = unit.update_job = self.worker.submit(unit.update_from, self.staging[turn],
                                                                             event, *update)
        else:
            self.staging_jobs[turn] = self.worker.submit(unit.accumulate, self.staging[turn], event, final)
        if update is not None and unit.adam is not None and not unit.direct:
            unit.update_job = self.worker.submit(unit.update, *update)
        self._unload(index)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows, gathered on the host (the V x D table never goes up)."""
        weight = self.stack.embed.weight
        unit = self._edge_unit(weight)
        self._await_update(unit)
        with torch.no_grad():  # a trained table's rows come from its master, not the bf16 weight that goes up
            rows = self.stack.embed(input_ids.cpu()) if unit is None else unit.rows(weight, input_ids.cpu())
        return self.link.ready(self.link.to_device(rows.contiguous()))

    def _embed_backward(self, input_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Add d(loss)/d(embedding rows) into the working set's host gradient (by id, on the worker)."""
        weight, add_rows = self.stack.embed.weight, self.working_set.add_embedding_rows
        host, event = self.link.to_host(grad.reshape(-1, grad.shape[-1]))
        ids = input_ids.reshape(-1).cpu()
        padding = self.stack.embed.padding_idx

        def add() -> None:
            if event is not None:
                event.synchronize()
            add_rows(weight, ids, host, padding)

        self.worker.submit(add)

    def _tiles(self):
        """Yields (start, stop, rows of the LM head on the device), one tile at a time."""
        host = self.edge_head_weight()  # at rest: the host master (or frozen host tensor)
        self._await_update(self._edge_unit(self.stack.head.weight))
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
        """streamed_ce's sink for a trainable head: each tile's gradient goes to the working set's
        host rows."""
        weight = self.stack.head.weight
        found = self._edge_tensor(weight)
        if found is None or not found.trainable:
            return None
        add_rows, unit = self.working_set.add_head_rows, self._edge_unit(weight)

        def sink(start: int, stop: int, grad: torch.Tensor) -> None:
            # Down in the compute dtype, as a block's gradient comes (and as resident's head gradient
            # is made under autocast): half the link bytes of fp32, held once on the host as it came.
            host, event = self.link.to_host(grad.to(found.device_dtype))

            def add() -> None:
                if event is not None:
                    event.synchronize()
                add_rows(weight, start, stop, host)

            job = self.worker.submit(add)
            if unit.direct:  # the tile's AdamW is in it: the next read of the head waits for the last
                unit.update_job = job

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
        chunk = activations.tile_tokens(self.stack, hidden.shape[1], self.activations_cfg, batch.segmented)
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
            x, targets = trained_rows(out, device_batch.targets, self.loss_cfg, device_batch.trained_positions)
            # the final norm runs inside streamed_ce's chunks; its gradient lands in the last unit's slot
            loss_sum, grad_x = streamed_ce(x.detach(), targets, self._tiles, chunk_tokens(self.loss_cfg, self._vocab()),
                                           scale=1.0 / total, sink=self._head_sink(), norm=self.stack.norm)
        torch.autograd.backward(x, grad_x)  # scattered back to the rows that were gathered
        grad = out.grad
        del hidden, out, x, grad_x  # only the gradient travels down the blocks
        embedding = self._edge_tensor(self.stack.embed.weight)
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
                activations.block_backward(self.stack, index, x_in, grad, inputs, chunk, grad_owned=True)
                grad = x_in.grad if x_in.requires_grad else None
                del x_in
                self._finish_block(index, update, final)
        memory.mark("edges")
        if wants_embed_grad and grad is not None:
            self._embed_backward(batch.input_ids, grad)
        for unit in self.edges if final else ():
            if unit.adam is not None and not unit.direct:  # after its head-tile and embedding-row jobs, in order
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
        lr = self.working_set.begin_step(self.step_count)
        link_before = self.link.bytes
        guard = StepGuard()
        with self.meter.measure(self._resident_tensors()) as reading, self._store() as store, self._window():
            loss_sum = 0.0
            for k, batch in enumerate(micro_batches):
                final = k == len(micro_batches) - 1
                update_now = self.working_set.backward_update(lr, guard) if final else None
                loss_sum = loss_sum + self._micro_step(batch, total, store, update_now, final)
            self.worker.barrier()
            memory.mark("update")
            grad_norm = self.working_set.grad_norm()
            applied = rules.is_finite(loss_sum) and rules.is_finite(grad_norm) and not guard.tripped
            self.working_set.update(lr, grad_norm, applied)
            if then is None:  # something may read the engine before the next step: the updates end here
                self.worker.barrier()
        self.step_count += 1
        self.working_set.end_step(applied)
        return StepResult(
            loss=to_float(loss_sum) / total, tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches), lr=lr, grad_norm=to_float(grad_norm),
            device_peak_bytes=reading.peak, device_peak_breakdown=reading.peak_breakdown,
            host_link_bytes=self.link.bytes - link_before + store.link_bytes,
            host_peak_bytes=self.host_bytes() + (store.peak_bytes if self._store_kind() == "host" else 0),
            disk_peak_bytes=self.working_set.disk_bytes() + (store.peak_bytes if self._store_kind() == "disk" else 0),
            applied=applied, extras=self.working_set.extras(),
        )

    def _all_units(self) -> list[HostUnit]:
        return [*self.units, *self.edges]

    def _store_kind(self) -> str:
        return "host" if self.activations_cfg.checkpoint == "none" else self.activations_cfg.checkpoint

    def host_bytes(self) -> int:
        """Host RAM held for the device: every unit's masters, accumulators, moments and frozen
        tensors, the staging buffers (block inputs are counted by the store) and what the working set
        holds besides."""
        held = sum(u.host_bytes() for u in self._all_units()) + sum(s.numel() for s in self.staging)
        shared = self.shared_grads.host_bytes() if self.shared_grads is not None else 0
        return held + shared + self.working_set.host_bytes()

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        self.worker.barrier()  # the last step's updates, if it left them running
        self.stack.model.eval()
        return evaluate_batches(batches, self._eval_loss)

    def _eval_loss(self, batch: Batch) -> torch.Tensor:
        with autocast_for(self.device, self.precision), self._window():
            device_batch, hidden, *_ = self._forward(batch, None, keep_grads=False)
            x, targets = trained_rows(hidden, device_batch.targets, self.loss_cfg, device_batch.trained_positions)
            return streamed_ce(x, targets, self._tiles, chunk_tokens(self.loss_cfg, self._vocab()),
                               norm=self.stack.norm)[0]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The working set's weights at full precision by parameter name (what the modules point at
        between steps is not relied on), once the last step's updates are done."""
        self.worker.barrier()
        return self.working_set.trainable_state()

    def state_dict(self) -> EngineState:
        self.worker.barrier()
        return self.working_set.state_dict(self.name, self.step_count)

    def load_state_dict(self, state: EngineState) -> None:
        """Weights and moments by parameter name, into the working set's own buffers (RAM or mapped files)."""
        check_resumable(state, list(self.names.values()), self.name)
        self.worker.barrier()
        self.working_set.load_state_dict(state)
        self.step_count = state.step


register(EngineSpec(
    name="slide", summary="weights, gradients and AdamW state on the host, a window of blocks on the device"
    " (models far larger than the device).",
    build=SlideEngine, step_time=step_time, section=SlideConfig, validate=validate, plans=plans, model_on_host=True,
    scratch=scratch, block_margin=lambda cfg: cfg.section("slide").slots - 1,
    by_depth=lambda cfg: working_set_of(cfg).by_depth,
    open_settings=lambda cfg: working_set_of(cfg).open_settings(cfg)))
