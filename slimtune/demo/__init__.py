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

import torch

from slimtune import config, data, train
from slimtune.metrics import format_table

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


@torch.no_grad()
def accuracy(run: train.Run, records: list[dict], batch_size: int = 50, max_new_tokens: int = 24) -> float:
    """Exact match of greedy completions of each prompt against its response (both stripped)."""
    tok, model = run.tokenizer, run.stack.model
    model.eval()
    hits = 0
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        prompts = [data.encode_prompt(tok, r["prompt"]) for r in chunk]
        width = max(map(len, prompts))
        # Left padding, so every prompt ends where generation starts.
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts], device=run.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=run.device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, use_cache=True)
        for record, row in zip(chunk, out[:, width:]):
            text = tok.decode(row, skip_special_tokens=True)
            hits += text.strip() == record["response"].strip()
    return hits / max(len(records), 1)


def main(progress: bool = True) -> dict:
    began = time.perf_counter()
    shutil.rmtree(OUTPUT_DIR, ignore_errors=True)  # the demo always starts fresh
    cfg = config.load(None, [], base=SETTINGS)
    run = train.build(cfg)
    records = heldout()
    print(f"slimtune demo: LoRA on a {sum(p.numel() for p in run.stack.model.parameters()):,}-parameter base model, "
          f"CPU, {len(records)} held-out examples (see {ASSETS / 'README.md'})")
    before = accuracy(run, records)
    print(f"held-out accuracy before fine-tuning: {before:.1%}")
    run, summary = train.fit(cfg, progress=progress, run=run)
    after = accuracy(run, records)
    print(train.summary_table(summary))
    print(format_table([
        ("held-out accuracy before", f"{before:.1%}"),
        ("held-out accuracy after", f"{after:.1%}"),
        ("demo wall time", f"{time.perf_counter() - began:.0f} s"),
    ]))
    return {"before": before, "after": after, "summary": summary}
