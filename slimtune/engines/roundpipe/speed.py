"""Engine roundpipe's modelled step time: device/speed.py's parts composed for workers that share
the step, every backward stage recomputed, and a host AdamW whose exposure is the optimizer
variant's (optimizer.py)."""

from __future__ import annotations

from slimtune.config import RunConfig
from slimtune.device import speed
from slimtune.engines.roundpipe.optimizer import variant_of


def step_time(model_config, cfg: RunConfig, counts: speed.StepCounts, gpu, batch_size: int,
              seq_len: int) -> speed.StepTime:
    """Modelled for the given card count: the step's FLOPs (every backward stage recomputed) shared
    by the workers, the weights crossing each worker's link (the estimate's bytes, spread over the
    workers), and the host AdamW: hidden behind the next step when async, exposed when sync."""
    workers = _worker_count(cfg)
    accum = cfg.train.grad_accum
    flops = speed.step_flops(model_config, cfg.method, batch_size, seq_len, recompute=True) * accum / workers
    return speed.overlapped_step_time(flops, counts.trainable_params, gpu, cfg.precision,
                                      counts.host_link_bytes / workers, 0.0,
                                      updates_exposed=variant_of(cfg).updates_exposed)


def _worker_count(cfg: RunConfig) -> int:
    workers = cfg.section("roundpipe").workers
    return len(workers) if isinstance(workers, list) else workers
