"""The planner's worker process, started as early as possible: spawning imports slimtune afresh
(about two seconds of torch and transformers), so `slimtune plan` starts it before importing anything
heavy itself, and both processes import at once. This module imports nothing heavy for that reason.

The worker holds no state worth saving, so it is killed once its last answer is in: an interpreter
that imported torch takes over a second to tear itself down on two cores, and nobody waits for it."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import signal
import threading
from collections.abc import Iterator
from typing import Any, Callable

_EARLY: Worker | None = None  # started by start(), handed to the next take()


class Worker:
    """One spawned process (a forked torch can hang in its thread pool) running one call at a time;
    `run` blocks until the answer is back, so one thread may feed it."""

    def __init__(self, warm_up: tuple[str, str, tuple] = ("slimtune.planning.planner", "warm_up", (None,))):
        """`warm_up`: (module, function, args) the worker calls before anything is asked of it (its
        imports, while the asking process does its own); it answers nothing, and a failure is ignored
        (the asking process meets the same problem itself and reports it)."""
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, warm_up), daemon=True)
        with _deaf_to_ctrl_c_from_birth():
            self._process.start()
        child_end.close()

    def run(self, function: Callable, *args) -> Any:
        """function(*args) in the worker (function must be importable by module and name)."""
        self._connection.send((function.__module__, function.__qualname__, args))
        try:
            ok, value = self._connection.recv()
        except EOFError:
            raise RuntimeError(f"the planning worker died (exit code {self._process.exitcode})") from None
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        """Kill the worker: between calls it holds nothing, and its own teardown is slow."""
        self._process.kill()
        self._process.join()
        self._connection.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def _deaf_to_ctrl_c_from_birth() -> Iterator[None]:
    """A process started inside begins with SIGINT blocked (the mask survives fork and exec) until
    _serve ignores it: Ctrl-C reaches the whole process group, and the worker's start-up would
    otherwise print a KeyboardInterrupt traceback of its own. This process gets a Ctrl-C pressed
    meanwhile once the block ends (ignoring SIGINT here instead could lose it). multiprocessing's
    resource tracker unblocks SIGINT when it starts (bpo-33613): started first, it cannot undo the
    block. The mask is the main thread's: from another thread the worker starts as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _serve(connection, warm_up: tuple[str, str, tuple]) -> None:
    # Ctrl-C reaches the whole process group: the parent answers it (and kills this worker), so
    # the worker prints no traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _no_process_locks_for_bars()
    module, name, args = warm_up
    try:
        getattr(importlib.import_module(module), name)(*args)
    except Exception:  # noqa: BLE001  (only ever saves time)
        pass
    while True:
        try:
            module, name, args = connection.recv()
        except EOFError:  # the parent is gone
            return
        try:
            answer = (True, getattr(importlib.import_module(module), name)(*args))
        except Exception as err:  # noqa: BLE001  (handed to the caller, who raises it)
            answer = (False, err)
        try:
            connection.send(answer)
        except OSError:  # the parent is gone
            return


def _no_process_locks_for_bars() -> None:
    """This worker is killed, never torn down, and lsp's projector fit makes a (disabled) bar in it under
    fake tensors: progress.thread_lock_for_bars says why a thread lock then."""
    from slimtune import progress

    progress.thread_lock_for_bars()


def start(model: str | None = None) -> None:
    """Spawn the worker now (the CLI calls this first thing for `slimtune plan`); `model` (the
    command line's --model, if any) is what it warms up for."""
    global _EARLY
    if _EARLY is None:
        _EARLY = Worker(("slimtune.planning.planner", "warm_up", (model,)))


def take() -> Worker:
    """The early worker if one was started, else a new one; use it in `with` (stopped at the end)."""
    global _EARLY
    worker, _EARLY = _EARLY or Worker(), None
    return worker


def discard() -> None:
    """Let an early worker go unused (a plan too small to share)."""
    global _EARLY
    if _EARLY is not None:
        _EARLY.stop()
        _EARLY = None
