"""estimate.estimate: the real training step of the real engine, run on fake tensors.

The model is built on the meta device and given fake parameters (FakeTensorMode on the
CPU device: fake `cuda` tensors cannot exist on a CPU-only torch), the run is assembled
by assembly.assemble exactly as `train.build` assembles it, and one step runs under the
same meter the training loop uses. Nothing is computed and no weight is allocated. The engines
create their optimizer state when they are built, so that first step holds what every later
step holds (tests/unit/test_estimate.py compares it with a real run's second step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torch._subclasses.fake_tensor import FakeTensorMode

from slimtune import assembly
from slimtune.config import RunConfig
from slimtune.data import IGNORE_INDEX, Batch
from slimtune.model import Stack
from slimtune.speed import StepCounts

# Steps run: one. Engines hold their optimizer state from construction (rules.init_adamw_state,
# HostAdam), so the first step is already the steady state every later step repeats.
STEPS = 1


@dataclass
class Estimate:
    device_peak_bytes: int
    breakdown: dict[str, int]  # by memory.CATEGORIES, at the peak
    host_bytes: int  # host RAM the plan holds beyond the loaded model files (offloaded state)
    disk_bytes: int
    host_link_bytes: int  # per optimizer step
    trainable_params: int
    total_params: int

    def counts(self) -> StepCounts:
        """What the time model needs of it."""
        return StepCounts(self.trainable_params, self.host_link_bytes, self.disk_bytes)


def synthetic_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int = 0) -> Batch:
    """A packed-looking batch: each row holds two examples (position ids restart halfway), and
    the first quarter of each example is prompt (no loss), as response-only training has."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    half = seq_len // 2
    positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).expand(batch_size, -1).clone()
    targets = torch.roll(ids, -1, dims=1)
    targets[positions < max(1, half // 4)] = IGNORE_INDEX
    targets[:, [half - 1, seq_len - 1]] = IGNORE_INDEX
    return Batch(ids, targets, positions)


def meta_model(config, dtype: torch.dtype) -> nn.Module:
    """An HF model of `config`'s shape with no storage at all."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def make_fake(model: nn.Module, mode) -> nn.Module:
    """Give every parameter and buffer a fake tensor of its shape (tied weights stay tied).
    Assigned directly: Module.to() cannot move parameters onto fake tensors."""
    replaced: dict[int, nn.Parameter] = {}
    with mode:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    if id(param) not in replaced:
                        fake = torch.empty(param.shape, dtype=param.dtype)
                        replaced[id(param)] = nn.Parameter(fake, requires_grad=param.requires_grad)
                    module._parameters[name] = replaced[id(param)]
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)
    return model


def fake_model(config, dtype: torch.dtype, mode) -> nn.Module:
    return make_fake(meta_model(config, dtype), mode)


def estimate(config, cfg: RunConfig, batch_size: int, seq_len: int, batch: Batch | None = None) -> Estimate:
    """Device peak of one steady-state optimizer step of `cfg` on a model of `config`'s shape, on
    `batch` (real tensors; its shape wins) or else a synthetic_batch(batch_size, seq_len)."""
    precision = assembly.resolve_precision(cfg.precision, torch.device("cuda"))  # planned for a GPU
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stack = Stack(fake_model(config, assembly.weight_dtype(precision, cfg.method), mode))
    real_batch = batch if batch is not None else synthetic_batch(batch_size, seq_len, config.vocab_size)
    with mode:
        engine = assembly.assemble(cfg, stack, assembly.HOST, precision)
        tensors = (real_batch.input_ids, real_batch.targets, real_batch.position_ids, real_batch.trained_positions)
        batch = Batch(*(mode.from_tensor(t) for t in tensors), num_targets=real_batch.num_targets,
                      segmented=real_batch.segmented)
        results = [engine.step([batch] * cfg.train.grad_accum) for _ in range(STEPS)]
    model = stack.model
    return Estimate(
        device_peak_bytes=results[-1].device_peak_bytes,
        breakdown=results[-1].device_peak_breakdown,
        host_bytes=results[-1].host_peak_bytes,
        disk_bytes=results[-1].disk_peak_bytes,
        host_link_bytes=results[-1].host_link_bytes,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in model.parameters()),
    )
