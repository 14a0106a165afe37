"""Whole-tensor gradients summed across ranks while backward still runs (what DDP's reducer does,
for an engine whose forward does not go through DDP's wrapper: the resident engine's).

The trained tensors are cut into buckets of at most distributed.BUCKET_BYTES, in the reverse of
their registration order (roughly the order backward completes them). On the step's last
micro-batch, each tensor's accumulate-grad hook marks it ready; a bucket is launched, flattened, as
one asynchronous all-reduce once all its tensors are ready and every bucket before it has been
launched. The launch order is therefore the same on every rank whatever order the hooks fire in,
which collectives need. `finish()` launches what is left, waits for all, and copies the sums back.
"""

from __future__ import annotations

import torch

from slimtune.dist import ranks as distributed
from slimtune.dist.ranks import Dist


class GradientBuckets:
    def __init__(self, dist: Dist, params: list[torch.Tensor]):
        self.dist = dist
        self.buckets = distributed.buckets(list(reversed(params)))
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.armed = False
        self._ready: list[int] = []
        self._next = 0
        self._flights: list[tuple] = []  # Dist.start_sum's, in launch order

    def arm(self) -> None:
        """The coming backward completes the step's gradients: sum each bucket as it fills."""
        self.armed, self._ready, self._next, self._flights = True, [0] * len(self.buckets), 0, []

    def ready(self, param: torch.Tensor) -> None:
        """A tensor's gradient is complete (its accumulate-grad hook)."""
        if not self.armed or id(param) not in self.bucket_of:
            return
        self._ready[self.bucket_of[id(param)]] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, k: int) -> None:
        grads = [p.grad for p in self.buckets[k] if p.grad is not None]
        if grads:
            self._flights.append(self.dist.start_sum(grads, "the gradient sum"))

    def finish(self) -> None:
        """Every bucket launched (those whose tensors got no gradient this step: what they have), all
        sums waited for and copied into the gradients."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        flights, self._flights, self.armed = self._flights, [], False
        for flight in flights:
            self.dist.finish_sum(flight)
