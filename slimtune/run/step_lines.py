"""--no-progress: the training loop's progress as lines, not a bar. A log file or a pipe then shows a long
run moving, at most a line every EVERY_S seconds (and after the first and the last step), instead of
nothing (tqdm's bar written to a file is a stream of carriage returns). Rank 0's only: the others say
nothing, as with the bar. What runs between two steps (an evaluation, a checkpoint's save) is said too
when it outlasts EVERY_S (running()).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Callable

from slimtune.progress import EVERY_S


class StepLines:
    """tqdm's set_postfix / update / close, said as "step 120/500 loss=0.4512 tok_s=7771 mem=73.4 MiB"."""

    def __init__(self, total: int, initial: int, say: Callable[[str], None], every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.n, self.say, self.every_s, self.clock = total, initial, say, every_s, clock
        self.first, self.last_said, self.fields = initial + 1, float("-inf"), {}

    def set_postfix(self, refresh: bool = True, **fields: str) -> None:
        del refresh  # (tqdm's: redraw now) a line is said by update alone
        self.fields = fields

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.n in (self.first, self.total) or now - self.last_said >= self.every_s:
            self.say(" ".join([f"step {self.n}/{self.total}", *(f"{k}={v}" for k, v in self.fields.items())]))
            self.last_said = now

    @contextlib.contextmanager
    def running(self, doing: str) -> Iterator[None]:
        """`doing` ("saving step 500") said once it has run every_s, and again every every_s until it ends:
        a full fine-tune's save or a long evaluation takes minutes, where the lines would stop with no
        word. Work shorter than every_s says nothing (the lines' own rhythm)."""
        done, began = threading.Event(), time.monotonic()

        def watch() -> None:
            while not done.wait(self.every_s):
                self.say(f"{doing} ({time.monotonic() - began:.0f} s so far)")

        watcher = threading.Thread(target=watch, name="slimtune-step-lines", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()

    def close(self) -> None:
        pass
