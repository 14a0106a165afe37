"""A run's folder is safe: divergence, foreign resumes, shared folders and damaged files end in one
sentence or recover, and nothing good is lost. Every case goes through the CLI (in-process
`cli.main`, or a subprocess where two processes or a kill are needed), and checks the folder after."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from e2e_helpers import workdir  # noqa: F401  (a fixture)
from slimtune.store import checkpoint
from slimtune import cli, train


@pytest.fixture()
def here(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


def run(*overrides) -> int:
    return cli.main(["train", "run.yaml", "--no-progress", *overrides])


def refused(capsys, code: int, needle: str) -> str:
    """The run ended with exit 2 and one sentence holding `needle` (no traceback); returns it."""
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err, err
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def tree(folder) -> dict:
    """Every file under `folder` with a hash of its bytes: what a refusal must leave as it was."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def records(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- 1. divergence


def test_divergence_stops_before_a_nonfinite_step_reaches_weights_checkpoints_or_the_result(here, capsys):
    code = run("train.lr=1e4", "train.warmup_steps=0", "train.save_every=1", "train.steps=6")
    err = refused(capsys, code, "is not finite")
    step = int(err.split("step ")[1].split(":")[0])
    assert f"the last good checkpoint is 'out/checkpoints/step-{step - 1:08d}'" in err
    for folder in checkpoint.list_checkpoints(here / "out" / "checkpoints"):
        assert checkpoint.step_of(folder) < step
        assert all(torch.isfinite(t).all() for t in load_file(str(folder / "trainable.safetensors")).values())
    assert not (here / "out" / "adapter").exists()  # no result from a diverged run
    last = records(here / "out")[-1]
    assert last["step"] == step and last["skipped_updates"] == 1


def test_skip_leaves_steps_out_and_stops_after_its_patience(here, capsys):
    code = run("train.lr=1e4", "train.warmup_steps=0", "train.on_nonfinite=skip", "train.nonfinite_patience=2",
               "train.steps=8")
    refused(capsys, code, "(2 steps in a row)")
    assert [r["skipped_updates"] for r in records(here / "out")][-2:] == [1, 2]


def test_skipped_steps_are_counted_and_the_run_goes_on(here, monkeypatch):
    """The loop's side of skip: a step whose engine applied nothing is logged, counted and passed."""
    real = train._train_step
    cfg_steps = []

    def one_bad_step(run_, step, *args):
        if step == 3:
            step_of_engine = run_.engine.step
            run_.engine.step = lambda batches, total=None, then=None: _not_applied(step_of_engine(batches, total, then=then))
            try:
                return real(run_, step, *args)
            finally:
                run_.engine.step = step_of_engine
        cfg_steps.append(step)
        return real(run_, step, *args)

    monkeypatch.setattr(train, "_train_step", one_bad_step)
    assert run("train.on_nonfinite=skip", "train.steps=5") == 0
    assert [r["skipped_updates"] for r in records(here / "out")] == [0, 0, 1, 1, 1]
    assert (here / "out" / "adapter").is_dir()


def _not_applied(result):
    result.applied = False
    return result


# ---------------------------------------------------------------- 2. settings refused before anything loads


@pytest.mark.parametrize("override", ["train.lr=nan", "train.lr=.inf", "lora.alpha=.nan", "train.max_grad_norm=-.inf"])
def test_non_finite_settings_are_refused(here, capsys, override):
    refused(capsys, run(override), f"{override.split('=')[0]} must be a finite number")
    assert not (here / "out").exists()


def test_folders_that_cannot_be_written_are_refused_before_anything_loads(here, capsys, monkeypatch):
    (here / "afile").write_text("not a folder")
    refused(capsys, run("output_dir=afile/run"), "output_dir 'afile/run' cannot be a folder: 'afile' is a file")
    refused(capsys, run("activations.checkpoint=disk", "activations.disk_dir=afile"),
            "activations.disk_dir 'afile' cannot be a folder")
    refused(capsys, run("engine=slide", "method=full", "slide.moments=disk", "slide.moments_dir=afile/m"),
            "slide.moments_dir 'afile/m' cannot be a folder")
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a user without write permission sees it
    refused(capsys, run(), "output_dir 'out' is not writable")
    assert not (here / "out").exists()


# ---------------------------------------------------------------- 3. a folder knows whose run it holds


def test_resume_checks_the_runs_identity_before_rewriting_anything(here, capsys):
    assert run("train.steps=4") == 0
    capsys.readouterr()
    before = tree(here / "out")
    other = here / "other-model"
    other.mkdir()
    for path in (here / "model").iterdir():  # the same shape, other weights
        (other / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(other / "model.safetensors"))
    save_file({k: v + 0.01 for k, v in weights.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    refused(capsys, run("model=other-model", "train.steps=6"), "the base model's weights differ")
    refused(capsys, run("lora.rank=8", "train.steps=6"), "lora.rank was 4, now 8")
    refused(capsys, run("method=full", "train.steps=6"), "method was 'lora', now 'full'.")
    assert tree(here / "out") == before
    assert run("train.steps=6", "train.save_every=3") == 0  # safe changes are allowed, and said once
    said = capsys.readouterr().out
    assert "resuming with changed settings: train.steps: 4 -> 6, train.save_every: 2 -> 3" in said
    assert run("train.steps=6", "train.save_every=3") == 0
    assert "changed settings" not in capsys.readouterr().out


def test_the_bar_to_a_file_redraws_at_its_interval_not_every_step(here, capsys):
    """A log file got a frame of the bar every step (set_postfix redrew it, past tqdm's 30 s interval for a
    file): 51 KB of carriage returns for the demo (found by a newcomer walkthrough)."""
    assert cli.main(["train", "run.yaml", "train.steps=8"]) == 0  # the bar on, to capsys' stream (no terminal)
    frames = capsys.readouterr().err.count("\r")
    assert 0 < frames <= 3, frames  # drawn at the start and the end, not 8 times more


def test_a_finished_run_run_again_says_there_is_nothing_to_train_and_shows_no_speed(here, capsys):
    assert run("train.steps=2") == 0
    capsys.readouterr()
    assert run("train.steps=2") == 0
    said = capsys.readouterr().out
    assert ("nothing to train: output_dir 'out' holds this run trained to step 2 of 2 already; raise train.steps"
            " to go on.") in said, said
    assert "2 (all taken before this run)" in said and "tokens/s" not in said and "wall time" not in said
    assert "out/adapter" in said  # the result is still named
    assert [r["step"] for r in records(here / "out")] == [1, 2]
    # Settings given to a run that trained nothing are not recorded as its own (found by a newcomer walkthrough).
    record, config_yaml = (here / "out" / "run.json").read_text(), (here / "out" / "config.yaml").read_text()
    exported = {f.name: f.stat().st_mtime_ns for f in (here / "out" / "adapter").iterdir()}
    for again in (["train.steps=2", "train.lr=0.5"], ["train.steps=1", "train.warmup_steps=0"]):  # lower: still step 2
        assert run(*again) == 0
        said = capsys.readouterr().out
        assert "changed settings" not in said
        assert "2 (all taken before this run)" in said  # the steps it holds, not train.steps (said "1 (...)")
        assert ((here / "out" / "run.json").read_text(), (here / "out" / "config.yaml").read_text()) == \
            (record, config_yaml)
    assert json.loads(record)["result"] == {"step": 2, "path": "adapter"}
    assert {f.name: f.stat().st_mtime_ns for f in (here / "out" / "adapter").iterdir()} == exported  # not written again


def test_a_resume_where_auto_resolves_otherwise_says_so_and_records_what_it_resolved_to(here, capsys):
    """A run begun on a card (device=auto -> cuda, precision=auto -> bf16) and resumed on this CPU: both
    settings still read auto, but the run computes otherwise now, and the resume says so."""
    assert run("train.steps=2") == 0
    record_path = here / "out" / "run.json"
    record = json.loads(record_path.read_text())
    assert record["resolved"] == {"device": "cpu", "precision": "fp32"}
    record["resolved"] = {"device": "cuda", "precision": "bf16"}  # as a run on a card records it
    record_path.write_text(json.dumps(record))
    capsys.readouterr()
    assert run("train.steps=4") == 0
    said = capsys.readouterr().out
    assert ("device: 'auto' (cuda at the last start) -> 'auto' (cpu now), "
            "precision: 'auto' (bf16 at the last start) -> 'auto' (fp32 now) (the resumed steps compute in the new"
            " precision") in said, said
    assert json.loads(record_path.read_text())["resolved"] == {"device": "cpu", "precision": "fp32"}
    assert run("train.steps=4") == 0
    assert "changed settings" not in capsys.readouterr().out


# ---------------------------------------------------------------- 4. a new run over an old one


def test_resume_false_over_a_run_is_refused_unless_overwrite(here, capsys):
    assert run("train.steps=4") == 0
    (here / "out" / "notes.txt").write_text("mine")
    before = tree(here / "out")
    refused(capsys, run("train.resume=false", "train.steps=2"), "train.overwrite=true")
    assert tree(here / "out") == before
    assert run("train.overwrite=true", "train.steps=2") == 0
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(here / "out" / "checkpoints")] == [2]
    assert [r["step"] for r in records(here / "out")] == [1, 2]
    assert (here / "out" / "notes.txt").read_text() == "mine"  # only what a run writes is removed
    capsys.readouterr()
    assert run("train.steps=3") == 0  # the next plain run resumes the new run, not the old one
    assert "resuming after step 2" in capsys.readouterr().out


# ---------------------------------------------------------------- 5. one run per folder


def test_a_second_run_into_a_busy_folder_is_refused_and_a_killed_run_leaves_no_lock(here, capsys):
    first = subprocess.Popen([sys.executable, "-m", "slimtune.cli", "train", "run.yaml", "train.steps=2000",
                              "train.save_every=1000", "--no-progress"], cwd=here,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (here / "out" / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before the second started; the test proved nothing"
        # The live first run goes on appending its log: the refused second must change nothing else.
        def written(folder):
            return {k: v for k, v in tree(folder).items() if k != "metrics.jsonl" and not k.startswith("tensorboard")}

        before = written(here / "out")
        refused(capsys, run("train.steps=4"), f"output_dir 'out' is in use by another run (pid {first.pid} on")
        assert written(here / "out") == before
    finally:
        first.kill()
        first.wait()
    assert run("train.overwrite=true", "train.steps=2") == 0  # kill -9 released the lock


# ---------------------------------------------------------------- 6. damaged files


def test_a_damaged_newest_checkpoint_is_passed_over_and_resume_stays_exact(here, capsys):
    assert run("train.steps=10", "train.schedule=constant", "output_dir=straight") == 0
    assert run("train.steps=8", "train.schedule=constant", "train.keep_last=3") == 0
    newest = here / "out" / "checkpoints" / "step-00000008"
    moments = newest / "moments.safetensors"
    moments.write_bytes(moments.read_bytes()[:100])
    with open(here / "out" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 9, "loss": 1.2')  # a line torn by a kill
    capsys.readouterr()
    assert run("train.steps=10", "train.schedule=constant", "train.keep_last=3") == 0
    said = capsys.readouterr().out
    assert "step-00000008' is damaged (moments.safetensors has 100 bytes" in said
    assert "resuming from 'out/checkpoints/step-00000006' instead" in said
    assert [r["loss"] for r in records(here / "out")] == [r["loss"] for r in records(here / "straight")]


def test_one_byte_changed_in_the_newest_checkpoint_is_caught_by_its_crc_and_passed_over(here, capsys):
    """The size check cannot see a changed byte: the CRC-32 in meta.json must."""
    assert run("train.steps=4") == 0
    tensors = here / "out" / "checkpoints" / "step-00000004" / "trainable.safetensors"
    blob = bytearray(tensors.read_bytes())
    data_start = 8 + int.from_bytes(blob[:8], "little")  # past the safetensors header: a weight's bytes
    blob[data_start + (len(blob) - data_start) // 2] ^= 0x01
    tensors.write_bytes(bytes(blob))
    capsys.readouterr()
    assert run("train.steps=6") == 0
    said = capsys.readouterr().out
    assert "step-00000004' is damaged (trainable.safetensors has changed since it was written (CRC-32))" in said
    assert "resuming from 'out/checkpoints/step-00000002' instead" in said


def test_every_checkpoint_damaged_is_one_sentence(here, capsys):
    assert run("train.steps=4") == 0
    for folder in checkpoint.list_checkpoints(here / "out" / "checkpoints"):
        (folder / "meta.json").write_text("{")
    capsys.readouterr()
    refused(capsys, run("train.steps=6"), "no intact checkpoint is left to resume from")


# ---------------------------------------------------------------- 7. leftovers


def test_scratch_folders_of_killed_runs_are_removed_at_the_next_start(here):
    blocks = here / "out" / "activations"
    from slimtune.device import runtime

    here_tag = runtime._host_tag()
    dead, alive = blocks / f"blocks-999999@{here_tag}-x", blocks / f"blocks-{os.getpid()}@{here_tag}-y"
    legacy = blocks / "blocks-999999-z"  # named before the machine was in the name: judged here
    elsewhere = blocks / "blocks-999999@0badc0de-w"  # another machine's (a shared output_dir): not ours to judge
    for folder in (dead, alive, legacy, elsewhere):  # pid 999999: no such process here
        folder.mkdir(parents=True)
        (folder / "block-0.bin").write_bytes(b"0" * 64)
    assert run("train.steps=2", "activations.checkpoint=disk") == 0
    assert not dead.exists() and not legacy.exists()
    assert alive.exists() and elsewhere.exists()  # another live process's folder, another machine's, left alone


# ---------------------------------------------------------------- 8. export says what it exports


def test_export_merges_a_checkpoint_newer_than_the_result(here, capsys, monkeypatch):
    assert run("train.steps=4") == 0
    real = train._train_step

    def interrupted_after_step_6(run_, step, *args):
        if step == 7:
            raise KeyboardInterrupt
        return real(run_, step, *args)

    monkeypatch.setattr(train, "_train_step", interrupted_after_step_6)
    assert run("train.steps=8") == 130
    capsys.readouterr()
    assert cli.main(["export", "out", "--merge"]) == 0
    assert "merged model (step 6, adapter from out/checkpoints/step-00000006)" in capsys.readouterr().out
    merged = load_file(str(here / "out" / "merged" / "model.safetensors"))
    trained = load_file(str(here / "out" / "checkpoints" / "step-00000006" / "trainable.safetensors"))
    base = load_file(str(here / "model" / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    delta = trained[f"{name}.lora_B.weight"] @ trained[f"{name}.lora_A.weight"] * 2.0  # alpha / rank = 8 / 4
    torch.testing.assert_close(merged[f"{name}.weight"], base[f"{name}.weight"] + delta)


# ---------------------------------------------------------------- kill -9 and Ctrl-C at random moments


def test_kills_and_interrupts_at_random_moments_keep_resume_bit_exact(here):
    args = ["train", "run.yaml", "train.steps=12", "train.save_every=1", "train.keep_last=2",
            "activations.checkpoint=disk", "--no-progress"]
    assert cli.main([*args, "output_dir=straight"]) == 0  # the run to compare with: in this process
    rng = random.Random(0)
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "slimtune.cli", *args], cwd=here,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(2.0, 5.0))  # start-up takes ~2 s: some kills land in start-up, some in steps
        proc.send_signal(signal.SIGKILL if attempt % 2 == 0 else signal.SIGINT)
        proc.wait()
    subprocess.run([sys.executable, "-m", "slimtune.cli", *args], cwd=here, check=True, capture_output=True)
    assert [r["loss"] for r in records(here / "out")] == [r["loss"] for r in records(here / "straight")]
    assert not list((here / "out" / "activations").glob("blocks-*"))  # nothing a kill left behind


def test_a_run_stopped_before_its_first_checkpoint_may_be_retried_with_other_settings(here, capsys):
    """Its stop says no checkpoint was written yet: there is nothing to continue, so a retry with another
    method trains (it was refused as "a run this one cannot continue"). A run with a checkpoint stays held."""
    code = run("method=full", "train.lr=1e30", "train.max_grad_norm=0", "train.save_every=0", "output_dir=stopped")
    refused(capsys, code, "no checkpoint was written yet")
    assert not (here / "stopped" / "run.json").exists()
    assert run("train.steps=2", "output_dir=stopped") == 0
    assert run("train.steps=3", "method=full", "output_dir=stopped") == 2  # now it holds checkpoints
    assert "holds a run this one cannot continue: method was 'lora', now 'full'" in capsys.readouterr().err


def test_a_users_config_in_output_dir_is_never_replaced(here, capsys):
    """A config kept in the folder it names as output_dir was replaced by the run's resolved dump,
    comments and all (a common layout: runs/exp1/config.yaml with output_dir: runs/exp1)."""
    mine = (here / "mine")
    mine.mkdir()
    text = "# my experiment\n" + (here / "run.yaml").read_text().replace("output_dir: out", "output_dir: mine")
    (mine / "config.yaml").write_text(text)
    before = tree(mine)
    code = cli.main(["train", "mine/config.yaml", "--no-progress", "train.steps=2"])
    refused(capsys, code, "output_dir 'mine' holds config.yaml, which no run there wrote; a run writes its resolved"
                          " settings to mine/config.yaml (chat, eval and export read them), so keep your config")
    assert tree(mine) == before and not (mine / "run.json").exists()
    refused(capsys, run("train.steps=2", "output_dir=mine", "train.overwrite=true"), "holds config.yaml")  # a run's
    assert (mine / "config.yaml").read_text() == text
    # a run's own config.yaml goes with the run it withdraws (stopped before a checkpoint): a retry is not refused
    code = run("method=full", "train.lr=1e30", "train.max_grad_norm=0", "train.save_every=0", "output_dir=stopped")
    refused(capsys, code, "no checkpoint was written yet")
    assert not (here / "stopped" / "config.yaml").exists() and (here / "stopped" / "metrics.jsonl").exists()
    assert run("train.steps=2", "output_dir=stopped") == 0


def test_an_output_dir_the_file_system_cannot_hold_is_one_sentence(here, capsys):
    """A name past the file system's limit (ENAMETOOLONG from a stat) and a folder under /proc (writable by
    its permissions, yet mkdir fails) were tracebacks."""
    refused(capsys, run(f"output_dir=runs/{'a' * 300}"), "File name too long.")
    if Path("/proc/self").is_dir():
        refused(capsys, run("output_dir=/proc/slimtune-run"), "output_dir '/proc/slimtune-run' cannot be made: ")
    assert not (here / "runs").exists()


def test_a_row_for_several_steps_carries_their_largest_device_peak(here):
    """train.log_every=4 logged only every fourth step's own peak, and the summary's peak (the largest
    row's) missed the steps between: 3.4x too low on data of mixed lengths."""
    assert run("train.steps=8", "train.save_every=0", "train.eval_every=0", "output_dir=each") == 0
    assert run("train.steps=8", "train.save_every=0", "train.eval_every=0", "train.log_every=4",
               "output_dir=fourth") == 0
    each = [r["device_peak_bytes"] for r in records(here / "each")]
    assert (each[3], each[7]) != (max(each[:4]), max(each[4:]))  # the logged steps' own are not the largest
    assert [r["device_peak_bytes"] for r in records(here / "fourth")] == [max(each[:4]), max(each[4:])]


def test_an_evaluation_is_logged_on_a_step_that_is_not_a_logging_step(here):
    """train.eval_every=2, train.log_every=3: the evaluations at steps 2 and 4 reached no log (only the
    last step's did), though they ran."""
    assert run("train.steps=5", "train.eval_every=2", "train.log_every=3", "train.save_every=0", "output_dir=evals") == 0
    found = [json.loads(line) for line in (here / "evals" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "eval_loss" in r) for r in found] == [(2, True), (3, False), (4, True), (5, True)]
