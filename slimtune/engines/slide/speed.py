"""Engine slide's modelled step time: device/speed.py's parts composed for a step whose every block
is recomputed in backward, the rest said by the working set (working_set.py)."""

from __future__ import annotations

from slimtune.config import RunConfig
from slimtune.device import speed
from slimtune.engines.slide.working_set import working_set_of


def step_time(model_config, cfg: RunConfig, counts: speed.StepCounts, gpu, batch_size: int,
              seq_len: int) -> speed.StepTime:
    """Copies overlap compute; every block is recomputed in backward; a 4-bit base is dequantized in
    the forward, the recompute and the input-gradient pass; when the host AdamW is exposed is the
    working set's."""
    accum = cfg.train.grad_accum
    flops = speed.step_flops(model_config, cfg.method, batch_size, seq_len, recompute=True) * accum
    dequant = speed.dequant_bytes(model_config, 3 * accum) if cfg.quant.scheme != "none" else 0.0
    return working_set_of(cfg).modelled_time(cfg, counts, gpu, flops, dequant)
