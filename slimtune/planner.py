"""The planner: every applicable plan (engine plus options), its measured-on-fake-tensors device
peak, its modelled speed on a card, which fit, and the one to run.

A plan is a set of RunConfig overrides. Each engine offers its own candidates and models its
own step time in its registration (engines.EngineSpec.plans, .step_time), so the planner names no
engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from slimtune import config as config_module
from slimtune import engines, estimate, speed
from slimtune.config import RunConfig, to_dict
from slimtune.errors import UserError
from slimtune.metrics import human_bytes

# CUDA context and allocator slack a process holds beyond its tensors (PLATFORM.md: 0.5-1 GiB).
# Assumed: benchmarks/cases/device_checks.py measures it on a GPU (context bytes beside this figure).
CUDA_OVERHEAD_BYTES = 768 * 2**20
# Host RAM a plan may hold for the device (masters, moments, offloaded activations): this share of
# the planning machine's RAM, checked before the device (a plan the host cannot hold never fits).
HOST_RAM_SHARE = 0.9


def host_ram_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class PlanResult:
    engine: str
    options: dict
    estimate: estimate.Estimate
    time: speed.StepTime
    tokens_per_s: float
    fits: bool
    recommended: bool = False
    host_fits: bool = True  # the plan's host RAM fits this machine (fits needs it too)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.options.items())

    def as_json(self) -> dict:
        e = self.estimate
        return {
            "engine": self.engine,
            "options": self.options,
            "device_peak_bytes": e.device_peak_bytes,
            "device_peak_kind": "measured on fake tensors (training meter)",
            "breakdown": e.breakdown,
            "host_bytes": e.host_bytes,
            "disk_bytes": e.disk_bytes,
            "host_link_bytes": e.host_link_bytes,
            "fits": self.fits,
            "host_fits": self.host_fits,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_kind": "modelled",
            "step_s_modelled": self.time.seconds,
            "step_parts_s_modelled": {"compute": self.time.compute_s, "optimizer": self.time.optimizer_s,
                                      "link": self.time.link_s},
            "trainable_params": e.trainable_params,
            "total_params": e.total_params,
            "recommended": self.recommended,
        }


def _run_config(base: RunConfig, plan: dict) -> RunConfig:
    """`base` with the plan's dotted-key settings applied, validated like any run config."""
    return config_module.load(None, [f"{k}={v}" for k, v in plan.items()], base=to_dict(base))


def weigh(model_config, base: RunConfig, plan: dict, gpu, batch_size: int, seq_len: int) -> PlanResult:
    """One plan: its device peak and host bytes on fake tensors, its modelled time on `gpu`, whether it fits."""
    cfg = _run_config(base, plan)
    found = estimate.estimate(model_config, cfg, batch_size, seq_len)
    time = engines.get(cfg.engine).step_time(model_config, cfg, found.counts(), gpu, batch_size, seq_len)
    tokens = batch_size * seq_len * cfg.train.grad_accum
    host_fits = found.host_bytes <= HOST_RAM_SHARE * host_ram_bytes()
    fits = host_fits and found.device_peak_bytes + CUDA_OVERHEAD_BYTES <= gpu.memory_bytes
    options = {k: v for k, v in plan.items() if k != "engine"}
    return PlanResult(plan["engine"], options, found, time, time.tokens_per_s(tokens), fits, host_fits=host_fits)


# Below this many block-widths (layers x hidden) a plan is estimated faster than a worker process starts.
PARALLEL_FROM = 16 * 1024


def _weigh_all(model_config, base: RunConfig, gpu, batch_size: int, seq_len: int) -> list[PlanResult]:
    """Plans are independent: large models are estimated in worker processes, one per core
    (spawned, not forked: a forked torch can hang in its thread pool)."""
    import concurrent.futures
    import multiprocessing
    import os

    jobs = [(model_config, base, p, gpu, batch_size, seq_len) for p in engines.plans_for(base.method)]
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers < 2 or model_config.num_hidden_layers * model_config.hidden_size < PARALLEL_FROM:
        return [weigh(*job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(_weigh_job, jobs))


def _weigh_job(job: tuple) -> PlanResult:
    return weigh(*job)


def plan(model_config, base: RunConfig, gpu, batch_size: int, seq_len: int) -> list[PlanResult]:
    """Every candidate plan for base.method, fastest first; the fastest that fits is recommended."""
    results = _weigh_all(model_config, base, gpu, batch_size, seq_len)
    results.sort(key=lambda r: (-r.tokens_per_s, r.estimate.device_peak_bytes))
    fitting = [r for r in results if r.fits]
    if fitting:
        fitting[0].recommended = True
    return results


def recommended(results: list[PlanResult]) -> PlanResult | None:
    return next((r for r in results if r.recommended), None)


def smallest(results: list[PlanResult]) -> PlanResult:
    return min(results, key=lambda r: r.estimate.device_peak_bytes)


def planning_config(method: str, rank: int = 16, **train) -> RunConfig:
    """A RunConfig for planning a model by preset or folder (no data is read)."""
    base = {"model": "(planned)", "data": "(planned)", "method": method, "lora": {"rank": rank, "alpha": 2 * rank},
            "train": {"batch_size": 1, **train}}
    return config_module.load(None, [], base=base)


def plan_run(cfg: RunConfig, model_config, gpu) -> tuple[list[PlanResult], PlanResult | None]:
    """The run's own method, sequence length and batch, planned for `gpu`; and the recommended plan."""
    results = plan(model_config, cfg, gpu, cfg.train.batch_size, cfg.data.max_length)
    return results, recommended(results)


def no_fit_sentence(results: list[PlanResult], gpu) -> str:
    return f"no plan fits {gpu.name} ({human_bytes(gpu.memory_bytes)}): {_smallest_need(results)}."


def _smallest_need(results: list[PlanResult]) -> str:
    """What the smallest plan needs: device memory, or the host RAM that keeps it from fitting."""
    need = smallest(results)
    device = human_bytes(need.estimate.device_peak_bytes + CUDA_OVERHEAD_BYTES)
    if not need.host_fits:
        return (f"the smallest on the device, {need.engine} {need.label}, needs {device} there but "
                f"{human_bytes(need.estimate.host_bytes)} of host RAM, and this machine has "
                f"{human_bytes(host_ram_bytes())}")
    return f"the smallest, {need.engine} {need.label}, needs {device}; lower train.batch_size or data.max_length"


def apply_recommended(cfg: RunConfig, model_config, gpu) -> tuple[RunConfig, PlanResult]:
    """plan=auto: the run's settings with the recommended plan's engine and options."""
    results, chosen = plan_run(cfg, model_config, gpu)
    if chosen is None:
        raise UserError(no_fit_sentence(results, gpu))
    return _run_config(cfg, {"engine": chosen.engine, **chosen.options}), chosen


# ---------------------------------------------------------------- printing

_COLUMNS = ("weights", "gradients", "optimizer", "activations", "loss", "temporaries")


def table(results: list[PlanResult], title: str, gpu) -> str:
    lines = [title, ""]
    head = ["engine", "options", "device peak", *_COLUMNS, "host RAM", "disk", "link/step", "tokens/s*", "fits"]
    rows = [head]
    for r in results:
        e = r.estimate
        rows.append([
            r.engine, r.label, human_bytes(e.device_peak_bytes),
            *(human_bytes(e.breakdown.get(c, 0)) for c in _COLUMNS),
            human_bytes(e.host_bytes), human_bytes(e.disk_bytes), human_bytes(e.host_link_bytes),
            f"{r.tokens_per_s:,.0f}",
            ("yes" if r.fits else "no" if r.host_fits else "no (host RAM)") + (" <- recommended" if r.recommended else ""),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [
        "",
        "Device peak and its breakdown: the real training step run on fake tensors and counted by the training "
        f"loop's meter. Fits: peak + {human_bytes(CUDA_OVERHEAD_BYTES)} CUDA context (assumed) <= "
        f"{human_bytes(gpu.memory_bytes)}, and host RAM <= {HOST_RAM_SHARE:.0%} of this machine's "
        f"{human_bytes(host_ram_bytes())}.",
        f"* tokens/s is modelled: step FLOPs over {gpu.name}'s spec-sheet rate at {speed.ASSUMED_MFU:.0%} MFU "
        "(assumed), plus optimizer and host-link traffic over its bandwidths.",
    ]
    chosen = recommended(results)
    lines.append(f"recommended: {chosen.engine} {chosen.label}" if chosen else f"no plan fits: {_smallest_need(results)}.")
    return "\n".join(lines)


def to_json(results: list[PlanResult]) -> str:
    return json.dumps([r.as_json() for r in results], indent=2)
