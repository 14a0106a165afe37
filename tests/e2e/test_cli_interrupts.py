"""Ctrl-C always stops a run: a KeyboardInterrupt that a finalizer swallows (Python prints "Exception
ignored in: <finalize object ...>" and drops it) still ends training within the step, with exit 130;
and Ctrl-C while the imports run, before any command began, exits 130 without a traceback. SIGTERM
stops a run as Ctrl-C does, with exit 143. (A job under --nproc: test_cli_distributed.)"""

import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from e2e_helpers import workdir  # noqa: F401  (a fixture)
from slimtune import cli, train
from slimtune.run import interrupts


def ctrl_c_inside_a_finalizer() -> None:
    """What Python does when SIGINT arrives while a finalizer runs (the CPU meter releases each tensor
    it counts through one): the SIGINT handler is called there, and what it raises is dropped."""
    class Storage:
        pass

    storage = Storage()
    weakref.finalize(storage, lambda: signal.getsignal(signal.SIGINT)(signal.SIGINT, None))
    del storage  # the last reference: the finalizer runs now, on this thread


def test_a_ctrl_c_that_a_finalizer_swallows_still_stops_training(workdir, monkeypatch, capsys):
    real, stepped = train._train_step, []

    def step_with_ctrl_c_at_3(run, step, *args):
        real(run, step, *args)
        stepped.append(step)
        if step == 3:
            ctrl_c_inside_a_finalizer()

    dropped = []  # what Python printed as "Exception ignored in: <finalize object ...>"
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    monkeypatch.setattr(train, "_train_step", step_with_ctrl_c_at_3)
    monkeypatch.chdir(workdir)
    assert cli.main(["train", "run.yaml", "--no-progress"]) == 130
    assert dropped == [interrupts.Signalled]  # a KeyboardInterrupt
    assert stepped == [1, 2, 3]  # stopped right after the step it was pressed in, of 8
    assert not (workdir / "out" / "adapter").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "slimtune: interrupted. The last checkpoint is 'out/checkpoints/step-00000002'; resume with the same command.")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler is back


@pytest.mark.parametrize("save_every, said", [
    ("0", "No checkpoint was written yet (train.save_every=0 writes none before the end), so the same command starts over."),
    ("5", "No checkpoint was written yet (the first is due at step 5), so the same command starts over.")])
def test_a_ctrl_c_before_any_checkpoint_says_the_run_starts_over(workdir, monkeypatch, capsys, save_every, said):
    real = train._train_step

    def step_with_ctrl_c_at_3(run, step, *args):
        real(run, step, *args)
        if step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "_train_step", step_with_ctrl_c_at_3)
    monkeypatch.chdir(workdir)
    assert cli.main(["train", "run.yaml", "--no-progress", f"train.save_every={save_every}"]) == 130
    assert not (workdir / "out" / "checkpoints").exists() or not any((workdir / "out" / "checkpoints").iterdir())
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"slimtune: interrupted. {said}"


def test_sigterm_stops_training_as_ctrl_c_does_with_exit_143(workdir, monkeypatch, capsys):
    """A job scheduler's stop (SIGTERM): the run ends after its step, names the checkpoint to resume
    from, and exits 143; the default handler is back afterwards."""
    import os

    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):  # in a torchrun rank SIGTERM keeps its default
        monkeypatch.delenv(name, raising=False)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh process
    real = train._train_step

    def step_with_sigterm_at_3(run, step, *args):
        real(run, step, *args)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train, "_train_step", step_with_sigterm_at_3)
    monkeypatch.chdir(workdir)
    try:
        assert cli.main(["train", "run.yaml", "--no-progress", "train.save_every=2"]) == 143
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "slimtune: stopped by SIGTERM. The last checkpoint is 'out/checkpoints/step-00000002'; resume with the same"
        " command.")


def torch_is_loading(pid: int) -> bool:
    """torch's native library is mapped: the process is inside its imports (they take seconds more)."""
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc to see the imports under way")
@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "slimtune", "plan", "--model", "model", "--gpu", "24GiB"],
    # the console script `slimtune` is this import and call
    [sys.executable, "-c", "import sys; from slimtune.cli import main; sys.exit(main())", "train", "run.yaml"],
], ids=["python -m slimtune plan", "console script train"])
def test_ctrl_c_while_the_imports_run_exits_130_without_a_word(workdir, command):
    proc = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not torch_is_loading(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "torch was never imported"
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (130, "", "")


def test_every_command_names_the_module_it_imports_under_the_watch():
    """cli.COMMAND_MODULES: a command without an entry would fail at once; one whose module is gone, too."""
    import importlib

    assert set(cli.COMMAND_MODULES) == set(cli._parser()[1])
    for module in cli.COMMAND_MODULES.values():
        importlib.import_module(module)


def test_a_command_line_stopped_and_said_so_ignores_a_second_ctrl_c_while_it_ends():
    """Two Ctrl-Cs a few milliseconds apart: the second, landing in the process's teardown (atexit,
    finalizers) after the one-sentence message, printed a KeyboardInterrupt traceback (2 runs in 4). The
    process's own command line (argv not given) ignores both signals once it has said it stopped; an
    in-process caller keeps its handlers."""
    script = (
        "import signal, sys\n"
        "from slimtune import cli\n"
        "cli._main = lambda argv: 130\n"  # a command stopped by Ctrl-C, its sentence said
        "assert cli.main(['train']) == 130 and signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
        "code = cli.main()\n"
        "assert code == 130 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN, code\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN\n"
        "import os; os.kill(os.getpid(), signal.SIGINT)\n"  # the second Ctrl-C: nothing happens
        "print('ended quietly')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ended quietly", done.stderr
