"""Hand-offs between workers, and the run's stop when one of them fails.

Every boundary value (a stage's output, an input gradient) is a host tensor put under a key
(job index, micro-batch) by its producer and taken once by its consumer: the host counting
semaphore and per-micro-batch events of the spec become one condition variable here, since on
every backend the value crosses the host anyway. Putting a key twice is an error (a schedule bug,
never silently overwritten). When a worker fails, `fail` wakes every waiter with the failure, so
no worker waits for a micro-batch that will never come.
"""

from __future__ import annotations

import threading

from slimtune.errors import UserError


class WorkerFailed(UserError):
    """A worker stopped the step; the message names it and what it was running."""


class Mailbox:
    def __init__(self, timeout_s: float | None = None):
        self._ready = threading.Condition()
        self._items: dict[tuple, object] = {}
        self._failure: BaseException | None = None
        self.timeout_s = timeout_s  # a waiter gives up after this long (None: never)

    def put(self, key: tuple, value: object) -> None:
        with self._ready:
            if key in self._items:
                raise RuntimeError(f"pipeline hand-off {key} was set twice")
            self._items[key] = value
            self._ready.notify_all()

    def take(self, key: tuple) -> object:
        with self._ready:
            found = self._ready.wait_for(lambda: key in self._items or self._failure is not None, self.timeout_s)
            if self._failure is not None:
                raise self._failure
            if not found:
                raise WorkerFailed(f"roundpipe: nothing arrived for hand-off {key} within {self.timeout_s:.0f} s;"
                                   " a worker hangs, so the run stops.")
            return self._items.pop(key)

    def fail(self, error: BaseException) -> None:
        with self._ready:
            if self._failure is None:
                self._failure = error
            self._ready.notify_all()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def leftover(self) -> list[tuple]:
        return sorted(self._items)
