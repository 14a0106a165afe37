"""Engine slide: what it needs on the device and the host, and what its machinery costs.

Part 1: the device peak of the real slide step run on fake tensors (slimtune.planning.estimate, the
training meter) for Llama-3.1-8B, Qwen2.5-7B and Qwen2.5-14B at 1K and 4K tokens, batch 1, full
fine-tuning, bf16 compute with fp32 master weights and fp32 AdamW moments on the host, clipping on,
block inputs in host RAM; with the host RAM it holds (masters, gradient accumulators, moments, bf16
shadows, staging, block inputs: counted from the tensors it allocates) and the bytes it moves
across the host link per step (counted by Link in slimtune/device/runtime.py and the store). Beside it, the resident
engine's estimate for the same run. Goal: Llama-3.1-8B at 1K tokens in <= 4 GiB of device memory.

Part 2: a scaled-down model run for real on the CPU (Llama-3.2-1B shapes with 4 blocks, T=256,
fp32, one micro-batch): the CPU meter's device peak beside the fake-tensor estimate, and the step
time of slide against resident (median of 3 steps after one warm-up; the CPU is both host and
device here, so this is the machinery's overhead, not a GPU's overlap).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from slimtune import assembly, presets
from slimtune.engines import settings
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.planning.estimate import estimate

GIB = 2**30
MODELS = ("Llama-3.1-8B", "Qwen2.5-7B", "Qwen2.5-14B")
LENGTHS = (1024, 4096)
GOAL = dict(model="Llama-3.1-8B", seq=1024, gib=4.0)


def run_config(engine: str, precision: str = "bf16"):
    return settings.load(None, [f"engine={engine}", "method=full", f"precision={precision}",
                                "train.batch_size=1", "activations.checkpoint=host" if engine == "slide" else
                                "activations.checkpoint=none"],
                         base={"model": "(benchmark)", "data": "(benchmark)"})


def estimated(model_config, engine: str, seq: int) -> dict:
    began = time.perf_counter()
    found = estimate(model_config, run_config(engine), 1, seq)
    return {"engine": engine, "device_peak_bytes": found.device_peak_bytes,
            "device_peak_gib": found.device_peak_bytes / GIB, "breakdown_bytes": found.breakdown,
            "host_bytes": found.host_bytes, "host_gib": found.host_bytes / GIB,
            "host_link_bytes": found.host_link_bytes, "host_link_gib": found.host_link_bytes / GIB,
            "trainable_params": found.trainable_params, "seconds": time.perf_counter() - began}


def part1(quick: bool) -> list[dict]:
    rows = []
    for name in MODELS[:1] if quick else MODELS:
        model_config = presets.model_config(name)
        for seq in LENGTHS:
            for engine in ("slide", "resident"):
                row = {"model": name, "seq": seq, **estimated(model_config, engine, seq)}
                rows.append(row)
                print(f"{name} T={seq} {engine}: device {row['device_peak_gib']:.2f} GiB, host {row['host_gib']:.1f}"
                      f" GiB, link {row['host_link_gib']:.1f} GiB/step [{row['seconds']:.0f} s]", flush=True)
    return rows


def scaled_model(layers: int = 4):
    from transformers import AutoModelForCausalLM

    model_config = presets.model_config("Llama-3.2-1B")
    model_config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    return model_config, model


def one_batch(vocab: int, seq: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    return Batch(ids, targets, torch.arange(seq).unsqueeze(0))


def timed_steps(engine, batch: Batch, steps: int = 3) -> tuple[list[float], object]:
    engine.step([batch])  # warm-up (creates optimizer state in resident)
    times, result = [], None
    for _ in range(steps):
        began = time.perf_counter()
        result = engine.step([batch])
        times.append(time.perf_counter() - began)
    return times, result


def part2(seq: int = 256) -> dict:
    model_config, model = scaled_model()
    batch = one_batch(model_config.vocab_size, seq)
    rows = {}
    cpu = torch.device("cpu")
    for engine_name in ("slide", "resident"):
        cfg = run_config(engine_name, "fp32")
        found = estimate(model_config, cfg, 1, seq, batch=batch)
        engine = assembly.assemble(cfg, assembly.stack_of(copy.deepcopy(model), cfg, cpu, "fp32"), cpu, "fp32")
        times, result = timed_steps(engine, batch)
        rows[engine_name] = {
            "measured_device_peak_bytes": result.device_peak_bytes, "estimate_device_peak_bytes": found.device_peak_bytes,
            "difference_bytes": result.device_peak_bytes - found.device_peak_bytes,
            "host_bytes": result.host_peak_bytes, "host_link_bytes_per_step": result.host_link_bytes,
            "step_seconds": times, "median_step_seconds": statistics.median(times), "loss": result.loss,
        }
        print(f"scaled {engine_name}: measured {result.device_peak_bytes / GIB:.3f} GiB, estimate "
              f"{found.device_peak_bytes / GIB:.3f} GiB, step {statistics.median(times):.2f} s, link "
              f"{result.host_link_bytes / GIB:.2f} GiB", flush=True)
    rows["slide_over_resident_time"] = rows["slide"]["median_step_seconds"] / rows["resident"]["median_step_seconds"]
    return {"model": "Llama-3.2-1B shapes, 4 blocks", "seq": seq, "precision": "fp32", **rows}


def run(quick: bool) -> dict:
    began = time.perf_counter()
    p1 = part1(quick)
    goal_row = next(r for r in p1 if r["model"] == GOAL["model"] and r["seq"] == GOAL["seq"] and r["engine"] == "slide")
    p2 = part2()
    return {
        "setting": "full fine-tuning, batch 1, bf16 compute, fp32 masters and AdamW on the host, clipping on",
        "units": "GiB = 2**30 bytes", "estimates": p1,
        "goal": {**GOAL, "device_peak_gib": goal_row["device_peak_gib"], "met": goal_row["device_peak_gib"] <= GOAL["gib"]},
        "scaled_cpu": p2, "seconds": time.perf_counter() - began,
    }
