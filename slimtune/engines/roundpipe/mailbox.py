"""Hand-offs between workers, and the run's stop when one of them fails.

Every boundary value (a stage's output, an input gradient) is a host tensor put under a key
(job index, micro-batch) by its producer and taken once by its consumer: the host counting
semaphore and per-micro-batch events of the spec become one condition variable here, since on
every backend the value crosses the host anyway. Putting a key twice is an error (a schedule bug,
never silently overwritten). When a worker fails, `fail` wakes every waiter with the failure, so
no worker waits for a micro-batch that will never come; a step begun before the one before it ended
has its mailbox fail with that one's (`passes_failure_to`).
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
        self._followers: list[Mailbox] = []
        self.timeout_s = timeout_s  # a waiter gives up after this long (None: never)

    def put(self, key: tuple, value: object) -> None:
        with self._ready:
            if key in self._items:
                raise RuntimeError(f"pipeline hand-off {key} was set twice")
            self._items[key] = value
            self._ready.notify_all()

    def take(self, key: tuple) -> object:
        with self._ready:
            self._wait_for(key)
            return self._items.pop(key)

    def wait(self, key: tuple) -> None:
        """Until `key` has been put; it stays for every other waiter (a flag, not a hand-off)."""
        with self._ready:
            self._wait_for(key)

    def _wait_for(self, key: tuple) -> None:
        found = self._ready.wait_for(lambda: key in self._items or self._failure is not None, self.timeout_s)
        if self._failure is not None:
            raise self._failure
        if not found:
            raise WorkerFailed(f"roundpipe: nothing arrived for hand-off {key} within {self.timeout_s:.0f} s;"
                               " a worker hangs, so the run stops.")

    def fail(self, error: BaseException) -> None:
        with self._ready:
            if self._failure is None:
                self._failure = error
            self._ready.notify_all()
            followers = list(self._followers)
        for follower in followers:
            follower.fail(error)

    def passes_failure_to(self, follower: "Mailbox") -> None:
        """A failure here (now or later) fails `follower` too: the next step's jobs stop with this one's."""
        with self._ready:
            self._followers.append(follower)
            failed = self._failure
        if failed is not None:
            follower.fail(failed)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def leftover(self) -> list[tuple]:
        return sorted(self._items)
