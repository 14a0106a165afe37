"""Calibrating the planner's time model against measured CPU steps.

For a few model shapes and both methods, a real resident step (fp32, CPU, memory meter off)
is timed and set beside speed.serial_step_time() (slimtune/device/speed.py) on the CPU profile that
`slimtune probe` measures (its fp32 GEMM rate and memory bandwidth). The ratio modelled-at-100%-MFU / measured is
the model-FLOPs utilisation the CPU reaches: the number the GPU figure (assumed) stands for.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import LlamaConfig

from slimtune import assembly, presets
from slimtune.engines import settings
from slimtune.planning import probe
from slimtune.device import speed
from slimtune.planning.estimate import synthetic_batch
from slimtune.model.stack import Stack

SHAPES = {
    "demo-2M": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=4, vocab_size=1024, tie_word_embeddings=True),
    "llama-34M": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=8000, tie_word_embeddings=False),
    "llama-110M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=4, vocab_size=16000, tie_word_embeddings=False),
}
BATCH, SEQ = 4, 256


def real_stack(shape: dict) -> Stack:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config_ = LlamaConfig(max_position_embeddings=SEQ, **shape)
    return Stack(AutoModelForCausalLM.from_config(config_, dtype=torch.float32, attn_implementation="sdpa"))


def measure(shape: dict, method: str, steps: int) -> dict:
    stack = real_stack(shape)
    cfg = settings.load(None, [], base={"model": "-", "data": "-", "method": method, "precision": "fp32",
                                        "train": {"batch_size": BATCH, "measure_memory": False, "lr": 1e-5}})
    engine = assembly.assemble(cfg, stack, torch.device("cpu"), "fp32")
    batch = synthetic_batch(BATCH, SEQ, shape["vocab_size"])
    times = []
    for _ in range(steps + 1):  # the first step warms up
        began = time.perf_counter()
        engine.step([batch])
        times.append(time.perf_counter() - began)
    trainable = sum(p.numel() for p in stack.model.parameters() if p.requires_grad)
    return {"measured_step_s": statistics.median(times[1:]), "trainable_params": trainable,
            "total_params": sum(p.numel() for p in stack.model.parameters())}


def run(quick: bool) -> dict:
    cpu = probe.probe_cpu()
    profile = presets.GpuProfile(name="cpu", memory_bytes=cpu["memory_bytes"], bf16_tflops=cpu["bf16_tflops"],
                                 fp32_tflops=cpu["fp32_tflops"], memory_gbps=cpu["memory_gbps"],
                                 host_link_gbps=cpu["host_link_gbps"])
    rows = []
    for name, shape in list(SHAPES.items())[: 1 if quick else None]:
        model_config = LlamaConfig(max_position_embeddings=SEQ, **shape)
        for method in ("lora", "full"):
            found = measure(shape, method, 2 if quick else 5)
            flops = speed.step_flops(model_config, method, BATCH, SEQ)
            modelled = speed.serial_step_time(flops, found["trainable_params"], profile, "fp32", mfu=1.0)
            rows.append({"shape": name, "method": method, **found, "flops": flops,
                         "modelled_step_s_at_100pct": modelled.seconds,
                         "achieved_mfu": modelled.seconds / found["measured_step_s"]})
    return {"batch": BATCH, "seq": SEQ, "cpu_profile": cpu, "rows": rows}
