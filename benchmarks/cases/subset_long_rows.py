"""loss.mode=subset at long rows: the planner's device peak of a LoRA step with the subset loss beside the
exact loss, since both norm the final rows a loss chunk at a time (step/loss.py: _NormedExactCE, _SubsetCE).

Llama-3.2-1B, LoRA rank 16, bf16, engine resident with block checkpoints in host RAM, batch 1 at 16,384 and
65,536 tokens. Every figure is an estimate: the real step on fake tensors, counted by the training loop's
meter (slimtune.planning.estimate), with what the peak is made of.

    python benchmarks/run.py subset_long_rows    # a few seconds
"""

from __future__ import annotations

import time

from slimtune import config, presets
from slimtune.engines import settings
from slimtune.planning import estimate, planner

MODEL, SEQS = "Llama-3.2-1B", (16_384, 65_536)


def run(quick: bool) -> dict:
    began = time.perf_counter()
    base = config.to_dict(planner.planning_config("lora"))
    model_config = presets.model_config(MODEL)
    rows = []
    for mode in ("exact", "subset"):
        cfg = settings.load(None, ["engine=resident", "precision=bf16", "activations.checkpoint=host",
                                   f"loss.mode={mode}"], base=base)
        for seq in SEQS[:1] if quick else SEQS:
            found = estimate.estimate(model_config, cfg, 1, seq)
            rows.append({"loss.mode": mode, "seq": seq, "device_peak_gib": found.device_peak_bytes / 2**30,
                         "breakdown_mib": {k: v / 2**20 for k, v in found.breakdown.items()}})
            print(f"{mode} {seq}: {rows[-1]['device_peak_gib']:.3f} GiB", flush=True)
    return {"model": MODEL, "plan": "LoRA rank 16, bf16, resident, activations.checkpoint=host, batch 1",
            "figures": "estimate (fake-tensor step, the training loop's meter)", "rows": rows,
            "wall_s": time.perf_counter() - began}
