"""What the planner shows while it weighs plans: a cold `slimtune plan` runs a fake training step for
every plan, 10-30 s on two cores (benchmarks/docs/plans.md), and plan=auto the same before training.
On a terminal a bar counts the plans weighed and is wiped once they are all in (the table or the
training follows); on a file or a pipe one line says what is being done, once; nothing where every
plan is already in the estimate cache."""

from __future__ import annotations

import sys
import threading
from typing import TextIO


class Weighing:
    """`who` heads the bar or the line ("slimtune plan"); `extra` follows the line's count (", and the
    longest sequence each fits"). `show` False: silent. `bar`: a bar (True) or the one line (False);
    None: a bar where `stream` (stderr) is a terminal. The planner calls start(total) once it knows how
    many plans it must weigh, then tick() after each, from any thread (the planning worker's answers
    arrive on another), and close() when done."""

    def __init__(self, who: str, extra: str = "", show: bool = True, stream: TextIO | None = None,
                 bar: bool | None = None):
        self.who, self.extra, self.show = who, extra, show
        self.stream = stream or sys.stderr
        self.as_bar = self.stream.isatty() if bar is None else bar
        self.total, self.done = 0, 0
        self._bar = None
        self._lock = threading.Lock()

    def start(self, total: int, exact: bool = True) -> None:
        """`total` plans to weigh (`exact` False: at most that many, as a bisection weighs)."""
        self.total, self.done = total, 0
        if not (self.show and total):
            return
        if not self.as_bar:
            count = f"{'' if exact else 'at most '}{total} plan{'s' if total != 1 else ''}"
            print(f"{self.who}: weighing {count} on fake tensors{self.extra}", file=self.stream, flush=True)
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=f"{self.who}: weighing plans", unit="plan", file=self.stream,
                         leave=False, dynamic_ncols=True)

    def tick(self) -> None:
        with self._lock:
            self.done += 1
            if self._bar is not None:
                self._bar.update(1)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def __enter__(self) -> Weighing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quiet() -> Weighing:
    """A Weighing that shows nothing (the planner's when its caller asks for none)."""
    return Weighing("", show=False)
