"""The planner on every preset: how long `slimtune plan` takes a user (cold: the CLI in a fresh
process with an empty estimate cache, every plan of the method; the median of three such runs),
whether its bytes equal the fake step at full depth (every plan, by_depth=False; two processes,
after the timings), and what fits at 24 GiB and 8 GiB; and an outside reference: the plain Hugging
Face step for Llama-3-8B at seq 1024, batch 1, counted by the same meter.

Every device figure is the real step run on fake tensors (slimtune.planning.estimate) and counted by
the training loop's meter; every tokens/s is modelled (slimtune.device.speed) on the generic card
of each size (the RTX 4090's spec-sheet rates).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from slimtune import config, presets
from slimtune.engines import settings
from slimtune.planning import estimate, planner
from slimtune.planning.estimate import fake_model, make_fake, meta_model, synthetic_batch
from slimtune.device.memory import LiveBytesMeter

SEQ, BATCH = 2048, 1
SIZES = ("24GiB", "8GiB")
COLD_RUNS = 3  # run-to-run noise on a shared 2-core machine is about 10%: the median of three is reported
REFERENCE = dict(preset="Llama-3.1-8B", seq=1024, batch=1)


def _at_size(results: list[dict], size: str) -> list[dict]:
    """The same plans judged for a card of another size: the estimates do not depend on the card,
    and both sizes use the same generic rates, so only fits and the recommendation change."""
    memory = presets.gpu_profile(size).memory_bytes
    judged = [dict(r, fits=r["host_fits"] and r["device_peak_bytes"] + planner.CUDA_OVERHEAD_BYTES <= memory,
                   recommended=False) for r in results]
    fitting = [r for r in judged if r["fits"]]
    if fitting:
        fitting[0]["recommended"] = True  # plans arrive fastest first
    return judged


def preset_rows(names: list[str]) -> list[dict]:
    """Cold plan times first, one at a time with the machine to themselves (they are timings); then
    the full-depth checks, which are not timed against a goal, on both cores."""
    methods = ("lora", "full")
    cold = {}
    for name in names:
        for method in methods:
            runs = [cold_plan(name, method) for _ in range(COLD_RUNS)]
            assert all(plans == runs[0][1] for _, plans in runs), "a cold plan answered differently"
            cold[name, method] = ([seconds for seconds, _ in runs], runs[0][1])
            print(f"{name} {method}: plan {' / '.join(f'{s:.1f}' for s, _ in runs)} s cold", flush=True)
    refused = {key: plans for key, (_, plans) in cold.items() if isinstance(plans, str)}
    for (name, method), sentence in refused.items():
        print(f"{name} {method}: refused on this machine: {sentence}", flush=True)
    jobs = [(name, method, found) for (name, method), (_, plans) in cold.items() if (name, method) not in refused
            for found in plans]
    checker = _importable_self()
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        deepest_first = sorted(range(len(jobs)), key=lambda i: -presets.model_config(jobs[i][0]).num_hidden_layers)
        futures = {i: pool.submit(checker.full_depth_check, *jobs[i]) for i in deepest_first}
        checks = [futures[i].result() for i in range(len(jobs))]
    rows = []
    for (name, method), (seconds, plans) in cold.items():
        if (name, method) in refused:
            rows.append({"preset": name, "method": method, "cold_plan_seconds": statistics.median(seconds),
                         "cold_plan_seconds_runs": seconds, "refused": plans, "equal_to_full_depth": None,
                         "full_depth": []})
            continue
        mine = [c for (n, m, _), c in zip(jobs, checks) if (n, m) == (name, method)]
        rows.append({"preset": name, "method": method, "cold_plan_seconds": statistics.median(seconds),
                     "cold_plan_seconds_runs": seconds,
                     "equal_to_full_depth": all(c["equal"] for c in mine), "full_depth": mine,
                     **{size: _at_size(plans, size) for size in SIZES}})
        print(f"{name} {method}: full depth equal: {rows[-1]['equal_to_full_depth']} "
              f"({sum(c['full_depth_seconds'] for c in mine):.0f} s)", flush=True)
    return rows


def _importable_self():
    """This module under a name a spawned process can import (run.py loads cases by file path)."""
    benchmarks = str(Path(__file__).resolve().parent.parent)
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)  # a spawned process starts with this sys.path
    return importlib.import_module("cases.plans")


def cold_plan(name: str, method: str) -> tuple[float, list[dict] | str]:
    """`slimtune plan --json` as a user runs it: a new process, no cached estimate. Returns its wall
    time and its plans, or the planner's refusal (exit 2: a model whose weights fit neither this
    machine's RAM nor the card, which every engine loads them into whole) as its sentence."""
    with tempfile.TemporaryDirectory(prefix="slimtune-cache-") as cache:
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "slimtune.cli", "plan", "--model", name, "--gpu", SIZES[0],
                               "--seq", str(SEQ), "--batch", str(BATCH), "--method", method, "--json"],
                              capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": cache})
        seconds = time.perf_counter() - began
        if done.returncode == 2 and done.stderr.startswith("slimtune: error: "):
            return seconds, done.stderr.strip().splitlines()[-1].removeprefix("slimtune: error: ")
        if done.returncode != 0:
            raise SystemExit(f"slimtune plan --model {name} --method {method} failed ({done.returncode}): "
                             f"{done.stderr.strip()[-2000:]}")
        return seconds, json.loads(done.stdout)


def full_depth_check(name: str, method: str, found: dict) -> dict:
    """One plan's figures against the fake step at full depth (no extrapolation)."""
    model_config, base = presets.model_config(name), config.to_dict(planner.planning_config(method))
    cfg = settings.load(None, [f"{k}={v}" for k, v in {"engine": found["engine"], **found["options"]}.items()],
                        base=base)
    began = time.perf_counter()
    full = estimate.estimate(model_config, cfg, BATCH, SEQ, by_depth=False)
    same = (full.device_peak_bytes, full.breakdown, full.host_bytes, full.disk_bytes, full.host_link_bytes) == (
        found["device_peak_bytes"], found["breakdown"], found["host_bytes"], found["disk_bytes"],
        found["host_link_bytes"])
    return {"engine": found["engine"], "options": found["options"], "equal": same,
            "full_depth_peak_bytes": full.device_peak_bytes,
            "full_depth_seconds": time.perf_counter() - began}


def _hf_step(model: nn.Module, params: list[nn.Parameter], batch, mode) -> int:
    """Device peak of step 2 of a plain HF step: model(labels=...) loss, backward, fused AdamW."""
    with mode:
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
        ids = mode.from_tensor(batch.input_ids)
        peak = 0
        for _ in range(2):  # the second step: torch's AdamW makes its state in the first
            meter = LiveBytesMeter("cpu")
            meter.track(model.parameters(), "weights")
            meter.track((p.grad for p in params), "gradients")
            for state in optimizer.state.values():
                meter.track((v for v in state.values() if isinstance(v, torch.Tensor)), "optimizer")
            with meter:
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            meter.close()
            peak = meter.peak
    return peak


def hf_reference() -> dict:
    """Full fine-tuning in bf16 with fused AdamW, and LoRA r16 on every projection via peft over a
    bf16 base: the two figures PLATFORM.md quotes (about 60 and 26 GiB)."""
    from peft import LoraConfig, get_peft_model
    from torch._subclasses.fake_tensor import FakeTensorMode

    model_config = presets.model_config(REFERENCE["preset"])
    batch = synthetic_batch(REFERENCE["batch"], REFERENCE["seq"], model_config.vocab_size)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    full = fake_model(model_config, torch.bfloat16, mode)
    full_peak = _hf_step(full, list(full.parameters()), batch, mode)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # peft moves its new layers with Module.to(), which fake parameters refuse: wrap on meta first.
    lora = get_peft_model(meta_model(model_config, torch.bfloat16), LoraConfig(r=16, lora_alpha=32,
                                                                               target_modules=targets))
    make_fake(lora, mode)
    lora_peak = _hf_step(lora, [p for p in lora.parameters() if p.requires_grad], batch, mode)
    ours = {}
    for method in ("full", "lora"):
        results = planner.plan(model_config, planner.planning_config(method), planner.Machine.named("80GiB"),
                               REFERENCE["batch"], REFERENCE["seq"])
        ours[method] = [r.as_json() for r in results]
    return {**REFERENCE, "hf_full_bf16_fused_adamw_bytes": full_peak, "hf_peft_lora_r16_bf16_base_bytes": lora_peak,
            "slimtune": ours}


def run(quick: bool) -> dict:
    names = ["Qwen2.5-0.5B", "Llama-3.2-1B"] if quick else sorted(presets.preset_names())
    rows = preset_rows(names)
    return {"seq": SEQ, "batch": BATCH, "sizes": SIZES, "cold_plan_goal_seconds": 10,
            "cold_runs": COLD_RUNS, "slowest_cold_plan_seconds": max(r["cold_plan_seconds"] for r in rows),
            "slowest_single_cold_plan_seconds": max(max(r["cold_plan_seconds_runs"]) for r in rows),
            "every_plan_equal_to_full_depth": all(r["equal_to_full_depth"] for r in rows if "refused" not in r),
            "presets": rows, "reference": hf_reference()}
