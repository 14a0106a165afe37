"""`slimtune train run.yaml --nproc P`: torchrun on this machine, P ranks, without typing torchrun.

The launch is torchrun's own (torch.distributed.run: its argument parsing, its elastic agent, its
rendezvous), as `torchrun --standalone --nproc-per-node P --max-restarts 0 -m slimtune train ...`
would start it (torchrun_args); what this adds is the end. When a rank fails, torchrun stops the others; here that
becomes one sentence naming the rank, how it ended, and the checkpoint to resume from, instead of
torchrun's report.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from slimtune.errors import UserError
from slimtune.run import interrupts
from slimtune.store import checkpoint

# Once a rank fails, the others get SIGTERM and this long to end before SIGKILL (torchrun's default
# is 30 s; a rank that hangs ignores SIGTERM, and a rank that is well has nothing left to finish:
# checkpoints are written whole or not at all).
SHUTDOWN_S = 5
REFUSED = 2  # a rank's exit code after it said why in one sentence (a UserError: cli._run)
# Set for the ranks this launcher starts: a stop (Ctrl-C) is said by the launcher, which outlives them;
# a rank finishing its trackers could be killed by torchrun (SHUTDOWN_S) before it had said it.
LAUNCHER_SAYS_STOPS = "SLIMTUNE_LAUNCHER_SAYS_STOPS"


def torchrun_args(nproc: int, train_args: list[str]) -> list[str]:
    """torchrun's command line for `slimtune train <train_args>` on `nproc` local ranks: what
    --standalone means to torchrun (a c10d rendezvous on a free local port), spelled out, since
    torchrun fills it in only in its own main."""
    import uuid

    return ["--nnodes=1", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
            f"--rdzv-id={uuid.uuid4()}", "--max-restarts=0", f"--shutdown-timeout={SHUTDOWN_S}", "-m", "slimtune",
            "train", *train_args]


def run_local(nproc: int, train_args: list[str], output_dir: str) -> None:
    """Run the job to its end; a failed rank ends it in one sentence (UserError)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # torchrun would set 1 and say so; the cores shared out is what a CPU rank should use.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config, entrypoint, args = torchrun.config_from_args(torchrun.parse_args(torchrun_args(nproc, train_args)))
    _quiet_agent()
    os.environ[LAUNCHER_SAYS_STOPS] = "1"  # the ranks inherit it
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        rank, failure = _cause(err.failures)
        raise UserError(_failure_sentence(rank, nproc, failure, output_dir)) from None
    except SignalException as err:  # the launcher itself was stopped; torchrun passed the signal on to the ranks
        raise _stopped(err.sigval, output_dir) from None


def _quiet_agent() -> None:
    """Its agent's own account of a failure or a stop (a warning per rank it stops, "Received 2 death
    signal") is said here in one sentence. Each of its modules' loggers has a level of its own
    (torch's elastic get_logger sets it), so the parent's level alone would not reach them."""
    prefix = "torch.distributed.elastic"
    for name in [prefix, *(n for n in logging.root.manager.loggerDict if n.startswith(prefix + "."))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _stopped(signum: int, output_dir: str) -> KeyboardInterrupt:
    """The launcher was stopped (Ctrl-C reaches it alone: torchrun starts the ranks in sessions of their
    own; or SIGTERM from a scheduler), and torchrun passed the signal on to the ranks and waited for
    them: the launcher says where the same command resumes from (the ranks leave it to it)."""
    return interrupts.Interrupted(f"torchrun stopped every rank. {_resume_hint(output_dir)}", signum)


def _failure_sentence(rank: int, nproc: int, failure, output_dir: str) -> str:
    """How the job ended; the checkpoint to resume from after a crash or a kill, but not after a
    rank's own sentence (exit 2: a refusal, say of a folder in use or another world size, where
    "the same command resumes" would contradict it; a lost peer names the checkpoint itself)."""
    ended = f"{_how_it_ended(rank, nproc, failure)}; torchrun stopped the other ranks."
    return ended if failure.exitcode == REFUSED else f"{ended} {_resume_hint(output_dir)}"


def _cause(failures: dict) -> tuple[int, object]:
    """The failure that ended the job: a rank killed by a signal (not torchrun's own SIGTERM to the
    others), else one that exited with an error (it said why), else the first torchrun saw. Among
    the killed, SIGABRT comes last: NCCL's watchdog aborts a rank whose peer vanished ("taking the
    entire process down"), and torchrun's failure times are whole seconds, so the aborted survivor
    and the rank that was killed first often tie (the lower rank, often a survivor, would be named)."""
    import signal

    def rank_of(item) -> tuple:
        rank, failure = item
        by = -failure.exitcode if failure.exitcode < 0 else 0
        killed = by not in (0, signal.SIGTERM)
        return (not killed, by == signal.SIGABRT, failure.exitcode <= 0, failure.timestamp, rank)

    return min(failures.items(), key=rank_of)


def _how_it_ended(rank: int, nproc: int, failure) -> str:
    if failure.exitcode < 0:
        return f"rank {rank} of {nproc} (pid {failure.pid}) was killed by {failure.signal_name()}"
    return f"rank {rank} of {nproc} (pid {failure.pid}) ended with exit code {failure.exitcode} (its message is above)"


def _resume_hint(output_dir: str) -> str:
    latest = checkpoint.latest(Path(output_dir))  # named, not read (train._last_checkpoint_sentence)
    if latest is None:
        return "No checkpoint was written yet."
    return f"The last checkpoint is '{latest}'; the same command resumes from it."
