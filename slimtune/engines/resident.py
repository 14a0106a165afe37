"""Engine `resident`: everything on the device; the baseline every other engine is checked against.

Under torchrun: dist.strategy=ddp sums the gradients across ranks while the step's last backward
runs (flat buckets launched as they fill: grad_buckets.py) and waits for the sums before clipping
and AdamW; dist.strategy=fsdp shards every weight, gradient and moment across ranks with FSDP2
(sharding.py), bf16 gathers under precision=bf16."""

from __future__ import annotations

from pathlib import Path

import torch

from slimtune.step import activations, block_stores
from slimtune.device import memory, speed
from slimtune.dist import sharding
from slimtune.store.checkpoint import EngineState
from slimtune.config import RunConfig
from slimtune.data.dataset import Batch
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.engines.base import Engine, NextStep, StepResult
from slimtune.step.forward import evaluate_batches, model_loss, step_divisor, to_float
from slimtune.step.hooks import weak_hook
from slimtune.store.checkpoint import check_resumable
from slimtune.engines.registry import EngineSpec, register
from slimtune.dist.grad_buckets import GradientBuckets
from slimtune.errors import UserError
from slimtune.step.loss import LossOutput
from slimtune.model import quant
from slimtune.model.stack import Stack
from slimtune.optim import rules


class ResidentEngine(Engine):
    name = "resident"

    def __init__(self, stack: Stack, cfg: RunConfig, device: torch.device, precision: str, dist: Dist = SINGLE):
        self.stack, self.device, self.precision, self.dist = stack, device, precision, dist
        self.train_cfg, self.loss_cfg, self.activations_cfg = cfg.train, cfg.loss, cfg.activations
        if cfg.dist.strategy == "fsdp":  # one process too: the planner's one-device step for an fsdp plan
            self.activations_cfg = sharding.whole_blocks(cfg.activations)
        self.store_dir = Path(cfg.output_dir) / "activations"  # checkpoint=disk without activations.disk_dir
        self.sharded, self.method = sharding.sharded_run(cfg, dist), cfg.method
        # fsdp: the root unit every forward runs through (sharding.StepRoot), None otherwise.
        self.offloaded = self.sharded and cfg.dist.offload == "cpu"  # shards, gradients, AdamW in host RAM
        self.root = self._shard(stack, cfg, device, precision, dist) if self.sharded else None
        if cfg.dist.strategy == "fsdp" and not dist.active and not stack.fake:
            print(unsharded_note(cfg.dist.offload))
        self.named = [(n, p) for n, p in stack.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        # Fused AdamW on every device: the fastest form and the leanest in temporaries, and one
        # op per step, so the fake-tensor estimate models the same optimizer a GPU runs.
        groups = rules.decay_groups(self.params, cfg.train.weight_decay)
        self.optimizer = torch.optim.AdamW(
            [{"params": params, "weight_decay": decay} for params, decay in sharding.split_by_sharding(groups)],
            **rules.adamw_settings(cfg.train), fused=True)
        rules.init_adamw_state(self.optimizer)
        if self.offloaded:
            sharding.mark_offloaded([*stack.model.parameters(), *self._moments()])
        # ddp: sums launched during the last backward (the planner's Counting dist counts instead).
        ddp = dist.active and not self.sharded
        self.buckets = GradientBuckets(dist, self.params, _blocks_of(stack)) if ddp else None
        self.step_count = 0  # optimizer steps taken: the learning-rate schedule's position
        self.meter = memory.meter_for(device, cfg.train.measure_memory)
        self._reading = None  # the meter reading of the step in progress
        for param in self.params:  # a gradient made in backward is counted as a gradient
            param.register_post_accumulate_grad_hook(weak_hook(self._tag_gradient))
        # the hook tags a gradient (again for each part: harmless) and ddp's buckets wait for a block's end
        stack.gradients_accumulate_plainly = True

    def _shard(self, stack: Stack, cfg: RunConfig, device: torch.device, precision: str, dist: Dist):
        """fsdp: a 4-bit base's codes and scales made parameters FSDP shards (a row per block), every
        weight sharded, and a rank that built its model on the meta device handed rank 0's weights."""
        quant.hold_as_rows(stack.model)
        awaited = sharding.ranks_await_weights(stack.model, dist)
        whole = sharding.held_for_sending(stack.model, dist) if awaited else {}
        root = sharding.shard_model(stack, device, dist, sharding.precision_policy(cfg.dist, precision),
                                    self.offloaded)
        if awaited:
            sharding.fill_from_rank0(root, stack.model, whole, dist, device, self.offloaded)
        return root

    def _moments(self) -> list[torch.Tensor]:
        return [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]

    def _tag_gradient(self, param: torch.Tensor) -> None:
        if self.offloaded:  # FSDP copied the reduce-scattered shard to the host
            sharding.mark_offloaded([param.grad])
        if self._reading is not None:
            self._reading.retag(param.grad, "gradients")
        if self.buckets is not None:
            self.buckets.ready(param)

    def _in_tiles(self, batch: Batch) -> bool:
        """Whether the blocks may run in tiles on `batch` (each block's gradients then come in parts):
        whenever they are checkpointed with a tile shorter than the rows (activations.run_blocks may
        still run them whole; a bucket then waits one block longer, never too little)."""
        seq = batch.input_ids.shape[1]
        cfg = self.activations_cfg
        return cfg.checkpoint != "none" and activations.tile_tokens(self.stack, seq, cfg, batch.segmented) < seq

    def _resident_tensors(self):
        yield from ((p, "weights") for p in self.stack.model.parameters())
        yield from ((b, "weights") for b in self.stack.model.buffers())  # 4-bit codes live in buffers
        yield from ((p.grad, "gradients") for p in self.params)
        for state in self.optimizer.state.values():
            yield from ((v, "optimizer") for v in state.values() if isinstance(v, torch.Tensor))

    def _loss(self, batch: Batch, reading=memory.NO_READING, training: bool = True, store=None) -> LossOutput:
        def loss() -> LossOutput:
            return model_loss(self.stack, self.activations_cfg, self.loss_cfg, self.device, self.precision, batch,
                              reading, training, store)

        return loss() if self.root is None else self.root(loss)

    def step(self, micro_batches: list[Batch], total_targets: int | None = None,
             then: NextStep | None = None) -> StepResult:
        self.stack.model.train()
        total = step_divisor(micro_batches, total_targets)
        lr = rules.lr_at(self.train_cfg, self.step_count)
        with self.meter.measure(self._resident_tensors()) as reading:
            self._reading = reading
            exact_sum, excluded_sum = 0.0, 0.0
            with block_stores.open_store(self.activations_cfg, self.device, self.store_dir) as store:
                for k, batch in enumerate(micro_batches):
                    out = self._loss(batch.to(self.device), reading, store=store)
                    if self.buckets is not None and k == len(micro_batches) - 1:
                        self.buckets.arm(in_parts=self._in_tiles(batch))
                    (out.loss_sum / total).backward()
                    # The exact loss is what is logged: a subset objective is only a lower bound of it.
                    exact_sum, excluded_sum = exact_sum + out.exact_sum, excluded_sum + out.excluded_mass_sum
            memory.mark("update")
            if self.buckets is not None:
                self.buckets.finish()
            else:  # whole gradients: none under fsdp (reduce-scattered in backward); Counting's count
                self.dist.all_reduce_(p.grad for p in self.params if not sharding.is_sharded(p.grad))
            grad_norm = self._clip()
            applied = rules.is_finite(grad_norm) and rules.is_finite(exact_sum)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if applied:
                with reading.phase("optimizer"):
                    self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._reading = None
        self.step_count += 1
        extras = {"excluded_mass": to_float(excluded_sum) / total} if self.loss_cfg.mode == "subset" else {}
        return StepResult(
            loss=to_float(exact_sum) / total, tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches),
            lr=lr, grad_norm=to_float(grad_norm), device_peak_bytes=reading.peak, host_link_bytes=store.link_bytes,
            device_peak_breakdown=reading.peak_breakdown, extras=extras, applied=applied, **self._offload_peaks(store),
        )

    def _offload_peaks(self, store) -> dict:
        """Block inputs held in host RAM or on disk at most at once this step; with dist.offload=cpu the
        host also holds every shard, a gradient for each trained one, and AdamW's moments."""
        where = {"host": "host_peak_bytes", "disk": "disk_peak_bytes"}.get(self.activations_cfg.checkpoint)
        peaks = {where: store.peak_bytes} if where else {}
        if self.offloaded:
            state = sharding.local_bytes([*self.stack.model.parameters(), *self.params, *self._moments()])
            peaks["host_peak_bytes"] = peaks.get("host_peak_bytes", 0) + state
        return peaks

    def _clip(self) -> torch.Tensor:
        """The global gradient norm before clipping; the gradients clipped (rules.clip_coefficient)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        # foreach: one op over all gradients, as torch's clip_grad_norm_ does on a GPU (on the CPU it
        # loops per tensor inside, with the same results); the planner's fake step runs 2 ops, not 2n.
        if self.sharded:
            norm = sharding.total_norm(grads)
            if self.train_cfg.max_grad_norm > 0 and grads:
                sharding.scale_(grads, rules.clip_coefficient(norm, self.train_cfg.max_grad_norm))
            return norm
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.train_cfg.max_grad_norm > 0 and grads:
            torch._foreach_mul_(grads, rules.clip_coefficient(norm, self.train_cfg.max_grad_norm))
        return norm

    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        self.stack.model.eval()
        return evaluate_batches(batches, self._eval_loss)

    def _eval_loss(self, batch: Batch) -> torch.Tensor:
        loss_sum = self._loss(batch.to(self.device), training=False).exact_sum
        if self.root is not None:
            # The root keeps its weights gathered after a forward, for a backward: freed after each
            # batch, every forward gathers alike however a rank's batches are grouped into calls.
            self.root.reshard()
        return loss_sum

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained weights by name. Under fsdp gathered whole one at a time to the host: a
        collective, so every rank calls it (export does), and only rank 0 keeps what it gathers; for
        full fine-tuning the frozen sharded tensors too (export writes the whole model from it)."""
        if self.sharded:
            whole_model = self.method == "full"
            gathered = ((n, sharding.full(p, self.dist.is_main)) for n, p in self.stack.model.named_parameters()
                        if p.requires_grad or (whole_model and sharding.is_sharded(p)))
            return {n: t for n, t in gathered if t is not None}
        return {n: p.detach() for n, p in self.named}

    def host_bytes(self) -> int:
        return 0  # nothing of its own: offloaded block inputs are the step's (StepResult.host_peak_bytes)

    def state_dict(self) -> EngineState:
        kept = [(n, self.optimizer.state[p]) for n, p in self.named if p in self.optimizer.state]
        # Under fsdp the live shards (DTensors): checkpoint.save writes them with DCP, rank by rank.
        return EngineState(
            engine=self.name, step=self.step_count, trainable={n: p.detach() for n, p in self.named},
            exp_avg={n: s["exp_avg"] for n, s in kept}, exp_avg_sq={n: s["exp_avg_sq"] for n, s in kept},
            adam_steps={n: float(s["step"]) for n, s in kept})

    def load_state_dict(self, state: EngineState) -> None:
        check_resumable(state, [n for n, _ in self.named], self.name)
        for name, param in self.named:
            if state.trainable[name] is not param:  # a sharded checkpoint was read into the live tensors
                sharding.copy_into(param, state.trainable[name])
            if name in state.exp_avg:  # fused AdamW's state: a float32 step on the parameter's device
                held = self.optimizer.state[param]
                held["step"] = torch.tensor(state.adam_steps[name], dtype=torch.float32, device=param.device)
                for moment in ("exp_avg", "exp_avg_sq"):
                    source = getattr(state, moment)[name]
                    if source is not held[moment]:
                        sharding.copy_into(held[moment], source)
        self.step_count = state.step


def _blocks_of(stack: Stack) -> dict[int, int]:
    """id(tensor) -> its block, for the blocks' trained tensors: under ddp a tiled block's tensors
    get their gradients in parts, whole once backward leaves the block (grad_buckets.py)."""
    return {id(p): index for index, block in enumerate(stack.blocks) for p in block.parameters() if p.requires_grad}


def unsharded_note(offload: str) -> str:
    """The start line of an fsdp run in one process: nothing to shard it across."""
    ignored = "; dist.offload=cpu does nothing here" if offload == "cpu" else ""
    return ("dist.strategy=fsdp in one process: nothing is sharded, the model trains whole on one device"
            f"{ignored} (start several ranks with slimtune train --nproc N or torchrun).")


def step_time(model_config, cfg: RunConfig, counts: speed.StepCounts, gpu, batch_size: int,
              seq_len: int) -> speed.StepTime:
    """Nothing overlaps: compute (a checkpointed step recomputes every block; a 4-bit base is
    dequantized in every pass), the device AdamW, and link and disk traffic add up."""
    checkpoint = cfg.activations.checkpoint
    recompute = checkpoint != "none"
    accum = cfg.train.grad_accum
    flops = speed.step_flops(model_config, cfg.method, batch_size, seq_len, recompute) * accum
    passes = (3 if recompute else 2) * accum
    dequant = speed.dequant_bytes(model_config, passes) if cfg.quant.scheme != "none" else 0.0
    disk = counts.host_link_bytes if checkpoint == "disk" else 0.0
    return speed.serial_step_time(flops, counts.trainable_params, gpu, cfg.precision, counts.host_link_bytes, disk,
                                  dequant)


def validate(cfg: RunConfig) -> None:
    """dist.strategy=fsdp: what sharding.refusal says it cannot do yet. train.moments=8bit is the
    host optimizer's: this engine runs torch's AdamW where the weights are."""
    if cfg.train.moments == "8bit":
        raise UserError("train.moments=8bit codes the moments of the host optimizer (engines slide, chunk,"
                        " roundpipe); engine=resident keeps torch's AdamW on the device: set train.moments=fp32.")
    if cfg.dist.strategy != "fsdp":
        return
    if cfg.precision != "auto":  # auto is resolved where the run starts (bf16 on CUDA): checked there
        sharding.precision_policy(cfg.dist, cfg.precision)
    refused = sharding.refusal(cfg)
    if refused:
        raise UserError(refused)


def plans(method: str) -> list[dict]:
    """bf16 and fp32, checkpointing in each store, and for LoRA a 4-bit base with and without them
    and the whole LoRA peak-memory stack; for full fine-tuning also everything sharded across ranks,
    with and without recompute, and with recompute and the shards in host RAM (dist.offload=cpu);
    for LoRA a sharded 4-bit base, recomputed, with and without offload (fsdp plans are weighed only
    where there are several ranks: planner.Machine.ranks)."""
    options = [{"precision": precision} for precision in ("bf16", "fp32")]
    options += [{"precision": "bf16", "activations.checkpoint": store} for store in ("recompute", "host", "disk")]
    if method == "full":
        fsdp = {"precision": "bf16", "dist.strategy": "fsdp"}
        options += [fsdp, {**fsdp, "activations.checkpoint": "recompute"},
                    {**fsdp, "activations.checkpoint": "recompute", "dist.offload": "cpu"}]
    if method == "lora":
        nf4 = {"precision": "bf16", "quant.scheme": "nf4"}
        options += [nf4, *({**nf4, "activations.checkpoint": store} for store in ("recompute", "host", "disk"))]
        options.append({**nf4, "activations.checkpoint": "disk", "loss.mode": "subset"})
        # QLoRA sharded (FSDP + QLoRA, Answer.AI's recipe): the 4-bit base's codes sharded, blocks
        # recomputed, and with the shards, adapters' gradients and AdamW in host RAM.
        fsdp = {**nf4, "dist.strategy": "fsdp", "activations.checkpoint": "recompute"}
        options += [fsdp, {**fsdp, "dist.offload": "cpu"}]
    return options


register(EngineSpec(
    name="resident", summary="everything on the device (the baseline every other engine is checked against).",
    build=ResidentEngine, step_time=step_time, plans=plans, validate=validate, strategies=("ddp", "fsdp")))
