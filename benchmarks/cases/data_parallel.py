"""Data parallelism on the CPU: the demo's LoRA run on 1 and 2 processes (`slimtune train --nproc`),
and the bytes each engine sums across ranks per step.

Scaling. The demo's settings (LoRA r=16 on every linear of the bundled base model, batch 16 x 64
tokens), the same global batch both ways: one process with train.grad_accum=2, and two with 1 each.
Reported: the steady tokens/s of the whole job (seen tokens over step time after step 1, from
metrics.jsonl), the wall time, the final loss of each, and the all-reduce bytes a rank logged per
step. The machine has 2 cores: two processes share them (OMP_NUM_THREADS=1 each), so this records
the machinery's cost and overlap on this box (one process gets both cores, two get one each), not a
speed-up to expect on two GPUs.

Payload per engine. Each engine's step on a 7M-parameter Llama (hidden 256, 4 blocks, vocabulary
8000; fp32), run with Counting (slimtune/dist/ranks.py): the bytes it hands to its all-reduces per
step, on the real code path, beside the trained parameters' bytes (what a plain DDP would send). lsp's is d x d
per projected matrix.

    python benchmarks/run.py data_parallel      # ~4 minutes on 2 cores
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from slimtune import assembly
from slimtune.dist import ranks as distributed
from slimtune.demo import SETTINGS

STEPS = 30


def _demo_run(folder: Path, nproc: int, steps: int) -> dict:
    """The demo's settings through the CLI on `nproc` processes; what metrics.jsonl says."""
    import yaml

    settings = copy.deepcopy(SETTINGS)
    settings["train"].update(steps=steps, log_every=1, eval_every=0, grad_accum=2 // nproc, save_every=0)
    settings["output_dir"] = str(folder / f"nproc{nproc}")
    (folder / "run.yaml").write_text(yaml.safe_dump(settings))
    began = time.perf_counter()
    command = [sys.executable, "-m", "slimtune", "train", str(folder / "run.yaml"), "--no-progress"]
    command += ["--nproc", str(nproc)] if nproc > 1 else []
    # One process uses both cores; two get one each (what --nproc sets: the cores shared out).
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    records = [json.loads(line) for line in (Path(settings["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:]
    return {
        "processes": nproc,
        "global_batch_rows": settings["train"]["batch_size"] * settings["train"]["grad_accum"] * nproc,
        "tokens_per_s": sum(r["seen_tokens"] for r in steady) / sum(r["step_s"] for r in steady),
        "median_step_s": sorted(r["step_s"] for r in steady)[len(steady) // 2],
        "wall_s": wall,
        "final_loss": records[-1]["loss"],
        "allreduce_bytes_per_step": records[-1].get("allreduce_bytes", 0),
    }


def _small_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=8000, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


ENGINES = {
    "resident full": dict(engine="resident", method="full"),
    "resident lora r=16": dict(engine="resident", method="lora"),
    "slide full": dict(engine="slide", method="full"),
    "slide full, chunk working set (4 chunks)": dict(engine="slide", method="full",
                                                     overrides=["slide.working_set=chunk", "chunk.n_chunks=4"]),
    "lsp full (d=64)": dict(engine="lsp", method="full", overrides=["lsp.d=64", "train.weight_decay=0"]),
    "chunk full (4 chunks)": dict(engine="chunk", method="full", overrides=["chunk.n_chunks=4"]),
    "roundpipe full (2 workers)": dict(engine="roundpipe", method="full", overrides=["roundpipe.workers=2"]),
}


def _payloads(quick: bool) -> list[dict]:
    from slimtune.engines import settings
    from slimtune.data.dataset import IGNORE_INDEX, Batch

    model = _small_model()
    rows, seq = (2, 32) if quick else (4, 128)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8000, (rows, seq), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    batch = Batch(ids, targets, torch.arange(seq).expand(rows, seq).clone())
    out = []
    for label, plan in ENGINES.items():
        base = {"model": "(benchmark)", "data": "(benchmark)", "method": plan["method"], "engine": plan["engine"],
                "precision": "fp32", "train": {"batch_size": rows, "steps": 4, "max_grad_norm": 1.0}}
        cfg = settings.load(None, plan.get("overrides", []), base=base)
        counting = distributed.Counting()
        stack = assembly.stack_of(copy.deepcopy(model), cfg, torch.device("cpu"), "fp32")
        engine = assembly.assemble(cfg, stack, torch.device("cpu"), "fp32", counting)
        if hasattr(engine, "use_sample"):
            engine.use_sample([batch])
        engine.step([batch])
        counting.take_reduced_bytes()  # the first step (an lsp fit) counted apart
        engine.step([batch])
        trained = sum(p.numel() for p in stack.model.parameters() if p.requires_grad)
        trained = getattr(engine, "trained_numel", lambda: trained)()
        payload = counting.take_reduced_bytes()
        out.append({"engine": label, "allreduce_bytes_per_step": payload, "trained_params": trained,
                    "trained_param_bytes_fp32": 4 * trained, "ratio_to_trained_bytes": payload / (4 * trained)})
        if plan["engine"] == "lsp":
            out[-1]["sum_d_squared_x4"] = sum(4 * m.d ** 2 for m in engine.modules)
            out[-1]["other_trained_bytes"] = 4 * sum(p.numel() for _, p in engine.others)
    whole = next(p["allreduce_bytes_per_step"] for p in out if p["engine"] == "resident full")
    for p in out:
        p["ratio_to_resident_full"] = p["allreduce_bytes_per_step"] / whole
    return out


def run(quick: bool) -> dict:
    steps = 6 if quick else STEPS
    with tempfile.TemporaryDirectory() as folder:
        scaling = [_demo_run(Path(folder), nproc, steps) for nproc in (1, 2)]
    return {
        "case": "data_parallel",
        "note": "CPU, 2 cores shared by the processes (gloo); speed figures measured, not a GPU forecast",
        "scaling_demo_lora": scaling,
        "speed_ratio_2_over_1": scaling[1]["tokens_per_s"] / scaling[0]["tokens_per_s"],
        "payload_by_engine": _payloads(quick),
    }
