"""What a worker does in each kind of job, over the step's micro-batches (roundpipe.md 2.2).

  forward   weights up (no gradients); per micro-batch: the input from the host, the stage's
            blocks without grad, a host copy of the input of every layer that starts a backward
            stage (every layer under grain=layer), the output down.
  tail      weights up with gradients; per micro-batch: input with grad, the remaining blocks, the
            final norm, LM head and exact loss, backward, the input gradient down. Nothing is
            recomputed. The parameter gradients, summed over the micro-batches on the worker, go
            down when the job ends. A tail cut into token shards (stages.py) is one job a shard:
            each takes the whole input (the last forward job hands it to every shard at once),
            runs the norm, head and loss on its own token slice, and sends down that slice's input
            gradient; the first backward job joins the slices. The shards' parameter gradients are
            added in shard order (a shard that ends early waits for those before it), so the sum
            does not depend on timing.
  backward  weights up with gradients; per micro-batch: the saved input up and the stage recomputed
            (before waiting for the gradient from above, so the two overlap), then backward and the
            input gradient down; grain=layer recomputes and back-propagates layer by layer from
            every layer's saved input instead (less device memory, more host RAM and traffic).
Layer l < B (B blocks) is block l; layer B is the final norm + head + loss. The embedding's rows are
gathered on the host, and its gradient rows added there (as slide does): the V x D table never goes
up, and a tied head's weight is one tensor with one accumulator.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from slimtune.step import activations
from slimtune.config import ActivationsConfig, LossConfig
from slimtune.data.dataset import Batch
from slimtune.step.precision import autocast_for
from slimtune.optim.host_unit import HostUnit
from slimtune.step.loss import causal_lm_loss
from slimtune.engines.roundpipe.mailbox import Mailbox
from slimtune.engines.roundpipe.row_split import token_slice
from slimtune.engines.roundpipe.stages import Job, token_range
from slimtune.engines.roundpipe.step_weights import StepWeights
from slimtune.engines.roundpipe.timing import BackwardTiming, StepTimes
from slimtune.engines.roundpipe.worker import Prefetch, Worker

EMBED = -1  # the job index whose hand-offs are the embedding rows (job 0's inputs)


@dataclass
class StepContext:
    """What the step's jobs share. Host tensors only: nothing here lives on a device."""

    pieces: list[Batch]  # the micro-batches, on the host
    total: int  # trained tokens of the whole step: every loss is divided by it
    units: list[HostUnit]  # per layer
    mailbox: Mailbox
    source: Callable  # slot tensor -> the host tensor its upload reads (compute weights)
    add_grads: Callable  # (job, [(original param, host gradient, event)]) -> added on the host worker
    add_embedding_grad: Callable  # (micro-batch, host gradient of the rows, event)
    saved_at: frozenset[int]  # layers whose input the forward keeps for a backward stage
    precision: str
    grain: str  # roundpipe.grain: stage | layer
    loss_cfg: LossConfig
    activations_cfg: ActivationsConfig
    embedding_trainable: bool
    next_job: dict[int, Job | None]  # job index -> the same worker's next job this step (prefetch)
    tail_jobs: range = range(0)  # the job indices of the tail's token shards (one: not cut)
    weights: StepWeights | None = None  # which weight version the step reads, and when it is in place
    prefetched: dict[int, Prefetch] = field(default_factory=dict)  # job index -> its weights, copied ahead
    link_bytes: int = 0  # what this step's jobs moved across their links
    losses: dict = field(default_factory=dict)  # (micro-batch, shard) -> exact loss sum (host scalar)
    times: StepTimes = field(default_factory=StepTimes)  # what the jobs timed, per layer
    host_bytes: int = 0  # hand-offs and saved inputs alive on the host now
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Every change of host_bytes, with the place in the schedule of the job that made it: (job index,
    # micro-batch), EMBED's (the main thread's rows) before all; host_peak replays them in that order.
    _held: list[tuple[tuple[int, int], int]] = field(default_factory=list)
    _at: threading.local = field(default_factory=threading.local)  # each worker thread's (job index, micro-batch)
    _takers: dict[int, int] = field(default_factory=dict)  # id of a host tensor put under several keys -> takes left

    def await_weights(self, layers: range) -> None:
        if self.weights is not None:
            self.weights.wait(layers)

    def weights_read(self, layers: range, event: object) -> None:
        """This job's upload of `layers` is complete once `event` is: the step's update of them waits for it."""
        if self.weights is not None:
            self.weights.read(layers, event)

    def moved(self, nbytes: int) -> None:
        with self._lock:
            self.link_bytes += nbytes

    def at(self, job: Job, m: int) -> None:
        """This thread now runs micro-batch m of `job`: the hand-offs it puts and takes are that place's."""
        self._at.place = (job.index, m)

    def held(self, delta: int) -> None:
        with self._lock:
            self.host_bytes += delta
            self._held.append((getattr(self._at, "place", (EMBED, 0)), delta))

    @property
    def host_peak(self) -> int:
        """The most bytes the step's hand-offs and saved inputs hold at once with its jobs run one
        after another in job order (as the planner's fake step runs them), not in the order this run's
        workers happened to put and take them: that order varies run to run (a tail worker that takes
        a hand-off before the forward worker puts the next holds one hand-off less), and the figure
        must not. No timing holds more: in job order all forward and tail work comes before any
        backward work, and on balance a forward or tail micro-batch only adds hand-offs (it takes one
        and puts one or more) and a backward one only frees them (it takes its saved input and the
        gradient, puts one gradient), so job order reaches the largest set of finished micro-batches
        any timing could have."""
        now = peak = 0
        for _, delta in sorted(self._held, key=lambda change: change[0]):  # stable: a place's own order kept
            now += delta
            peak = max(peak, now)
        return peak

    def put(self, key: tuple, handoff: tuple) -> None:
        """handoff: (host tensor, the event after which it is filled, None on the CPU)."""
        self.held(_nbytes(handoff[0]))
        self.mailbox.put(key, handoff)

    def fan_out(self, keys: list[tuple], handoff: tuple) -> None:
        """One hand-off for several takers (the tail's shards): its bytes held once, until the last take."""
        self.held(_nbytes(handoff[0]))
        with self._lock:
            self._takers[id(handoff[0])] = len(keys)
        for key in keys:
            self.mailbox.put(key, handoff)

    def take(self, key: tuple) -> tuple:
        handoff = self.mailbox.take(key)
        with self._lock:
            left = self._takers.pop(id(handoff[0]), 1) - 1
            if left:
                self._takers[id(handoff[0])] = left
        if not left:
            self.held(-_nbytes(handoff[0]))
        return handoff

    @property
    def sharded(self) -> bool:
        return len(self.tail_jobs) > 1

    def hand_on(self, job: Job, m: int, handoff: tuple) -> None:
        """A forward job's output of micro-batch m, to the next job (or to every tail shard)."""
        if self.sharded and job.index + 1 == self.tail_jobs.start:
            self.fan_out([(job.index, m, shard) for shard in range(len(self.tail_jobs))], handoff)
        else:
            self.put((job.index, m), handoff)

    def tail_input(self, job: Job, m: int) -> tuple:
        if self.sharded:
            return self.take((self.tail_jobs.start - 1, m, job.shard))
        return self.take((job.index - 1, m))

    def save(self, layer: int, m: int, handoff: tuple) -> None:
        """Keep layer `layer`'s input of micro-batch m for its backward stage (which may be waiting)."""
        self.put(("saved", layer, m), handoff)

    def saved_input(self, layer: int, m: int) -> tuple:
        return self.take(("saved", layer, m))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def run(worker: Worker, job: Job, ctx: StepContext) -> None:
    """Job `job` on `worker`: its stage's weights up (or prefetched), then the next job's weights
    copied ahead, then every micro-batch, then the weights dropped and the gradients sent down."""
    stage, moved = job.stage, worker.link.bytes
    units = [ctx.units[layer] for layer in stage.layers]
    ahead = ctx.prefetched.pop(job.index, None)
    if ahead is None:
        ctx.await_weights(stage.layers)
        uploaded = worker.upload(units, ctx.source)
    else:
        uploaded = ahead.finish()
    ctx.weights_read(stage.layers, uploaded.ready)
    following = ctx.next_job[job.index]
    ahead = None
    if following is not None:
        ctx.await_weights(following.stage.layers)
        ahead = ctx.prefetched[following.index] = worker.prefetch(
            [ctx.units[l] for l in following.stage.layers], ctx.source, len(ctx.pieces))
    pairs = worker.bind(units, uploaded, with_grads=stage.kind != "forward")
    del uploaded
    try:
        with autocast_for(worker.device, ctx.precision), worker.phase("activations"):
            body = {"forward": _forward_micro_batch, "tail": _tail_micro_batch, "backward": _backward_micro_batch}
            for m, piece in enumerate(ctx.pieces):
                worker.pause(job, m)
                ctx.at(job, m)
                body[stage.kind](worker, job, ctx, m, piece, ahead)
                for _, leaf in pairs:  # made by the first backward: the job's gradient sums
                    worker.retag(leaf.grad, "gradients")
    finally:
        worker.unbind(units)
    ctx.add_grads(job, [(original, *worker.link.to_host(leaf.grad)) for original, leaf in pairs
                        if leaf.grad is not None])
    ctx.moved(worker.link.bytes - moved)


def _upload_input(worker: Worker, handoff: tuple, requires_grad: bool = False) -> torch.Tensor:
    """A hand-off (host tensor, the event of its download) up to this worker: its copy waits for
    that event on the device (the spec's per-micro-batch events), not on the host."""
    host, event = handoff
    x = worker.link.ready(worker.link.to_device(host, event))
    return x.requires_grad_(requires_grad) if requires_grad else x


def _down(worker: Worker, x: torch.Tensor) -> tuple:
    """(host copy of device tensor x, the event after which it is filled)."""
    return worker.link.to_host(x.detach())


def _advance(ahead: Prefetch | None) -> None:
    """After a micro-batch's activation copy is queued: one group of the next job's weights."""
    if ahead is not None:
        ahead.advance()


def _positions(worker: Worker, piece: Batch) -> Batch:
    return piece.to(worker.device)


def _forward_micro_batch(worker: Worker, job: Job, ctx: StepContext, m: int, piece: Batch,
                         ahead: Prefetch | None) -> None:
    stage, stack = job.stage, worker.replica.stack
    host = ctx.take((job.index - 1, m))
    batch = _positions(worker, piece)
    x = _upload_input(worker, host)
    _advance(ahead)
    inputs = stack.prepare(x, batch.position_ids, piece.segmented)
    chunk = activations.tile_tokens(stack, x.shape[1], ctx.activations_cfg, piece.segmented)
    with torch.no_grad():
        for layer in stage.layers:
            if layer in ctx.saved_at:
                ctx.save(layer, m, host if layer == stage.start else _down(worker, x))
            began = worker.clock.mark()
            x = activations.block_forward(stack, layer, x, inputs, chunk)
            ctx.times.forwards.append((layer, began, worker.clock.mark()))
    ctx.hand_on(job, m, _down(worker, x))


def _tail_micro_batch(worker: Worker, job: Job, ctx: StepContext, m: int, piece: Batch,
                      ahead: Prefetch | None) -> None:
    stage, stack = job.stage, worker.replica.stack
    first, sharded = stage.start == 0, stage.shards > 1
    wants_grad = not sharded and (not first or ctx.embedding_trainable)  # a shard makes its slice a leaf
    x = _upload_input(worker, ctx.tail_input(job, m), requires_grad=wants_grad)
    _advance(ahead)
    if sharded:  # this shard's tokens: the norm, the head and the loss treat every token alone
        a, b = token_range(x.shape[1], job.shard, stage.shards)
        x, piece = x[:, a:b].detach().requires_grad_(), token_slice(piece, a, b)
    batch = _positions(worker, piece)
    inputs = stack.prepare(x.detach(), batch.position_ids, piece.segmented) if len(stage.layers) > 1 else None
    hidden, timing = x, BackwardTiming(tuple(stage.layers))
    for layer in stage.layers:  # the last layer is the norm + head + loss
        began = worker.clock.mark()
        if layer < stage.stop - 1:
            hidden = stack.run_block(layer, hidden, inputs)
        else:
            with worker.phase("loss"):
                out = causal_lm_loss(hidden, stack.norm, stack.head, batch.targets, ctx.loss_cfg,
                                     trained_positions=batch.trained_positions)
        timing.recomputes.append((layer, began, worker.clock.mark()))
    ctx.times.forwards += timing.recomputes
    timing.start = worker.clock.mark()
    torch.autograd.backward(out.loss_sum / ctx.total)
    timing.stop = worker.clock.mark()
    ctx.times.backwards.append(timing)
    ctx.losses[(m, job.shard)] = _down(worker, out.exact_sum)
    _send_input_grad(worker, job, ctx, m, x)


def _send_input_grad(worker: Worker, job: Job, ctx: StepContext, m: int, x: torch.Tensor) -> None:
    """The gradient of the stage's input: to the next backward job, or (layer 0) to the embedding."""
    if job.stage.start > 0:
        ctx.put((job.index, m), _down(worker, x.grad))
    elif x.requires_grad and x.grad is not None:
        ctx.add_embedding_grad(m, *worker.link.to_host(x.grad))


def _output_grad(worker: Worker, job: Job, ctx: StepContext, m: int) -> torch.Tensor:
    """The gradient of a backward job's output, from the job before (or the tail's shards, joined)."""
    if ctx.sharded and job.index == ctx.tail_jobs.stop:
        return torch.cat([_upload_input(worker, ctx.take((t, m))) for t in ctx.tail_jobs], dim=1)
    return _upload_input(worker, ctx.take((job.index - 1, m)))


def _backward_micro_batch(worker: Worker, job: Job, ctx: StepContext, m: int, piece: Batch,
                          ahead: Prefetch | None) -> None:
    stage, stack = job.stage, worker.replica.stack
    batch = _positions(worker, piece)
    wants_grad = stage.start > 0 or ctx.embedding_trainable
    if ctx.grain == "layer":
        _backward_by_layer(worker, job, ctx, m, batch, piece.segmented, wants_grad, ahead)
        return
    x = _upload_input(worker, ctx.saved_input(stage.start, m), requires_grad=wants_grad)
    _advance(ahead)
    inputs = stack.prepare(x.detach(), batch.position_ids, piece.segmented)
    timing = BackwardTiming(tuple(stage.layers))
    with torch.enable_grad():  # recomputed before the gradient from above is waited for
        y = x
        for layer in stage.layers:
            began = worker.clock.mark()
            y = stack.run_block(layer, y, inputs)
            timing.recomputes.append((layer, began, worker.clock.mark()))
    grad = _output_grad(worker, job, ctx, m)
    timing.start = worker.clock.mark()
    torch.autograd.backward(y, grad)
    timing.stop = worker.clock.mark()
    ctx.times.backwards.append(timing)
    del y
    _send_input_grad(worker, job, ctx, m, x)


def _backward_by_layer(worker: Worker, job: Job, ctx: StepContext, m: int, batch: Batch, segmented: bool,
                       wants_grad: bool, ahead: Prefetch | None) -> None:
    """grain=layer: each layer recomputed from its own saved input and back-propagated at once."""
    stage, stack = job.stage, worker.replica.stack
    grad = _output_grad(worker, job, ctx, m)
    _advance(ahead)
    x = None
    for layer in reversed(stage.layers):
        x = _upload_input(worker, ctx.saved_input(layer, m), requires_grad=layer > 0 or wants_grad)
        inputs = stack.prepare(x.detach(), batch.position_ids, segmented)
        chunk = activations.tile_tokens(stack, x.shape[1], ctx.activations_cfg, segmented)
        timing = BackwardTiming((layer,), worker.clock.mark())
        activations.block_backward(stack, layer, x, grad, inputs, chunk, grad_owned=True)
        timing.stop = worker.clock.mark()
        ctx.times.backwards.append(timing)
        grad = x.grad if x.requires_grad else None
    _send_input_grad(worker, job, ctx, m, x)


def embedding_rows(weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The embedding rows of `input_ids` (B, T) from the host table: (B, T, D) on the host."""
    with torch.no_grad():
        return torch.nn.functional.embedding(input_ids, weight)
