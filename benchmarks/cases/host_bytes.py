"""Host RAM a parameter: what the host optimizer's layouts hold, engine by engine (issue 30's table).

For Llama-3.1-8B and Qwen2.5-32B, full fine-tuning at 1K tokens, batch 1, bf16 compute: the real
step run on fake tensors (slimtune.planning.estimate, what `slimtune plan` prints), its host RAM and
disk, divided by the model's parameter count. Host RAM counts every tensor the engine allocates on
the host: weights and residuals (or fp32 masters and bf16 shadows), gradient accumulators, moments
unless in files, staging buffers and block inputs. Options per row: the default (split master,
gradients held once in bf16, clipping on), clipping off, moments in files, 8-bit moments (also in
files), the old layout (train.master=fp32), slide's chunk working set (state in RAM, 8-bit, files),
engine chunk, roundpipe. The estimate equals a real CPU run's meter on tiny shapes for every option
(tests/unit/test_host_layouts.py); the figures here are estimates, not runs.
"""

from __future__ import annotations

import time

import torch

from slimtune import presets
from slimtune.engines import settings
from slimtune.planning.estimate import estimate, meta_model

GIB = 2**30
SEQ = 1024
MODELS = ("Llama-3.1-8B", "Qwen2.5-32B")
SLIDE = ["engine=slide", "activations.checkpoint=host"]
CHUNKED = [*SLIDE, "slide.working_set=chunk", "chunk.n_chunks=8"]
OPTIONS = {  # name -> overrides (method=full, precision=bf16, batch 1 for all)
    "slide": SLIDE,
    "slide, clipping off": [*SLIDE, "train.max_grad_norm=0"],
    "slide, slide.moments=disk": [*SLIDE, "slide.moments=disk"],
    "slide, train.moments=8bit": [*SLIDE, "train.moments=8bit"],
    "slide, 8bit + slide.moments=disk": [*SLIDE, "train.moments=8bit", "slide.moments=disk"],
    "slide, train.master=fp32 (the old layout)": [*SLIDE, "train.master=fp32"],
    "chunk on slide, state in RAM": CHUNKED,
    "chunk on slide, state in RAM, 8bit": [*CHUNKED, "train.moments=8bit"],
    "chunk on slide, chunk.state=disk": [*CHUNKED, "chunk.state=disk"],
    "chunk (engine), 8 chunks": ["engine=chunk", "chunk.n_chunks=8", "activations.checkpoint=recompute"],
    "roundpipe (sync)": ["engine=roundpipe"],
}
GOALS = {"slide": 14.2, "slide, clipping off": 12.2, "slide, slide.moments=disk": 6.2,
         "slide, train.moments=8bit": 8.2, "chunk on slide, state in RAM": 8.2}  # Llama-3.1-8B, B/param


def params_of(model_config) -> int:
    return sum(p.numel() for p in meta_model(model_config, torch.bfloat16).parameters())


def row(model: str, model_config, params: int, name: str, overrides: list[str]) -> dict:
    cfg = settings.load(None, ["method=full", "precision=bf16", "train.batch_size=1", *overrides],
                        base={"model": "(benchmark)", "data": "(benchmark)"})
    began = time.perf_counter()
    found = estimate(model_config, cfg, 1, SEQ)
    return {"model": model, "option": name, "overrides": overrides, "params": params,
            "host_bytes": found.host_bytes, "host_gib": found.host_bytes / GIB,
            "host_bytes_per_param": found.host_bytes / params, "disk_bytes": found.disk_bytes,
            "disk_gib": found.disk_bytes / GIB, "device_peak_gib": found.device_peak_bytes / GIB,
            "goal_bytes_per_param": GOALS.get(name) if model == "Llama-3.1-8B" else None,
            "seconds": time.perf_counter() - began}


def run(quick: bool) -> dict:
    rows = []
    for model in MODELS[:1] if quick else MODELS:
        model_config = presets.model_config(model)
        params = params_of(model_config)
        for name, overrides in list(OPTIONS.items())[: 3 if quick else None]:
            rows.append(row(model, model_config, params, name, overrides))
            print(f"{model:14s} {name:44s} {rows[-1]['host_bytes_per_param']:6.2f} B/param", flush=True)
    return {"seq": SEQ, "batch": 1, "precision": "bf16", "kind": "estimate (fake-tensor step)", "rows": rows}
