"""`slimtune plan` shares its plans with a spawned worker process: the answers must be the ones the
planner gives alone in one process, in the same order, and the worker must really be used."""

import io
import json
import math
import os
import subprocess
import sys

import pytest
from transformers import LlamaConfig

from slimtune.planning import planner, worker as planning_worker
from slimtune.planning.weighing import Weighing
from slimtune import presets

# One xdist worker runs this module (scripts/test.sh: --dist loadgroup), so its module fixture
# (alone) is built once, not once on each worker.
pytestmark = pytest.mark.xdist_group("test_plan_worker")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A config (only a config: the planner reads no weights) wide and deep enough for the worker:
    layers x hidden >= planner.PARALLEL_FROM."""
    folder = tmp_path_factory.mktemp("wide-llama")
    LlamaConfig(hidden_size=4096, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
                num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512).save_pretrained(folder)
    config = presets.model_config(str(folder))
    assert config.num_hidden_layers * config.hidden_size >= planner.PARALLEL_FROM
    return folder


def _alone(model_dir, method: str, seq: int, empty_cache, monkeypatch) -> list[dict]:
    """The plans computed in this process only (no worker, and no estimate read from the cache the
    worker wrote), as `--json` prints them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(empty_cache))
    base = planner.planning_config(method)
    machine = planner.Machine.named("1GiB")
    original = planner.PARALLEL_FROM
    planner.PARALLEL_FROM = 2**62
    try:
        results = planner.plan(presets.model_config(str(model_dir)), base, machine, 1, seq)
    finally:
        planner.PARALLEL_FROM = original
    return json.loads(planner.to_json(results))


def test_worker_answers_passes_errors_back_and_is_stopped():
    with planning_worker.Worker(("slimtune.planning.planner", "warm_up", (None,))) as worker:
        assert worker.run(math.factorial, 5) == 120
        with pytest.raises(ValueError):
            worker.run(math.factorial, -1)
        assert worker.run(math.comb, 5, 2) == 10  # still serving after an error
        process = worker._process
    assert not process.is_alive()


@pytest.fixture(scope="module")
def alone(wide_model_dir, tmp_path_factory) -> list[dict]:
    """LoRA's plans at seq 48 made alone, once for both comparisons below."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _alone(wide_model_dir, "lora", 48, tmp_path_factory.mktemp("alone"), monkeypatch)


def test_plans_shared_with_a_worker_equal_the_plans_made_alone(wide_model_dir, monkeypatch, alone):
    served = []
    run = planning_worker.Worker.run
    monkeypatch.setattr(planning_worker.Worker, "run", lambda self, *call: served.append(call) or run(self, *call))
    model_config = presets.model_config(str(wide_model_dir))
    weighing = Weighing("slimtune plan", stream=io.StringIO())
    shared = planner.plan(model_config, planner.planning_config("lora"), planner.Machine.named("1GiB"), 1, 48,
                          progress=weighing)
    assert served, "the worker took no plan"
    assert json.loads(planner.to_json(shared)) == alone
    assert weighing.done == weighing.total == len(alone)  # the worker's plans counted as they came back


def test_the_command_line_with_its_early_worker_prints_the_same_plans(wide_model_dir, tmp_path, alone):
    """The CLI starts the worker before its own imports, warmed for --model, and ends without the
    interpreter's teardown: what it prints must still be whole and equal to the planner's answer."""
    done = subprocess.run(
        [sys.executable, "-m", "slimtune.cli", "plan", "--model", str(wide_model_dir), "--gpu", "1GiB",
         "--seq", "48", "--method", "lora", "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cli")})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == alone
    # stderr is a pipe here: a line for every plan weighed (none was cached), then (a slow machine) the count
    said = done.stderr.splitlines()
    assert said[0] == f"slimtune plan: weighing {len(alone)} plans on fake tensors"
    assert all(line.startswith("slimtune plan: weighing plans: ") for line in said[1:]), said


def test_the_command_line_leaves_no_leaked_semaphore_warning(wide_model_dir, tmp_path):
    """The worker is killed once its last answer is in. A full-method plan runs lsp's fake step there, whose
    projector fit makes a (disabled) progress bar: tqdm's default lock is a multiprocessing lock, which
    the resource tracker would then report as leaked when the command ends."""
    done = subprocess.run(
        [sys.executable, "-m", "slimtune.cli", "plan", "--model", str(wide_model_dir), "--gpu", "1GiB",
         "--seq", "48", "--method", "full"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cli")})
    assert done.returncode == 0, done.stderr
    assert "lsp" in done.stdout and "leaked" not in done.stderr, done.stderr
