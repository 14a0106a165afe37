"""Engine chunk at its defaults (issue 32: a random order each sweep, chunk.switch_every derived from
the run, the backward stopped at the active chunk) against resident full fine-tuning on the demo
task: held-out accuracy and CPU step time.

Part 1, quality: held-out exact-match accuracy (greedy, the demo's 100 held-out prompts) at equal
steps and data, lr 3e-4 (resident's best in the chunk case), constant after 10 warm-up steps:
resident at 300 and 1,600 steps; chunk at its defaults at N = 4 over 300 steps and N = 16 over 1,600
(the goals: within 2 points of resident), the 300-step pair again at seed 1 (data order, random
chunk order and initial state of the run), and beside them N = 16 over 300 steps and N = 4 with the
spec's round robin and K = 1 (the old defaults). A curve is scored along the way by stopping and
resuming the run (resume is exact: tests/unit/test_chunk.py), so its chunk.switch_every is pinned to
what a run of its full length derives (a resumed run of fewer steps would derive a smaller one); one
N = 4 run at the true defaults in a single 300-step fit checks that its final accuracy is the
curve's. Two runs at a time, one thread each.

Part 2, step time: the mean CPU step time (fp32, one torch thread and two) of chunk at N = 4 and 16
against resident on the demo model, the engines stepping in turn on the same batches (so the
machine's load falls on them alike), over one sweep in model order with the same steps on each
chunk (every chunk the same share, as over a defaults run's whole sweeps; the order does not change
a step's cost). Beside it chunk with the backward run to the embedding for every chunk (the engine
before this change: every tensor requiring grad, no block run without autograd), and each chunk's
own mean with its reach.

Part 3, the planner's figure: Llama-3.1-8B full fine-tuning, batch 1 x 1024, bf16, every block
recomputed, N = 4 and 16, gradient on the device and on the host: the estimate (the largest of the
chunks the fake step runs), each of those chunks alone, and the estimate's wall time.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from _accuracy import time_to_accuracy

LR = 3e-4
WORKERS = 2  # quality runs at once, one thread each


def _resident() -> dict:
    return {"method": "full", "engine": "resident", "train": {"lr": LR}}


def _chunk(n: int, steps: int | None = None, **chunk) -> dict:
    """chunk at its defaults; `steps`: the curve's run length, whose derived switch_every is pinned."""
    from slimtune.engines.chunk.state import derived_switch_every
    pinned = {"switch_every": derived_switch_every(steps, n)} if steps else {}
    return {"method": "full", "engine": "chunk", "train": {"lr": LR}, "chunk": {"n_chunks": n, **pinned, **chunk}}


def quality_jobs(quick: bool) -> list[tuple[str, dict, int, int]]:
    short, long = (20, 40) if quick else (300, 1600)
    short_every, long_every = (10, 20) if quick else (50, 400)
    return [
        ("resident full, 300 steps", _resident(), short, short_every),
        ("resident full, 1600 steps", _resident(), long, long_every),
        ("chunk N=4 defaults, 300 steps", _chunk(4, short), short, short_every),
        ("chunk N=16 defaults, 1600 steps", _chunk(16, long), long, long_every),
        ("chunk N=16 defaults, 300 steps", _chunk(16, short), short, short_every),
        ("chunk N=4 round_robin switch_every=1 (old defaults), 300 steps",
         _chunk(4, switch_every=1, order="round_robin", lr_scale=1.0), short, short_every),
        ("chunk N=4 defaults, 300 steps in one fit", _chunk(4), short, short),
        ("resident full, 300 steps, seed 1", _seeded(_resident(), 1), short, short_every),
        ("chunk N=4 defaults, 300 steps, seed 1", _seeded(_chunk(4, short), 1), short, short_every),
    ]


def _seeded(variant: dict, seed: int) -> dict:
    return {**variant, "train": {**variant["train"], "seed": seed}}


def _run_jobs(jobs: list, workers: int) -> list[dict]:
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters: no torch state forked
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(workers, spawn, torch.set_num_threads, (1,)) as pool:
        futures = [pool.submit(time_to_accuracy, *job, Path(tmp)) for job in sorted(jobs, key=lambda j: -j[2])]
        return [f.result() for f in futures]


def part1(quick: bool) -> dict:
    jobs = quality_jobs(quick)
    return scored(jobs, _run_jobs(jobs, WORKERS))


def scored(jobs: list, runs: list[dict]) -> dict:
    """Part 1's figures from its runs: best and final accuracy of each, and the goals."""
    runs = sorted(runs, key=lambda r: [j[0] for j in jobs].index(r["run"]))
    best = {r["run"]: max(p["accuracy"] for p in r["curve"]) for r in runs}
    final = {r["run"]: r["curve"][-1]["accuracy"] for r in runs}
    goals = {}
    for chunk_run, resident_run in (("chunk N=4 defaults, 300 steps", "resident full, 300 steps"),
                                    ("chunk N=4 defaults, 300 steps, seed 1", "resident full, 300 steps, seed 1"),
                                    ("chunk N=16 defaults, 1600 steps", "resident full, 1600 steps")):
        goals[chunk_run] = {"best": best[chunk_run], "residents_best": best[resident_run],
                            "final": final[chunk_run], "residents_final": final[resident_run],
                            "best_within_2_points": best[chunk_run] >= best[resident_run] - 0.02 - 1e-9,
                            "final_within_2_points": final[chunk_run] >= final[resident_run] - 0.02 - 1e-9}
    one_fit = final["chunk N=4 defaults, 300 steps in one fit"] == final["chunk N=4 defaults, 300 steps"]
    return {"task": "slimtune demo (heldout.jsonl, greedy exact match)", "lr": LR, "runs": runs,
            "best_accuracy": best, "final_accuracy": final, "goals": goals,
            "one_fit_equals_the_curves_end": one_fit}


# ---------------------------------------------------------------- part 2: step time


def _build(variant: dict, root: Path):
    import copy

    from slimtune import demo, train
    from slimtune.engines import settings as run_settings
    found = copy.deepcopy(demo.SETTINGS)
    found.update({k: v for k, v in variant.items() if k != "train"})
    found["train"].update(schedule="constant", warmup_steps=10, measure_memory=False, **variant["train"])
    found["output_dir"] = str(root / variant["engine"])
    run = train.build(run_settings.load(None, [], base=found))
    return run, train.batch_stream(run)


def _timed(engine, batch, scope=contextlib.nullcontext) -> float:
    with scope():
        began = time.perf_counter()
        engine.step([batch])
        return time.perf_counter() - began


@contextlib.contextmanager
def _whole_backward():
    """Engine chunk as before the change: every trainable tensor requires grad in every step (so the
    backward runs to the embedding whatever the chunk); its engine also has every reach set to the
    embedding, so no block runs without autograd."""
    from slimtune.engines.chunk import reach
    kept = reach.only_these_require_grad
    reach.only_these_require_grad = lambda params, active: contextlib.nullcontext()
    try:
        yield
    finally:
        reach.only_these_require_grad = kept


def step_times(n: int, per_chunk: int, threads: int, root: Path) -> dict:
    """Resident and chunk (its backward stopped at the active chunk, and run to the embedding as
    before) stepping in turn on the same batches."""
    from slimtune.engines.chunk import reach
    torch.set_num_threads(threads)
    resident, stream = _build(_resident(), root / "resident")
    chunk, _ = _build(_chunk(n, switch_every=per_chunk, order="round_robin"), root / f"chunk{n}")
    full, _ = _build(_chunk(n, switch_every=per_chunk, order="round_robin"), root / f"full{n}")
    full.engine.reaches = [reach.EMBEDDING] * n
    batches = [stream.next_batch() for _ in range(n * per_chunk + 1)]
    times: dict[str, list[float]] = {"resident": [], "chunk": [], "chunk, whole backward": []}
    visited = []
    for i, batch in enumerate(batches):
        k = chunk.engine.state.active
        laps = (_timed(resident.engine, batch), _timed(chunk.engine, batch),
                _timed(full.engine, batch, _whole_backward))
        if i == 0:
            continue  # the first step of each builds what it keeps (host state, caches)
        visited.append(k)
        for name, lap in zip(times, laps):
            times[name].append(lap)
    mean = {name: statistics.fmean(t) for name, t in times.items()}
    by_chunk = {k: {"reach": chunk.engine.reaches[k],
                    "mean_s": statistics.fmean(t for t, v in zip(times["chunk"], visited) if v == k)}
                for k in range(n)}
    return {"n_chunks": n, "torch_threads": threads, "steps_each": len(times["resident"]), "mean_step_s": mean,
            "median_step_s": {name: statistics.median(t) for name, t in times.items()},
            "vs_resident": {name: m / mean["resident"] for name, m in mean.items()}, "by_chunk": by_chunk}


def part2(quick: bool) -> dict:
    steps_per_chunk = {4: 2, 16: 1} if quick else {4: 25, 16: 8}  # 100 and 128 steps of each engine
    goals = {4: 0.75, 16: 0.6}
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [step_times(n, steps_per_chunk[n], t, Path(tmp)) for t in (1, 2) for n in (4, 16)]
    torch.set_num_threads(threads)
    for row in rows:
        row["goal"] = goals[row["n_chunks"]]
        row["goal_met"] = row["vs_resident"]["chunk"] <= row["goal"]
    return {"rows": rows}


# ---------------------------------------------------------------- part 3: the planner's figure at 8B


def estimate_row(model_config, n: int, gradients: str) -> dict:
    """The planner's estimate of chunk's step (the largest of the chunks it runs) and each chunk
    it runs on its own: the same fake step with planned_chunks pinned to one."""
    from slimtune.engines import settings
    from slimtune.engines.chunk.engine import ChunkEngine
    from slimtune.planning import estimate
    cfg = settings.load(None, ["engine=chunk", "method=full", "precision=bf16", "train.batch_size=1",
                               "activations.checkpoint=recompute", f"chunk.n_chunks={n}",
                               f"chunk.gradients={gradients}"], base={"model": "(benchmark)", "data": "(benchmark)"})
    began = time.perf_counter()
    found = estimate.estimate(model_config, cfg, 1, 1024)
    seconds = time.perf_counter() - began
    ran: list[int] = []
    kept = ChunkEngine.planned_chunks

    def noting(engine):
        ran[:] = kept(engine)
        return ran
    ChunkEngine.planned_chunks = noting
    try:
        estimate.estimate(model_config, cfg, 1, 1024)
        each = {}
        for k in list(ran):
            ChunkEngine.planned_chunks = lambda engine, k=k: [k]
            each[k] = estimate.estimate(model_config, cfg, 1, 1024).device_peak_bytes / GIB
    finally:
        ChunkEngine.planned_chunks = kept
    return {"n_chunks": n, "gradients": gradients, "device_peak_gib": found.device_peak_bytes / GIB,
            "breakdown_gib": {k: v / GIB for k, v in found.breakdown.items()}, "chunks_run": ran,
            "each_chunk_gib": each, "estimate_seconds": seconds}


def part3(quick: bool) -> list[dict]:
    from slimtune import presets
    model_config = presets.model_config("Llama-3.2-1B" if quick else "Llama-3.1-8B")
    return [estimate_row(model_config, n, g) for n in ((16,) if quick else (4, 16)) for g in ("host", "device")]


GIB = 2**30


def rerun_chunk_quality(path: Path, why: str, workers: int = 1) -> None:
    """Part 1's chunk runs again (resident's kept: nothing of its run changed), into the result file at
    `path`; the runs they replace are kept under quality["replaced"], with `why`."""
    import datetime
    import json
    import subprocess
    result = json.loads(path.read_text())
    jobs = quality_jobs(quick=False)
    again = [job for job in jobs if job[0].startswith("chunk") and "old defaults" not in job[0]]
    kept = [r for r in result["quality"]["runs"] if r["run"] not in {job[0] for job in again}]
    fresh = _run_jobs(again, workers)
    replaced = [r for r in result["quality"]["runs"] if r not in kept]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    quality = scored(jobs, kept + fresh)
    quality["replaced"] = {"why": why, "runs": replaced, "previous": result["quality"].get("replaced")}
    quality["rerun"] = {"runs": [job[0] for job in again], "commit": head,
                        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")}
    result["quality"] = quality
    path.write_text(json.dumps(result, indent=2) + "\n")


def run(quick: bool) -> dict:
    began = time.perf_counter()
    result = {"step_time": part2(quick), "quality": part1(quick), "estimate_8b": part3(quick)}
    result["seconds"] = time.perf_counter() - began
    return result


if __name__ == "__main__":
    # python benchmarks/cases/chunk_defaults.py rerun-chunk RESULT.json "why": part 1's chunk runs again
    import sys
    if len(sys.argv) != 4 or sys.argv[1] != "rerun-chunk":
        sys.exit('usage: chunk_defaults.py rerun-chunk RESULT.json "why they run again"')
    rerun_chunk_quality(Path(sys.argv[2]), sys.argv[3])
