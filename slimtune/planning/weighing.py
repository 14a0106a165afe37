"""What the planner shows while it weighs plans: a cold `slimtune plan` runs a fake training step for
every plan, 10-30 s on two cores (benchmarks/docs/plans.md), and plan=auto the same before training.
Once 2 s have passed (progress.Counter): on a terminal a bar counts the plans weighed and is wiped
once they are all in (the table or the training follows); on a file or a pipe one line says what is
being done, then the count at most every 30 s. Plans in the estimate cache are not counted, and
planning that ends within 2 s (every answer cached) shows nothing."""

from __future__ import annotations

import sys
from typing import TextIO

from slimtune import progress


class Weighing:
    """`who` heads the bar or the line ("slimtune plan"); `extra` follows the line's count (", and the
    longest sequence each fits"). `show` False: silent. `bar`: a bar (True) or lines (False); None: a bar
    where `stream` (stderr) is a terminal. The planner calls start(total) once it knows how many plans
    it must weigh, then tick() after each, from any thread (the planning worker's answers arrive on
    another), and close() when done. `delay`: progress.DELAY_S unless given (tests: 0)."""

    def __init__(self, who: str, extra: str = "", show: bool = True, stream: TextIO | None = None,
                 bar: bool | None = None, delay: float | None = None):
        self.who, self.extra, self.show, self.stream, self.bar, self.delay = who, extra, show, stream, bar, delay
        self.total = 0
        self._count: progress.Counter | None = None

    @property
    def done(self) -> int:
        return self._count.done if self._count is not None else 0

    def start(self, total: int, exact: bool = True) -> None:
        """`total` plans to weigh (`exact` False: at most that many, as a bisection weighs)."""
        self.total = total
        stream = self.stream or sys.stderr
        as_bar = progress.is_terminal(stream) if self.bar is None else self.bar
        mode = ("bar" if as_bar else "lines") if self.show else "none"
        count = f"{'' if exact else 'at most '}{total} plan{'s' if total != 1 else ''}"
        self._count = progress.Counter(f"{self.who}: weighing plans", "plan", "plans", total, mode, stream,
                                       opening=f"{self.who}: weighing {count} on fake tensors{self.extra}",
                                       delay=self.delay)

    def tick(self) -> None:
        if self._count is not None:
            self._count.tick()

    def close(self) -> None:
        if self._count is not None:
            self._count.close()

    def __enter__(self) -> Weighing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quiet() -> Weighing:
    """A Weighing that shows nothing (the planner's when its caller asks for none)."""
    return Weighing("", show=False)
