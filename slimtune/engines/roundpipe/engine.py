"""Engine `roundpipe`: several devices as stateless workers, fed the model's stages round robin
(RoundPipe; the team's spec is roundpipe.md; the schedule's pieces are beside this file, in
slimtune/engines/roundpipe/).

Where things live. Host: one host unit per layer (optim/host_unit.py: each block; the final norm
with the LM head), holding the fp32 masters of its trainable tensors, their gradient accumulators and
AdamW moments (a HostAdam), its frozen tensors (a LoRA base, 4-bit codes), and the embedding table
(its rows are gathered on the host). Workers: nothing between jobs; during a job its stage's weights
(and the next job's, prefetched), the stage's activations for one micro-batch, and the trainable
gradients of the stage summed over the step's micro-batches.

One step. Each of the loop's batches is cut by rows into roundpipe.micro_batches micro-batches (0:
one more than the workers; at most its rows). The partitioner (partitioner.py) cuts the layers into
forward stages, a fused tail and backward stages from per-layer costs (proportional to their bytes
until measured, then the per-layer time EMA, partitioner.LayerTimes), and the jobs take workers
from one cursor that carries on across steps (stages.py). When the tail is the final norm + LM head
+ loss alone, the partitioner may cut it by tokens into up to roundpipe.tail_shards jobs (0: up to
the workers), each on a slice of every micro-batch's tokens, so a large vocabulary's head stops
pacing every stage (jobs.py). Every worker thread runs its jobs in order; a micro-batch waits only
for the same micro-batch of the job before (mailbox.py), so when M >= N every worker has work while
the others finish theirs. Gradients go down when a job ends and are added into the host
accumulators by the host worker.

The optimizer (roundpipe.optimizer) is an object chosen once here (optimizer.py: sync, exact; async,
one step stale): the engine asks it where gradients go, which weights a step reads, the norm, the
learning rate and the update, and never which one it is. Where it `starts_ahead`, the loop hands
step() the next step's batches (`then`, except before a checkpoint, an evaluation or the end): its
first jobs start while this step's last ones still run, filling the workers the drain leaves idle,
as the simulator (simulate.py) plays it, and no result changes.

Not done: dropout (workers share torch's random generator, so a recompute could not redraw the
forward's masks; refused in one sentence), weight pieces bin-packed behind activation copies (on a
GPU each worker's copies run on one side stream in issue order: activations before the weights of
its next job, which it prefetches only after the current job's inputs are queued).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

from slimtune.device import memory, runtime
from slimtune.config import RunConfig
from slimtune.data.dataset import Batch
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.engines.base import Engine, NextStep, StepResult
from slimtune.step.forward import evaluate_batches, step_divisor, to_float
from slimtune.step.precision import autocast_for
from slimtune.store.checkpoint import EngineState, check_resumable, copy_named
from slimtune.engines.registry import EngineSpec, register
from slimtune.errors import UserError
from slimtune.optim.host_unit import CODED, HostUnit, load_units_state, units_coded, units_masters, units_state
from slimtune.step.loss import causal_lm_loss
from slimtune.model.stack import Stack
from slimtune.optim import rules
from slimtune.engines.roundpipe import jobs
from slimtune.engines.roundpipe.partitioner import LayerTimes, costs_from_bytes, plan_stages
from slimtune.engines.roundpipe.row_split import split_rows
from slimtune.engines.roundpipe.settings import RoundPipeConfig, on_cards, plans, validate, worker_devices
from slimtune.engines.roundpipe.speed import step_time
from slimtune.engines.roundpipe.stages import Job, Partition, assign
from slimtune.engines.roundpipe.mailbox import Mailbox
from slimtune.engines.roundpipe.optimizer import variant_of
from slimtune.engines.roundpipe.step_weights import Gate, StepWeights
from slimtune.engines.roundpipe.worker import Worker


class RoundPipeEngine(Engine):
    name = "roundpipe"

    def __init__(self, stack: Stack, cfg: RunConfig, device: torch.device, precision: str, dist: Dist = SINGLE):
        self.stack, self.precision, self.dist = stack, precision, dist
        self.train_cfg, self.loss_cfg, self.activations_cfg = cfg.train, cfg.loss, cfg.activations
        self.max_tokens = cfg.data.max_length  # no micro-batch is longer: the tail's shards stay non-empty
        self.section: RoundPipeConfig = cfg.section("roundpipe")
        self._devices = worker_devices(self.section, device)
        if device.type == "cuda" and dist.local_world_size > 1:
            # Its workers take the machine's cards from cuda:0: two ranks of one machine would share them.
            raise UserError(f"engine=roundpipe spreads one rank over this machine's cards, and torchrun started "
                            f"{dist.local_world_size} here; start one process per machine (--nproc-per-node 1).")
        self.device = self.devices[0]
        self._refuse_dropout(stack)
        if getattr(stack.head, "bias", None) is not None:
            raise NotImplementedError("engine=roundpipe runs an LM head without bias")
        self.names = {id(p): n for n, p in stack.model.named_parameters() if p.requires_grad}
        weight_dtype = torch.bfloat16 if precision == "bf16" else None
        blocks, count = stack.blocks, len(stack.blocks)
        self.units = [HostUnit(f"block {i}", [blocks[i]], self.device, weight_dtype, cfg.train, None)
                      for i in range(count)]
        self.units.append(HostUnit("final norm and LM head", [stack.norm, stack.head], self.device, weight_dtype,
                                   cfg.train, None))
        self.embedding = None if stack.tied else HostUnit("embedding", [stack.embed], self.device, None, cfg.train, None)
        self.table_unit = self._find_table_unit()  # its rows are gathered on the host
        fake = stack.fake
        self.workers = [Worker(i, d, stack.model, inline=fake) for i, d in enumerate(self.devices)]
        # The host threads wait on the workers' copy events; each is given this run's first card.
        self.host = runtime.HostWorker(inline=fake, device=self.device)  # gradient additions (sync: the AdamW)
        self.optimizer = variant_of(cfg)(self._all_units(), self.table_unit, cfg.train, self.host, self.device,
                                         inline=fake)
        for owner in (*self.workers, self.host, self.optimizer):
            weakref.finalize(self, owner.close)
        self.layer_times = LayerTimes(len(self.units), costs_from_bytes(
            [u.binding.weight_bytes for u in self.units], [u.binding.grad_bytes > 0 for u in self.units]))
        self.fake = fake
        self.stage_cap = self._stage_cap()
        self.partition: Partition = self._plan()
        # Replans keep this first cut's tail shard count: token shards change the order of the head's
        # sums (1 ulp), while any stage cut gives the same bits, so a replan from measured times may
        # move the cut but not the count, and the results do not depend on how fast anything ran.
        self.tail_shard_count = self.partition.tail.shards
        self.cursor = 0
        self.step_count = 0
        self.meter = memory.meter_for(self.device, cfg.train.measure_memory)  # the run's kind (train prints it)
        self.measure = cfg.train.measure_memory
        # The loop may hand step() the next step's batches (then=), to start before this one ends.
        self.starts_ahead = self.optimizer.starts_ahead and not fake
        self._next_step = 0  # the index of the next step to start (one ahead of step_count while one runs early)
        self._next_gate = Gate(opened=True)  # that step's gate: it opens when the step before it has ended
        self._last_mailbox: Mailbox | None = None  # the last started step's: a failure there stops the next
        self._ahead: _Started | None = None  # a step started early, whose jobs are running

    def _refuse_dropout(self, stack: Stack) -> None:
        config = stack.config
        rates = [getattr(config, key, 0.0) or 0.0 for key in ("attention_dropout", "hidden_dropout", "resid_pdrop")]
        if any(r > 0 for r in rates):
            raise UserError("engine=roundpipe cannot redraw dropout masks when a stage is recomputed on another worker;"
                            " the model's config sets dropout above 0 (attention_dropout / hidden_dropout): set it to 0.")

    def _all_units(self) -> list[HostUnit]:
        return [*self.units, *([self.embedding] if self.embedding is not None else [])]

    def _stage_cap(self) -> int | None:
        """The stage memory cap (CUDA; None elsewhere): memory_fraction of the smallest free device memory,
        halved (a worker holds its stage and the one it prefetches) and shared by the workers on one card.
        Read once, as the engine is built: at a replan the caching allocator's own blocks would count as
        used, and each replan would cut smaller stages than the last."""
        if not all(d.type == "cuda" for d in self.devices):
            return None
        free = min(torch.cuda.mem_get_info(d)[0] for d in self.devices)
        sharing = max(Counter(runtime.card_index(d) for d in self.devices).values())
        return int(self.section.memory_fraction * free / 2 / sharing)

    def _plan(self) -> Partition:
        """The spec's partitioner on the per-layer costs (proportional to each layer's bytes until
        measured), under the stage memory cap."""
        shards = min(self.section.tail_shards or len(self.workers), self.max_tokens)
        kept = getattr(self, "tail_shard_count", None)  # a replan: the first cut's count (see __init__)
        try:
            return plan_stages(self.layer_times.costs(), len(self.workers), memory_cap=self.stage_cap,
                               max_tail_shards=kept or shards, min_tail_shards=kept or 1)
        except ValueError as err:
            raise UserError(f"engine=roundpipe cannot cut the model into stages: {err}") from None

    # ------------------------------------------------------------ the pieces of a step

    def _add_grads(self, to_host, shards: "_InShardOrder", job: Job, grads: list[tuple]) -> None:
        """A job's downloaded gradients, added on the host worker (through the step's gate): now, or
        (a tail shard's) once every shard before it has been, so that a sum over shards does not
        depend on which ended first."""
        adds = [self._adder(param, host, event) for param, host, event in grads]
        if job.stage.shards == 1:
            for add in adds:
                to_host(add)
        else:
            shards.put(job.shard, adds)

    def _adder(self, param: torch.Tensor, host: torch.Tensor, event: object):
        accumulator = self.optimizer.accumulator(param)

        def add() -> None:
            if event is not None:
                event.synchronize()
            accumulator.add_(host)

        return add

    def _embedding_weight(self) -> tuple[torch.Tensor, runtime.SlotTensor | None]:
        weight, unit = self.stack.embed.weight, self.table_unit
        return weight, None if unit < 0 else self._all_units()[unit].tensor_of(weight)

    def _embedding_rows(self, piece: Batch, source) -> torch.Tensor:
        weight, found = self._embedding_weight()
        table = source(found) if found is not None else weight.data
        return runtime.to_host_storage(jobs.embedding_rows(table, piece.input_ids), self.device)

    def _add_embedding_grad(self, pieces: list[Batch], deferred: list):
        """The rows' gradients of each micro-batch, kept until the step's jobs are done and then added
        in micro-batch order (a tied head's gradient arrives at another moment each run: adding
        these after it keeps the sum's order, so results do not depend on timing)."""
        weight, found = self._embedding_weight()
        padding = getattr(self.stack.embed, "padding_idx", None)

        def add(m: int, host: torch.Tensor, event: object) -> None:
            accumulator, ids = self.optimizer.accumulator(weight), pieces[m].input_ids.reshape(-1)

            def job() -> None:
                if event is not None:
                    event.synchronize()
                rows = host.reshape(-1, host.shape[-1]).to(accumulator.dtype)
                if padding is not None:  # as nn.Embedding: the padding row gets no gradient
                    rows[ids == padding] = 0
                accumulator.index_add_(0, ids, rows)

            deferred.append((m, job))

        return add, found is not None and found.trainable

    def _saved_at(self) -> frozenset[int]:
        e = self.partition.tail.start
        if self.section.grain == "layer":
            return frozenset(range(e))
        return frozenset(stage.start for stage in self.partition.backward)

    def _pieces(self, micro_batches: list[Batch]) -> list[Batch]:
        wanted = self.section.micro_batches or len(self.workers) + 1
        return [piece for batch in micro_batches for piece in split_rows(batch, wanted)]

    def _context(self, pieces: list[Batch], total: int, deferred: list, weights: StepWeights) -> jobs.StepContext:
        add_embedding_grad, embedding_trainable = self._add_embedding_grad(pieces, deferred)
        first_tail = len(self.partition.forward)
        def to_host(fn) -> None:
            weights.gate.run(lambda: self.host.submit(fn))

        return jobs.StepContext(
            pieces=pieces, total=total, units=self.units, mailbox=weights.mailbox, weights=weights,
            source=self.optimizer.source_at(weights.step),
            add_grads=functools.partial(self._add_grads, to_host, _InShardOrder(to_host)),
            add_embedding_grad=add_embedding_grad,
            tail_jobs=range(first_tail, first_tail + self.partition.tail.shards),
            saved_at=self._saved_at(), precision=self.precision, grain=self.section.grain, loss_cfg=self.loss_cfg,
            activations_cfg=self.activations_cfg, embedding_trainable=embedding_trainable, next_job={})

    def _start(self, micro_batches: list[Batch], total_targets: int | None, idle: bool = True) -> "_Started":
        """Cut the batches, take the step's jobs from the cursor, gather the embedding rows (once the
        step's version of the table is in place) and hand the jobs to the workers. `idle`: no other step
        is running (False for a step begun early, while the one before it runs)."""
        weights, next_gate = self._step_weights(), Gate(opened=False)
        self._next_gate = next_gate
        step_jobs, self.cursor = assign(self.partition, len(self.workers), self.cursor)
        pieces, deferred = self._pieces(micro_batches), []
        ctx = self._context(pieces, step_divisor(micro_batches, total_targets), deferred, weights)
        ctx.next_job.update(_next_on_worker(step_jobs))
        self._gather_rows(ctx)  # first: under fake tensors each job runs inline as it is submitted
        meters = self._open_meters(idle=idle)
        futures = []
        for job in step_jobs:
            worker = self.workers[job.worker]
            label = f"job {job.index} ({job.stage.kind} layers {job.stage.start}-{job.stage.stop - 1})"
            meter = meters.get(worker.index) if isinstance(meters, dict) else None
            futures.append(worker.submit(lambda w=worker, j=job: jobs.run(w, j, ctx), label, ctx.mailbox, meter))
        return _Started(micro_batches, ctx, futures, meters, deferred, next_gate)

    def _step_weights(self) -> StepWeights:
        """The StepWeights of the step to start now: the units it waits for and the updates still
        writing its weights (the optimizer's); its gate is the one the step before opens."""
        step, self._next_step = self._next_step, self._next_step + 1
        weights = StepWeights(step, self.optimizer.versioned, self.optimizer.pending_for(step), self.section.timeout_s,
                              self._next_gate)
        if self._last_mailbox is not None:  # a step begun early stops with the one before
            self._last_mailbox.passes_failure_to(weights.mailbox)
        self._last_mailbox = weights.mailbox
        return weights

    def _gather_rows(self, ctx: jobs.StepContext) -> None:
        """Every micro-batch's embedding rows, from the step's version of the table, for job 0."""
        ctx.await_weights([self.table_unit])
        for m, piece in enumerate(ctx.pieces):
            ctx.put((jobs.EMBED, m), (self._embedding_rows(piece, ctx.source), None))

    def _find_table_unit(self) -> int:
        """The index (in _all_units) of the unit holding the embedding table; -1: none does."""
        weight = self.stack.embed.weight
        return next((i for i, unit in enumerate(self._all_units()) if unit.tensor_of(weight) is not None), -1)

    def _take_ahead(self, micro_batches: list[Batch]) -> "_Started | None":
        started, self._ahead = self._ahead, None
        if started is not None and (len(started.micro_batches) != len(micro_batches) or any(
                a is not b for a, b in zip(started.micro_batches, micro_batches))):
            raise RuntimeError("engine=roundpipe began its next step with other batches than step() was given")
        return started

    def _wait_jobs(self, started: "_Started") -> BaseException | None:
        """Wait for a started step's jobs; the first failure (the mailbox's, naming the worker), if any."""
        errors = [f.exception() for f in started.futures]
        failed = next((e for e in errors if e is not None), None)
        return None if failed is None else started.ctx.mailbox.failure or failed

    def _settled(self) -> None:
        if self._ahead is not None:
            raise RuntimeError("engine=roundpipe has a step running that began early; call step() for it first")

    # ------------------------------------------------------------ the Engine interface

    def step(self, micro_batches: list[Batch], total_targets: int | None = None,
             then: NextStep | None = None) -> StepResult:
        """One step. `then`: the next step's (micro_batches, total_targets), begun now where the
        optimizer `starts_ahead`, before this one ends, so its first stages fill the workers this
        step's last stages leave idle; the next call must pass those same batches. No result
        changes: that step computes at the same weights either way."""
        self.stack.model.train()
        started = self._take_ahead(micro_batches) or self._start(micro_batches, total_targets)
        if then is not None and self.starts_ahead:
            try:
                self._ahead = self._start(*then, idle=False)
            except BaseException:
                self._wait_jobs(started)
                raise
        return self._finish(started)

    def _finish(self, started: "_Started") -> StepResult:
        """Wait for a started step's jobs, sum its losses and gradients, and submit its update."""
        ctx, lr = started.ctx, self.optimizer.lr_at(self.step_count)
        failed = self._wait_jobs(started)
        peaks = self._close_meters(started.meters)
        if failed is not None:  # its mailbox passed the failure on: a step started early stops too
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                self._wait_jobs(ahead)
            self.host.barrier()
            raise failed
        for _, add in sorted(started.deferred, key=lambda item: item[0]):
            self.host.submit(add)  # the step's gate is open: it opened when the step before ended
        self.host.barrier()
        loss_sum = sum(_complete(ctx.losses[key]) for key in sorted(ctx.losses))
        self._observe(ctx)
        # The host worker is idle (barrier; a step started early holds its additions at its gate):
        # its gloo group is this thread's until the next job.
        self.dist.all_reduce_(self.optimizer.gradients(), host=True, what="the stages' gradient sum")
        grad_norm = self.optimizer.grad_norm()
        applied = rules.is_finite(loss_sum) and rules.is_finite(grad_norm)
        self.optimizer.apply(lr, grad_norm, applied, ctx.weights)
        started.next_gate.open()  # the next step's gradient additions
        self.step_count += 1
        worst = max(peaks, key=lambda p: p[1] or 0) if peaks else (None, None, None)
        micro_batches = started.micro_batches
        return StepResult(
            loss=to_float(loss_sum) / ctx.total, tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches), lr=lr, grad_norm=to_float(grad_norm),
            device_peak_bytes=worst[1], device_peak_breakdown=worst[2], host_link_bytes=ctx.link_bytes,
            host_peak_bytes=self.host_bytes() + ctx.host_peak, applied=applied,
            extras={f"peak_{label}": float(p) for label, p, _ in peaks if p is not None},
        )

    def _observe(self, ctx: jobs.StepContext) -> None:
        """The step's per-layer times into the EMA, and (roundpipe.replan) the next step's cut."""
        if self.fake:
            return
        ctx.times.complete()
        for layer, (forward, backward) in sorted(ctx.times.layer_seconds(len(ctx.pieces)).items()):
            self.layer_times.observe(layer, forward, backward)
        if self.section.replan:
            self.partition = self._plan()

    def _open_meters(self, idle: bool):
        """A CPU meter per worker (each counts the tensors its jobs of this step make), or the CUDA
        allocator's peak per device, reset only when no step is running (`idle`): with a step begun
        early, the peak covers both."""
        if not self.measure:
            return None
        if self.device.type == "cuda":
            if idle:
                for d in {w.device for w in self.workers}:
                    torch.cuda.reset_peak_memory_stats(d)
            return "cuda"
        meters = {}
        for worker in self.workers:
            meters[worker.index] = memory.LiveBytesMeter("cpu")
            for tensor, category in worker.resident():
                meters[worker.index].track([tensor], category)
        return meters

    def _close_meters(self, meters) -> list[tuple[str, int | None, dict | None]]:
        """(label, peak, breakdown) per worker (CPU) or per device (CUDA)."""
        if meters == "cuda":
            return [(str(d).replace(":", ""), torch.cuda.max_memory_allocated(d), None)
                    for d in sorted({w.device for w in self.workers}, key=str)]
        if meters is None:
            return []
        found = []
        for index, meter in sorted(meters.items()):
            meter.close()
            found.append((f"worker{index}", meter.peak, meter.peak_breakdown))
        return found

    @property
    def devices(self) -> list[torch.device]:
        """Its workers' devices (roundpipe.devices), the first one its own."""
        return self._devices

    def host_bytes(self) -> int:
        """Host RAM held for the workers: every unit's masters, accumulators, moments and frozen
        tensors, and what the optimizer holds beside them (hand-offs are the step's)."""
        return sum(u.host_bytes() for u in self._all_units()) + self.optimizer.host_bytes()

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        """On worker 0, layer by layer without grad, with the latest weights."""
        self.stack.model.eval()
        self._settled()
        self.optimizer.wait()
        return evaluate_batches(batches, self._eval_loss)

    def _eval_loss(self, batch: Batch) -> torch.Tensor:
        worker, stack = self.workers[0], self.workers[0].replica.stack
        latest = self.optimizer.source_at(self.step_count + 1)  # every update is done: the step after next's weights
        weight, found = self._embedding_weight()
        table = latest(found) if found is not None else weight.data
        device_batch = batch.to(worker.device)
        hidden = worker.link.ready(worker.link.to_device(jobs.embedding_rows(table, batch.input_ids)))
        with autocast_for(worker.device, self.precision):
            inputs = stack.prepare(hidden, device_batch.position_ids, batch.segmented)
            for layer, unit in enumerate(self.units):
                worker.bind([unit], worker.upload([unit], latest), with_grads=False)
                try:
                    if layer < len(self.units) - 1:
                        hidden = stack.run_block(layer, hidden, inputs)
                    else:
                        hidden = causal_lm_loss(hidden, stack.norm, stack.head, device_batch.targets, self.loss_cfg,
                                                trained_positions=device_batch.trained_positions,
                                                training=False).exact_sum
                finally:
                    worker.unbind([unit])
        return hidden

    def trainable_state(self) -> dict[str, torch.Tensor]:
        self._settled()
        self.optimizer.wait()
        return units_masters(self._all_units(), self.names)

    def state_dict(self) -> EngineState:
        self.optimizer.wait()
        exp_avg, exp_avg_sq, steps = units_state(self._all_units(), self.names)
        extra = {"roundpipe": {"cursor": self.cursor, **self.optimizer.saved(self.step_count, self._trainables())},
                 CODED: units_coded(self._all_units())}
        return EngineState(engine=self.name, step=self.step_count, trainable=self.trainable_state(),
                           exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, adam_steps=steps, extra=extra)

    def load_state_dict(self, state: EngineState) -> None:
        check_resumable(state, list(self.names.values()), self.name)
        self._settled()
        self.optimizer.wait()
        load_units_state(self._all_units(), self.names, state)
        own = state.extra.get("roundpipe", {}) if state.engine == self.name else {}
        self.cursor = int(own.get("cursor", 0)) % len(self.workers)
        self.optimizer.load(state.step, own, self._trainables(), state.trainable)
        self.step_count = self._next_step = state.step
        self._next_gate, self._last_mailbox = Gate(opened=True), None

    def _trainables(self) -> list[tuple[torch.Tensor, str]]:
        return [(param, self.names[id(param)]) for unit in self._all_units() for param, _, _ in unit.members]


@dataclass
class _Started:
    """A step whose jobs are with the workers."""

    micro_batches: list[Batch]
    ctx: jobs.StepContext
    futures: list
    meters: object  # _open_meters'
    deferred: list  # (micro-batch, the embedding rows' gradient addition)
    next_gate: Gate  # the next step's: it opens when this step's update has been submitted


class _InShardOrder:
    """A step's tail-shard gradient additions, released to the host worker (FIFO) in shard order:
    each shard's as soon as every shard before it has gone."""

    def __init__(self, submit):
        self._submit, self._next, self._waiting, self._lock = submit, 0, {}, threading.Lock()

    def put(self, shard: int, adds: list) -> None:
        with self._lock:
            self._waiting[shard] = adds
            while self._next in self._waiting:
                for add in self._waiting.pop(self._next):
                    self._submit(add)
                self._next += 1


def _next_on_worker(step_jobs: list[Job]) -> dict[int, Job | None]:
    """Job index -> the same worker's next job this step (what it prefetches), None for its last."""
    following: dict[int, Job | None] = {}
    last_of: dict[int, int] = {}
    for job in step_jobs:
        following[job.index] = None
        if job.worker in last_of:
            following[last_of[job.worker]] = job
        last_of[job.worker] = job.index
    return following


def _complete(handoff: tuple) -> torch.Tensor:
    host, event = handoff
    if event is not None:
        event.synchronize()
    return host


register(EngineSpec(
    name="roundpipe", summary="stateless workers on several devices, stages dispatched round robin, state on the host"
    " (a box of consumer cards).",
    build=RoundPipeEngine, step_time=step_time, section=RoundPipeConfig, validate=validate, plans=plans,
    model_on_host=True, on_cards=on_cards, uses_cards=True,
    # A stage holds several blocks and the partition depends on the whole model: estimated at full depth.
    by_depth=lambda cfg: False))
