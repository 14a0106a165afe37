"""What one rank holds under dist.strategy=fsdp on 1, 2 and 3 gloo CPU ranks (issue 33: "per-device bytes
under fsdp fall as 1/ranks for the sharded parts, measured by the meter on gloo ranks, 1 to 3 ranks").

A small Llama (hidden 256, 4 blocks, vocabulary 4,096, untied head: 4.8M weights) trained 2 steps by the
resident engine under torchrun on this machine, every rank the same batch (2 rows x 128 tokens), for
full fine-tuning, LoRA r16 and QLoRA r16 (NF4 base), each under precision=bf16 (bf16 gathers, fp32
gradient reduction) with blocks recomputed, and each again with dist.offload=cpu. Per rank: step 2's
device peak and its breakdown by the training meter (the CPU meter: live tensor bytes; under offload
the shards count as host memory, not device), the host bytes the step reports, and what the rank holds
between steps (its shards' own storage: weights, the 4-bit codes and scales among them, and AdamW's
moments).
One rank is the plain one-device step (fsdp needs several ranks: with one, nothing is sharded).

    python benchmarks/run.py fsdp_rank_bytes     # ~2 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

RANKS = (1, 2, 3)
SEQ, ROWS = 128, 2
BASE = {"engine": "resident", "precision": "bf16", "dist.strategy": "fsdp", "activations.checkpoint": "recompute"}
SETTINGS = {
    "full": {"method": "full"},
    "lora": {"method": "lora"},
    "qlora": {"method": "lora", "quant.scheme": "nf4"},
}


def small_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def rank_main(out: Path) -> None:
    """One rank of the job: every setting, with and without offload; its figures to out/<rank>.json."""
    from slimtune import assembly
    from slimtune.data.dataset import Batch
    from slimtune.dist import ranks as distributed
    from slimtune.dist.sharding import local_bytes
    from slimtune.engines import settings
    from slimtune.model.quant import QuantWeight
    from slimtune.model.stack import Stack

    dist = distributed.from_env(60.0)
    model = small_model()
    ids = torch.randint(0, model.config.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.roll(ids, -1, dims=1), torch.arange(SEQ).expand(ROWS, SEQ).clone())
    found = {}
    for name, fields in SETTINGS.items():
        for offload in ("none", "cpu"):
            overrides = {**BASE, **fields, "dist.offload": offload}
            cfg = settings.load(None, [f"{k}={v}" for k, v in overrides.items()],
                                base={"model": "(bench)", "data": "(bench)", "output_dir": str(out),
                                      "train": {"batch_size": ROWS, "measure_memory": True}})
            stack = Stack(model_copy(model).to(assembly.run_weight_dtype(cfg, "bf16")))
            engine = assembly.assemble(cfg, stack, torch.device("cpu"), "bf16", dist)
            result = [engine.step([batch]) for _ in range(2)][-1]
            moments = [v for s in engine.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
            # parameters and buffers: one process holds a 4-bit base's codes as buffers, fsdp ranks as parameters
            held = [*engine.stack.model.parameters(), *engine.stack.model.buffers()]
            found[f"{name}, offload={offload}"] = {
                "device_peak_bytes": result.device_peak_bytes, "breakdown": result.device_peak_breakdown,
                "host_peak_bytes": result.host_peak_bytes or 0,
                "held_weights_bytes": local_bytes(held),
                "held_4bit_bytes": local_bytes(t for m in engine.stack.model.modules() if isinstance(m, QuantWeight)
                                               for t in (m.codes, m.scales)),
                "held_moments_bytes": local_bytes(moments), "loss": result.loss}
    (out / f"{dist.rank}.json").write_text(json.dumps(found))
    dist.close()


def model_copy(model):
    import copy

    return copy.deepcopy(model)


def job(world: int) -> list[dict]:
    """torchrun of `world` gloo ranks on this machine; each rank's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={world}",
                   "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--max-restarts=0", __file__, str(out)]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            raise RuntimeError(f"{world} ranks: {done.stderr[-3000:]}")
        return [json.loads((out / f"{rank}.json").read_text()) for rank in range(world)]


def run(quick: bool = False) -> dict:
    jobs = {world: job(world) for world in (RANKS[:2] if quick else RANKS)}
    rows = []
    for setting in jobs[1][0]:
        one = jobs[1][0][setting]
        for world, ranks in jobs.items():
            for rank, figures in enumerate(ranks):
                figures = figures[setting]
                rows.append({"setting": setting, "ranks": world, "rank": rank, **figures,
                             "device_peak_of_one_rank": figures["device_peak_bytes"] / one["device_peak_bytes"],
                             "held_weights_of_one_rank": figures["held_weights_bytes"] / one["held_weights_bytes"]
                             if one["held_weights_bytes"] else None})
                print(setting, world, rank, figures["device_peak_bytes"], figures["held_weights_bytes"],
                      figures["held_moments_bytes"], figures["host_peak_bytes"], flush=True)
    return {"model": "Llama-shaped, hidden 256, 4 blocks, vocab 4096, untied (4.8M weights)", "seq": SEQ,
            "rows_per_step": ROWS, "settings": {**BASE, "per setting": SETTINGS},
            "meter": "CPU live-tensor meter (measure_memory); one rank = the plain one-device step", "rows": rows}


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
