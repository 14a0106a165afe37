"""Engine lsp through the CLI on a tiny model: it trains (projectors fit before step 1, checked at
every lsp.check_every), a run stopped at a checkpoint and started again continues exactly as the
straight run, and the exported folder loads in transformers with the trained weights."""

import json

import torch

from e2e_helpers import slimtune, workdir  # noqa: F401  (workdir is a fixture)

LSP = ["engine=lsp", "method=full", "lsp.d=8", "lsp.r=2", "lsp.check_every=3", "lsp.alpha=0.2",
       "lsp.fit_samples=8", "lsp.fit_iterations=6", "train.schedule=constant", "train.lr=0.01",
       "train.save_every=3", "--no-progress"]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lsp_trains_resumes_exactly_and_exports_a_loadable_model(workdir):
    from transformers import AutoModelForCausalLM

    first = slimtune("train", "run.yaml", *LSP, "train.steps=6", "output_dir=straight", cwd=workdir)
    counted = next(line for line in first.stdout.splitlines() if "trainable parameters" in line)
    assert int(counted.split()[-1].replace(",", "")) > 0  # the projected matrices count, though frozen to autograd
    slimtune("train", "run.yaml", *LSP, "train.steps=3", "output_dir=resumed", cwd=workdir)
    out = slimtune("train", "run.yaml", *LSP, "train.steps=6", "output_dir=resumed", cwd=workdir)
    assert "resumed from 3" in out.stdout
    straight, resumed = records(workdir / "straight"), records(workdir / "resumed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert straight[0]["lsp_refit"] > 0 and "lsp_error_mean" in straight[3]  # fit before step 1, check at 3
    assert straight[-1]["loss"] < straight[0]["loss"]
    assert all(r["host_link_bytes"] > 0 for r in straight)

    model = AutoModelForCausalLM.from_pretrained(str(workdir / "straight" / "model"), local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(str(workdir / "model"), local_files_only=True)
    trained, start = model.state_dict(), base.state_dict()
    changed = [k for k in trained if not torch.equal(trained[k], start[k])]
    assert changed and all("layers" in k and k.endswith("proj.weight") for k in changed)  # block linears only
    again = AutoModelForCausalLM.from_pretrained(str(workdir / "resumed" / "model"), local_files_only=True)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in trained.items())


def test_lsp_refuses_lora_in_one_sentence(workdir):
    proc = slimtune("train", "run.yaml", "engine=lsp", "--no-progress", cwd=workdir, check=False)
    assert proc.returncode != 0 and "engine=lsp is full fine-tuning" in proc.stderr
    assert "Traceback" not in proc.stderr
