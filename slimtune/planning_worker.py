"""The planner's worker process, started as early as possible: spawning imports slimtune afresh
(about two seconds of torch and transformers), so `slimtune plan` starts it before importing anything
heavy itself, and both processes import at once. This module imports nothing heavy for that reason."""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing

_EARLY = None  # started by start(), handed to the next take()


def start() -> None:
    """Spawn the worker now (the CLI calls this first thing for `slimtune plan`)."""
    global _EARLY
    if _EARLY is None:
        _EARLY = _spawn()


def take() -> concurrent.futures.ProcessPoolExecutor:
    """The early worker if one was started, else a new one: a one-process pool, to use in `with`."""
    global _EARLY
    pool, _EARLY = _EARLY or _spawn(), None
    return pool


def discard() -> None:
    """Let an early worker go unused (a plan too small to share): it ends after its imports."""
    global _EARLY
    if _EARLY is not None:
        _EARLY.shutdown(wait=False, cancel_futures=True)
        _EARLY = None


def _spawn() -> concurrent.futures.ProcessPoolExecutor:
    # Spawned, not forked: a forked torch can hang in its thread pool.
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    pool.submit(importlib.import_module, "slimtune.planner")  # its imports, before its first plan
    return pool
