"""Engine chunk through the CLI on a tiny model: it trains a chunk at a time (state on disk), a run
stopped mid-sweep and started again continues exactly as the straight run, and the exported folder
loads in transformers with every tensor trained. The stopped run sends its gradients to the host
(chunk.gradients=host): at one micro-batch a step that adds the same numbers in the same order, so it
must log the straight run's losses bit for bit too."""

import json

import torch

from e2e_helpers import slimtune, workdir  # noqa: F401  (workdir is a fixture)

CHUNK = ["engine=chunk", "method=full", "chunk.n_chunks=3", "chunk.state=disk", "train.schedule=constant",
         "train.lr=0.01", "train.save_every=4", "train.grad_accum=1", "--no-progress"]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_chunk_trains_resumes_mid_sweep_exactly_and_exports_a_loadable_model(workdir):
    from transformers import AutoModelForCausalLM

    slimtune("train", "run.yaml", *CHUNK, "train.steps=7", "output_dir=straight", cwd=workdir)
    host = [*CHUNK, "chunk.gradients=host"]
    slimtune("train", "run.yaml", *host, "train.steps=4", "output_dir=resumed", cwd=workdir)
    out = slimtune("train", "run.yaml", *host, "train.steps=7", "output_dir=resumed", cwd=workdir)
    assert "resumed from 4" in out.stdout
    straight, resumed = records(workdir / "straight"), records(workdir / "resumed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["chunk"] for r in straight] == [0, 1, 2, 0, 1, 2, 0]
    assert straight[-1]["loss"] < straight[0]["loss"]
    assert all(r["host_link_bytes"] > 0 for r in straight)
    # the embedding's gradient goes down as its tokens' rows on the host path, as its whole slice from the device
    assert [r["host_link_bytes"] for r in resumed] != [r["host_link_bytes"] for r in straight]
    assert not list((workdir / "straight").rglob("*.bin"))  # the state files go with the run
    assert not (workdir / "straight" / "chunk-state").exists()  # and the folder the run made for them

    model = AutoModelForCausalLM.from_pretrained(str(workdir / "straight" / "model"), local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(str(workdir / "model"), local_files_only=True)
    trained, start = model.state_dict(), base.state_dict()
    assert all(not torch.equal(trained[k], start[k]) for k in trained if k.endswith("proj.weight"))
    again = AutoModelForCausalLM.from_pretrained(str(workdir / "resumed" / "model"), local_files_only=True)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in trained.items())


def test_chunk_refuses_lora_in_one_sentence(workdir):
    proc = slimtune("train", "run.yaml", "engine=chunk", "--no-progress", cwd=workdir, check=False)
    assert proc.returncode != 0 and "engine=chunk is full fine-tuning" in proc.stderr
    assert "Traceback" not in proc.stderr
