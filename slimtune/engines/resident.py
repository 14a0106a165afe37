"""Engine `resident`: everything on the device; the baseline every other engine is checked against."""

from __future__ import annotations

import torch
from torch import nn

from pathlib import Path

from slimtune import activations, memory, schedule
from slimtune.config import ActivationsConfig, LossConfig, TrainConfig
from slimtune.data import Batch
from slimtune.engines.base import StepResult, autocast_for, to_float
from slimtune.loss import LossOutput, causal_lm_loss
from slimtune.model import Stack


def param_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm gains (1-D) are left undecayed, as is usual."""
    decay = [p for _, p in named if p.ndim >= 2]
    plain = [p for _, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0})
    return groups


class ResidentEngine:
    name = "resident"

    def __init__(self, stack: Stack, cfg: TrainConfig, device: torch.device, precision: str,
                 loss_cfg: LossConfig | None = None, activations_cfg: ActivationsConfig | None = None,
                 store_dir: Path | None = None):
        self.stack, self.cfg, self.device, self.precision = stack, cfg, device, precision
        self.loss_cfg = loss_cfg or LossConfig()
        self.activations_cfg = activations_cfg or ActivationsConfig()
        self.store_dir = store_dir  # checkpoint=disk without activations.disk_dir
        self.named = [(n, p) for n, p in stack.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        # Fused AdamW on every device: the fastest form and the leanest in temporaries, and one
        # op per step, so the fake-tensor estimate models the same optimizer a GPU runs.
        self.optimizer = torch.optim.AdamW(
            param_groups(self.named, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True
        )
        self.scheduler = schedule.build(self.optimizer, cfg.steps, cfg.warmup_steps, cfg.schedule)
        self.meter = memory.meter_for(device, cfg.measure_memory)
        self._reading = None  # the meter reading of the step in progress
        for param in self.params:  # a gradient made in backward is counted as a gradient
            param.register_post_accumulate_grad_hook(self._tag_gradient)

    def _tag_gradient(self, param: torch.Tensor) -> None:
        if self._reading is not None:
            self._reading.retag(param.grad, "gradients")

    def _resident_tensors(self):
        yield from ((p, "weights") for p in self.stack.model.parameters())
        yield from ((b, "weights") for b in self.stack.model.buffers())  # 4-bit codes live in buffers
        yield from ((p.grad, "gradients") for p in self.params)
        for state in self.optimizer.state.values():
            yield from ((v, "optimizer") for v in state.values() if isinstance(v, torch.Tensor))

    def _loss(self, batch: Batch, reading=memory.NO_READING, training: bool = True, store=None) -> LossOutput:
        blocks = activations.runner(self.activations_cfg, store)
        with autocast_for(self.device, self.precision):
            with reading.phase("activations"):
                hidden = self.stack.body_hidden(batch.input_ids, batch.position_ids, blocks, batch.segmented)
            with reading.phase("loss"):
                return causal_lm_loss(hidden, self.stack.norm, self.stack.head, batch.targets, self.loss_cfg,
                                      rows=batch.rows, training=training)

    def step(self, micro_batches: list[Batch]) -> StepResult:
        self.stack.model.train()
        total = max(sum(b.num_targets for b in micro_batches), 1)
        with self.meter.measure(self._resident_tensors()) as reading:
            self._reading = reading
            exact_sum, excluded_sum = 0.0, 0.0
            with activations.open_store(self.activations_cfg, self.device, self.store_dir) as store:
                for batch in micro_batches:
                    out = self._loss(batch.to(self.device), reading, store=store)
                    (out.loss_sum / total).backward()
                    # The exact loss is what is logged: a subset objective is only a lower bound of it.
                    exact_sum, excluded_sum = exact_sum + out.exact_sum, excluded_sum + out.excluded_mass_sum
            grad_norm = self._clip()
            lr = self.scheduler.get_last_lr()[0]
            with reading.phase("optimizer"):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self._reading = None
        return StepResult(
            loss=to_float(exact_sum) / total,
            excluded_mass=to_float(excluded_sum) / total,
            tokens=sum(b.num_targets for b in micro_batches),
            seen_tokens=sum(b.input_ids.numel() for b in micro_batches),
            lr=lr, grad_norm=to_float(grad_norm), device_peak_bytes=reading.peak, host_link_bytes=store.link_bytes,
            device_peak_breakdown=reading.peak_breakdown, **self._offload_peaks(store),
        )

    def _offload_peaks(self, store) -> dict:
        """Block inputs held in host RAM or on disk at most at once this step."""
        where = {"host": "host_peak_bytes", "disk": "disk_peak_bytes"}.get(self.activations_cfg.checkpoint)
        return {where: store.peak_bytes} if where else {}

    def _clip(self) -> torch.Tensor:
        grads = [p for p in self.params if p.grad is not None]
        if self.cfg.max_grad_norm > 0:
            return torch.nn.utils.clip_grad_norm_(grads, self.cfg.max_grad_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in grads])

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        self.stack.model.eval()
        loss_sum, tokens = 0.0, 0
        for batch in batches:
            batch = batch.to(self.device)
            loss_sum += float(self._loss(batch, training=False).exact_sum)
            tokens += batch.num_targets
        return loss_sum, tokens

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named}

    def state_dict(self) -> dict:
        return {
            "trainable": self.trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, param in self.named:
                param.copy_(state["trainable"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
