"""`slimtune train` and `slimtune export` through the CLI on a tiny model."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from e2e_helpers import assert_trains_and_resumes_exactly, every_tensor, make_workdir, slimtune, slimtune_here
from e2e_helpers import workdir  # noqa: F401  (a fixture)

# One xdist worker runs this module (scripts/test.sh: --dist loadgroup), so its module fixture
# (lora_run) is built once, not once on each worker.
pytestmark = pytest.mark.xdist_group("test_cli")


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tokenizer) -> tuple[Path, str]:
    """run.yaml as it is (LoRA, 8 steps, a checkpoint every 2, eval every 4) trained once into out/,
    with what the run printed: the tests below read it, and one that writes copies it first. Trained in
    this process (the kill test's killed and resumed runs are processes of their own)."""
    folder = make_workdir(tmp_path_factory.mktemp("lora-run"), tokenizer)
    return folder, slimtune_here("train", "run.yaml", "--no-progress", cwd=folder).stdout


def test_train_writes_result_metrics_plot_and_checkpoints(lora_run):
    folder, stdout = lora_run
    out = folder / "out"
    assert "final train loss" in stdout and "measured" in stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for key in ("step", "loss", "tokens_per_s", "device_peak_bytes"):
        assert all(key in r for r in records)
    assert all(r["device_peak_bytes"] > 0 for r in records)
    assert "eval_loss" in records[3] and "eval_ppl" in records[-1]
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "metrics.png").stat().st_size > 1000
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-00000006", "step-00000008"]


def test_full_finetune_writes_a_loadable_model(workdir):
    from transformers import AutoModelForCausalLM

    slimtune_here("train", "run.yaml", "method=full", "train.steps=2", "--no-progress", cwd=workdir)
    model = AutoModelForCausalLM.from_pretrained(str(workdir / "out" / "model"), local_files_only=True)
    assert model.config.model_type == "llama"


def test_resume_after_kill_is_bit_exact(workdir, lora_run):
    straight = lora_run[0] / "out"  # the same run.yaml, model and data, 8 steps straight
    # kill -9 once a checkpoint exists, then resume with the same command
    cmd = [sys.executable, "-m", "slimtune.cli", "train", "run.yaml", "train.steps=8", "output_dir=killed",
           "train.save_every=1", "train.keep_last=3", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (workdir / "killed" / "checkpoints" / "step-00000003").exists() and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stopped_at = json.loads(sorted((workdir / "killed" / "checkpoints").glob("step-*[0-9]"))[-1]
                            .joinpath("meta.json").read_text())["step"]
    assert stopped_at < 8, "the run finished before it was killed; the test proved nothing"
    out = slimtune("train", "run.yaml", "train.steps=8", "output_dir=killed", "train.save_every=1",
                   "train.keep_last=3", "--no-progress", cwd=workdir)
    assert f"resumed from {stopped_at}" in out.stdout
    assert losses(workdir / "killed") == losses(straight)


def test_export_merge_equals_base_plus_adapter(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from slimtune.model import lora
    from slimtune.model.stack import load_model

    workdir = tmp_path / "run"
    shutil.copytree(lora_run[0], workdir)  # export reads the run folder: a copy of its own
    slimtune("export", "out", "--merge", "--out", "merged", cwd=workdir)
    merged = AutoModelForCausalLM.from_pretrained(str(workdir / "merged"), local_files_only=True).eval()
    adapted = load_model(workdir / "model", torch.float32, torch.device("cpu")).eval()
    lora.load_peft_adapter(adapted, workdir / "out" / "adapter")
    ids = torch.randint(3, 300, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        base = load_model(workdir / "model", torch.float32, torch.device("cpu"))
        assert (base(input_ids=ids).logits - adapted(input_ids=ids).logits).abs().max() > 1e-4


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run.yaml", "train.stepz=1"], "unknown key 'train.stepz' on the command line (did you mean 'train.steps'?)"),
        (["run.yaml", "model=missing"], "model folder 'missing' does not exist"),
        (["run.yaml", "data.path=nope.jsonl"], "nope.jsonl"),
        (["nope.yaml"], "config file 'nope.yaml' does not exist"),
        (["run.yaml", "data.path=bad.jsonl"], "bad.jsonl line 2"),
    ],
)
def test_user_errors_are_one_sentence_and_leave_nothing(workdir, args, needle):
    (workdir / "bad.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": oops}\n')
    proc = slimtune("train", *args, "--no-progress", cwd=workdir, check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert not (workdir / "out").exists()


def test_export_of_a_non_run_folder_is_refused(workdir):
    proc = slimtune("export", "model", "--merge", cwd=workdir, check=False)
    assert proc.returncode == 2 and "not a slimtune run folder" in proc.stderr
    proc = slimtune("export", "nowhere", "--merge", cwd=workdir, check=False)  # as chat and eval say it
    assert proc.returncode == 2 and proc.stderr.strip() == "slimtune: error: run folder 'nowhere' does not exist."


def test_slide_trains_resumes_exactly_and_exports(workdir):
    """engine=slide through the CLI: full fine-tuning, stopped after 3 steps and resumed to 6, logs
    the same losses as 6 steps straight, and exports the same model, every tensor trained. (A
    resident checkpoint resuming under slide, and back, is exact in float64: tests/unit/test_checkpoint.py.)"""
    slide = ["engine=slide", "method=full", "train.schedule=constant", "--no-progress"]
    assert_trains_and_resumes_exactly(workdir, slide, steps=6, stop_at=3, trained=every_tensor)


def test_slide_with_the_split_master_and_8bit_moments_in_files_trains_resumes_exactly_and_exports(workdir):
    """The host optimizer's new layouts through the CLI (issue 30): precision bf16, so each master
    rests split (bf16 weight + residual) and each block's gradient is held in bf16, with 8-bit
    moments in memory-mapped files: stopped after 3 steps and resumed to 6, the same losses and the
    same exported model as 6 steps straight (the codes travel in the checkpoint as they rest)."""
    slide = ["engine=slide", "method=full", "precision=bf16", "train.moments=8bit", "slide.moments=disk",
             "train.grad_accum=1", "train.schedule=constant", "--no-progress"]
    assert_trains_and_resumes_exactly(workdir, slide, steps=6, stop_at=3, trained=every_tensor)


def test_resuming_with_other_trained_weights_is_one_sentence_and_changes_nothing(lora_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(lora_run[0], workdir)
    settings = (workdir / "out" / "config.yaml").read_text()
    proc = slimtune("train", "run.yaml", "method=full", "train.steps=4", "--no-progress", cwd=workdir, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "holds a run this one cannot continue: method was" in proc.stderr
    assert (workdir / "out" / "config.yaml").read_text() == settings
