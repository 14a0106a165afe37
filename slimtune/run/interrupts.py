"""Ctrl-C stops the command line, always: during its imports and while a run trains.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. When
that is inside a weakref finalizer or a `__del__` (the CPU meter releases every tensor it counts
through a finalizer, thousands of times a step), Python prints "Exception ignored in: ..." and
drops the exception, and the run would train on to its last step and exit 0; inside an extension
module's initialisation (numpy's, while torch imports) it may be cleared, leaving the module half
made, so that the command goes on or fails later in a stranger way. Under `watching()` the handler
also records the request, and `check()`, called where nothing can drop an exception (after each
step of the loop), raises it again; at the block's end it is raised too, and an error that ends
the block after the request becomes the KeyboardInterrupt it follows from. A command asked to stop
never ends as if it had not been.

check() is not called on the way out of a step: in the common case the first raise is not
dropped, and a second one in the middle of the unwinding would cut its cleanup short.

SIGTERM (a job scheduler's stop, `docker stop`, `kill`) is taken the same way, where its handler is
the default one: the run ends within its step and names the checkpoint a resume starts from, and the
process exits 143 (128 + 15) as a process killed by SIGTERM would. A rank under torchrun leaves
SIGTERM alone: torchrun sends it to the surviving ranks when one fails, and the launcher says how
the job ended (launch.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

_requested = 0  # the signal (SIGINT or SIGTERM) that arrived inside watching(); 0: none


class Signalled(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the main thread is (as Python raises KeyboardInterrupt)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__()
        self.signum = signum


class Interrupted(Signalled):
    """A Ctrl-C or SIGTERM that ended a run's training, carrying one sentence on what its folder now
    holds (the checkpoint a resume starts from, or none), which the command line says after it."""

    def __init__(self, sentence: str, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.args = (sentence,)


def signum_of(err: KeyboardInterrupt) -> int:
    """The signal behind a KeyboardInterrupt: SIGINT unless it is a Signalled one."""
    return getattr(err, "signum", signal.SIGINT)


def exit_code(err: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a process the signal ended: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + signum_of(err)


def stopped_by(err: KeyboardInterrupt) -> str:
    """'interrupted' for Ctrl-C, 'stopped by SIGTERM' for SIGTERM: the first words of the command line's sentence."""
    signum = signum_of(err)
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


def _on_signal(signum, frame) -> None:
    del frame
    global _requested
    _requested = signum
    raise Signalled(signum)


def _ours_to_take(signum: int) -> bool:
    """Python's default handler only (a caller's own, or the signal ignored as for a job started in
    the background, is left alone), and SIGTERM not in a torchrun rank."""
    default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    if signal.getsignal(signum) is not default:
        return False
    return signum == signal.SIGINT or not _in_a_torchrun_rank()


def _in_a_torchrun_rank() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Inside the block Ctrl-C (and SIGTERM: the module's docstring) is recorded as well as raised.
    Only Python's default handlers are replaced, and only on the main thread (_ours_to_take)."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM) if _ours_to_take(signum)}
    if not taken:
        yield
        return
    _requested = 0
    for signum in taken:
        signal.signal(signum, _on_signal)
    try:
        yield
        check()  # dropped during the last step or after it: the command still ends as interrupted
    except Exception:
        if _requested:  # what failed was left half done by the interrupt (a module half imported)
            raise Signalled(_requested) from None
        raise
    finally:
        for signum, handler in taken.items():
            signal.signal(signum, handler)
        _requested = 0


def check() -> None:
    """Raise the interrupt if Ctrl-C or SIGTERM came inside watching() (its first raise may have
    been dropped by a finalizer). Call it from the main thread where an exception cannot be lost."""
    if _requested and threading.current_thread() is threading.main_thread():
        raise Signalled(_requested)
