"""Shared by the benchmark cases that train on the demo task: a run's held-out accuracy along the
way, and the wall clock its steps took (fitting and every other cost inside a step included)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from slimtune import demo, train
from slimtune.engines import settings as run_settings


def time_to_accuracy(name: str, variant: dict, steps: int, every: int, root: Path) -> dict:
    settings = copy.deepcopy(demo.SETTINGS)
    settings.update({k: v for k, v in variant.items() if k != "train"})
    settings["train"].update(schedule="constant", warmup_steps=10, eval_every=0, log_every=1, measure_memory=False,
                             resume=True, save_every=every)
    settings["train"].update(variant["train"])
    if settings["train"]["schedule"] != "constant":
        every = steps  # a decaying schedule is sized by train.steps: one run, scored at its end
    settings["output_dir"] = str(root / name.replace(" ", "_").replace("=", "").replace("(", "").replace(")", ""))
    curve, records = [], []
    for upto in range(every, steps + 1, every):
        settings["train"]["steps"] = upto
        run, _ = train.fit(run_settings.load(None, [], base=settings), progress=False)
        accuracy = demo.accuracy(run, demo.heldout())
        records = [json.loads(line) for line in (Path(settings["output_dir"]) / "metrics.jsonl").read_text()
                   .splitlines() if line]
        curve.append({"step": upto, "train_seconds": sum(r["step_s"] for r in records), "accuracy": accuracy})
    return {"run": name, "settings": variant, "curve": curve,
            "first_step_s": records[0]["step_s"], "median_step_s": sorted(r["step_s"] for r in records)[len(records) // 2]}
