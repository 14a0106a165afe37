"""The fsdp plan table (issue 33): per-device bytes of dist.strategy=fsdp plans as the planner now
measures them (rank 0's real sharded step on fake tensors under torch's fake process group:
slimtune/dist/fake_ranks.py), on 2, 4 and 8 cards of 24 GiB, with and without recompute and CPU offload
(dist.offload=cpu), for Llama-3.1-8B full fine-tuning and Llama-3.1-70B LoRA r16 on all linears over a
bf16 base at 1024 tokens, and Llama-3.1-70B QLoRA (the NF4 base sharded, issue 33's goal) at 2048.

Per plan: the device peak and its breakdown (measured on fake tensors), host RAM a rank holds (the
offloaded shards, gradients and AdamW state), whether it fits a 24 GiB card with the planner's 768 MiB
CUDA context and a host of HOST_RAM for all the machine's ranks, the modelled tokens/s (not measured;
offload's AdamW on the host is not in it) and the seconds the estimate took here (2 shared cores).

    python benchmarks/run.py fsdp_plans      # ~5 minutes on 2 cores
"""

from __future__ import annotations

import time

from slimtune import presets
from slimtune.planning import planner

SEQ = 1024
HOST_RAM = "256GiB"
CARDS = (2, 4, 8)
FSDP = {"precision": "bf16", "dist.strategy": "fsdp"}
PLANS = {
    "fsdp": FSDP,
    "fsdp + recompute": {**FSDP, "activations.checkpoint": "recompute"},
    "fsdp + recompute + offload": {**FSDP, "activations.checkpoint": "recompute", "dist.offload": "cpu"},
}
# (model, method, tokens, options every plan of the row adds)
MODELS = (("Llama-3.1-8B", "full", SEQ, {}), ("Llama-3.1-70B", "lora", SEQ, {}),
          ("Llama-3.1-70B", "lora", 2048, {"quant.scheme": "nf4"}))


def _row(model: str, method: str, seq: int, cards: int, name: str, options: dict) -> dict:
    model_config = presets.model_config(model)
    machine = planner.Machine.named("24GiB", HOST_RAM, "1TiB", cards=cards)
    began = time.perf_counter()
    result = planner.weigh(model_config, planner.planning_config(method), {"engine": "resident", **options}, machine,
                           1, seq)
    seconds = time.perf_counter() - began
    e = result.estimate
    return {"model": model, "method": method, "seq": seq, "cards": cards, "plan": name, "options": options,
            "device_peak_bytes": e.device_peak_bytes, "device_peak_gib": round(e.device_peak_bytes / 2**30, 2),
            "breakdown": e.breakdown, "host_bytes_per_rank": e.host_bytes,
            "host_gib_per_rank": round(e.host_bytes / 2**30, 2), "fits": result.fits,
            "short": sorted(result.short), "derived": result.derived, "tokens_per_s_modelled": round(result.tokens_per_s),
            "estimate_s": round(seconds, 2)}


def run(quick: bool = False) -> dict:
    rows = []
    for model, method, seq, extra in MODELS[:1] if quick else MODELS:
        for cards in CARDS[-1:] if quick else CARDS:
            for name, options in PLANS.items():
                rows.append(_row(model, method, seq, cards, name, {**extra, **options}))
                print(rows[-1]["model"], rows[-1]["options"].get("quant.scheme", ""), seq, cards, name, rows[-1]["device_peak_gib"], rows[-1]["host_gib_per_rank"],
                      rows[-1]["fits"], rows[-1]["estimate_s"], flush=True)
    return {"seq": "per row", "batch": 1, "gpu": "24GiB", "host_ram": HOST_RAM, "lora_rank": 16,
            "device_peak_kind": "measured on fake tensors (rank 0 of a fake process group)",
            "tokens_per_s_kind": "modelled", "rows": rows}
