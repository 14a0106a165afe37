"""The planner's device peak of an lsp step at SmolLM2-135M's shapes, where the projector check's pass
(probe pass and fits) holds the step's peak: what fitting a block's same-shape matrices together
(optim/value_fit.py) costs in device memory.

SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 heads, 3 KV heads, 30 layers, vocabulary
49,152; a config only, no weights), full fine-tuning, engine lsp at d = 256, bf16, batch 8 x 256 tokens,
with block checkpoints off and with recompute. Every figure is an estimate: the real step on fake
tensors, counted by the training loop's meter (slimtune.planning.estimate).

    python benchmarks/run.py lsp_check_peak    # a few seconds
"""

from __future__ import annotations

import time

from transformers import LlamaConfig

from slimtune import config
from slimtune.engines import settings
from slimtune.planning import estimate, planner


def smollm2_shapes() -> LlamaConfig:
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                       num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True, head_dim=64)


def run(quick: bool) -> dict:
    began = time.perf_counter()
    base = config.to_dict(planner.planning_config("full"))
    rows = []
    for checkpoint in ("none", "recompute"):
        cfg = settings.load(None, ["engine=lsp", "precision=bf16", f"activations.checkpoint={checkpoint}",
                                   "lsp.d=256"], base=base)
        found = estimate.estimate(smollm2_shapes(), cfg, 8, 256)
        rows.append({"activations.checkpoint": checkpoint, "device_peak_bytes": found.device_peak_bytes,
                     "breakdown_bytes": dict(found.breakdown)})
        print(f"checkpoint {checkpoint}: {found.device_peak_bytes / 2**20:.1f} MiB", flush=True)
    return {"model": "SmolLM2-135M's shapes (config only)", "plan": "full, lsp d 256, bf16, batch 8 x 256",
            "figures": "estimate (fake-tensor step, the training loop's meter)", "rows": rows,
            "wall_s": time.perf_counter() - began}
