"""Engine lsp through the CLI on a tiny model: it trains (projectors fit before step 1, checked at
every lsp.check_every), a run stopped at a checkpoint and started again continues exactly as the
straight run, and the exported folder loads in transformers with the trained weights."""

from e2e_helpers import assert_trains_and_resumes_exactly, slimtune
from e2e_helpers import workdir  # noqa: F401  (a fixture)

LSP = ["engine=lsp", "method=full", "lsp.d=8", "lsp.r=2", "lsp.check_every=3", "lsp.alpha=0.2",
       "lsp.fit_samples=8", "lsp.fit_iterations=6", "train.schedule=constant", "train.lr=0.01",
       "train.save_every=3", "--no-progress"]


def block_linear(key: str) -> bool:
    """What lsp trains: the blocks' linears, nothing else."""
    return "layers" in key and key.endswith("proj.weight")


def test_lsp_trains_resumes_exactly_and_exports_a_loadable_model(workdir):
    straight, _, stdout = assert_trains_and_resumes_exactly(workdir, LSP, steps=6, stop_at=3, trained=block_linear)
    counted = next(line for line in stdout.splitlines() if "trainable parameters" in line)
    assert int(counted.split()[-1].replace(",", "")) > 0  # the projected matrices count, though frozen to autograd
    assert straight[0]["lsp_refit"] > 0 and "lsp_error_mean" in straight[3]  # fit before step 1, check at 3
    assert all(r["host_link_bytes"] > 0 for r in straight)
    # --no-progress: no bar, so each projector check says one line as it begins; the fit sample is said
    # apart from the examples trained on (both found missing by a newcomer walkthrough)
    assert "lsp: fitting the projectors of " in stdout and " on the fit sample's " in stdout and "before step 1" in stdout
    assert "lsp: checking the projectors of " in stdout and "before step 4" in stdout
    assert "(and 8 held out as the engine's own sample)" in stdout, stdout


def test_lsp_refuses_lora_in_one_sentence(workdir):
    proc = slimtune("train", "run.yaml", "engine=lsp", "--no-progress", cwd=workdir, check=False)
    assert proc.returncode != 0 and "engine=lsp is full fine-tuning" in proc.stderr
    assert "Traceback" not in proc.stderr
