"""The updates of engine lsp's matrices in flight: each G_c down when it is complete, its host AdamW
on the worker, the new Z up and applied, in the order schedule.Schedule says (the module
docstring there has the actions and lags).

A matrix may receive its G_c in parts (a checkpointed block runs in tiles of tokens), so
on the step's last micro-batch a block's matrices are complete when backward reaches a block below
it, or ends; a matrix's arrival is its place in that completion order.

Under clipping no update may start before the global norm, so every matrix, deep ones too, is
treated as shallow: its update is submitted when backward ends, in forward order, and the step
returns with them running; the next forward overtakes them, each matrix waiting only for its own
update (`_await_update`) and upload before it computes. The weights are the sync schedule's bit for bit.

Weight decay: the host AdamW decays Z; W's share, the module's scale s (projected_linear.py), is
multiplied by (1 - lr wd) when that Z is applied, once per update that ran (none for a step that may
not update), so the effective weight decays whole, once a step, whatever the schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from slimtune.device import runtime
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.optim.host_unit import StepGuard
from slimtune.engines.lsp.schedule import Clock, Schedule
from slimtune.optim import rules
from slimtune.optim.host_adam import HostAdam
from slimtune.engines.lsp.projected_linear import ProjectedLinear


@dataclass
class Pending:
    """One matrix's update in flight: its G_c on the host, then its host AdamW, then its upload."""

    host: torch.Tensor
    copied: object  # the D2H event (None on the CPU)
    lr: float
    guard: StepGuard
    coef: float = 1.0
    job: object = None  # the worker's future
    uploaded: object = "not yet"  # the H2D event once issued (None on the CPU)
    ran: bool = False  # the host AdamW ran (a step that may not update leaves Z and s as they were)


@dataclass
class Backward:
    """The step's last backward, as the gradient hooks see it."""

    clipping: bool
    lr: float
    guard: StepGuard
    order: list[int] = field(default_factory=list)  # matrices in arrival (completion) order
    due: dict[int, list] = field(default_factory=dict)  # arrival count -> [(action, matrix)]
    norms: list[torch.Tensor] = field(default_factory=list)
    block: int | None = None  # the block whose matrices are receiving gradients
    open: list[int] = field(default_factory=list)  # its matrices seen so far, in first-seen order


class UpdatePipeline:
    def __init__(self, modules: list[ProjectedLinear], adams: list[HostAdam], blocks: list[int], link: runtime.Link,
                 worker: runtime.HostWorker, schedule: Schedule, clock: Clock, dist: Dist = SINGLE,
                 weight_decay: float = 0.0):
        """`blocks`: each matrix's block index; `schedule` may be replaced between steps; `dist`: the
        ranks each complete G_c is summed across (d x d numbers: what lsp sends between ranks);
        `weight_decay`: the matrices' (their scales follow their Z's decay)."""
        self.modules, self.adams, self.blocks, self.dist = modules, adams, blocks, dist
        self.weight_decay = weight_decay
        self.link, self.worker, self.schedule, self.clock = link, worker, schedule, clock
        self.pending: dict[int, Pending] = {}
        self.backward: Backward | None = None

    def begin(self, clipping: bool, lr: float, guard: StepGuard) -> None:
        """The step's last backward starts: its gradients are complete ones (earlier micro-batches
        only accumulate into Z.grad)."""
        self.backward = Backward(clipping, lr, guard)
        self.clock.start()

    def arrived(self, index: int) -> None:
        """Autograd added into matrix `index`'s Z.grad."""
        backward = self.backward
        if backward is None:
            return
        block = self.blocks[index]
        if backward.block is not None and block != backward.block:
            self._complete_block()
        backward.block = block
        if index not in backward.open:
            backward.open.append(index)

    def _complete_block(self) -> None:
        backward = self.backward
        self.clock.arrived(len(backward.open))
        # Summed across ranks first, in matrix order (not autograd's hook order): every rank's
        # collectives pair the same matrices. One bucket for the block's matrices.
        self.dist.all_reduce_([self.modules[i].z.grad for i in sorted(backward.open)],
                              what="a block's compressed gradient sum")
        for index in backward.open:
            self._finalize(index)
        backward.open = []

    def _finalize(self, index: int) -> None:
        """Matrix `index`'s G_c is complete: it goes down now, and the actions due at this arrival run."""
        backward, z = self.backward, self.modules[index].z
        backward.norms.append(torch.linalg.vector_norm(z.grad))
        host, copied = self.link.to_host(z.grad)
        z.grad = None
        self.pending[index] = Pending(host, copied, backward.lr, backward.guard)
        arrival = len(backward.order)
        backward.order.append(index)
        if not backward.clipping and self.schedule.deep(index):
            for action, lag in self.schedule.lags():
                backward.due.setdefault(arrival + lag, []).append((action, index))
        for action, matrix in backward.due.pop(arrival, []):
            self._act(action, matrix)

    def end_backward(self) -> list[torch.Tensor]:
        """The last block completes; returns every matrix's G_c norm (device scalars)."""
        self._complete_block()
        return self.backward.norms

    def clip(self, coef: float, applied: bool) -> None:
        """Clipping: every update waits for the global norm; a step that may not update updates nothing."""
        for pending in self.pending.values():
            pending.coef = coef
            pending.guard.tripped = pending.guard.tripped or not applied

    def submit_rest(self) -> None:
        """The updates not yet submitted: deep ones whose turn fell past the last arrival, then the rest
        in forward order (the next forward needs the shallowest first)."""
        backward, self.backward = self.backward, None
        for arrival in sorted(backward.due):
            for action, index in backward.due[arrival]:
                if action == "update":
                    self._act(action, index)
        for index in sorted(self.pending):
            self._act("update", index)

    def _act(self, action: str, index: int) -> None:
        pending = self.pending.get(index)
        if pending is None:
            return
        if action == "update" and pending.job is None:
            pending.job = self.worker.submit(self._host_update, index, pending)
        elif action == "upload" and pending.uploaded == "not yet":
            self._act("update", index)
            self._await_update(pending)
            pending.uploaded = self.link.copy_up(self.modules[index].z, self.adams[index].member(0, 0).master)
        elif action == "apply":
            self._act("upload", index)
            self.link.wait(pending.uploaded)  # the compute stream waits for the copy up
            if pending.ran and self.weight_decay:
                self.modules[index].scale *= 1.0 - pending.lr * self.weight_decay
            del self.pending[index]

    @staticmethod
    def _await_update(pending: Pending) -> None:
        """The device loop waits for this matrix's host AdamW before its new Z goes up."""
        pending.job.result()

    def _host_update(self, index: int, pending: Pending) -> None:
        """On the host worker: AdamW of one matrix in its d x d space, unless the step may not update
        (then, or when this G_c is not finite, the guard trips for the matrices after it)."""
        if pending.copied is not None:
            pending.copied.synchronize()
        if pending.guard.tripped or not rules.is_finite(pending.host.sum()):
            pending.guard.tripped = True
            return
        begun = time.perf_counter()
        adam = self.adams[index]
        with torch.no_grad():
            adam.member(0, 0).grad.copy_(pending.host)
        adam.update(pending.lr, pending.coef)
        pending.ran = True
        self.clock.updates.append(time.perf_counter() - begun)

    def complete(self, index: int) -> None:
        """Before matrix `index` computes: its pending update (if any) is applied, waiting as needed."""
        if index in self.pending:
            self._act("apply", index)

    def flush(self) -> None:
        """Every pending update applied."""
        for index in sorted(self.pending):
            self.complete(index)
        self.worker.barrier()
