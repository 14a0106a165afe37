"""How long `slimtune plan --model M --gpu 24GiB --max-seq --method lora` takes with a cold estimate
cache (issue 31's goal: any preset in 30 s on 2 cores), for every model preset (Llama-3.2-1B first).
(Full fine-tuning is left out here: its plans include engine chunk and slide's chunk working set,
whose estimates run the whole depth, and lsp's; benchmarks/docs/max_seq_time.md gives their cost.)

Each command runs as a user runs it (a fresh process, its planning worker beside it), with
XDG_CACHE_HOME pointed at an empty folder: every estimate is computed. Recorded per command: wall
seconds, the CPU seconds of the process and its worker (user + system, from the children's rusage),
the estimates it computed (files in the cache folder), the load average before and after (the 2 cores
are shared), and the printed table (its max seq column is what must not change). --quick: 1B LoRA.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slimtune import presets

MODELS = tuple(presets.preset_names())
METHODS = ("lora",)
GOAL_S = 30


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_one(model: str, method: str, host_ram: str | None = None) -> dict:
    """One cold `plan --max-seq`; a model this host cannot load (70B: the planner refuses at once) is
    planned again for a host with HOST_RAM_FOR_LARGE, as its user would ask."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        command = [sys.executable, "-m", "slimtune.cli", "plan", "--model", model, "--gpu", "24GiB", "--max-seq",
                   "--method", method, *(["--host-ram", host_ram] if host_ram else [])]
        load_before, cpu_before, began = os.getloadavg(), _cpu_seconds(), time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - began, _cpu_seconds() - cpu_before
        estimates = len(list((Path(cache) / "slimtune" / "estimates").glob("*.json")))
    if done.returncode != 0:
        if host_ram is None and "host" in done.stderr:
            return time_one(model, method, HOST_RAM_FOR_LARGE)
        raise RuntimeError(f"{model}: {done.stderr.strip()[-500:]}")
    return {"model": model, "method": method, "host_ram": host_ram or "this machine's", "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "estimates": estimates, "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()], "within_goal": wall <= GOAL_S,
            "table": done.stdout}


HOST_RAM_FOR_LARGE = "256GiB"


def run(quick: bool) -> dict:
    pairs = [(MODELS[0], "lora")] if quick else [(m, x) for x in METHODS for m in MODELS]
    rows = []
    for model, method in pairs:
        rows.append(time_one(model, method))
        print(f"{model} {method}: {rows[-1]['wall_s']} s wall, {rows[-1]['cpu_s']} s CPU, "
              f"{rows[-1]['estimates']} estimates, load {rows[-1]['load_before'][0]}", flush=True)
    return {"goal_wall_s": GOAL_S, "gpu": "24GiB", "cores": os.cpu_count(), "rows": rows}
