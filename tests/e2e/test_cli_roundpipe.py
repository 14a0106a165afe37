"""Engine roundpipe through the CLI on a tiny model: three worker threads train, a run stopped and
started again continues exactly as the straight run (with the async optimizer, whose checkpoint
must also keep the stale weights the next step computes at; sync resume is test_roundpipe's), the
per-worker peaks are in the metrics, and the exported folder loads in transformers with every
tensor trained."""

import json

import pytest
import torch

from e2e_helpers import slimtune, workdir  # noqa: F401  (workdir is a fixture)

PIPE = ["engine=roundpipe", "method=full", "roundpipe.workers=3", "train.batch_size=4", "train.schedule=constant",
        "train.lr=0.01", "train.save_every=3", "--no-progress"]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("optimizer", ["async"])
def test_roundpipe_trains_resumes_exactly_and_exports_a_loadable_model(workdir, optimizer):
    from transformers import AutoModelForCausalLM

    args = [*PIPE, f"roundpipe.optimizer={optimizer}"]
    slimtune("train", "run.yaml", *args, "train.steps=5", "output_dir=straight", cwd=workdir)
    slimtune("train", "run.yaml", *args, "train.steps=3", "output_dir=resumed", cwd=workdir)
    out = slimtune("train", "run.yaml", *args, "train.steps=5", "output_dir=resumed", cwd=workdir)
    assert "resumed from 3" in out.stdout
    straight, resumed = records(workdir / "straight"), records(workdir / "resumed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert straight[-1]["loss"] < straight[0]["loss"]
    assert all(r["host_link_bytes"] > 0 and r["peak_worker2"] > 0 for r in straight)

    model = AutoModelForCausalLM.from_pretrained(str(workdir / "straight" / "model"), local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(str(workdir / "model"), local_files_only=True)
    trained, start = model.state_dict(), base.state_dict()
    assert all(not torch.equal(trained[k], start[k]) for k in trained if k.endswith("proj.weight"))
    again = AutoModelForCausalLM.from_pretrained(str(workdir / "resumed" / "model"), local_files_only=True)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in trained.items())


def test_roundpipe_refuses_a_bad_worker_count_in_one_sentence(workdir):
    proc = slimtune("train", "run.yaml", "engine=roundpipe", "roundpipe.workers=0", "--no-progress", cwd=workdir,
                    check=False)
    assert proc.returncode != 0 and "roundpipe.workers must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr
