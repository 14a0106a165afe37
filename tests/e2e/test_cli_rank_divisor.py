"""Under `--nproc 2`, each rank divides its loss by the trained tokens of the whole step (every rank's),
not by its own: two ranks train and log what one process trains on the same micro-batches. The data
here gives every example another number of trained tokens, so the ranks always hold different counts
(tests/unit/test_distributed.py hands the engines that total itself; this goes through the loop)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_jsonl
from e2e_helpers import slimtune, workdir  # noqa: F401  (workdir is a fixture)
from slimtune import cli

STEPS = 3
SETTINGS = ["engine=resident", "method=full", "precision=fp64", "train.batch_size=1", f"train.steps={STEPS}",
            "train.schedule=constant", "train.lr=0.003", "train.warmup_steps=0", "train.eval_every=0",
            f"train.save_every={STEPS}", "train.measure_memory=false", "--no-progress"]


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_with_different_trained_token_counts_train_as_one_process(workdir):
    # Response k has k words: no two examples have the same number of trained tokens.
    data = write_jsonl(workdir / "lengths.jsonl", [{"prompt": f"user says {k}:", "response": " hello" * k}
                                                   for k in range(1, 13)])
    slimtune("train", "run.yaml", *SETTINGS, f"data.path={data.name}", "train.grad_accum=1", "--nproc", "2",
             "output_dir=two", cwd=workdir)
    # The same micro-batches in this process (the stream's order does not depend on the world size).
    assert cli.main(["train", str(workdir / "run.yaml"), *SETTINGS, f"model={workdir / 'model'}", f"data.path={data}",
                     "train.grad_accum=2", f"output_dir={workdir / 'one'}"]) == 0
    two, one = logged(workdir / "two"), logged(workdir / "one")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=1e-10, rel=0)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], abs=1e-10, rel=0)
    found, expected = (load_file(str(workdir / run / "model" / "model.safetensors")) for run in ("two", "one"))
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(found[key], value, atol=1e-10, rtol=0, msg=key)
