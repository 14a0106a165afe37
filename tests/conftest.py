"""Shared fixtures: a tokenizer trained offline and tiny random models saved as HF folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def python_sigint():
    """Every test starts with Python's own Ctrl-C handler, as a fresh slimtune process does. A test
    worker runs many tests in one process, and torch's launcher (run in-process by some) installs its
    own SIGINT handler and leaves it; interrupts.watching() then rightly stands aside, and a process a
    test starts would inherit SIGINT ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield


def pytest_configure(config):
    """`--dist loadgroup` under pytest 9 with pytest-xdist 3.8 or older stops the run. That xdist sends a
    module marked xdist_group to one worker whole (its module fixture built once) by rewriting each
    item's _nodeid, which pytest 9 no longer reads: every group was ignored without a word, and both
    workers built each grouped module's fixture (a trained run, two torchrun jobs). requirements-dev.txt
    pins pytest 8.4."""
    if config.getoption("dist", "no") != "loadgroup" or hasattr(config, "workerinput"):
        return
    from importlib.metadata import version

    xdist = tuple(int(part) for part in version("pytest-xdist").split(".")[:2])
    if int(pytest.__version__.split(".")[0]) >= 9 and xdist <= (3, 8):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {version('pytest-xdist')} ignores"
                                " the xdist_group marks --dist loadgroup relies on; install requirements-dev.txt"
                                " (pytest 8.4).")


# Modules run whole by one worker under --dist loadgroup, beside those marked xdist_group in their own
# file: test_fsdp's module fixture runs two torchrun jobs (~40 s); on both workers it ran twice.
GROUPED = {"tests/unit/test_fsdp.py": "test_fsdp"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook, which tags each grouped node id
def pytest_collection_modifyitems(items):
    for item in items:
        group = GROUPED.get(item.nodeid.split("::")[0])
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """The planner's estimate cache goes to a folder of this session, not the user's ~/.cache: every
    session estimates afresh, and leaves nothing behind."""
    import os

    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny corpus for a tiny tokenizer",
    "question: what is two plus two? answer: four",
    "user assistant system says hi and bye 0 1 2 3 4 5 6 7 8 9",
]


def train_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained in well under a second, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer()


def tiny_config(family: str = "llama", vocab_size: int = 300, **overrides):
    """A tiny config of a supported family; overrides pass through to the config class."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 8
    kwargs.update(overrides)
    return classes[family](**kwargs)


def save_tiny_model(folder: Path, tokenizer, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Build a random model from a tiny config and save it (safetensors) with the tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer), **overrides))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def engine_config(train=None, **fields):
    """A RunConfig for building an engine straight from a Stack in a test (no model folder or data
    is read): `train` a TrainConfig, `fields` any other RunConfig field (sections={"slide": ...}); every
    engine's section not given holds its defaults, as in a loaded config. Not validated."""
    from slimtune.config import DataConfig, RunConfig, TrainConfig
    from slimtune.engines import settings

    return settings.complete(RunConfig(model="(test)", data=DataConfig(path="(test)"), train=train or TrainConfig(),
                                       **fields))


def shapes_in_turn(plans: list[tuple[str, dict]], shapes: list[str]) -> list[tuple[str, str, dict]]:
    """(shape, method, plan) cases: each plan on one shape, in turn, and then each engine's first plan
    on the shapes its plans' turns missed, so every engine meets every shape. About a third of every
    plan on every shape, for the estimate tests that run a step per case."""
    cases = [(shapes[i % len(shapes)], method, plan) for i, (method, plan) in enumerate(plans)]
    met = {(shape, plan["engine"]) for shape, _, plan in cases}
    first = {}
    for method, plan in plans:
        first.setdefault(plan["engine"], (method, plan))
    for engine, (method, plan) in first.items():
        cases += [(shape, method, plan) for shape in shapes if (shape, engine) not in met]
    return cases


class Fp32RMSNorm(nn.Module):
    """Llama's RMSNorm: computes in fp32 whatever its input, scales by its weight in the input's dtype. Its
    backward rounds the incoming gradient to fp32, so a loss must scale the gradient before it, as the plain
    way does (test_loss.py, test_loss_streamed_norm.py)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim, dtype=torch.float64))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)
