"""Engine roundpipe through the CLI on a tiny model: three worker threads train, a run stopped and
started again continues exactly as the straight run (with the async optimizer, whose checkpoint
must also keep the stale weights the next step computes at; sync resume is test_roundpipe's), the
per-worker peaks are in the metrics, and the exported folder loads in transformers with every
tensor trained."""

import pytest

from e2e_helpers import assert_trains_and_resumes_exactly, every_tensor, slimtune
from e2e_helpers import workdir  # noqa: F401  (a fixture)

PIPE = ["engine=roundpipe", "method=full", "roundpipe.workers=3", "train.batch_size=4", "train.schedule=constant",
        "train.lr=0.01", "train.save_every=3", "--no-progress"]


@pytest.mark.parametrize("optimizer", ["async"])
def test_roundpipe_trains_resumes_exactly_and_exports_a_loadable_model(workdir, optimizer):
    args = [*PIPE, f"roundpipe.optimizer={optimizer}"]
    straight, _, _ = assert_trains_and_resumes_exactly(workdir, args, steps=5, stop_at=3, trained=every_tensor)
    assert all(r["host_link_bytes"] > 0 and r["peak_worker2"] > 0 for r in straight)


def test_roundpipe_refuses_a_bad_worker_count_in_one_sentence(workdir):
    proc = slimtune("train", "run.yaml", "engine=roundpipe", "roundpipe.workers=0", "--no-progress", cwd=workdir,
                    check=False)
    assert proc.returncode != 0 and "roundpipe.workers must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr
