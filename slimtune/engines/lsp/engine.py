"""Engine `lsp`: full fine-tuning of every block linear whose gradients leave the device compressed
by learned sparse projectors (LSP-Offload; the team's spec is lsp-offload.md).

Where things live. Device: the model in the run's weight dtype (bf16 under bf16), each block linear
a ProjectedLinear (lsp/projected_linear.py) with its d x d coordinate Z (fp32) and its two sparse
projectors; activations (each projected linear keeps X P_i, not X). Host: per matrix a HostAdam over
Z (fp32 master, AdamW moments, step count): the shared host optimizer (torch's fused CPU AdamW on
the host worker thread, off the GIL). Embeddings, norms and the head are frozen, or with
lsp.train_other trained by a fused AdamW on the device (fp32 copies of them there).

One step. Forward and backward as on the resident engine. When a matrix's compressed gradient
G_c = dZ is complete (autograd's hook on Z, last micro-batch), it is copied down (d^2 x 4 bytes,
counted by runtime.Link) and its update follows the schedule (lsp/schedule.py): host AdamW in the
d x d space, the new Z copied up (d^2 x 4 bytes), and applied before the matrix's next use. The
weights never change between refits: Z carries the update (lsp/projected_linear.py says why).

Projectors are learned (spec 2.5). Before step 1, and every lsp.check_every steps, a pass over a
fixed sample of examples held out of training (lsp.fit_samples, drawn once; the step's own batches
when none was given, as in the planner's estimate) hands each matrix's full gradient to the engine, one matrix at
a time: every check measures e(G) on it; a matrix whose e(G) grew past its e(G) just after its last
fit by lsp.drift (or, with lsp.alpha set, one above lsp.alpha) is refit (values only, positions fixed,
starting from its current values, early-stopped on held-out rows) on a second pass; if its values
changed, its Z is first folded into W, its AdamW moments move into the new subspace (spec formulas;
never zeroed; step counts go on) and it is measured again on a third pass; a refit that kept its
values leaves the matrix as it was. lsp/learning.py has the rule and the fit. Those passes' device peak is measured with the step
that runs them and reported with every later step (it recurs).

Weight decay (train.weight_decay, decoupled as in AdamW) is exact: each matrix computes with
s W + P_o Z P_i^T, the host AdamW decays Z, and the module's scale s takes the same factor
(1 - lr wd) when that update is applied (projected_linear.py, updates.py); a fold puts s into W.

Clipping (train.max_grad_norm > 0) is over the compressed gradients (and the other trained
tensors'): it needs the global norm first, so every update is submitted when backward ends (still
hidden behind the next forward, module by module). Checkpoints fold Z into W first, so a checkpoint
holds plain weights (any engine reads them), the moments in Z space, the projectors and the RNG.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.step import block_stores
from slimtune.model import lora
from slimtune.device import memory, runtime
from slimtune import presets
from slimtune.engines.lsp import learning, schedule as lsp_schedule, sizing, updates as lsp_updates
from slimtune.engines.lsp.speed import step_time
from slimtune.store.checkpoint import EngineState
from slimtune.config import RunConfig, TrainConfig, positive, setting
from slimtune.data.dataset import Batch
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.engines.base import Engine, NextStep, StepResult
from slimtune.step.forward import evaluate_batches, model_loss, step_divisor, to_float
from slimtune.step.hooks import weak_hook
from slimtune.store.checkpoint import check_resumable, copy_named
from slimtune.engines.registry import EngineSpec, register
from slimtune.errors import UserError
from slimtune.optim.host_unit import StepGuard
from slimtune.model.stack import Stack
from slimtune.optim import projectors, rules
from slimtune.optim.host_adam import MOMENTS, Group, HostAdam, host_threads
from slimtune.engines.lsp.projected_linear import ProjectedLinear


@dataclass
class LspConfig:
    d: int = setting(-1, "engine=lsp: subspace size of every projected matrix (capped at its smaller side); the link"
                         " moves 2 x d^2 x 4 bytes a matrix a step. -1: half the hidden size, rounded down to a"
                         " multiple of 64 (at least 64), capped at each matrix's smaller side (lsp/sizing.py).")
    r: int = setting(4, "engine=lsp: non-zeros in each projector row.")
    check_every: int = setting(100, "engine=lsp: optimizer steps between projector checks (0: fit once, before step 1).")
    alpha: float = setting(-1.0, "engine=lsp: if set (> 0), a check refits every matrix whose projectors' relative"
                                 " error e(G) on the fit sample exceeds it (the spec's absolute rule) instead of"
                                 " the drift rule (lsp.drift); -1: unset.")
    drift: float = setting(0.2, "engine=lsp: a check refits a matrix whose e(G) on the check examples has grown past"
                                " its e(G) just after its last fit by this fraction (0.2: 20%).")
    fit_samples: int = setting(32, "engine=lsp: examples drawn once from the training data and held out of"
                                   " training, whose gradients the projectors are checked and fit on (the first"
                                   " lsp.check_samples for the checks, the rest for the fits).")
    check_samples: int = setting(8, "engine=lsp: the fit sample's first examples that every check (and the"
                                    " error after each fit) measures e(G) on; the fits learn on the sample's other"
                                    " batches.")
    fit_iterations: int = setting(100, "engine=lsp: the most Adam steps of one fit, spread over the fit sample's"
                                       " batches; each batch's stop early once the error on its held-out half stops"
                                       " falling.")
    fit_lr: float = setting(0.05, "engine=lsp: the fit's Adam learning rate.")
    schedule: Literal["pipelined", "sync"] = setting(
        "pipelined", "engine=lsp: pipelined: deep matrices update while backward runs, shallow ones before their next"
                     " forward; sync: every update after backward (the same weights, bit for bit).")
    k: int = setting(-1, "engine=lsp: matrices (in forward order) updated just before their next forward; -1: derived"
                         " from measured times after step 2.")
    p: int = setting(-1, "engine=lsp: a deep matrix's host update starts p matrix backwards after its own; -1: derived.")
    h: int = setting(-1, "engine=lsp: ... its new Z goes up h matrix backwards after its own (h >= p); -1: derived.")
    u: int = setting(-1, "engine=lsp: ... and is applied u matrix backwards after its own (u >= h); -1: derived.")
    train_other: bool = setting(False, "engine=lsp: also train the embedding, norms, head and biases, with AdamW on the"
                                       " device (fp32 copies); default: they stay frozen.")

    def validate(self) -> None:
        for name in ("r", "fit_samples", "check_samples", "fit_iterations"):
            positive(f"lsp.{name}", getattr(self, name))
        if self.d != -1:
            positive("lsp.d", self.d)
        if self.alpha != -1:
            positive("lsp.alpha", self.alpha)
        if self.drift < 0:
            raise UserError(f"lsp.drift must not be negative, got {self.drift}.")
        positive("lsp.fit_lr", self.fit_lr)
        if self.d != -1 and self.r > self.d:
            raise UserError(f"lsp.r ({self.r}) cannot exceed lsp.d ({self.d}): a row's non-zeros sit in distinct columns.")
        if self.check_every < 0:
            raise UserError(f"lsp.check_every must not be negative, got {self.check_every}.")
        for name in ("k", "p", "h", "u"):
            if getattr(self, name) < -1:
                raise UserError(f"lsp.{name} must be -1 (derived) or a count, got {getattr(self, name)}.")
        given = [v for v in (self.p, self.h, self.u) if v != -1]
        if given != sorted(given):
            raise UserError(f"lsp.p <= lsp.h <= lsp.u is required, got p={self.p}, h={self.h}, u={self.u}.")


def validate(cfg: RunConfig) -> None:
    """What engine=lsp does not do, refused in one sentence each."""
    if cfg.method != "full":
        raise UserError("engine=lsp is full fine-tuning of the block linears in a learned subspace; set method=full"
                        " (LoRA runs on engine=resident or slide).")
    if cfg.train.moments == "8bit":
        raise UserError("engine=lsp keeps its d x d coordinates' moments in fp32 (they are small); set"
                        " train.moments=fp32.")
    if cfg.activations.cache == "small":
        raise UserError("engine=lsp does not take activations.cache=small; set activations.cache=none or last_k.")
    if cfg.train.on_nonfinite == "skip" and cfg.train.max_grad_norm == 0:
        raise UserError("engine=lsp updates matrices while backward runs when clipping is off, so a step cannot be"
                        " skipped whole; set train.max_grad_norm > 0 or train.on_nonfinite=stop.")


class LspEngine(Engine):
    name = "lsp"

    def __init__(self, stack: Stack, cfg: RunConfig, device: torch.device, precision: str, dist: Dist = SINGLE):
        self.stack, self.device, self.precision, self.dist = stack, device, precision, dist
        self.train_cfg, self.loss_cfg, self.activations_cfg = cfg.train, cfg.loss, cfg.activations
        self.lsp = cfg.section("lsp")
        self.store_dir = Path(cfg.output_dir) / "activations"
        self.fake = stack.fake
        self.generator = torch.Generator().manual_seed(cfg.train.seed)  # projector draws (host: any device alike)
        # The stochastic rounding of bf16 folds (projected_linear.fold); none under fake tensors.
        self.rounding = None if self.fake else torch.Generator(device=device).manual_seed(cfg.train.seed)
        self.modules = self._project()
        self.names = {id(p): n for n, p in stack.model.named_parameters()}
        self.others = self._others(cfg.train.weight_decay)
        self.adams = [self._host_adam(m, cfg.train) for m in self.modules]
        self.link = runtime.Link(device)
        worker = runtime.HostWorker(inline=self.fake, device=device)
        weakref.finalize(self, worker.close)
        knobs = (self.lsp.k, self.lsp.p, self.lsp.h, self.lsp.u)
        schedule = lsp_schedule.initial(len(self.modules), *knobs, self.lsp.schedule == "sync")
        blocks = [self._block_of(m) for m in self.modules]
        self.updates = lsp_updates.UpdatePipeline(self.modules, self.adams, blocks, self.link, worker, schedule,
                                                  lsp_schedule.Clock(device), dist, cfg.train.weight_decay)
        self.step_count = 0
        self.learning = learning.ProjectorLearning(self.modules, self.adams, self.lsp, self.generator,
                                                       self.rounding, self.fake, blocks)
        self.sample: list[Batch] | None = None
        self.check_peak: tuple[int, dict] | None = None  # the projector pass's device peak, once measured
        self.meter = memory.meter_for(device, cfg.train.measure_memory)
        self._reading = None
        for module in self.modules:
            module.before_forward = weak_hook(self._complete)  # the module would keep the engine alive too
            module.z.register_post_accumulate_grad_hook(weak_hook(self._arrived, module.index))
        for _, param in self.others:
            param.register_post_accumulate_grad_hook(weak_hook(self._tag_gradient))

    # ------------------------------------------------------------ building

    def _project(self) -> list[ProjectedLinear]:
        """Every trainable linear in the blocks becomes a ProjectedLinear, numbered in forward order."""
        model, targets = self.stack.model, []
        for name in lora.select_targets(model, "all-linear"):
            path, _, leaf = name.rpartition(".")
            parent = model.get_submodule(path)
            if getattr(parent, leaf).weight.requires_grad:  # one frozen by a freeze pattern stays a plain linear
                targets.append((parent, leaf))
        if not targets:
            raise UserError("engine=lsp found no trainable linear in the blocks to project (freeze patterns?).")
        shapes = [(getattr(p, leaf).out_features, getattr(p, leaf).in_features) for p, leaf in targets]
        self.d = sizing.subspace_size(self.lsp.d, shapes)
        found = []
        for parent, leaf in targets:
            linear = getattr(parent, leaf)
            d = min(self.d, linear.out_features, linear.in_features)
            pair = [self._projector(n, d, linear.weight) for n in (linear.out_features, linear.in_features)]
            found.append(ProjectedLinear(linear, len(found), *pair))
            setattr(parent, leaf, found[-1])
        return found

    def _block_of(self, module: ProjectedLinear) -> int:
        return next(b for b, block in enumerate(self.stack.blocks) if any(m is module for m in block.modules()))

    def _projector(self, n: int, d: int, weight: torch.Tensor) -> projectors.SparseProjector:
        r, dtype = min(self.lsp.r, d), torch.promote_types(weight.dtype, torch.float32)
        if self.fake:  # the planner's estimate: shapes only, no random draws
            return projectors.SparseProjector(torch.zeros((n, r), dtype=torch.long, device=self.device),
                                              torch.empty((n, r), dtype=dtype, device=self.device), d)
        return projectors.SparseProjector.random(n, d, r, self.generator, dtype, self.device)

    def _others(self, weight_decay: float) -> list[tuple[str, torch.nn.Parameter]]:
        """The trainable tensors that are not projected: frozen, or (lsp.train_other) fp32 on the
        device with a fused AdamW of their own."""
        rest = [(n, p) for n, p in self.stack.model.named_parameters() if p.requires_grad]
        self.optimizer = None
        if not self.lsp.train_other:
            for _, param in rest:
                param.requires_grad_(False)
            return []
        for _, param in rest:
            if param.dtype in (torch.bfloat16, torch.float16):
                param.data = param.data.float()
        params = [p for _, p in rest]
        self.optimizer = torch.optim.AdamW(
            [{"params": ps, "weight_decay": decay} for ps, decay in rules.decay_groups(params, weight_decay)],
            **rules.adamw_settings(self.train_cfg), fused=True)
        rules.init_adamw_state(self.optimizer)
        return rest

    def _host_adam(self, module: ProjectedLinear, train: TrainConfig) -> HostAdam:
        # Z decays with the weight it is part of (its scale s follows: updates.py); matrices decay (rules.decays).
        adam = HostAdam(f"lsp {module.index}", [Group((module.z.shape,), train.weight_decay)], module.z.dtype, self.device,
                        rules.adamw_settings(train), threads=host_threads(train, self.device))
        with torch.no_grad():
            adam.masters[0].zero_()
        return adam

    def use_sample(self, batches: list[Batch]) -> None:
        """The fixed sample the projectors are checked and fit on (train.build hands it over)."""
        self.sample = batches

    # ------------------------------------------------------------ the meter's view

    def _resident_tensors(self):
        yield from ((p, "weights") for p in self.stack.model.parameters())
        yield from ((b, "weights") for b in self.stack.model.buffers())
        for m in self.modules:
            yield m.z, "weights"
            yield from ((t, "optimizer") for t in (m.p_o.pos, m.p_o.val, m.p_i.pos, m.p_i.val))
        yield from ((p.grad, "gradients") for _, p in self.others)
        for state in (self.optimizer.state.values() if self.optimizer else ()):
            yield from ((v, "optimizer") for v in state.values() if isinstance(v, torch.Tensor))

    def _tag_gradient(self, param: torch.Tensor) -> None:
        if self._reading is not None:
            self._reading.retag(param.grad, "gradients")

    def _arrived(self, index: int, z: torch.Tensor) -> None:
        self._tag_gradient(z)
        self.updates.arrived(index)

    def _complete(self, index: int) -> None:
        self.updates.complete(index)

    def flush(self) -> None:
        """Every pending update applied (before evaluation, a checkpoint or a projector check)."""
        self.updates.flush()

    def _flush_and_drain(self) -> None:
        """flush(), and its uploads of Z finished as the host sees them: what follows zeroes the host
        masters (a fold), which a copy up still in flight on CUDA would read after the write."""
        self.flush()
        self.link.drain()

    # ------------------------------------------------------------ one step

    def step(self, micro_batches: list[Batch], total_targets: int | None = None,
             then: NextStep | None = None) -> StepResult:
        self.stack.model.train()
        total = step_divisor(micro_batches, total_targets)
        self._lr = lr = rules.lr_at(self.train_cfg, self.step_count)
        clipping = self.train_cfg.max_grad_norm > 0
        link_before = self.link.bytes
        with self.meter.measure(self._resident_tensors()) as reading:
            self._reading = reading
            extras = self._check_projectors(micro_batches, reading)
            exact_sum = 0.0
            with block_stores.open_store(self.activations_cfg, self.device, self.store_dir) as store:
                for k, batch in enumerate(micro_batches):
                    out = model_loss(self.stack, self.activations_cfg, self.loss_cfg, self.device, self.precision,
                                     batch.to(self.device), reading, store=store)
                    exact_sum = exact_sum + out.exact_sum
                    if k == len(micro_batches) - 1:
                        self._begin_last_backward(clipping, exact_sum)
                    (out.loss_sum / total).backward()
            memory.mark("update")
            grad_norm, applied = self._end_backward(clipping, exact_sum)
            if self.fake:  # the planner's one step has no next forward: its uploads are this step's traffic
                self.flush()
            self._reading = None
        self.step_count += 1
        if self.step_count == 1:
            extras["lsp_d"] = self.d  # derived from the shapes unless lsp.d was given
        extras.update(self._maybe_derive_schedule())
        peak, breakdown = self._reported_peak(reading)
        return StepResult(
            loss=to_float(exact_sum) / total, tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches), lr=lr, grad_norm=to_float(grad_norm),
            device_peak_bytes=peak, device_peak_breakdown=breakdown,
            host_link_bytes=self.link.bytes - link_before + store.link_bytes,
            host_peak_bytes=self.host_bytes() + (store.peak_bytes if self.activations_cfg.checkpoint == "host" else 0),
            disk_peak_bytes=store.peak_bytes if self.activations_cfg.checkpoint == "disk" else 0,
            extras=extras, applied=applied)

    def _begin_last_backward(self, clipping: bool, exact_sum) -> None:
        """Updates may start during the coming backward: a non-finite loss must stop them first."""
        guard = StepGuard()
        guard.tripped = not clipping and not rules.is_finite(exact_sum)
        self.updates.begin(clipping, self._lr, guard)

    def _end_backward(self, clipping: bool, exact_sum) -> tuple[torch.Tensor, bool]:
        """The global norm, clipping, the updates not yet submitted (in forward order: the next forward
        needs the shallowest first), the other tensors' device AdamW; `sync` applies everything now."""
        norms = self.updates.end_backward()
        if self.others:
            grads = [p.grad for _, p in self.others if p.grad is not None]
            self.dist.all_reduce_(grads, what="the other trained tensors' gradient sum")
            norms = norms + ([torch.nn.utils.get_total_norm(grads, foreach=True)] if grads else [])
        grad_norm = torch.linalg.vector_norm(torch.stack(norms))
        applied = rules.is_finite(exact_sum) and rules.is_finite(grad_norm)
        coefficient = rules.clip_coefficient(grad_norm, self.train_cfg.max_grad_norm)
        if clipping:
            self.updates.clip(1.0 if is_fake(coefficient) else float(coefficient), applied)
        self.updates.submit_rest()
        self._step_others(coefficient, applied)
        if self.updates.schedule.sync:
            self.flush()
        return grad_norm, applied

    def _step_others(self, coefficient: torch.Tensor, applied: bool) -> None:
        if self.optimizer is None:
            return
        grads = [p.grad for _, p in self.others if p.grad is not None]
        if self.train_cfg.max_grad_norm > 0 and grads:
            torch._foreach_mul_(grads, coefficient)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        if applied:
            with self._reading.phase("optimizer"):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _reported_peak(self, reading) -> tuple[int | None, dict | None]:
        """The step's peak, or the projector pass's when that is higher: it recurs every check."""
        if reading.peak is None or self.check_peak is None or self.check_peak[0] <= reading.peak:
            return reading.peak, reading.peak_breakdown
        return self.check_peak

    def _maybe_derive_schedule(self) -> dict:
        """After step 2 (the first steady one), the knobs left at -1 from its measured times."""
        clock = self.updates.clock
        if self.fake or self.updates.schedule.sync or self.step_count != 2 or not clock.marks:
            return {}
        knobs = (self.lsp.k, self.lsp.p, self.lsp.h, self.lsp.u)
        if -1 not in knobs:
            return {}
        copy_s = 0.0
        if self.device.type == "cuda":  # modelled from the card's link rate: 4 d^2 bytes one way
            d = max(m.d for m in self.modules)
            copy_s = 4 * d * d / (presets.device_profile(self.device).host_link_gbps * 1e9)
        self.updates.worker.barrier()
        s = self.updates.schedule = lsp_schedule.derive(clock.backward_seconds(), clock.updates, copy_s, knobs)
        return {"lsp_k": s.k, "lsp_p": s.p, "lsp_h": s.h, "lsp_u": s.u}

    # ------------------------------------------------------------ learning the projectors

    def _check_projectors(self, micro_batches: list[Batch], reading) -> dict:
        """Before step 1, and every lsp.check_every steps, the projector check (lsp/learning.py) on the
        fit sample (the step's own batches when none was given); its pass's peak is kept."""
        if not self.learning.due(self.step_count):
            return {}
        if self.dist.active and not self.sample:
            # Each rank's own batches would fit each rank other projectors, and the ranks would part.
            raise UserError("engine=lsp under torchrun fits its projectors on a fixed sample every rank holds alike;"
                            " set lsp.fit_samples > 0 (it is 0, or the data has too few examples to hold any out).")
        self._flush_and_drain()  # a refit folds the matrices it changes
        memory.mark("lsp check")
        self.learning.progress = self.progress and self.dist.is_main
        if self.notes and not self.progress and not self.fake:
            what = "checking" if self.learning.fitted else "fitting"
            print(f"lsp: {what} the projectors of {len(self.modules)} matrices on "
                  f"{'the fit sample' if self.sample else 'this step'}'s {len(self.sample or micro_batches)}"
                  f" batches before step {self.step_count + 1}", flush=True)
        extras = self.learning.check(self.sample or micro_batches, self._probe_pass)
        self._agree_with_rank0()
        if reading.peak is not None and (self.check_peak is None or reading.peak > self.check_peak[0]):
            self.check_peak = (reading.peak, dict(reading.peak_breakdown or {}))
        return extras

    def _agree_with_rank0(self) -> None:
        """Under torchrun, every rank takes rank 0's outcome of the check it has just run too. Each rank
        fits from the same sample, but on CUDA the sparse products' index_add_ (and attention's backward)
        sum in varying orders, so two ranks' fits can differ in their last bits or decide differently
        which matrices to refit or when to stop; each would then apply one summed G_c through other
        projectors and the ranks would part. So the matrices any rank changed take rank 0's projector
        values (positions are fixed when drawn: a fit never moves them) and host AdamW state (moments
        moved through the new values), and every rank takes rank 0's baselines and the draws' states.
        A matrix no rank changed is as it was on every rank.

        The weight and Z go too only where the ranks changed different sets: a fold is deterministic
        (index_select products of the agreed old projectors and the one Z every rank holds, and the
        same rounding draws: the agreed generator, and the changed matrices folded in matrix order,
        learning.refit), so where every rank changed the same matrices their W and Z are already equal. That is every first fit (all
        matrices, Z = 0): the whole model's block weights need not cross the link at the job's start.
        (Only rank 0's figures are logged; learning.changed stays each rank's own.)"""
        if not self.dist.active or self.fake:
            return
        changed, same_everywhere = self._changed_on_any_rank()
        folded = [] if same_everywhere else [t for m in changed for t in (m.weight, m.z)]
        with torch.no_grad():
            self.dist.broadcast_([*folded, *(t for m in changed for t in (m.p_o.val, m.p_i.val))],
                                 what="rank 0's refit projectors and weights")
            self.dist.broadcast_([t for m in changed for t in self._host_state(self.adams[m.index])], host=True,
                                 what="rank 0's refit subspace moments")
        self._take_rank0s_check_state(changed)

    def _changed_on_any_rank(self) -> tuple[list[ProjectedLinear], bool]:
        """The matrices this check changed on at least one rank, and whether every rank changed exactly
        those (two flags a matrix, +-1 reduced by MAX: the MAX of -flag is minus the MIN; those 16 bytes
        a matrix count in the step's allreduce_bytes)."""
        mine, count = set(self.learning.changed), len(self.modules)
        flags = [float(i in mine) for i in range(count)]
        reduced = self.dist.max_floats([*flags, *(-f for f in flags)], "which matrices the projector check changed")
        anywhere, everywhere = reduced[:count], [-f for f in reduced[count:]]
        return [self.modules[i] for i, flag in enumerate(anywhere) if flag], anywhere == everywhere

    def _take_rank0s_check_state(self, changed: list[ProjectedLinear]) -> None:
        """Rank 0's baselines, draw states (fresh values; bf16 folds' rounding) and the changed matrices'
        decay scales, on every rank."""
        shared = self.dist.broadcast_object(
            {"baseline": self.learning.baseline, "generator": self.generator.get_state(),
             "rounding": None if self.rounding is None else self.rounding.get_state(),
             "scales": [m.scale for m in changed]}, "rank 0's projector check")
        self.learning.baseline = list(shared["baseline"])
        self.generator.set_state(shared["generator"])
        if self.rounding is not None:
            self.rounding.set_state(shared["rounding"])
        for module, scale in zip(changed, shared["scales"]):
            module.scale = scale

    @staticmethod
    def _host_state(adam: HostAdam) -> list[torch.Tensor]:
        """A matrix's host AdamW tensors a refit writes: Z's master and the moments (whole, in Z's dtype:
        lsp keeps no split or 8-bit layout)."""
        held = [adam.masters[0], *adam.moments[0].values()]
        assert all(isinstance(t, torch.Tensor) for t in held), "lsp's subspace moments are whole tensors"
        return held

    def _probe_pass(self, batches: list[Batch], observers: dict, finished=None) -> None:
        """Forward and backward over `batches` with the observed matrices in probe mode (each batch's
        full gradient handed to observers[i] once complete, then dropped: learning.Collector) and
        nothing else collecting gradients; `finished()` true after a batch: the rest are not needed."""
        saved = [(t, t.requires_grad) for t in [p for _, p in self.others] + [m.z for m in self.modules]]
        for tensor, _ in saved:
            tensor.requires_grad_(False)
        # A checkpointed block runs in tiles of tokens (step/seq_tiles.py): every matrix of it gets its gradient in parts.
        tiled = self.activations_cfg.checkpoint != "none"
        in_parts = {m.index for m in self.modules} if tiled else set()
        collector = learning.Collector(self.updates.blocks, observers, in_parts)
        # A probe pass makes no parameter or Z gradient: a tiled block's parts go to the Collector, the first
        # tile's (which also hands the previous block's over) always run, and the later ones, added in place
        # into it, may be replayed in the planner's estimate as a plain step's are (seq_tiles; a real run
        # runs every tile whatever the flags say).
        flags = self.stack.gradients_accumulate_plainly, self.stack.first_backward_tile_hands_over
        self.stack.gradients_accumulate_plainly = self.stack.first_backward_tile_hands_over = True
        try:
            for index in observers:
                self.modules[index].probe = functools.partial(collector.take, index)
                self.modules[index].z.requires_grad_(True)
            for batch in batches:
                with block_stores.open_store(self.activations_cfg, self.device, self.store_dir) as store:
                    out = model_loss(self.stack, self.activations_cfg, self.loss_cfg, self.device, self.precision,
                                     batch.to(self.device), self._reading or memory.NO_READING, store=store)
                    (out.loss_sum / max(batch.num_targets, 1)).backward()
                collector.finish()
                if finished is not None and finished():
                    break
        finally:
            self.stack.gradients_accumulate_plainly, self.stack.first_backward_tile_hands_over = flags
            for module in self.modules:
                module.probe = None
            for tensor, wanted in saved:
                tensor.requires_grad_(wanted)

    # ------------------------------------------------------------ the Engine interface

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        self.flush()
        self.stack.model.eval()
        return evaluate_batches(batches, lambda b: model_loss(
            self.stack, self.activations_cfg, self.loss_cfg, self.device, self.precision, b.to(self.device),
            training=False).exact_sum)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The effective weights W + P_o Z P_i^T (on the host, one matrix at a time: no second copy
        of the model on the device) and the other trained tensors, by parameter name."""
        self.flush()
        state = {self.names[id(m.weight)]: m.effective_weight().cpu() for m in self.modules}
        state.update((n, p.detach()) for n, p in self.others)
        return state

    def trained_numel(self) -> int:
        """Weights this run trains: every projected matrix (through its subspace) and the others."""
        return sum(m.weight.numel() for m in self.modules) + sum(p.numel() for _, p in self.others)

    def host_bytes(self) -> int:
        return sum(adam.host_bytes() for adam in self.adams)

    def state_dict(self) -> EngineState:
        """Z is folded into W first, so the trained weights are plain ones; the moments in Z space,
        the projectors, the step counts and the projector RNG go in `extra`."""
        self._flush_and_drain()
        for module in self.modules:
            module.fold(self.rounding)
        for adam in self.adams:
            adam.masters[0].zero_()
        trainable = {self.names[id(m.weight)]: m.weight.detach() for m in self.modules}
        trainable.update((n, p.detach()) for n, p in self.others)
        kept = [(n, self.optimizer.state[p]) for n, p in self.others if self.optimizer and p in self.optimizer.state]
        matrices = {self.names[id(m.weight)]: self._matrix_state(m) for m in self.modules}
        return EngineState(
            engine=self.name, step=self.step_count, trainable=trainable,
            exp_avg={n: s["exp_avg"] for n, s in kept}, exp_avg_sq={n: s["exp_avg_sq"] for n, s in kept},
            adam_steps={n: float(s["step"]) for n, s in kept},
            extra={"lsp": {"matrices": matrices, "fitted": self.learning.fitted, "baseline": list(self.learning.baseline),
                           "generator": self.generator.get_state(),
                           "rounding": self.rounding.get_state() if self.rounding is not None else None}})

    def _matrix_state(self, module: ProjectedLinear) -> dict:
        views, state = self.adams[module.index].member(0, 0), self.adams[module.index].state(0)
        tensors = {"pos_o": module.p_o.pos, "val_o": module.p_o.val, "pos_i": module.p_i.pos, "val_i": module.p_i.val,
                   "exp_avg": views.exp_avg, "exp_avg_sq": views.exp_avg_sq}
        return {**{k: v.detach().cpu().clone() for k, v in tensors.items()}, "step": float(state["step"])}

    def load_state_dict(self, state: EngineState) -> None:
        """Weights by name (Z restarts at zero: checkpoints hold folded weights); from an lsp checkpoint
        also the projectors, moments, steps and RNG; from another engine's, or one whose projectors
        have another shape (lsp.r or lsp.d changed), the projectors are fit afresh at the next step."""
        names = [self.names[id(m.weight)] for m in self.modules] + [n for n, _ in self.others]
        check_resumable(state, names, self.name, decided_by="lsp.train_other")
        self._flush_and_drain()
        by_name = {self.names[id(m.weight)]: m.weight for m in self.modules} | dict(self.others)
        copy_named(by_name, state.trainable)
        for module, adam in zip(self.modules, self.adams):
            with torch.no_grad():
                module.z.zero_()
                adam.masters[0].zero_()
            module.scale = 1.0
        lsp = state.extra.get("lsp") if state.engine == self.name else None
        same_shapes = True
        if lsp is not None:
            same_shapes = self._load_matrices(lsp["matrices"])
            self.generator.set_state(lsp["generator"])
            if self.rounding is not None and lsp["rounding"] is not None:
                self.rounding.set_state(lsp["rounding"])
        self.learning.fitted = bool(lsp and lsp["fitted"]) and same_shapes
        saved = (lsp or {}).get("baseline")  # a checkpoint from before the drift rule has none: the next check sets it
        self.learning.baseline = list(saved) if self.learning.fitted and saved else [None] * len(self.modules)
        for name, param in self.others:
            if name in state.exp_avg:
                self.optimizer.state[param] = {
                    "step": torch.tensor(state.adam_steps[name], dtype=torch.float32, device=param.device),
                    "exp_avg": state.exp_avg[name].to(param, copy=True),
                    "exp_avg_sq": state.exp_avg_sq[name].to(param, copy=True)}
        self.step_count = state.step

    def _load_matrices(self, matrices: dict) -> bool:
        """Each matrix's projectors, moments and step count as saved; False when some matrix's saved
        shapes differ from this run's (lsp.r or lsp.d changed on resume): that matrix keeps this run's
        projectors (drawn at its rank and size) and its moments and step count restart."""
        same = True
        for module, adam in zip(self.modules, self.adams):
            saved, views = matrices[self.names[id(module.weight)]], adam.member(0, 0)
            if not self._same_shapes(module, views, saved):
                same = False
                with torch.no_grad():
                    for moment in MOMENTS:
                        getattr(views, moment).zero_()
                adam.state(0)["step"].fill_(0)
                continue
            d = module.d
            module.p_o = projectors.SparseProjector(saved["pos_o"].to(self.device), saved["val_o"].to(self.device), d)
            module.p_i = projectors.SparseProjector(saved["pos_i"].to(self.device), saved["val_i"].to(self.device), d)
            copy_named({m: getattr(views, m) for m in MOMENTS}, saved)
            adam.state(0)["step"].fill_(saved["step"])
        return same

    @staticmethod
    def _same_shapes(module: ProjectedLinear, views, saved: dict) -> bool:
        """The saved projectors have this matrix's rank (pos: (n, r)) and subspace size (moments: (d, d))."""
        return (tuple(saved["pos_o"].shape) == tuple(module.p_o.pos.shape)
                and tuple(saved["pos_i"].shape) == tuple(module.p_i.pos.shape)
                and tuple(saved["exp_avg"].shape) == tuple(views.exp_avg.shape))


def weight_dtype(precision: str, method: str) -> torch.dtype:
    """The weights stay in the compute dtype (bf16 under bf16): their update lives in Z, in fp32."""
    del method
    return {"bf16": torch.bfloat16, "fp64": torch.float64}.get(precision, torch.float32)


def plans(method: str) -> list[dict]:
    """Full fine-tuning in bf16, with and without block recompute."""
    if method != "full":
        return []
    return [{"precision": "bf16"}, {"precision": "bf16", "activations.checkpoint": "recompute"}]


register(EngineSpec(
    name="lsp", summary="full fine-tuning with bf16 weights on the device; gradients leave it compressed by learned"
    " sparse projectors, AdamW runs on the host in the small space (LSP-Offload).",
    build=LspEngine, step_time=step_time, section=LspConfig, validate=validate, plans=plans,
    weight_dtype=weight_dtype, sample_examples=lambda cfg: cfg.section("lsp").fit_samples,
    estimate_passes=lambda cfg: 3))  # the first step's check: a fit's pass and a baseline's beside the step's
