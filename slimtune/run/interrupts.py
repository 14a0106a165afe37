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
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_requested = False  # Ctrl-C was pressed inside watching()


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C that ended a run's training, carrying one sentence on what its folder now holds (the
    checkpoint a resume starts from, or none), which the command line says after "interrupted"."""


def _on_sigint(signum, frame) -> None:
    del signum, frame
    global _requested
    _requested = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Inside the block Ctrl-C is recorded as well as raised (see the module's docstring). Only
    Python's default handler is replaced: a caller's own handler, or SIGINT ignored (a job started
    in the background), is left alone, and so is a thread other than the main one."""
    global _requested
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    _requested = False
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
        check()  # dropped during the last step or after it: the command still ends as interrupted
    except Exception:
        if _requested:  # what failed was left half done by the interrupt (a module half imported)
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _requested = False


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed inside watching() (its first raise may have
    been dropped by a finalizer). Call it from the main thread where an exception cannot be lost."""
    if _requested and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt
