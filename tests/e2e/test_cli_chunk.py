"""Engine chunk through the CLI on a tiny model: it trains a chunk at a time (state on disk), a run
stopped mid-sweep and started again continues exactly as the straight run, and the exported folder
loads in transformers with every tensor trained. The stopped run sends its gradients to the host
(chunk.gradients=host): at one micro-batch a step that adds the same numbers in the same order, so it
must log the straight run's losses bit for bit too."""

from e2e_helpers import assert_trains_and_resumes_exactly, every_tensor, slimtune
from e2e_helpers import workdir  # noqa: F401  (a fixture)

# The spec's round robin, a new chunk every step (the defaults are a random order and a derived stay).
CHUNK = ["engine=chunk", "method=full", "chunk.n_chunks=3", "chunk.order=round_robin", "chunk.switch_every=1",
         "chunk.state=disk", "train.schedule=constant", "train.lr=0.01", "train.save_every=4", "train.grad_accum=1",
         "--no-progress"]


def test_chunk_trains_resumes_mid_sweep_exactly_and_exports_a_loadable_model(workdir):
    straight, resumed, _ = assert_trains_and_resumes_exactly(
        workdir, CHUNK, steps=7, stop_at=4, trained=every_tensor, resumed_args=("chunk.gradients=host",))
    assert [r["chunk"] for r in straight] == [0, 1, 2, 0, 1, 2, 0]
    assert all(r["host_link_bytes"] > 0 for r in straight)
    # the embedding's gradient goes down as its tokens' rows on the host path, as its whole slice from the device
    assert [r["host_link_bytes"] for r in resumed] != [r["host_link_bytes"] for r in straight]
    for run in ("straight", "resumed"):  # ended in this process (collected) and in its own (at exit)
        assert not list((workdir / run).rglob("*.bin")), run  # the state files go with the run
        assert not (workdir / run / "chunk-state").exists(), run  # and the folder the run made for them


def test_chunk_refuses_lora_in_one_sentence(workdir):
    proc = slimtune("train", "run.yaml", "engine=chunk", "--no-progress", cwd=workdir, check=False)
    assert proc.returncode != 0 and "engine=chunk is full fine-tuning" in proc.stderr
    assert "Traceback" not in proc.stderr
