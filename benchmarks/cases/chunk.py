"""Engine chunk (ChunkFT, spec chunkft.md): its device peak and host state on Llama-3.1-8B, the
accuracy it reaches on the demo task against resident full fine-tuning, and its CPU step time.

Part 1, device peak from the estimate (the real step on fake tensors, the training meter; the
heaviest chunk's step, at full depth), Llama-3.1-8B full fine-tuning, batch 1 x 1024, bf16, every
block recomputed, N in {4, 8, 16, 32, 64, 128}, with the loss's default chunk and with 256-token
loss chunks; host RAM with state in RAM and on disk; and N in {4, 8, 16, 32} with the gradient
streamed to the host (chunk.gradients=host). Goal (issue 13): chunk alone <= bf16 weights + 1 GiB. The same working set on slide (slide.working_set=chunk, block inputs in host RAM), N = 8
and 16, state in RAM and on disk: device peak (goal <= 4 GiB) and host RAM a parameter (goals <= 6
bytes with state on disk, <= 8 with state in RAM; today's slide: 16.9).

Part 2, quality: held-out exact-match accuracy on the demo task after equal tokens (the same steps,
data, seed and schedule: constant after 10 warm-up steps) for chunk at N = 1, 4, 16 (per_step lr),
N = 4 per_sweep, and resident full fine-tuning, each at two learning rates (its best is compared).
Goal: within 2 points of resident full fine-tuning. Beside it, N = 4 at four times the steps (each
tensor updated as often as resident's 300 steps update it), at the better lr of the two, and
chunk.switch_every (steps on a chunk before the next) 10, 25, 50 at N = 4 and 5, 10 at N = 16; N = 4
with chunk.gradients=host; and a cosine schedule to zero over the 300 steps (scored at its end:
the schedule is sized by the run's steps) for resident, N = 1, 4, 16 per_step and N = 4, 16
per_sweep, where per_sweep's held lr differs from per_step's by more than the warm-up.

Part 3, the machinery's cost: the median CPU step time of those runs (2 cores, fp32), chunk against
resident, on the same model and batches.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from _accuracy import time_to_accuracy
from slimtune import presets
from slimtune.engines import settings
from slimtune.planning import estimate

GIB = 2**30
SEQ = 1024


def peak_row(model_config, n: int, extra: tuple[str, ...]) -> dict:
    cfg = settings.load(None, ["engine=chunk", "method=full", "precision=bf16", "train.batch_size=1",
                               "activations.checkpoint=recompute", f"chunk.n_chunks={n}", *extra],
                        base={"model": "(benchmark)", "data": "(benchmark)"})
    began = time.perf_counter()
    found = estimate.estimate(model_config, cfg, 1, SEQ)
    weights = found.breakdown["weights"]
    return {"n_chunks": n, "options": list(extra), "device_peak_bytes": found.device_peak_bytes,
            "device_peak_gib": found.device_peak_bytes / GIB, "weights_gib": weights / GIB,
            "beyond_weights_gib": (found.device_peak_bytes - weights) / GIB,
            "breakdown_gib": {k: v / GIB for k, v in found.breakdown.items()},
            "host_ram_gib": found.host_bytes / GIB, "host_link_gib_per_step": found.host_link_bytes / GIB,
            "goal_met": found.device_peak_bytes - weights <= GIB, "seconds": time.perf_counter() - began}


def part1(quick: bool) -> list[dict]:
    model_config = presets.model_config("Llama-3.1-8B")
    rows = []
    for n in (8,) if quick else (4, 8, 16, 32, 64, 128):
        rows.append(peak_row(model_config, n, ()))
        rows.append(peak_row(model_config, n, ("loss.chunk_size=256",)))
    rows.append(peak_row(model_config, 32, ("chunk.state=disk",)))
    for n in (8,) if quick else (4, 8, 16, 32):  # the gradient streamed to the host as backward makes it
        rows.append(peak_row(model_config, n, ("chunk.gradients=host",)))
    rows.append(peak_row(model_config, 4, ("chunk.gradients=host", "chunk.state=disk")))
    return rows


def slide_row(model_config, n: int, state: str) -> dict:
    cfg = settings.load(None, ["engine=slide", "method=full", "precision=bf16", "train.batch_size=1",
                               "activations.checkpoint=host", "slide.working_set=chunk", f"chunk.n_chunks={n}",
                               f"chunk.state={state}"], base={"model": "(benchmark)", "data": "(benchmark)"})
    found = estimate.estimate(model_config, cfg, 1, SEQ)
    per_param = found.host_bytes / found.trainable_params
    return {"n_chunks": n, "state": state, "device_peak_gib": found.device_peak_bytes / GIB,
            "host_ram_gib": found.host_bytes / GIB, "host_bytes_per_param": per_param,
            "disk_gib": found.disk_bytes / GIB, "host_link_gib_per_step": found.host_link_bytes / GIB,
            "device_goal_met": found.device_peak_bytes <= 4 * GIB,
            "host_goal_met": per_param <= (6 if state == "disk" else 8)}


def part1_slide(quick: bool) -> list[dict]:
    model_config = presets.model_config("Llama-3.1-8B")
    return [slide_row(model_config, n, state) for n in ((8,) if quick else (8, 16)) for state in ("disk", "ram")]


def variants(quick: bool) -> dict:
    out = {}
    for lr in (3e-4,) if quick else (3e-4, 1e-3):
        out[f"resident full lr={lr:g}"] = ("resident full", {"method": "full", "engine": "resident", "train": {"lr": lr}})
        for n in (1, 4) if quick else (1, 4, 16):
            out[f"chunk N={n} lr={lr:g}"] = (f"chunk N={n}", {"method": "full", "engine": "chunk", "train": {"lr": lr},
                                                             "chunk": {"n_chunks": n}})
        out[f"chunk N=4 per_sweep lr={lr:g}"] = ("chunk N=4 per_sweep", {
            "method": "full", "engine": "chunk", "train": {"lr": lr},
            "chunk": {"n_chunks": 4, "lr_schedule": "per_sweep"}})
    # The gradient on the host: the same numbers but for the order of fp32 additions; its step time.
    out["chunk N=4 gradients=host lr=0.0003"] = ("chunk N=4 gradients=host", {
        "method": "full", "engine": "chunk", "train": {"lr": 3e-4}, "chunk": {"n_chunks": 4, "gradients": "host"}})
    # A decaying schedule (cosine to zero over the run), where per_sweep differs from per_step by
    # more than the warm-up.
    cosine = {"lr": 3e-4, "schedule": "cosine"}
    out["resident full cosine lr=0.0003"] = ("resident full cosine", {"method": "full", "engine": "resident",
                                                                    "train": cosine})
    for n, mode in ((1, "per_step"), (4, "per_step"), (16, "per_step"), (4, "per_sweep"), (16, "per_sweep")):
        out[f"chunk N={n} {mode} cosine lr=0.0003"] = (f"chunk N={n} {mode} cosine", {
            "method": "full", "engine": "chunk", "train": cosine, "chunk": {"n_chunks": n, "lr_schedule": mode}})
    # Steps on a chunk before the next (the spec's K, default 1), at the better lr: BAdam switches
    # blocks every 50-100 steps.
    for n, ks in ((4, (10, 25, 50)), (16, (5, 10))) if not quick else ((4, (10,)),):
        for k in ks:
            out[f"chunk N={n} switch_every={k} lr=0.0003"] = (f"chunk N={n} switch_every={k}", {
                "method": "full", "engine": "chunk", "train": {"lr": 3e-4},
                "chunk": {"n_chunks": n, "switch_every": k}})
    return out


def part2(quick: bool) -> dict:
    steps, every = (20, 10) if quick else (300, 50)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [{"method": method, **time_to_accuracy(name, variant, steps, every, Path(tmp))}
                for name, (method, variant) in variants(quick).items()]
        fours = [r for r in runs if r["method"] == "chunk N=4"]
        best_lr = max(fours, key=lambda r: max(p["accuracy"] for p in r["curve"]))["settings"]["train"]["lr"]
        longer = {"method": "full", "engine": "chunk", "train": {"lr": best_lr}, "chunk": {"n_chunks": 4}}
        runs.append({"method": "chunk N=4, 4x steps", **time_to_accuracy(
            f"chunk N=4 4x steps lr={best_lr:g}", longer, 4 * steps, 4 * every, Path(tmp))})
    best: dict[str, float] = {}
    median: dict[str, float] = {}
    for r in runs:
        best[r["method"]] = max(best.get(r["method"], 0.0), max(p["accuracy"] for p in r["curve"]))
        median[r["method"]] = min(median.get(r["method"], math.inf), r["median_step_s"])
    reference = best["resident full"]
    return {"task": "slimtune demo (heldout.jsonl, greedy exact match)", "steps": steps,
            "best_accuracy": best, "within_2_points": {m: a >= reference - 0.02 for m, a in best.items()},
            "median_step_s": median,
            "step_time_vs_resident": {m: s / median["resident full"] for m, s in median.items()}, "runs": runs}


def run(quick: bool) -> dict:
    began = time.perf_counter()
    result = {"device_peak_8b": part1(quick), "slide_chunk_8b": part1_slide(quick),
              "quality_and_step_time": part2(quick)}
    result["seconds"] = time.perf_counter() - began
    return result
