"""Engine `slide`: fine-tuning a model far larger than the device, with a sliding window of blocks
(SlideFormer, specs/slide-window.md), on the offload runtime (runtime.py).

Where things live. Host: the fp32 master of every trainable tensor, in flat buffers per unit (a
block; the last block with the final norm; the LM head; the embedding, or one unit for a tied
pair), the gradient
accumulators in the same layout, the AdamW moments (torch's fused CPU AdamW, one optimizer per
unit), frozen tensors (a LoRA base, 4-bit codes), the embedding and LM head, and each block's input
(the activations store: host RAM, or disk). Device: a SlotPool of `slide.slots` slots sized to the
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

Ordering is explicit: a unit's next upload waits for its last update (`_Unit.update_job`), a
staging buffer is refilled only after the host job that read it finished, and a slot is refilled
only after the device work on it (an event on CUDA). On the CPU every copy is synchronous and the
same code runs; host tensors are marked host-resident, so the meter counts what a GPU would hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimtune import activations, memory, runtime, schedule
from slimtune.config import ActivationsConfig, LossConfig, SlideConfig, TrainConfig
from slimtune.data import Batch
from slimtune.engines.base import StepResult, autocast_for, to_float
from slimtune.errors import UserError
from slimtune.loss import chunk_tokens, head_inputs
from slimtune.model import Stack
from slimtune.streamed_ce import streamed_ce


@dataclass
class _Entry:
    """One tensor of a unit: where it rests on the host and where it goes in a slot."""

    owner: nn.Module
    attr: str
    param: nn.Parameter | None  # None: a buffer
    host: torch.Tensor  # at rest: a view into a flat master, or the frozen host tensor
    device_dtype: torch.dtype
    offset: int = 0  # bytes into slot.weights
    grad_offset: int = -1  # bytes into slot.grads; -1: frozen
    master_grad: torch.Tensor | None = None  # host gradient accumulator (a view into a flat buffer)
    shadow: torch.Tensor | None = None  # the master in device_dtype, when that is narrower (what goes up)

    @property
    def upload(self) -> torch.Tensor:
        """What crosses the link: the narrow shadow of a master, else the host tensor itself."""
        return self.shadow if self.shadow is not None else self.host

    @property
    def trainable(self) -> bool:
        return self.grad_offset >= 0

    def weight_in(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor's place in a slot's weight buffer."""
        return runtime.view_bytes(buffer, self.offset, tuple(self.host.shape), self.device_dtype)

    def grad_in(self, buffer: torch.Tensor) -> torch.Tensor:
        """Its gradient's place in a slot's gradient buffer or a staging buffer (same layout)."""
        return runtime.view_bytes(buffer, self.grad_offset, tuple(self.host.shape), self.device_dtype)


def _own_tensors(modules: list[nn.Module]):
    """(owner, attr, tensor, is_param) of every parameter and buffer, each tensor once."""
    seen = set()
    for module in modules:
        for owner in module.modules():
            for table, is_param in ((owner._parameters, True), (owner._buffers, False)):
                for attr, tensor in table.items():
                    if tensor is not None and id(tensor) not in seen:
                        seen.add(id(tensor))
                        yield owner, attr, tensor, is_param


class _Unit:
    """Modules whose tensors move together, with fp32 masters for the trainable ones (two flat host
    buffers: decayed matrices and undecayed vectors, the resident engine's groups), gradient
    accumulators in the same layout, and their own fused AdamW. Frozen tensors stay on the host
    (pinned on CUDA) and go to the device as they are; trainable ones go in `weight_dtype`."""

    def __init__(self, name: str, modules: list[nn.Module], device: torch.device, weight_dtype: torch.dtype | None,
                 cfg: TrainConfig, moments_dir: Path | None = None):
        self.name, self.device, self.cfg, self.moments_dir = name, device, cfg, moments_dir
        self.weight_dtype = weight_dtype
        self.entries: list[_Entry] = []
        for owner, attr, tensor, is_param in _own_tensors(modules):
            trainable = is_param and tensor.requires_grad
            host = tensor.data if trainable else self._frozen_host(owner, attr, tensor, is_param)
            dtype = (weight_dtype or tensor.dtype) if trainable else tensor.dtype
            self.entries.append(_Entry(owner, attr, tensor if is_param else None, host, dtype,
                                       grad_offset=0 if trainable else -1))
        self.flats = self._make_masters()
        self.shadows = self._make_shadows()
        self.weight_bytes, self.grad_bytes = self._lay_out()
        self.optimizer = self._make_optimizer() if self.flats else None
        self.update_job = None  # the last AdamW submitted for this unit
        self.norms: list[torch.Tensor] = []  # its step gradients' norms, noted once they are complete
        self.slot: runtime.Slot | None = None
        self.ready = None  # the event of its last copy into the slot (None on the CPU)
        self.grads_bound = False

    # ------------------------------------------------------------ host storage

    def _frozen_host(self, owner: nn.Module, attr: str, tensor: torch.Tensor, is_param: bool) -> torch.Tensor:
        if self.device.type != "cuda":
            return memory.mark_host_resident(tensor.data)
        host = runtime.to_host_storage(tensor.data, self.device)  # pinned, so uploads are DMA
        if is_param:
            tensor.data = host
        else:
            owner._buffers[attr] = host
        return host

    def _make_masters(self) -> list[tuple[nn.Parameter, float]]:
        """Copy trainable tensors into flat master buffers; the parameters then point into them."""
        trainable = [e for e in self.entries if e.trainable]
        groups = [([e for e in trainable if e.param.ndim >= 2], self.cfg.weight_decay),
                  ([e for e in trainable if e.param.ndim < 2], 0.0)]
        flats, self.members = [], []
        for members, decay in groups:
            if not members:
                continue
            self.members.append(members)
            dtype = torch.promote_types(members[0].param.dtype, torch.float32)  # fp32 masters; fp64 stays
            numel = sum(e.param.numel() for e in members)
            # Pinned only if it crosses the link itself (no narrower shadow goes up in its place).
            crosses = self.weight_dtype is None or self.weight_dtype == dtype
            master = runtime.host_empty((numel,), dtype, self.device, pinned=crosses)
            grads = runtime.host_empty((numel,), dtype, self.device, pinned=False)
            with torch.no_grad():
                grads.zero_()
                start = 0
                for e in members:
                    n, shape = e.param.numel(), e.param.shape
                    view = master[start : start + n].view(shape)
                    view.copy_(e.param.data)
                    e.param.data, e.host = view, view
                    e.master_grad = grads[start : start + n].view(shape)
                    start += n
            flat = nn.Parameter(master)
            flat.grad = grads
            flats.append((flat, decay))
        return flats

    def _make_shadows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(shadow, master) flat pairs: a bf16 copy of fp32 masters, refreshed after each update, so
        uploads move 2 bytes a weight and the host casts once per step, not once per upload."""
        pairs = []
        for (flat, _), members in zip(self.flats, self.members):
            dtype = members[0].device_dtype if members else flat.dtype
            if dtype == flat.dtype:
                continue
            shadow = runtime.host_empty(flat.shape, dtype, self.device)
            with torch.no_grad():
                shadow.copy_(flat)
            start = 0
            for e in members:
                n = e.host.numel()
                e.shadow = shadow[start : start + n].view(e.host.shape)
                start += n
            pairs.append((shadow, flat))
        return pairs

    def _make_optimizer(self) -> torch.optim.AdamW:
        cfg = self.cfg
        optimizer = torch.optim.AdamW([{"params": [flat], "weight_decay": decay} for flat, decay in self.flats],
                                      lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
        for k, (flat, _) in enumerate(self.flats):  # made here, host-resident, not lazily on the worker
            optimizer.state[flat] = {
                "step": memory.mark_host_resident(torch.zeros((), dtype=torch.float32)),
                "exp_avg": self._moment(flat, f"{k}-exp_avg"),
                "exp_avg_sq": self._moment(flat, f"{k}-exp_avg_sq"),
            }
        return optimizer

    def _moment(self, flat: torch.Tensor, tag: str) -> torch.Tensor:
        """A zeroed AdamW moment: in host RAM, or (slide.moments=disk) a memory-mapped file the
        page cache keeps as much of as RAM allows. Fake tensors (the estimate) never touch a disk."""
        if self.moments_dir is None or _is_fake(flat):
            return runtime.host_empty(flat.shape, flat.dtype, self.device, pinned=False).zero_()
        path = self.moments_dir / f"{self.name.replace(' ', '-')}-{tag}.bin"
        moment = torch.from_file(str(path), shared=True, size=flat.numel(), dtype=flat.dtype)  # a new file is zeros
        return memory.mark_host_resident(moment.view(flat.shape))

    def load_optimizer(self, saved: dict) -> None:
        """Load a checkpoint's AdamW state into this unit's own moment tensors (RAM or mapped files)."""
        own = {id(p): dict(self.optimizer.state[p]) for p, _ in self.flats}
        self.optimizer.load_state_dict(saved)
        with torch.no_grad():
            for flat, _ in self.flats:
                state = self.optimizer.state[flat]
                for key, mine in own[id(flat)].items():
                    mine.copy_(state[key])
                    state[key] = mine

    def _lay_out(self) -> tuple[int, int]:
        weights = grads = 0
        for e in self.entries:
            e.offset = weights
            weights += runtime.aligned(runtime.nbytes_of(e.host.shape, e.device_dtype))
            if e.trainable:
                e.grad_offset = grads
                grads += runtime.aligned(runtime.nbytes_of(e.host.shape, e.device_dtype))
        return weights, grads

    def host_bytes(self) -> int:
        """Host RAM this unit holds: masters, gradient accumulators, moments (unless on disk), frozen tensors."""
        copies = 3 if self.moments_dir is None else 1
        flat = sum(copies * p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size() for p, _ in self.flats)
        flat += sum(shadow.numel() * shadow.element_size() for shadow, _ in self.shadows)
        return flat + sum(e.host.numel() * e.host.element_size() for e in self.entries if not e.trainable)

    def host_tensors(self) -> list[torch.Tensor]:
        return [p for p, _ in self.flats] + [e.host for e in self.entries if not e.trainable]

    # ------------------------------------------------------------ device side

    def bind(self, slot: runtime.Slot, link: runtime.Link, with_grads: bool) -> object:
        """Copy the unit into `slot` and point its modules at the copies; zero and attach the
        gradient views when `with_grads`. Returns the copies' event (None on the CPU)."""
        if self.update_job is not None:
            self.update_job.result()  # never upload a unit before its last update finished
        self.slot = slot
        after = slot.released
        event = None
        if with_grads:  # zeroed on the copy stream: after the last borrower's gradients went down
            event = self._zero_grads(link, after)
        for e in self.entries:
            view = e.weight_in(slot.weights)
            event = link.copy_up(view, e.upload, after)
            if e.param is not None:
                e.param.data = view
            else:
                e.owner._buffers[e.attr] = view
        if with_grads:
            self._set_grads()
        return event

    def attach_grads(self, link: runtime.Link) -> object:
        """For a unit loaded without: zeroed gradient views become .grad; returns the zeroing's event."""
        event = self._zero_grads(link)
        self._set_grads()
        return event

    def _grad_view(self, e: _Entry) -> torch.Tensor:
        return e.grad_in(self.slot.grads)

    def _zero_grads(self, link: runtime.Link, after: object = None) -> object:
        event = None
        for e in self.entries:
            if e.trainable:
                event = link.zero(self._grad_view(e), after)
        return event

    def _set_grads(self) -> None:
        """The slot's gradient views become the trainable parameters' .grad (autograd adds into them)."""
        for e in self.entries:
            if e.trainable:
                e.param.grad = self._grad_view(e)
        self.grads_bound = True

    def unbind(self) -> runtime.Slot:
        """Point the modules back at the host tensors; returns the slot."""
        for e in self.entries:
            if e.param is not None:
                e.param.data = e.host
                e.param.grad = None
            else:
                e.owner._buffers[e.attr] = e.host
        slot, self.slot, self.grads_bound = self.slot, None, False
        return slot

    def download_grads(self, link: runtime.Link, staging: torch.Tensor) -> object:
        """The slot's gradients into the host `staging` buffer (same layout); returns the event."""
        event = None
        for e in self.entries:
            if e.trainable:
                event = link.copy_down(e.grad_in(staging), e.grad_in(self.slot.grads))
        return event

    # ------------------------------------------------------------ host work (on the worker)

    def accumulate(self, staging: torch.Tensor, event: object, final: bool = False) -> None:
        """Add the staged gradients; on the step's last micro-batch also note their norms (on the
        worker, so the global norm for clipping costs the device loop nothing)."""
        if event is not None:
            event.synchronize()
        self._add_staged(staging)
        if final:
            self.note_norms()

    def note_norms(self) -> None:
        self.norms = self.grad_norms()

    def _add_staged(self, staging: torch.Tensor) -> None:
        with torch.no_grad():
            for e in self.entries:
                if e.trainable:
                    e.master_grad.add_(e.grad_in(staging))

    def update(self, lr: float, clip: float) -> None:
        """AdamW on the masters with the accumulated gradients times `clip`; then zero them."""
        with torch.no_grad():
            for flat, _ in self.flats:
                if clip != 1.0:
                    flat.grad.mul_(clip)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            for flat, _ in self.flats:
                flat.grad.zero_()
            self.refresh_shadows()

    def refresh_shadows(self) -> None:
        with torch.no_grad():
            for shadow, flat in self.shadows:
                shadow.copy_(flat)

    def grad_norms(self) -> list[torch.Tensor]:
        return [torch.linalg.vector_norm(flat.grad) for flat, _ in self.flats]


class SlideEngine:
    name = "slide"

    def __init__(self, stack: Stack, cfg: TrainConfig, device: torch.device, precision: str,
                 loss_cfg: LossConfig | None = None, activations_cfg: ActivationsConfig | None = None,
                 slide_cfg: SlideConfig | None = None, store_dir: Path | None = None):
        self.stack, self.cfg, self.device, self.precision = stack, cfg, device, precision
        self.loss_cfg = loss_cfg or LossConfig()
        self.activations_cfg = activations_cfg or ActivationsConfig()
        self.slide_cfg = slide_cfg or SlideConfig()
        self.store_dir = store_dir
        if getattr(stack.head, "bias", None) is not None:
            raise NotImplementedError("engine=slide streams an LM head without bias")
        weight_dtype = torch.bfloat16 if precision == "bf16" else None  # None: the master's dtype
        moments = self._moments_dir(store_dir)
        blocks, count = stack.blocks, len(stack.blocks)
        self.units = [_Unit(f"block {i}", [blocks[i]] + ([stack.norm] if i == count - 1 else []), device,
                            weight_dtype, cfg, moments) for i in range(count)]
        self.edges = self._edge_units(weight_dtype, moments)
        self.named = [(n, p) for n, p in stack.model.named_parameters() if p.requires_grad]
        stack.rotary.to(device)
        self.link = runtime.Link(device)
        self.pool = runtime.SlotPool(device, self.slide_cfg.slots, max(u.weight_bytes for u in self.units),
                                     max(u.grad_bytes for u in self.units))
        grad_bytes = max(u.grad_bytes for u in self.units)
        self.staging = [runtime.host_empty((max(grad_bytes, 1),), torch.uint8, device) for _ in range(2)]
        self.staging_jobs: list = [None, None]
        self.staging_turn = 0
        self.head_tiles = self._make_head_tiles(weight_dtype)
        self.tiles_free: list = [None] * len(self.head_tiles)  # per tile buffer: its last reader is done
        self.worker = runtime.HostWorker(inline=any(_is_fake(p) for p in stack.model.parameters()))
        weakref.finalize(self, self.worker.close)  # its thread goes with the engine
        self.step_count = 0
        self.meter = memory.meter_for(device, cfg.measure_memory)

    def _edge_units(self, weight_dtype: torch.dtype | None, moments: Path | None) -> list[_Unit]:
        """The host-side units: the LM head (streamed up in tiles, so it gets a narrow shadow) and
        the embedding (never sent up: rows are gathered on the host, so no shadow); one unit when tied."""
        stack, device, cfg = self.stack, self.device, self.cfg
        if stack.tied:
            return [_Unit("embedding and LM head", [stack.embed, stack.head], device, weight_dtype, cfg, moments)]
        return [_Unit("LM head", [stack.head], device, weight_dtype, cfg, moments),
                _Unit("embedding", [stack.embed], device, None, cfg, moments)]

    def _edge_entry(self, param: torch.Tensor) -> _Entry | None:
        return next((e for unit in self.edges for e in unit.entries if e.param is param), None)

    def _moments_dir(self, store_dir: Path | None) -> Path | None:
        """slide.moments=disk: a private folder for the moment files, removed with the engine."""
        if self.slide_cfg.moments != "disk":
            return None
        root = Path(self.slide_cfg.moments_dir or (store_dir.parent / "moments" if store_dir else "moments"))
        try:
            root.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix="adam-", dir=root))
        except OSError as err:
            raise UserError(f"slide.moments_dir '{root}' is not a usable folder ({err}).") from None
        weakref.finalize(self, shutil.rmtree, folder, True)
        return folder

    # ------------------------------------------------------------ the pieces of a step

    def _make_head_tiles(self, weight_dtype: torch.dtype | None) -> list[torch.Tensor]:
        vocab, width = self.edge_head_weight().shape
        dtype = weight_dtype or self.edge_head_weight().dtype
        per_row = runtime.nbytes_of((width,), dtype)
        rows = max(1, min(vocab, int(self.slide_cfg.head_tile_mb * 2**20) // per_row))
        return [torch.empty((rows, width), dtype=dtype, device=self.device)
                for _ in range(2 if self.device.type == "cuda" else 1)]

    def edge_head_weight(self) -> torch.Tensor:
        """The LM head weight as it goes up: the narrow shadow of its master, or the host tensor."""
        weight = self.stack.head.weight
        entry = self._edge_entry(weight)
        return entry.upload if entry is not None else weight

    def _resident_tensors(self):
        yield from ((t, "weights") for t in self.pool.tensors())
        yield from ((t, "weights") for t in self.head_tiles)
        yield from ((b, "weights") for b in self.stack.rotary.buffers())

    def _load(self, index: int, with_grads: bool) -> None:
        unit = self.units[index]
        if unit.slot is None:
            unit.ready = unit.bind(self.pool.acquire(unit.name), self.link, with_grads)
        elif with_grads and not unit.grads_bound:
            unit.ready = unit.attach_grads(self.link)
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
        self.pool.release(self.units[index].unbind())

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
        event = unit.download_grads(self.link, self.staging[turn])
        self.staging_jobs[turn] = self.worker.submit(unit.accumulate, self.staging[turn], event, final)
        if update is not None and unit.optimizer is not None:
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
        entry = self._edge_entry(weight)
        host, event = self.link.to_host(grad.reshape(-1, grad.shape[-1]))
        ids = input_ids.reshape(-1).cpu()
        padding = getattr(self.stack.embed, "padding_idx", None)

        def add() -> None:
            if event is not None:
                event.synchronize()
            rows = host.to(entry.master_grad.dtype)
            if padding is not None:  # as nn.Embedding: the padding row gets no gradient
                rows[ids == padding] = 0
            entry.master_grad.index_add_(0, ids, rows)

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
        entry = self._edge_entry(weight)
        if entry is None or not entry.trainable:
            return None

        def sink(start: int, stop: int, grad: torch.Tensor) -> None:
            host, event = self.link.to_host(grad)

            def add() -> None:
                if event is not None:
                    event.synchronize()
                entry.master_grad[start:stop].add_(host)

            self.worker.submit(add)

        return sink

    def _store(self):
        checkpoint = self.activations_cfg.checkpoint
        cfg = dataclasses.replace(self.activations_cfg, checkpoint="host" if checkpoint == "none" else checkpoint)
        return activations.open_store(cfg, self.device, self.store_dir)

    # ------------------------------------------------------------ one micro-batch

    def _forward(self, batch: Batch, store, keep_grads: bool):
        """The blocks without grad; returns the last block's output (its unit stays loaded), the
        block inputs' store keys, RNG states, BlockInputs and the MLP chunk."""
        device_batch = batch.to(self.device)
        hidden = self._embed(batch.input_ids)
        inputs = self.stack.prepare(hidden, device_batch.position_ids, batch.segmented)
        chunk = activations.mlp_chunk_tokens(self.stack, hidden.shape[1], self.activations_cfg)
        last = len(self.units) - 1
        keys, states = [], []
        for index in range(len(self.units)):
            self._load(index, keep_grads and index == last)
            for ahead in range(1, self.slide_cfg.slots):
                self._prefetch(index + ahead, keep_grads and index + ahead == last)
            if keep_grads:
                keys.append(store.put(hidden))
                states.append(activations.rng_state(self.device))
            with torch.no_grad():
                hidden = activations.block_forward(self.stack, index, hidden, inputs, chunk)
            if index < last:
                self._unload(index)
        return device_batch, hidden, keys, states, inputs, chunk

    def _micro_step(self, batch: Batch, total: int, store, update: tuple | None, final: bool) -> torch.Tensor:
        with autocast_for(self.device, self.precision):
            device_batch, hidden, keys, states, inputs, chunk = self._forward(batch, store, keep_grads=True)
            out = hidden.detach().requires_grad_()
            x, targets = head_inputs(out, self.stack.norm, device_batch.targets, self.loss_cfg, device_batch.rows)
            loss_sum, grad_x = streamed_ce(x.detach(), targets, self._tiles, chunk_tokens(self.loss_cfg, self._vocab()),
                                           scale=1.0 / total, sink=self._head_sink())
        torch.autograd.backward(x, grad_x)  # the final norm's gradient lands in the last unit's slot
        grad = out.grad
        del hidden, out, x, grad_x  # only the gradient travels down the blocks
        embed_entry = self._edge_entry(self.stack.embed.weight)
        wants_embed_grad = embed_entry is not None and embed_entry.trainable
        with torch.random.fork_rng([self.device] if self.device.type == "cuda" else []), \
                autocast_for(self.device, self.precision):
            for index in range(len(self.units) - 1, -1, -1):
                self._load(index, with_grads=True)
                for ahead in range(1, self.slide_cfg.slots):
                    self._prefetch(index - ahead, with_grads=True)
                x_in = store.take(keys[index]).detach().requires_grad_(index > 0 or wants_embed_grad)
                if index > 0:
                    store.prefetch(keys[index - 1])  # the next input comes up while this block runs
                activations.restore_rng(states[index], self.device)
                activations.block_backward(self.stack, index, x_in, grad, inputs, chunk)
                grad = x_in.grad if x_in.requires_grad else None
                del x_in
                self._finish_block(index, update, final)
        if wants_embed_grad and grad is not None:
            self._embed_backward(batch.input_ids, grad)
        for unit in self.edges if final else ():
            if unit.optimizer is not None:  # after its head-tile and embedding-row jobs, in order
                self.worker.submit(unit.note_norms)
                if update is not None:
                    unit.update_job = self.worker.submit(unit.update, *update)
        return loss_sum

    def _vocab(self) -> int:
        return self.edge_head_weight().shape[0]

    # ------------------------------------------------------------ the Engine interface

    def step(self, micro_batches: list[Batch]) -> StepResult:
        self.stack.model.train()
        total = max(sum(b.num_targets for b in micro_batches), 1)
        lr = self.cfg.lr * schedule.lr_factor(self.step_count, self.cfg.steps, self.cfg.warmup_steps,
                                              self.cfg.schedule)
        clipping = self.cfg.max_grad_norm > 0
        link_before = self.link.bytes
        with self.meter.measure(self._resident_tensors()) as reading, self._store() as store, self._window():
            loss_sum = 0.0
            for k, batch in enumerate(micro_batches):
                update_now = (lr, 1.0) if k == len(micro_batches) - 1 and not clipping else None
                final = k == len(micro_batches) - 1
                loss_sum = loss_sum + self._micro_step(batch, total, store, update_now, final)
            self.worker.barrier()
            grad_norm = self._grad_norm()
            if clipping:
                coef = float(torch.clamp(self.cfg.max_grad_norm / (grad_norm + 1e-6), max=1.0)) \
                    if not _is_fake(grad_norm) else 1.0
                for unit in self._all_units():
                    if unit.optimizer is not None:
                        unit.update_job = self.worker.submit(unit.update, lr, coef)
            self.worker.barrier()
        self.step_count += 1
        return StepResult(
            loss=to_float(loss_sum) / total, tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches), lr=lr, grad_norm=to_float(grad_norm),
            device_peak_bytes=reading.peak, device_peak_breakdown=reading.peak_breakdown,
            host_link_bytes=self.link.bytes - link_before + store.link_bytes,
            host_peak_bytes=self.host_bytes() + (store.peak_bytes if self._store_kind() == "host" else 0),
            disk_peak_bytes=store.peak_bytes if self._store_kind() == "disk" else 0,
        )

    def _grad_norm(self) -> torch.Tensor:
        """The global norm of this step's gradients, from the per-unit norms the host jobs noted
        when each unit's gradients were complete (before any update touched them)."""
        norms = [n for u in self._all_units() if u.optimizer is not None for n in u.norms]
        return torch.linalg.vector_norm(torch.stack(norms))

    def _all_units(self) -> list[_Unit]:
        return [*self.units, *self.edges]

    def _store_kind(self) -> str:
        return "host" if self.activations_cfg.checkpoint == "none" else self.activations_cfg.checkpoint

    def host_bytes(self) -> int:
        """Host RAM held for the device: every unit's masters, accumulators, moments and frozen
        tensors, plus the staging buffers (block inputs are counted by the store)."""
        return sum(u.host_bytes() for u in self._all_units()) + sum(s.numel() for s in self.staging)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        self.stack.model.eval()
        loss_sum, tokens = 0.0, 0
        for batch in batches:
            with autocast_for(self.device, self.precision), self._window():
                device_batch, hidden, *_ = self._forward(batch, None, keep_grads=False)
                x, targets = head_inputs(hidden, self.stack.norm, device_batch.targets, self.loss_cfg,
                                         device_batch.rows)
                loss, _ = streamed_ce(x, targets, self._tiles, chunk_tokens(self.loss_cfg, self._vocab()))
            loss_sum += float(loss)
            tokens += batch.num_targets
        return loss_sum, tokens

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named}  # at rest: the host masters

    def state_dict(self) -> dict:
        return {"trainable": self.trainable_state(), "step": self.step_count,
                "optimizers": [u.optimizer.state_dict() if u.optimizer else None for u in self._all_units()]}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, param in self.named:
                param.copy_(state["trainable"][name])
        for unit, saved in zip(self._all_units(), state["optimizers"]):
            if unit.optimizer is not None:
                unit.load_optimizer(saved)
            unit.refresh_shadows()  # what goes up must be the loaded weights
        self.step_count = state["step"]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
