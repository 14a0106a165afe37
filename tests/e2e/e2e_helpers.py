"""End-to-end helpers: a tiny model folder with a small arithmetic dataset, and the CLI as a user runs it."""

import contextlib
import gc
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch

from conftest import save_tiny_model, write_jsonl


@pytest.fixture()
def workdir(tmp_path, tokenizer) -> Path:
    return make_workdir(tmp_path, tokenizer)


def make_workdir(folder: Path, tokenizer) -> Path:
    """`folder` with the tiny model (model/), the sums task (train.jsonl) and run.yaml: LoRA, 8 steps."""
    save_tiny_model(folder / "model", tokenizer)
    write_sums(folder / "train.jsonl")
    (folder / "run.yaml").write_text(
        "model: model\n"
        "data: {path: train.jsonl, format: prompt_response, max_length: 64}\n"
        "method: lora\n"
        "lora: {rank: 4, alpha: 8, dropout: 0.1}\n"
        "train: {steps: 8, batch_size: 4, lr: 1.0e-3, warmup_steps: 2, save_every: 2, eval_every: 4}\n"
        "output_dir: out\n"
    )
    return folder


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


def slimtune_here(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """The CLI run in this process (`cli.main`, from `cwd`, its output caught), answered as `slimtune`
    answers: for a run whose process is not what a test checks (a straight run to compare with, a run
    stopped at a checkpoint to resume in a fresh process). A CLI process of a tiny run takes ~6 CPU-s,
    most of it starting torch, transformers and datasets, which this one has."""
    from slimtune import cli

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as stop:  # argparse's refusals
                code = stop.code if isinstance(stop.code, int) else 1
        gc.collect()  # the run's scratch files go, as at a process's end (weakref.finalize; relative paths: in cwd)
    finally:
        os.chdir(here)
    proc = subprocess.CompletedProcess(["slimtune", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"slimtune {' '.join(args)} failed ({code}):\n{proc.stderr[-3000:]}")
    return proc


def records(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict a step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class TrainedTwice(NamedTuple):
    straight: list[dict]  # the straight run's metric records
    resumed: list[dict]  # the stopped and resumed run's
    stdout: str  # the straight run's


def assert_trains_and_resumes_exactly(workdir: Path, args: list[str], steps: int, stop_at: int,
                                      trained: Callable[[str], bool], resumed_args: tuple[str, ...] = ()
                                      ) -> TrainedTwice:
    """`slimtune train run.yaml *args` for `steps` steps into straight/, and the same plus `resumed_args`
    stopped at `stop_at` and started again with the same command into resumed/ (args must save a
    checkpoint at stop_at). The habit every engine's e2e test keeps: the run trained (its last loss
    under its first) and exported a model that loads in transformers and differs from the base in
    exactly the tensors `trained` names; the resumed run says where it resumed, logs the straight run's
    losses bit for bit and exports the same model tensor for tensor. The straight and the stopped runs
    run in this process (slimtune_here); the resumed one in a process of its own, as a user resumes, so
    nothing the stopped run left in memory can carry it."""
    first = slimtune_here("train", "run.yaml", *args, f"train.steps={steps}", "output_dir=straight", cwd=workdir)
    again = [*args, *resumed_args, "output_dir=resumed"]
    slimtune_here("train", "run.yaml", *again, f"train.steps={stop_at}", cwd=workdir)
    out = slimtune("train", "run.yaml", *again, f"train.steps={steps}", cwd=workdir)
    assert f"resumed from {stop_at}" in out.stdout
    straight, resumed = records(workdir / "straight"), records(workdir / "resumed")
    assert [r["step"] for r in straight] == list(range(1, steps + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert straight[-1]["loss"] < straight[0]["loss"]
    model, base, twin = (exported(workdir / folder) for folder in ("straight/model", "model", "resumed/model"))
    changed = {k for k, v in model.items() if not torch.equal(v, base[k])}
    assert changed == {k for k in model if trained(k)}, sorted(changed ^ {k for k in model if trained(k)})
    assert model.keys() == twin.keys() and all(torch.equal(v, twin[k]) for k, v in model.items())
    return TrainedTwice(straight, resumed, first.stdout)


def every_tensor(key: str) -> bool:
    """What full fine-tuning trains: every tensor of the model."""
    return True


def exported(folder: Path) -> dict[str, torch.Tensor]:
    """A model folder's tensors as transformers loads them."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).state_dict()
