"""One LoRA step and one full fine-tuning step of slimtune equal the same steps written by hand
in plain PyTorch (dense autograd, torch.optim.AdamW, F.cross_entropy), in float64."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import engine_config
from slimtune.model import lora
from slimtune.config import LoraConfig, TrainConfig
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.engines.resident import ResidentEngine
from slimtune.model.stack import Stack, load_model

pytestmark = pytest.mark.quick  # resident against the plain-PyTorch oracle: every engine is checked against resident

# warmup 1, cosine over 3 steps: lr factors 1, 1, 0.5 (written out, not computed by slimtune)
LR, FACTORS = 1e-2, [1.0, 1.0, 0.5]
TRAIN = TrainConfig(steps=3, batch_size=2, grad_accum=2, lr=LR, weight_decay=0.1, warmup_steps=1,
                    schedule="cosine", max_grad_norm=0.5)


def make_batches(vocab: int, seed: int) -> list[Batch]:
    """Two micro-batches of two rows; a few targets masked out, as response-only labels are."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(TRAIN.grad_accum):
        ids = torch.randint(3, vocab, (2, 12), generator=g)
        targets = torch.roll(ids, -1, dims=1)
        targets[:, -1] = IGNORE_INDEX
        targets[0, :4] = IGNORE_INDEX
        positions = torch.arange(12).expand(2, 12).clone()
        batches.append(Batch(ids, targets, positions))
    return batches


class HandLoRA(nn.Module):
    """The LoRA update written out: W x + b + (alpha/r) B A x."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.base, self.scale = base, scale
        self.a, self.b = nn.Parameter(a.clone()), nn.Parameter(b.clone())

    def forward(self, x):
        return self.base(x) + (x @ self.a.T) @ self.b.T * self.scale


def oracle_steps(model: nn.Module, params: list[nn.Parameter], batches_per_step) -> list[float]:
    decay = [p for p in params if p.ndim >= 2]
    plain = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": TRAIN.weight_decay}]
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for factor, batches in zip(FACTORS, batches_per_step):
        for group in opt.param_groups:
            group["lr"] = LR * factor
        total = sum(int((b.targets != IGNORE_INDEX).sum()) for b in batches)
        step_loss = 0.0
        for b in batches:
            logits = model(input_ids=b.input_ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum") / total
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(params, TRAIN.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    return losses


def slimtune_steps(stack: Stack, batches_per_step) -> list[float]:
    engine = ResidentEngine(stack, engine_config(TRAIN), torch.device("cpu"), "fp64")
    return [engine.step(batches).loss for batches in batches_per_step]


def test_lora_steps_equal_plain_pytorch(tiny_model_dir):
    model = load_model(tiny_model_dir, torch.float64, torch.device("cpu"))
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    names = lora.apply(model, LoraConfig(rank=4, alpha=8, targets="all-linear"))
    assert len(names) == 2 * 7  # q k v o gate up down in each of 2 blocks
    for module in lora.adapters(model).values():  # non-zero B so the first step moves A too
        nn.init.normal_(module.lora_B.weight, std=0.02)
    hand = []
    for name, module in lora.adapters(model).items():
        path, _, leaf = name.rpartition(".")
        parent = reference.get_submodule(path)
        wrapped = HandLoRA(getattr(parent, leaf), module.lora_A.weight.detach(), module.lora_B.weight.detach(), 2.0)
        setattr(parent, leaf, wrapped)
        hand.append((name, wrapped))
    for p in reference.parameters():
        p.requires_grad_(False)
    params = []
    for _, wrapped in hand:
        wrapped.a.requires_grad_(True)
        wrapped.b.requires_grad_(True)
        params += [wrapped.a, wrapped.b]
    steps = [make_batches(model.config.vocab_size, seed) for seed in range(3)]
    got = slimtune_steps(Stack(model), steps)
    want = oracle_steps(reference, params, steps)
    assert got == pytest.approx(want, abs=1e-10, rel=0)
    adapters = lora.adapters(model)
    for name, wrapped in hand:
        torch.testing.assert_close(adapters[name].lora_A.weight, wrapped.a, atol=1e-10, rtol=0)
        torch.testing.assert_close(adapters[name].lora_B.weight, wrapped.b, atol=1e-10, rtol=0)
    # the step really moved the weights
    assert not torch.equal(adapters[names[0]].lora_B.weight, torch.zeros_like(adapters[names[0]].lora_B.weight))


def test_full_steps_equal_plain_pytorch(tiny_model_dir):
    model = load_model(tiny_model_dir, torch.float64, torch.device("cpu"))
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = [make_batches(model.config.vocab_size, seed) for seed in range(3)]
    got = slimtune_steps(Stack(model), steps)
    want = oracle_steps(reference, list(reference.parameters()), steps)
    assert got == pytest.approx(want, abs=1e-10, rel=0)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, reference_params[name], atol=1e-10, rtol=0)
        assert not torch.equal(param, before[name]), name
