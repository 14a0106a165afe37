"""Quality and speed of the subset softmax (loss.mode=subset) against the exact loss on the demo
task: the same base model, data, seed and steps; only loss.mode and loss.subset_k change.

Reported per run: the run's own held-out eval loss (exact softmax, always, whatever the training
loss), held-out task accuracy (greedy exact match on slimtune/demo heldout.jsonl), the mean
probability mass outside the candidates during training (metrics.jsonl `excluded_mass`), and the
median seconds per optimizer step (metrics.jsonl `step_s`, meter off). The demo vocabulary is
1024 tokens, so k=1024 holds every token: a control that must match exact.
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

from slimtune import demo, train
from slimtune.engines import settings as run_settings

STEPS = 300  # the demo's 500 cut to fit the time budget
KS = (64, 256, 1024)


def variants(quick: bool) -> list[tuple[str, dict]]:
    ks = KS[:1] if quick else KS
    return [("exact", {"mode": "exact"})] + [(f"subset k={k}", {"mode": "subset", "subset_k": k}) for k in ks]


def one_run(name: str, loss: dict, steps: int, root: Path) -> dict:
    settings = copy.deepcopy(demo.SETTINGS)
    settings["train"].update(steps=steps, eval_every=0, measure_memory=False)
    settings["loss"] = loss
    settings["output_dir"] = str(root / name.replace(" ", "_").replace("=", ""))
    cfg = run_settings.load(None, [], base=settings)
    began = time.perf_counter()
    run, summary = train.fit(cfg, progress=False)
    accuracy = demo.accuracy(run, demo.heldout())
    records = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines() if line]
    steps_s = [r["step_s"] for r in records if r.get("step", 0) > 1]
    excluded = [r["excluded_mass"] for r in records if r.get("excluded_mass") is not None]
    row = {"run": name, "loss": loss, "steps": steps, "eval_loss_exact": summary["eval_loss"],
           "eval_ppl": summary["eval_ppl"], "final_train_loss": summary["final_loss"], "accuracy": accuracy,
           "mean_excluded_mass": statistics.fmean(excluded) if excluded else None,
           "max_excluded_mass": max(excluded) if excluded else None,
           "median_step_s": statistics.median(steps_s), "logged_steps": len(records),
           "tokens_per_s": summary["tokens_per_s"], "seconds": time.perf_counter() - began}
    print(f"{name}: eval {row['eval_loss_exact']:.4f} acc {accuracy:.1%} excluded {row['mean_excluded_mass']} "
          f"step {row['median_step_s'] * 1000:.1f} ms [{row['seconds']:.0f} s]", flush=True)
    return row


def run(quick: bool) -> dict:
    steps = 20 if quick else STEPS
    with tempfile.TemporaryDirectory(prefix="slimtune-subset-") as tmp:
        rows = [one_run(name, loss, steps, Path(tmp)) for name, loss in variants(quick)]
    exact = rows[0]
    for row in rows:
        row["eval_loss_minus_exact"] = row["eval_loss_exact"] - exact["eval_loss_exact"]
        row["accuracy_minus_exact"] = row["accuracy"] - exact["accuracy"]
        row["step_time_vs_exact"] = row["median_step_s"] / exact["median_step_s"]
    return {"task": "slimtune demo (bundled base model, train.jsonl, heldout.jsonl)", "steps": steps,
            "heldout_examples": len(demo.heldout()), "vocab_size": 1024,
            "settings": {k: v for k, v in demo.SETTINGS.items() if k not in ("model", "output_dir")}, "runs": rows}
