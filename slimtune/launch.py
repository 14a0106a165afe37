"""`slimtune train run.yaml --nproc P`: torchrun on this machine, P ranks, without typing torchrun.

The launch is torchrun's own (torch.distributed.run: its argument parsing, its elastic agent, its
rendezvous), as `torchrun --standalone --nproc-per-node P --max-restarts 0 -m slimtune train ...`
would start it (torchrun_args); what this adds is the end. When a rank fails, torchrun stops the others; here that
becomes one sentence naming the rank, how it ended, and the checkpoint to resume from, instead of
torchrun's report.
"""

from __future__ import annotations

import os
from pathlib import Path

from slimtune import checkpoint
from slimtune.errors import UserError


def torchrun_args(nproc: int, train_args: list[str]) -> list[str]:
    """torchrun's command line for `slimtune train <train_args>` on `nproc` local ranks: what
    --standalone means to torchrun (a c10d rendezvous on a free local port), spelled out, since
    torchrun fills it in only in its own main."""
    import uuid

    return ["--nnodes=1", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
            f"--rdzv-id={uuid.uuid4()}", "--max-restarts=0", "-m", "slimtune", "train", *train_args]


def run_local(nproc: int, train_args: list[str], output_dir: str) -> None:
    """Run the job to its end; a failed rank ends it in one sentence (UserError)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # torchrun would set 1 and say so; the cores shared out is what a CPU rank should use.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config, entrypoint, args = torchrun.config_from_args(torchrun.parse_args(torchrun_args(nproc, train_args)))
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        raise UserError(f"{_how_it_ended(rank, nproc, failure)}; torchrun stopped the other ranks. "
                        f"{_resume_hint(output_dir)}") from None


def _how_it_ended(rank: int, nproc: int, failure) -> str:
    if failure.exitcode < 0:
        return f"rank {rank} of {nproc} (pid {failure.pid}) was killed by {failure.signal_name()}"
    return f"rank {rank} of {nproc} (pid {failure.pid}) ended with exit code {failure.exitcode} (its message is above)"


def _resume_hint(output_dir: str) -> str:
    latest, _ = checkpoint.latest_intact(Path(output_dir))
    if latest is None:
        return "No checkpoint was written yet."
    return f"The last checkpoint is '{latest}'; the same command resumes from it."
