"""The planner with engine lsp's plans: how long a cold `slimtune plan --method full` takes now that it
weighs two lsp plans beside resident's and slide's (the plans benchmark's figures predate them), and
whether lsp's estimate by depth equals its fake step at full depth on real presets.

Cold: the CLI in a fresh process with an empty estimate cache, every full fine-tuning plan, batch
1 x 2048, an RTX 4090; the median of three runs per preset. Full depth: both lsp plans
(bf16, and bf16 with block recompute) of each preset at batch 1 x 2048, by depth and at full depth,
every figure compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from slimtune import config, presets
from slimtune.engines import settings
from slimtune.planning import estimate, planner

SEQ = 2048
PRESETS = ("Llama-3.2-1B", "Llama-3.1-8B", "Qwen2.5-7B")
FIELDS = ("device_peak_bytes", "breakdown", "host_bytes", "disk_bytes", "host_link_bytes", "trainable_params",
          "total_params")


def cold_plan(name: str) -> tuple[float, list[dict]]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        began = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "slimtune.cli", "plan", "--model", name, "--gpu", "rtx4090",
                              "--method", "full", "--seq", str(SEQ), "--json"], capture_output=True, text=True,
                             env=env, check=True)
        seconds = time.perf_counter() - began
    return seconds, json.loads(out.stdout)


def full_depth_check(name: str) -> list[dict]:
    model_config = presets.model_config(name)
    base = config.to_dict(planner.planning_config("full"))
    rows = []
    for extra in ([], ["activations.checkpoint=recompute"]):
        cfg = settings.load(None, ["engine=lsp", "precision=bf16", *extra], base=base)
        began = time.perf_counter()
        fast = estimate.estimate(model_config, cfg, 1, SEQ)
        by_depth_s = time.perf_counter() - began
        full = estimate.estimate(model_config, cfg, 1, SEQ, by_depth=False)
        rows.append({"preset": name, "options": extra, "by_depth_s": by_depth_s,
                     "device_peak_gib": fast.device_peak_bytes / 2**30,
                     "equal_to_full_depth": all(getattr(fast, f) == getattr(full, f) for f in FIELDS)})
    return rows


def run(quick: bool) -> dict:
    names = PRESETS[:1] if quick else PRESETS
    cold = []
    for name in names:
        runs = [cold_plan(name) for _ in range(1 if quick else 3)]
        lsp = [p for p in runs[0][1] if p["engine"] == "lsp"] if isinstance(runs[0][1], list) else []
        cold.append({"preset": name, "seconds": [s for s, _ in runs], "median_s": statistics.median(s for s, _ in runs),
                     "plans": len(runs[0][1]) if isinstance(runs[0][1], list) else None, "lsp_plans": len(lsp)})
    checks = [row for name in names[:2] for row in full_depth_check(name)]
    return {"cold_plan_full": cold, "lsp_full_depth": checks}
