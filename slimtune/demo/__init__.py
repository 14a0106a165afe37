"""The built-in demo: `slimtune train` with no config.

LoRA fine-tunes the bundled tiny base model (slimtune/demo/base, pretrained by
scripts/make_demo_assets.py on a corpus that script generates) on the bundled task,
on the CPU, and prints held-out task accuracy (greedy generation, exact match) before
and after. See slimtune/demo/README.md for the model, corpus and task.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from slimtune import train
from slimtune.data import dataset as data
from slimtune.engines import settings
from slimtune.serve import evaluate as scoring

ASSETS = Path(__file__).resolve().parent
OUTPUT_DIR = "runs/demo"

# Settings validated on 2 CPU cores: 0% -> 100% held-out exact match (see README.md here).
SETTINGS = {
    "model": str(ASSETS / "base"),
    "data": {"path": str(ASSETS / "data" / "train.jsonl"), "format": "prompt_response", "max_length": 64,
             "eval_fraction": 0.05},
    "method": "lora",
    "lora": {"rank": 16, "alpha": 32, "targets": "all-linear"},
    "train": {"steps": 500, "batch_size": 16, "lr": 2.0e-3, "warmup_steps": 10, "schedule": "cosine",
              "log_every": 5, "eval_every": 100, "resume": False},
    "output_dir": OUTPUT_DIR,
    "device": "cpu",
}


def heldout() -> list[dict]:
    path = ASSETS / "data" / "heldout.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accuracy(run: train.Run, records: list[dict], batch_size: int = 50, max_new_tokens: int = 24) -> float:
    """Exact match of greedy completions of each prompt against its response (both stripped):
    scoring.exact_match, the measure `slimtune eval` reports."""
    cases = [(data.encode_prompt(run.tokenizer, r["prompt"]), r["response"]) for r in records]
    return scoring.exact_match(run.stack.model, run.tokenizer, run.device, cases, batch_size, max_new_tokens,
                               run.precision)


def main(progress: bool = True) -> dict:
    began = time.perf_counter()
    shutil.rmtree(OUTPUT_DIR, ignore_errors=True)  # the demo always starts fresh
    cfg = settings.load(None, [], base=SETTINGS)
    run = train.build(cfg)
    records = heldout()
    trained = run.trainable_count()
    base = sum(p.numel() for p in run.stack.model.parameters()) - trained  # the model holds the adapters too
    print(f"slimtune demo: LoRA ({trained:,} trained parameters) on a {base:,}-parameter base model, "
          f"CPU, {len(records)} held-out examples (see {ASSETS / 'README.md'})")
    before = accuracy(run, records)
    print(f"held-out accuracy before fine-tuning: {before:.1%}")
    run, summary = train.fit(cfg, progress=progress, run=run)
    after = accuracy(run, records)
    print(train.summary_table(summary, [
        ("held-out accuracy before", f"{before:.1%}"),
        ("held-out accuracy after", f"{after:.1%}"),
        ("demo wall time", f"{time.perf_counter() - began:.0f} s"),
    ]))
    return {"before": before, "after": after, "summary": summary}
