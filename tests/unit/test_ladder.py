"""The whole LoRA peak-memory stack against plain PyTorch: each rung of the ladder (4-bit base,
disk checkpoints, subset softmax with k = V, logits masking) trains exactly like the plain dense
LoRA model over the same (dequantized) base, with F.cross_entropy and torch.optim.AdamW, in float64."""

import copy

import pytest
import torch

from slimtune import assembly
from slimtune.engines import settings
from slimtune.model import lora
from slimtune.model.stack import Stack, load_model
from test_oracle_step import TRAIN, HandLoRA, make_batches, oracle_steps

RUNGS = {
    "lora": [],
    "+quant": ["quant.scheme=int4", "quant.group_size=16"],
    "+checkpointing": ["quant.scheme=int4", "quant.group_size=16", "activations.checkpoint=disk"],
    "+subset k=V": ["quant.scheme=int4", "quant.group_size=16", "activations.checkpoint=disk", "loss.mode=subset",
                    "loss.subset_k=100000", "loss.chunk_size=5"],
    "+masking": ["quant.scheme=int4", "quant.group_size=16", "activations.checkpoint=disk", "loss.mode=subset",
                 "loss.subset_k=100000", "loss.chunk_size=5", "loss.masking=true"],
}


def rung_config(tmp_path, folder, overrides):
    masking = "loss.masking=true" in overrides
    t = TRAIN
    base = {"model": str(folder), "data": "x.jsonl", "method": "lora", "precision": "fp64",
            "lora": {"rank": 4, "alpha": 8}, "output_dir": str(tmp_path),
            "train": {"steps": t.steps, "batch_size": t.batch_size, "grad_accum": t.grad_accum, "lr": t.lr,
                      "weight_decay": t.weight_decay, "warmup_steps": t.warmup_steps, "schedule": t.schedule,
                      "max_grad_norm": t.max_grad_norm}}
    return settings.load(None, [*overrides, f"loss.masking={str(masking).lower()}"], base=base)


def dense_reference(model, reference) -> list:
    """Give the reference the rung's effective base weights and hand-written LoRA copies."""
    params = []
    for name, module in lora.adapters(model).items():
        base = module.base
        dense = base.dequantized_weight() if hasattr(base, "dequantized_weight") else base.weight
        path, _, leaf = name.rpartition(".")
        parent = reference.get_submodule(path)
        linear = getattr(parent, leaf)
        with torch.no_grad():
            linear.weight.copy_(dense)
        wrapped = HandLoRA(linear, module.lora_A.weight.detach(), module.lora_B.weight.detach(), module.scaling)
        setattr(parent, leaf, wrapped)
        params += [wrapped.a, wrapped.b]
    for p in reference.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


@pytest.mark.parametrize("rung", RUNGS)
def test_every_rung_trains_like_plain_lora(tmp_path, tiny_model_dir, rung):
    cfg = rung_config(tmp_path, tiny_model_dir, RUNGS[rung])
    model = load_model(tiny_model_dir, torch.float64, torch.device("cpu"))
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    engine = assembly.assemble(cfg, Stack(model), torch.device("cpu"), "fp64")
    with torch.no_grad():  # in place: the engine's optimizer holds these very parameters
        for module in lora.adapters(model).values():
            torch.nn.init.normal_(module.lora_B.weight, std=0.02)
    params = dense_reference(model, reference)
    steps = [make_batches(model.config.vocab_size, seed) for seed in range(3)]
    got = [engine.step(batches).loss for batches in steps]
    want = oracle_steps(reference, params, steps)
    assert got == pytest.approx(want, abs=1e-10, rel=0)
    for module, (a, b) in zip(lora.adapters(model).values(), zip(params[::2], params[1::2])):
        torch.testing.assert_close(module.lora_A.weight, a, atol=1e-10, rtol=0)
        torch.testing.assert_close(module.lora_B.weight, b, atol=1e-10, rtol=0)
    assert not list(tmp_path.rglob("*.bin")) and not any(p.is_file() for p in tmp_path.rglob("*"))
