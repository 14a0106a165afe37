"""Progress for long work outside the training loop's steps: tokenizing a dataset (a chat record takes
1-1.5 ms on two CPU cores, so 100K records are minutes), the eval command's loss and answers, the
planner's plans (planning/weighing.py), and a large folder written, checked or read (a checkpoint, a
result, a merged export: one line before). Work done within DELAY_S shows nothing. Past that: a bar on
a terminal ("bar"); on a file or a pipe ("lines", since tqdm's bar written to a file is a stream of
carriage returns) a line then and at most one every EVERY_S, the rhythm of the training loop's
--no-progress lines (run/step_lines.py); "none" shows nothing (another rank; a caller that shows its
own progress). Always on stderr: stdout may hold a table or JSON."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Callable, Literal, TextIO, TypeVar

from slimtune.units import human_bytes

DELAY_S = 2.0
EVERY_S = 30.0  # a file's or a pipe's lines: at most one this often (the training loop's too)
LARGE_FOLDER = 1 << 30  # bytes: a folder this large takes seconds to minutes to write or read, so it is said
Mode = Literal["bar", "lines", "none"]
T = TypeVar("T")


def mode_for(bar: bool, show: bool = True) -> Mode:
    """A bar where asked for and stderr is a terminal; lines elsewhere; nothing when not `show`."""
    if not show:
        return "none"
    return "bar" if bar and is_terminal(sys.stderr) else "lines"


def is_terminal(stream) -> bool:
    """(stderr is None under pythonw and some daemons, and a replaced one may have no isatty.)"""
    return bool(getattr(stream, "isatty", lambda: False)())


def thread_lock_for_bars() -> None:
    """tqdm guards its output with a multiprocessing lock, made at the first bar. A process that ends by
    os._exit (`slimtune plan`, the planning worker) never tears it down, and under the spawn start method
    (macOS; Linux from Python 3.14) the resource tracker then reports its semaphore as leaked. One
    process's bars need only a thread lock (tqdm.set_lock, tqdm's own way to choose it)."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


class Counter:
    """Units of work counted as they are done (tick(), from any thread) and shown as `mode` says once
    `delay` seconds have passed, whether or not a unit is done by then (a timer, so a slow first unit is
    not silent): a bar, or a line (`opening`, else the count) and then the count at most every EVERY_S as
    units end. Work over within `delay` shows nothing. Use it in `with`, or close() it."""

    def __init__(self, what: str, unit: str, units: str, total: int, mode: Mode, stream: TextIO | None = None,
                 opening: str | None = None, delay: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.what, self.unit, self.units, self.total, self.mode = what, unit, units, total, mode
        self.stream, self.opening, self.clock = stream or sys.stderr, opening, clock
        self.done, self._said, self._bar, self._closed = 0, None, None, False
        self._lock, self._timer = threading.Lock(), None
        if mode == "none" or total == 0 or self.stream is None:
            return
        delay = DELAY_S if delay is None else delay
        if delay <= 0:
            self._appear()
        else:
            self._timer = threading.Timer(delay, self._appear)
            self._timer.daemon = True
            self._timer.start()

    def _appear(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self.mode == "bar":
                from tqdm.auto import tqdm

                thread_lock_for_bars()
                self._bar = tqdm(total=self.total, initial=self.done, desc=self.what, unit=self.unit,
                                 file=self.stream, leave=False, dynamic_ncols=True)
            else:
                self._say(self.opening)

    def _say(self, text: str | None = None) -> None:
        print(text or f"{self.what}: {self.done:,}/{self.total:,} {self.units}", file=self.stream, flush=True)
        self._said = self.clock()

    def tick(self) -> None:
        with self._lock:
            self.done += 1
            if self._bar is not None:
                self._bar.update(1)
            elif self._said is not None and not self._closed and self.clock() - self._said >= EVERY_S:
                self._say()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def __enter__(self) -> Counter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shown(items: Sequence[T], what: str, unit: str, mode: Mode, units: str | None = None, **counter) -> Iterator[T]:
    """The items, one by one, with `what` ("tokenizing train.jsonl") shown as `mode` says while the
    caller works on them (Counter); `unit` names one ("record"), `units` several (default: unit + "s")."""
    if mode == "none":
        yield from items
        return
    with Counter(what, unit, units or unit + "s", len(items), mode, **counter) as count:
        for item in items:
            yield item
            count.tick()


def large_folder(doing: str, folder, size: int | None) -> None:
    """One line on stderr before a folder of `size` bytes is written, checked or read ("writing",
    "checking", "reading"), when it is large (a checkpoint of a full fine-tune: tens of GiB, minutes at a
    disk's speed); through tqdm, so a training bar is redrawn below it."""
    if size is not None and size >= LARGE_FOLDER:
        from tqdm import tqdm

        tqdm.write(f"{doing} {folder} ({human_bytes(size)})", file=sys.stderr)
