"""What `slimtune train` accepts on its command line and in its data, through the CLI as a user runs it: a
process of its own where its whole stderr is checked (one sentence, no traceback), else cli.main in this
process with the same arguments."""

import json
import subprocess
import sys

from conftest import write_jsonl
from e2e_helpers import slimtune, slimtune_here, workdir  # noqa: F401  (workdir is a fixture)


def assert_one_sentence_and_nothing_written(proc, needle: str, out_dir) -> None:
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert not out_dir.exists()


def test_overrides_may_come_before_and_after_flags(workdir):
    slimtune_here("train", "run.yaml", "output_dir=late", "--no-progress", "train.steps=2", cwd=workdir)
    steps = [json.loads(line)["step"] for line in (workdir / "late" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert "steps: 2" in (workdir / "late" / "config.yaml").read_text()


def test_bad_input_after_flags_still_ends_in_one_sentence(workdir):
    proc = slimtune("train", "run.yaml", "--no-progress", "train.stepz=1", cwd=workdir, check=False)
    assert_one_sentence_and_nothing_written(proc, "unknown key 'train.stepz'", workdir / "out")
    proc = slimtune("train", "run.yaml", "--no-progress", "--bogus", "train.steps=1", cwd=workdir, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "slimtune train: error: unrecognized arguments: --bogus"
    assert not (workdir / "out").exists()


def test_train_help_still_works(workdir):
    proc = slimtune_here("train", "--help", cwd=workdir)
    assert proc.stdout.startswith("usage: slimtune train") and "override any of them as key=value" in proc.stdout


VERSION_ALONE = """
import sys
from slimtune import cli
try:
    cli.main(["--version"])
except SystemExit as stop:
    assert stop.code == 0, stop.code
assert "slimtune.engines" not in sys.modules and "torch" not in sys.modules, sorted(sys.modules)
"""


def test_version_is_said_without_importing_an_engine(workdir):
    """--version is parsed like any option: the commands' arguments (train's help lists every engine's
    settings) are added only when a command is used, so nothing heavy is imported for it."""
    assert slimtune("--version", cwd=workdir).stdout.startswith("slimtune ")
    proc = subprocess.run([sys.executable, "-c", VERSION_ALONE], cwd=workdir, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("slimtune "), proc.stderr


def test_chat_record_without_an_assistant_turn_is_named_by_its_line(workdir):
    write_jsonl(workdir / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bye"}]},
        {"messages": [{"role": "system", "content": "says hi"}, {"role": "user", "content": "hello"}]},
    ])
    proc = slimtune("train", "run.yaml", "data.path=chat.jsonl", "data.format=chat", "--no-progress",
                    cwd=workdir, check=False)
    assert_one_sentence_and_nothing_written(proc, "chat.jsonl line 2: the conversation in 'messages' has no "
                                            "assistant turn, so it has nothing to train.", workdir / "out")
    assert "max_length" not in proc.stderr
