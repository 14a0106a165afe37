"""Engine lsp's first projector fit alone on the real SmolLM2-135M at the default d (issue 32 item 3's
goal: "lsp first fit, SmolLM2-135M full fine-tuning, 2 idle cores: <= 60 s, with progress").

The run is lsp_fit's `fit_with_progress` (one training step with the bar on; the first fit is the
step's lsp_check_s, and its CPU seconds lsp_check_cpu_s), here at one and at two torch threads,
alternating (1, 2, 1, 2), with the 1-minute load read before and after each: the goal is on two idle
cores, and on shared cores two threads can be far slower than one (a parallel region waits for a
descheduled partner), so the load says which figures count. With one thread the CPU seconds are what
an idle core would take, near enough (the process waits less, but its caches are shared); with two
they add up both threads' spinning too. Also recorded: the fit's Adam steps (the same at every thread count: the fit's
arithmetic does not depend on it beyond rounding), e(G) after the fit, and the bar's first lines.

    python benchmarks/run.py lsp_first_fit    # ~10 minutes on 2 cores (4 runs of ~2.5 minutes)
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from lsp_fit import fit_with_progress, word_task  # benchmarks/cases/ is on the path (run.py)

THREADS = (1, 2, 1, 2)


def run(quick: bool) -> dict:
    began = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = word_task(root)
        for index, threads in enumerate(THREADS[:2] if quick else THREADS):
            torch.set_num_threads(threads)
            load = os.getloadavg()[0]
            result = fit_with_progress(data, root / f"run{index}")
            result.update({"threads": threads, "load_1min_before": load})
            print(f"threads {threads}: first fit {result['first_fit_s']:.1f} s, {result['first_fit_cpu_s']:.1f} CPU s "
                  f"(load {load:.2f} -> {result['load_1min']:.2f})", flush=True)
            runs.append(result)
    best = {t: min(r["first_fit_s"] for r in runs if r["threads"] == t) for t in sorted(set(THREADS))}
    best_cpu = {t: min(r["first_fit_cpu_s"] for r in runs if r["threads"] == t) for t in sorted(set(THREADS))}
    return {"model": "SmolLM2-135M-Instruct (scripts/make_smollm2.py), full fine-tuning, engine lsp at its defaults",
            "task": "lsp_fit's word task (3,000 generated, seed 0), batch 8 x 32 tokens, fp32",
            "runs": runs, "best_first_fit_s_by_threads": best, "best_first_fit_cpu_s_by_threads": best_cpu,
            "goal_first_fit_s": 60,
            "wall_s": time.perf_counter() - began}
