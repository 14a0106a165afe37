"""End-to-end helpers: a tiny model folder with a small arithmetic dataset, and the CLI as a user runs it."""

import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import save_tiny_model, write_jsonl


@pytest.fixture()
def workdir(tmp_path, tokenizer) -> Path:
    save_tiny_model(tmp_path / "model", tokenizer)
    write_sums(tmp_path / "train.jsonl")
    (tmp_path / "run.yaml").write_text(
        "model: model\n"
        "data: {path: train.jsonl, format: prompt_response, max_length: 64}\n"
        "method: lora\n"
        "lora: {rank: 4, alpha: 8, dropout: 0.1}\n"
        "train: {steps: 8, batch_size: 4, lr: 1.0e-3, warmup_steps: 2, save_every: 2, eval_every: 4}\n"
        "output_dir: out\n"
    )
    return tmp_path


def write_sums(path: Path) -> None:
    """The e2e task: 100 prompt_response rows "what is a plus b?", shuffled by a fixed seed."""
    records = [{"prompt": f"question: what is {a} plus {b}? answer:", "response": f" {a + b}"}
               for a in range(10) for b in range(10)]
    random.Random(0).shuffle(records)
    write_jsonl(path, records)


def slimtune(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run the installed CLI entry point the way a user does."""
    proc = subprocess.run([sys.executable, "-m", "slimtune.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"slimtune {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc
