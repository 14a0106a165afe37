"""Engine roundpipe on the CPU with 1-4 worker threads: the same steps as resident full fine-tuning
(fp32, a 7M-parameter Llama: hidden 256, 4 blocks, vocabulary 8000, batch 8 x 256), the largest
loss and weight differences, the median step time against resident's (the machinery's cost:
threads, replicas, host hand-offs and the host AdamW on 2 cores), the bytes across the host link a
step and each worker's measured peak (live tensor bytes). Async also with each step handed the next
one's batches (then=, as train.fit does: the next step's first jobs start while this one drains),
against async step by step.

    python benchmarks/run.py roundpipe_cpu     # ~3 minutes on 2 cores
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from slimtune.engines import settings
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.engines.resident import ResidentEngine
from slimtune.engines.roundpipe.engine import RoundPipeEngine
from slimtune.model.stack import Stack

STEPS = 6


def model_and_batch(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=8000, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    rows, seq = (4, 64) if quick else (8, 256)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8000, (rows, seq), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    return model, Batch(ids, targets, torch.arange(seq).expand(rows, seq).clone())


def cfg_for(overrides: dict):
    base = {"model": "(bench)", "data": "(bench)", "output_dir": "/tmp/slimtune-bench", "method": "full",
            "precision": "fp32", "train": {"lr": 1e-3, "batch_size": 8, "max_grad_norm": 1.0}}
    return settings.load(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


def steps(engine_class, model, batch, cfg, early: bool = False):
    """STEPS steps (`early`: each handed the next one's batches); the engine, their results, the
    times after the first, and the jobs and tail shards of the cut the last step ran with
    (roundpipe re-plans after every step)."""
    engine = engine_class(Stack(copy.deepcopy(model)), cfg, torch.device("cpu"), "fp32")
    results, times, stages = [], [], None
    for k in range(STEPS):
        dispatching_last = k == STEPS - (2 if early else 1)  # an early step is cut one call before its own
        if hasattr(engine, "partition") and dispatching_last:
            stages = (len(engine.partition.stages()), engine.partition.tail.shards)
        began = time.perf_counter()
        then = {"then": ([batch], None)} if early and k + 1 < STEPS else {}
        results.append(engine.step([batch], **then))
        times.append(time.perf_counter() - began)
    return engine, results, times[1:], stages


def run(quick: bool) -> dict:
    model, batch = model_and_batch(quick)
    resident, expected, resident_times, _ = steps(ResidentEngine, model, batch, cfg_for({}))
    weights = {n: p.detach().clone() for n, p in resident.stack.model.named_parameters()}
    base_s = statistics.median(resident_times)
    rows = []
    for workers in (1, 2, 3, 4):
        step_by_step = None
        for optimizer, early in (("sync", False), ("async", False), ("async", True)):
            cfg = cfg_for({"engine": "roundpipe", "roundpipe.workers": workers, "roundpipe.optimizer": optimizer})
            engine, found, times, stages = steps(RoundPipeEngine, model, batch, cfg, early)
            state = engine.trainable_state()
            row = {"workers": workers, "optimizer": optimizer, "next_step_early": early, "micro_batches": workers + 1,
                   "stages": stages[0], "tail_shards": stages[1],  # of the last step's cut (jobs a step)
                   "max_loss_diff": max(abs(a.loss - b.loss) for a, b in zip(found, expected)),
                   "max_weight_diff": max((state[n] - w).abs().max().item() for n, w in weights.items()),
                   "median_step_s": statistics.median(times), "over_resident": statistics.median(times) / base_s,
                   "mean_step_s": statistics.mean(times),
                   "host_link_bytes": found[-1].host_link_bytes,
                   "worker_peaks": {k: int(v) for k, v in found[-1].extras.items()}}
            if optimizer == "async" and not early:
                step_by_step = (found, state)
            elif early:  # the same computation: only the reduction order of CPU kernels may differ
                row["max_loss_diff_vs_step_by_step"] = max(abs(a.loss - b.loss) for a, b in zip(found, step_by_step[0]))
                row["max_weight_diff_vs_step_by_step"] = max((state[n] - w).abs().max().item()
                                                             for n, w in step_by_step[1].items())
            rows.append(row)
            print(f"{workers} workers {optimizer}{' early' if early else ''}: loss diff {row['max_loss_diff']:.2e}, weight diff "
                  f"{row['max_weight_diff']:.2e}, {row['median_step_s']:.3f} s ({row['over_resident']:.2f}x)",
                  flush=True)
    return {"model": "Llama, hidden 256, 4 blocks, vocab 8000 (7M)", "batch": list(batch.input_ids.shape),
            "steps": STEPS, "resident_median_step_s": base_s, "resident_peak_bytes": expected[-1].device_peak_bytes,
            "runs": rows}
