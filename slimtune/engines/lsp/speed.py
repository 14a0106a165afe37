"""Engine lsp's modelled step time (labelled modelled wherever printed): speed.py's parts composed
for a step whose backward has no weight-gradient matmuls, with the sparse products' memory traffic
and the projector check spread over the steps between checks."""

from __future__ import annotations

from slimtune.device import speed
from slimtune.config import RunConfig
from slimtune.engines.lsp import sizing


def subspace_numbers(model_config, d: int) -> int:
    """Numbers the host AdamW updates a step: sum over the block linears of min(d, n_o, n_i)^2."""
    return model_config.num_hidden_layers * sum(min(d, *shape) ** 2 for shape in sizing.block_shapes(model_config))


def sparse_traffic_bytes(model_config, r: int, tokens: int, forwards: int, element_bytes: int) -> float:
    """Device memory traffic of the sparse products (modelled): each of X P_i, the output correction,
    dY P_o and the input-gradient correction runs r terms, each reading and writing a (T, n) tensor
    and adding it in (about 3 passes over T x n). Forward products run `forwards` times (2 with
    recompute), backward ones once."""
    per_token = sum(n_o + n_i for n_o, n_i in sizing.block_shapes(model_config)) * model_config.num_hidden_layers
    return 3 * r * tokens * per_token * element_bytes * (forwards + 1)


def step_time(model_config, cfg: RunConfig, counts: speed.StepCounts, gpu, batch_size: int,
              seq_len: int) -> speed.StepTime:
    """Modelled: the backward computes input gradients only (no weight-gradient matmuls), plus the
    sparse products' memory traffic (the d x d products are left out); copies and the host AdamW over
    the d x d coordinates overlap compute; the projector check's pass (a full backward over the fit
    sample) is spread over the steps between checks."""
    lsp_cfg = cfg.section("lsp")
    recompute = cfg.activations.checkpoint != "none"
    accum = cfg.train.grad_accum
    flops = speed.step_flops(model_config, "lora", batch_size, seq_len, recompute) * accum
    if lsp_cfg.check_every:
        check = speed.step_flops(model_config, "full", batch_size, seq_len, recompute)
        flops += check * -(-lsp_cfg.fit_samples // batch_size) / lsp_cfg.check_every
    element = 2 if cfg.precision == "bf16" else 4
    traffic = sparse_traffic_bytes(model_config, lsp_cfg.r, batch_size * seq_len, 2 if recompute else 1, element)
    disk = 2 * counts.disk_bytes if cfg.activations.checkpoint == "disk" else 0.0
    d = sizing.subspace_size(lsp_cfg.d, sizing.block_shapes(model_config) * model_config.num_hidden_layers)
    return speed.overlapped_step_time(flops, subspace_numbers(model_config, d), gpu, cfg.precision,
                                      counts.host_link_bytes, disk, updates_exposed=False,
                                      memory_bytes=traffic * accum)
