"""Data parallelism through the CLI (`slimtune train --nproc N`: torchrun on this machine, gloo):
an fsdp job of two ranks trains and logs every step, a job killed with kill -9 as a whole resumes
exactly (its sharded checkpoint, written by every rank with torch.distributed.checkpoint), one
killed rank or one hung rank ends the job with a message and no hang, and what rank 0 refuses is
said once. That ranks train what one process trains on the whole batch, fsdp included, is
tests/unit/test_distributed.py's (three ranks, every engine, fp64 and fp32)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e_helpers import slimtune, slimtune_here, workdir  # noqa: F401  (workdir is a fixture)

FULL = ["method=full", "train.schedule=constant", "train.lr=0.003", "train.warmup_steps=0", "train.eval_every=0",
        "--no-progress", "dist.timeout_s=20"]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Job:
    """`slimtune train ... --nproc N` started in the background, its stderr kept line by line."""

    def __init__(self, cwd: Path, *args: str):
        self.began = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "slimtune.cli", "train", *args], cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic() - self.began, line.rstrip()))

    def wait_for(self, path: Path, limit: float = 120.0) -> None:
        while not path.exists():
            assert self.proc.poll() is None, f"the job ended before {path} appeared: {self.stderr()[-3000:]}"
            assert time.monotonic() - self.began < limit, f"{path} did not appear within {limit} s"
            time.sleep(0.01)

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the processes torchrun started."""
        found = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        out = {}
        for pid in found:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((int(e.split(b"=")[1]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = int(pid)
        return out

    def end(self, limit: float = 90.0) -> int:
        try:
            return self.proc.wait(timeout=limit)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)


def test_fsdp_job_trains_and_resumes_exactly_after_kill_9(workdir):
    steps = ["train.steps=6", "train.save_every=3"]
    fsdp = [*FULL, *steps, "dist.strategy=fsdp", "--nproc", "2"]
    slimtune("train", "run.yaml", *fsdp, "output_dir=two", cwd=workdir)
    two = weights(workdir / "two")
    logged = records(workdir / "two")
    assert [r["step"] for r in logged] == list(range(1, 7))  # rank 0 alone writes the log
    assert all(r["allreduce_bytes"] > 0 for r in logged)
    assert (workdir / "two" / "checkpoints" / "step-00000006" / "sharded" / ".metadata").is_file()

    job = Job(workdir, "run.yaml", *fsdp, "output_dir=killed")
    job.wait_for(workdir / "killed" / "checkpoints" / "step-00000003")
    pids = [*job.ranks().values(), job.proc.pid]
    for pid in pids:  # the whole job at once: the launcher and every rank
        os.kill(pid, signal.SIGKILL)
    job.end()
    assert not (workdir / "killed" / "model").exists(), "the job finished before it was killed"
    out = slimtune("train", "run.yaml", *fsdp, "output_dir=killed", cwd=workdir)
    assert "resumed from" in out.stdout
    resumed = weights(workdir / "killed")
    for key in two:
        assert torch.equal(resumed[key], two[key]), key
    assert [r["loss"] for r in records(workdir / "killed")] == [r["loss"] for r in logged]
    # (another world size on resume is refused by the data stream: test_distributed)


@pytest.mark.parametrize("how", ["killed", "hung", "killed under fsdp"])
def test_a_lost_rank_ends_the_job_with_a_message(workdir, how):
    timeout_s = 5
    # fsdp: the peer is lost inside torch's own collectives (gloo raises a RuntimeError), not in Dist's
    engine = [*FULL, "dist.strategy=fsdp"] if how == "killed under fsdp" else ["lora.dropout=0", "--no-progress"]
    job = Job(workdir, "run.yaml", *engine, "train.steps=400", "train.save_every=3", f"dist.timeout_s={timeout_s}",
              "--nproc", "2", "output_dir=out")
    job.wait_for(workdir / "out" / "checkpoints" / "step-00000003")
    victim = job.ranks()[1]
    lost_at = time.monotonic() - job.began
    os.kill(victim, signal.SIGSTOP if how == "hung" else signal.SIGKILL)
    if how == "hung":
        # Rank 0 says so once dist.timeout_s has passed; then the stopped rank may take its SIGTERM
        # (torchrun's agent gives a stopped process 30 s before SIGKILL: its own grace, not ours).
        deadline = time.monotonic() + 60
        while not any("did not answer" in line for _, line in job.lines):
            assert time.monotonic() < deadline, job.stderr()
            time.sleep(0.05)
        said_at = next(t for t, line in job.lines if "did not answer" in line)
        assert timeout_s - 1 <= said_at - lost_at <= timeout_s + 15
        os.kill(victim, signal.SIGCONT)
    code = job.end(limit=60)
    text = job.stderr()
    assert code == 2, text
    last = text.splitlines()[-1]
    assert last.startswith("slimtune: error: rank ") and "torchrun stopped the other ranks" in last, text
    assert "Traceback" not in text
    if how == "hung":  # rank 0 said why, naming the checkpoint (exit 2): the launcher adds no advice of its own
        assert "exit code 2" in last and last.endswith("torchrun stopped the other ranks."), text
        assert "; resume with the same command." in text
        assert "rank 1: rank 1 of 2" not in text  # the stopped rank, let go, names itself once
    else:
        assert "was killed by SIGKILL" in last and "the same command resumes from it" in last
    checkpoints = sorted((workdir / "out" / "checkpoints").iterdir())
    assert checkpoints and all(not p.name.endswith(".tmp") for p in checkpoints)
    if how == "killed under fsdp":
        return
    if how == "hung":  # resuming after a lost rank is the same for both: here, a refusal of rank 0's instead
        refused = slimtune("train", "run.yaml", "lora.dropout=0", "train.resume=false", "--no-progress",
                           "output_dir=out", "--nproc", "2", cwd=workdir, check=False)
        assert refused.returncode == 2
        said = [line for line in refused.stderr.splitlines() if "train.overwrite=true" in line]
        assert len(said) == 1 and said[0].startswith("slimtune: error: "), refused.stderr  # rank 0's, once
        ended = refused.stderr.splitlines()[-1]  # and no "the same command resumes", which it refused
        assert ended.startswith("slimtune: error: rank 0 of 2") and ended.endswith("torchrun stopped the other ranks.")
        assert "Traceback" not in refused.stderr
        return
    latest = max(int(p.name.removeprefix("step-")) for p in checkpoints)
    out = slimtune("train", "run.yaml", "lora.dropout=0", f"train.steps={latest + 2}", "--no-progress",
                   "output_dir=out", "--nproc", "2", cwd=workdir)  # the last checkpoint stays usable
    assert f"resumed from {latest}" in out.stdout


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM"])
def test_a_stopped_job_ends_in_one_sentence(workdir, how):
    """Ctrl-C (SIGINT to the launcher's process group: torchrun starts the ranks in sessions of their own)
    or a scheduler's SIGTERM reaches the launcher; torchrun passes it on to the ranks and waits for them,
    and the launcher names the checkpoint to resume from, once (a rank finishing its trackers could be
    killed before it had said it). No traceback either way."""
    from slimtune.store import checkpoint

    job = Job(workdir, "run.yaml", "lora.dropout=0", "--no-progress", "train.steps=400", "train.save_every=1",
              "--nproc", "2", "output_dir=out")
    job.wait_for(workdir / "out" / "checkpoints" / "step-00000001")
    if how == "Ctrl-C":
        os.killpg(job.proc.pid, signal.SIGINT)
    else:
        job.proc.send_signal(signal.SIGTERM)
    code = job.end(limit=60)
    text = job.stderr()
    assert code == (130 if how == "Ctrl-C" else 143), text
    assert "Traceback" not in text and "death signal" not in text, text
    said = [line for line in text.splitlines() if "checkpoint" in line]
    words = "interrupted" if how == "Ctrl-C" else "stopped by SIGTERM"
    latest = checkpoint.latest(workdir / "out").relative_to(workdir)
    assert said == [f"slimtune: {words}. torchrun stopped every rank. The last checkpoint is '{latest}'; the same"
                    " command resumes from it."], text


def test_qlora_sharded_by_fsdp_resumes_and_trains_as_one_process(workdir):
    """`--nproc 2` with a 4-bit base sharded by FSDP2 (QLoRA, blocks recomputed): 2 steps and their
    sharded checkpoint, then the same folder asked for 3 resumes from it; the adapter it exports equals
    one process's on both ranks' micro-batches but for the order of the sums (fp32: 1e-6), and loads
    like any adapter (one file of LoRA tensors). (Bit-exact resume after kill -9 under fsdp: the full
    fine-tuning test above; one process against the ranks in fp64: tests/unit/test_fsdp.py.)"""
    qlora = ["train.save_every=2", "train.eval_every=0", "train.schedule=constant", "lora.dropout=0",
             "quant.scheme=nf4", "activations.checkpoint=recompute", "precision=fp32", "--no-progress"]
    fsdp = [*qlora, "dist.strategy=fsdp", "--nproc", "2"]
    slimtune("train", "run.yaml", *fsdp, "train.steps=2", "output_dir=two", cwd=workdir)
    assert (workdir / "two" / "checkpoints" / "step-00000002" / "sharded" / ".metadata").is_file()
    out = slimtune("train", "run.yaml", *fsdp, "train.steps=3", "output_dir=two", cwd=workdir)
    assert "resumed from" in out.stdout
    # one process on both ranks' micro-batches (each rank trains train.batch_size rows a step): in this one
    slimtune_here("train", "run.yaml", *qlora, "train.steps=3", "train.grad_accum=2", "output_dir=one", cwd=workdir)
    two, one = (load_file(str(workdir / run / "adapter" / "adapter_model.safetensors")) for run in ("two", "one"))
    assert two.keys() == one.keys() and all("lora_" in key for key in two)
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-6, rtol=0, msg=key)
    assert [r["step"] for r in records(workdir / "two")] == [1, 2, 3]
    assert [r["loss"] for r in records(workdir / "two")] == pytest.approx([r["loss"] for r in records(workdir / "one")],
                                                                          rel=1e-5)
