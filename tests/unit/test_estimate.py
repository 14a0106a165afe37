"""The planner's estimate against the training meter: the same step, run on fake tensors and for
real on the CPU, must agree within 3% (in practice byte for byte) for every plan that exists."""

import pytest
import torch

from conftest import save_tiny_model, tiny_config
from slimtune import assembly, config, engines, estimate
from slimtune.model import load_model

SHAPES = {
    "llama-untied": ("llama", {}),
    "qwen2-tied-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-gqa1": ("qwen3", {"num_key_value_heads": 1}),
}
PLANS = [(method, plan) for method in ("lora", "full") for plan in engines.plans_for(method)]


def measured_peak(folder, cfg, precision, batch) -> int:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    engine, _ = assembly.assemble(cfg, assembly.load_stack(cfg, cpu, precision), cpu, precision)
    return [engine.step([batch] * cfg.train.grad_accum) for _ in range(estimate.STEPS)][-1].device_peak_bytes


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method, plan", PLANS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
def test_estimate_matches_the_measured_peak(tmp_path, tokenizer, shape, method, plan):
    family, overrides = SHAPES[shape]
    folder = save_tiny_model(tmp_path, tokenizer, family, **overrides)
    cfg = config.load(None, [f"{k}={v}" for k, v in plan.items()],
                      base={"model": str(folder), "data": "x.jsonl", "method": method, "lora": {"rank": 4},
                            "train": {"batch_size": 2, "grad_accum": 2}})
    predicted = estimate.estimate(tiny_config(family, len(tokenizer), **overrides), cfg, 2, 48)
    batch = estimate.synthetic_batch(2, 48, len(tokenizer))
    measured = measured_peak(folder, cfg, plan["precision"], batch)
    assert abs(predicted.device_peak_bytes - measured) <= 0.03 * measured
    assert sum(predicted.breakdown.values()) == predicted.device_peak_bytes
    dense = sum(p.numel() * p.element_size() for p in load_model(folder, torch.float32, torch.device("cpu"))
                .parameters())
    # fp32 weights count 4 bytes a parameter, a bf16 base 2, a 4-bit base about half a byte
    share = {"fp32": 1.0, "bf16": 0.5}[plan["precision"]] * (0.125 if "quant.scheme" in plan else 1.0)
    assert predicted.breakdown["weights"] >= dense * share * 0.99


def test_synthetic_batch_is_packed_and_masked():
    batch = estimate.synthetic_batch(2, 16, 100)
    assert batch.position_ids[0].tolist() == list(range(8)) * 2
    assert 0 < batch.num_targets < 2 * 16
