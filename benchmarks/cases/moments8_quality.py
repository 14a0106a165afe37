"""8-bit AdamW moments against fp32 moments: held-out exact match at equal steps (issue 30, goal:
"on the demo task and on the real SmolLM2-135M, held-out exact match within 1 point of fp32 moments
at equal steps, full fine-tuning with slide").

Every run is engine=slide, method=full, precision=fp32 (this CPU's fast dtype: bf16 matmuls run 7-140x
slower here, PLATFORM.md; train.moments acts on the host AdamW whatever the compute dtype, and the
split master, which needs bf16, is not part of this question). A pair of runs differs only in
train.moments (fp32 | 8bit): the same seed, data order, steps and schedule. 8-bit moments here are
blockwise dynamic codes for every number, the norms' vectors included (bitsandbytes' AdamW8bit keeps
tensors under 4096 numbers in fp32; slimtune codes them all), so this is the stricter setting.

Part 1, the demo task (slimtune/demo: the bundled 2M-parameter base model, calculator notation
"9 + 13 =" -> " 22"), the demo's settings (batch 16 x 64 tokens, 5% of train.jsonl kept for eval
loss, 10 warm-up steps, cosine to zero over 500 steps) with full fine-tuning's learning rates 3e-4
and 1e-3 (the demo's 2e-3 is a LoRA rate), seeds 0, 1 and 2 (data order): held-out exact match
(heldout.jsonl, 100 prompts, greedy) at the end, eval loss every 100 steps. Beside it, curves at a
constant rate after the warm-up (as the cases chunk and lsp train it), lr 3e-4, seeds 0 and 1,
scored every 50 steps to 300 (each stop a checkpoint that the next train.fit resumes bit for bit):
there a run's exact match swings by several points from one scored step to the next, which sets the
size of a difference that means nothing.

Part 2, SmolLM2-135M-Instruct (pretrained, scripts/make_smollm2.py, cached under ~/.cache), a task it
cannot do zero-shot and learns only partly in the steps this CPU affords: three-digit addition in
calculator notation ("347 + 285 =" -> " 632"; zero-shot 0%: it goes on talking), generated here
(seed 0): 2,000 train and 500 held-out prompts, disjoint. Batch 8 x 32 tokens, lr 5e-5 (30-step
probes: 7% exact match at 1e-5, 14% at 5e-5), 10 warm-up steps then cosine to zero over 120 steps
(2.3-12 s a step on these 2 shared cores, by their load: 6-15 minutes a run), seeds 0 and 1; eval
loss on the 500 every 40 steps, exact match on them at the end.

Every run keeps its training-loss curve and, for every scoring, which held-out prompts it got right:
a pair's difference in exact match is set beside the number of prompts on which the two runs
disagree (a 1-point goal on 100 prompts is one prompt).

    python benchmarks/run.py moments8_quality      # ~70-100 minutes on 2 shared cores
    SLIMTUNE_QUALITY_PARTS=smollm2 SLIMTUNE_QUALITY_SMOL_SEEDS="2 3 4" python benchmarks/run.py moments8_quality
                                                   # more SmolLM2 pairs only (~13 minutes a pair)
"""

from __future__ import annotations

import copy
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from slimtune import demo, train
from slimtune.data import dataset as data
from slimtune.engines import settings as run_settings
from slimtune.serve import inference
from _smollm2 import smollm2_folder  # benchmarks/cases/ is on the path (run.py)

MOMENTS = ("fp32", "8bit")
GOAL_POINTS = 1.0
DEMO_LRS, DEMO_SEEDS, DEMO_STEPS, DEMO_EVAL_EVERY = (3e-4, 1e-3), (0, 1, 2), 500, 100
CURVE_LR, CURVE_SEEDS, CURVE_STEPS, CURVE_EVERY = 3e-4, (0, 1), 300, 50
SMOL_LR, SMOL_SEEDS, SMOL_STEPS, SMOL_EVAL_EVERY = 5e-5, (0, 1), 120, 40
SMOL_TRAIN, SMOL_HELDOUT = 2000, 500
PARTS_ENV, SMOL_SEEDS_ENV = "SLIMTUNE_QUALITY_PARTS", "SLIMTUNE_QUALITY_SMOL_SEEDS"  # a subset, for more seeds


# ---------------------------------------------------------------- one run, scored along the way


def correct(run: train.Run, records: list[dict], max_new_tokens: int) -> list[bool]:
    """Whether each held-out prompt's greedy answer equals its response (both stripped), as
    `slimtune eval`'s exact match decides it, kept per prompt so that two runs can be paired."""
    prompts = [data.encode_prompt(run.tokenizer, r["prompt"]) for r in records]
    answers = inference.greedy_answers(run.stack.model, run.tokenizer, run.device, prompts, max_new_tokens,
                                       50, run.precision)
    return [a.strip() == r["response"].strip() for a, r in zip(answers, records)]


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]


def scored_run(base: dict, steps: int, every: int, folder: Path, heldout: list[dict], max_new_tokens: int,
               eval_every: int = 0) -> dict:
    """Trains `base` to `steps`, stopping every `every` steps to score it: each stop ends a
    train.fit at a checkpoint that the next one resumes bit for bit (a constant schedule after its
    warm-up does not depend on train.steps; a decaying one does, so pass every=steps for it).
    `eval_every`: eval loss inside the run too (the curve of a run scored once)."""
    settings = copy.deepcopy(base)
    settings["output_dir"] = str(folder)
    settings["train"].update(eval_every=eval_every, log_every=1, measure_memory=False, resume=True,
                             save_every=every)
    points = []
    for upto in range(every, steps + 1, every):
        settings["train"]["steps"] = upto
        run, summary = train.fit(run_settings.load(None, [], base=settings), progress=False)
        hits = correct(run, heldout, max_new_tokens)
        points.append({"step": upto, "exact_match": sum(hits) / len(hits), "eval_loss": summary["eval_loss"],
                       "train_seconds": sum(r["step_s"] for r in metrics(folder) if "step_s" in r),
                       "load_1min": os.getloadavg()[0], "correct": hits})
    records = [r for r in metrics(folder) if "loss" in r]
    evals = [[r["step"], r["eval_loss"]] for r in metrics(folder) if "eval_loss" in r]
    return {"points": points, "loss_curve": [[r["step"], r["loss"]] for r in records], "eval_loss_curve": evals,
            "median_step_s": statistics.median(r["step_s"] for r in records)}


def paired(fp32: dict, bit8: dict) -> list[dict]:
    """At each scored step: both runs' exact match and eval loss, the difference in points and the
    prompts on which the two runs disagree."""
    out = []
    for a, b in zip(fp32["points"], bit8["points"]):
        disagree = sum(x != y for x, y in zip(a["correct"], b["correct"]))
        out.append({"step": a["step"], "exact_match_fp32": a["exact_match"], "exact_match_8bit": b["exact_match"],
                    "points_8bit_minus_fp32": round(100 * (b["exact_match"] - a["exact_match"]), 6),
                    "eval_loss_fp32": a["eval_loss"], "eval_loss_8bit": b["eval_loss"],
                    "prompts_disagreeing": disagree, "prompts": len(a["correct"])})
    return out


def pair(name: str, base: dict, steps: int, every: int, root: Path, heldout: list[dict], max_new_tokens: int,
         eval_every: int = 0) -> dict:
    runs = {}
    for moments in MOMENTS:
        settings = copy.deepcopy(base)
        settings["train"]["moments"] = moments
        began = time.perf_counter()
        runs[moments] = scored_run(settings, steps, every, root / f"{name}-{moments}", heldout, max_new_tokens,
                                   eval_every)
        runs[moments]["wall_s"] = time.perf_counter() - began
        print(f"{name} moments={moments}: " + ", ".join(
            f"step {p['step']} {p['exact_match']:.3f} (eval loss {p['eval_loss']:.4f})"
            for p in runs[moments]["points"]) + f" [{runs[moments]['wall_s']:.0f} s]", flush=True)
    table = paired(runs["fp32"], runs["8bit"])
    last = table[-1]
    return {"name": name, "settings": base, "steps": steps, "scored_every": every, "by_step": table,
            "final_within_goal": abs(last["points_8bit_minus_fp32"]) <= GOAL_POINTS,
            "worst_points_along_the_way": min(r["points_8bit_minus_fp32"] for r in table), "runs": runs}


# ---------------------------------------------------------------- part 1: the demo task


def demo_base(lr: float, seed: int, schedule: str, steps: int) -> dict:
    base = copy.deepcopy(demo.SETTINGS)
    base.update(method="full", engine="slide", precision="fp32")
    base["train"].update(lr=lr, seed=seed, schedule=schedule, warmup_steps=10, steps=steps)
    return base


def part_demo(quick: bool, root: Path) -> dict:
    heldout = demo.heldout()
    steps, eval_every = (30, 10) if quick else (DEMO_STEPS, DEMO_EVAL_EVERY)
    cosine = [pair(f"demo-cosine-lr{lr:g}-seed{seed}", demo_base(lr, seed, "cosine", steps), steps, steps, root,
                   heldout, 24, eval_every)
              for lr in (DEMO_LRS[1:] if quick else DEMO_LRS) for seed in (DEMO_SEEDS[:1] if quick else DEMO_SEEDS)]
    steps, every = (20, 10) if quick else (CURVE_STEPS, CURVE_EVERY)
    curves = [pair(f"demo-constant-lr{CURVE_LR:g}-seed{seed}", demo_base(CURVE_LR, seed, "constant", steps), steps,
                   every, root, heldout, 24)
              for seed in (CURVE_SEEDS[:1] if quick else CURVE_SEEDS)]
    return {"task": "slimtune demo: calculator notation, heldout.jsonl (100 prompts), greedy exact match",
            "model": "slimtune/demo/base (1.97M parameters, hidden 192, 4 blocks, vocabulary 1024)",
            "cosine": cosine, "constant_curves": curves, "summary": summary(cosine)}


def summary(pairs: list[dict]) -> dict:
    """Over the pairs' final scores: the mean difference, the largest, and how far fp32 runs of
    different seeds lie apart at the same lr (what a difference that means nothing looks like)."""
    finals = [p["by_step"][-1] for p in pairs]
    by_lr: dict[float, list[float]] = {}
    for p, f in zip(pairs, finals):
        by_lr.setdefault(p["settings"]["train"]["lr"], []).append(f["exact_match_fp32"])
    return {"mean_points_8bit_minus_fp32": statistics.mean(f["points_8bit_minus_fp32"] for f in finals),
            "largest_abs_points": max(abs(f["points_8bit_minus_fp32"]) for f in finals),
            "pairs_within_goal": sum(abs(f["points_8bit_minus_fp32"]) <= GOAL_POINTS for f in finals),
            "pairs": len(finals),
            "mean_exact_match_fp32": statistics.mean(f["exact_match_fp32"] for f in finals),
            "mean_exact_match_8bit": statistics.mean(f["exact_match_8bit"] for f in finals),
            "mean_eval_loss_fp32": statistics.mean(f["eval_loss_fp32"] for f in finals),
            "mean_eval_loss_8bit": statistics.mean(f["eval_loss_8bit"] for f in finals),
            "fp32_seed_spread_points": {f"{lr:g}": 100 * (max(v) - min(v)) for lr, v in by_lr.items()}}


# ---------------------------------------------------------------- part 2: SmolLM2-135M


def addition_task(folder: Path) -> tuple[Path, Path, list[dict]]:
    """Three-digit sums, SMOL_TRAIN for training and SMOL_HELDOUT held out (no prompt in both)."""
    rng = random.Random(0)
    seen, records = set(), []
    while len(records) < SMOL_TRAIN + SMOL_HELDOUT:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (a, b) not in seen:
            seen.add((a, b))
            records.append({"prompt": f"{a} + {b} =", "response": f" {a + b}"})
    train_path, heldout_path = folder / "train.jsonl", folder / "heldout.jsonl"
    for path, part in ((train_path, records[:SMOL_TRAIN]), (heldout_path, records[SMOL_TRAIN:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return train_path, heldout_path, records[SMOL_TRAIN:]


def smol_seeds() -> tuple[int, ...]:
    """$SLIMTUNE_QUALITY_SMOL_SEEDS (whole numbers, space-separated), else SMOL_SEEDS."""
    named = os.environ.get(SMOL_SEEDS_ENV, "").split()
    if not all(s.isdigit() for s in named):
        raise SystemExit(f"{SMOL_SEEDS_ENV} must be whole numbers separated by spaces, such as \"2 3 4\"; "
                         f"it is {os.environ[SMOL_SEEDS_ENV]!r}.")
    return tuple(int(s) for s in named) or SMOL_SEEDS


def part_smollm2(quick: bool, root: Path) -> dict:
    steps, eval_every = (4, 2) if quick else (SMOL_STEPS, SMOL_EVAL_EVERY)
    train_path, heldout_path, heldout = addition_task(root)
    if quick:
        heldout = heldout[:50]
    pairs = []
    seeds = smol_seeds()
    for seed in seeds[:1] if quick else seeds:
        base = {"model": str(smollm2_folder()), "device": "cpu", "method": "full", "engine": "slide",
                "precision": "fp32",
                "data": {"path": str(train_path), "eval_path": str(heldout_path), "format": "prompt_response",
                         "max_length": 32},
                "train": {"steps": steps, "batch_size": 8, "lr": SMOL_LR, "warmup_steps": min(10, steps),
                          "schedule": "cosine", "seed": seed}}
        pairs.append(pair(f"smollm2-seed{seed}", base, steps, steps, root, heldout, 12, eval_every))
    return {"task": f"three-digit addition, '347 + 285 =' -> ' 632' ({SMOL_TRAIN} train, {len(heldout)} held-out"
                    " prompts, disjoint; greedy exact match, at most 12 new tokens)",
            "model": "SmolLM2-135M-Instruct (scripts/make_smollm2.py; 134.5M parameters, tied embeddings)",
            "pairs": pairs, "summary": summary(pairs)}


def run(quick: bool) -> dict:
    began = time.perf_counter()
    load_before = os.getloadavg()
    parts = {"demo": part_demo, "smollm2": part_smollm2}
    chosen = os.environ.get(PARTS_ENV, " ".join(parts)).split()
    unknown = sorted(set(chosen) - set(parts))
    if unknown:
        raise SystemExit(f"{PARTS_ENV} names {', '.join(unknown)}; the parts are {', '.join(parts)}.")
    smol_seeds()  # a bad seed list is refused before an hour of the demo, not after
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: parts[name](quick, Path(tmp)) for name in chosen}
    result["goal_points"] = GOAL_POINTS
    result["load_average_before"], result["load_average_after"] = list(load_before), list(os.getloadavg())
    result["seconds"] = time.perf_counter() - began
    return result
