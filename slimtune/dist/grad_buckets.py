"""Whole-tensor gradients summed across ranks while backward still runs (what DDP's reducer does,
for an engine whose forward does not go through DDP's wrapper: the resident engine's).

The trained tensors are cut into buckets of at most distributed.BUCKET_BYTES, in the reverse of
their registration order (roughly the order backward completes them). On the step's last
micro-batch, a tensor is ready once its gradient is complete; a bucket is launched, flattened, as
one asynchronous all-reduce once all its tensors are ready and every bucket before it has been
launched. The launch order is therefore the same on every rank whatever order the hooks fire in,
which collectives need. `finish()` launches what is left, waits for all, and copies the sums back.

When is a gradient complete? Normally at its accumulate-grad hook: autograd sums every use of a
tensor before it adds into .grad, once per backward. A checkpointed block run in tiles of tokens
(step/seq_tiles.py) back-propagates each tile on its own, so each of its tensors' hooks fires once
per tile, every time with a partial sum. Blocks run backward one after the other, so such a tensor
(`groups`: its block) is complete once a hook of a tensor outside its block fires, or at `finish()`:
the lsp engine ends its blocks the same way (lsp/updates.py).
"""

from __future__ import annotations

import torch

from slimtune.dist import ranks as distributed
from slimtune.dist.ranks import Dist


class GradientBuckets:
    def __init__(self, dist: Dist, params: list[torch.Tensor], groups: dict[int, int] | None = None):
        """`groups`: id(tensor) -> its block, for the tensors whose gradient may come in parts."""
        self.dist = dist
        self.buckets = distributed.buckets(list(reversed(params)))
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.group_of = groups or {}
        self.armed = self.in_parts = False
        self._ready: list[int] = []
        self._next = 0
        self._flights: list[tuple] = []  # Dist.start_sum's, in launch order
        self._group: int | None = None  # in parts: the block backward is in, and its tensors so far
        self._open: set[int] = set()

    def arm(self, in_parts: bool = False) -> None:
        """The coming backward completes the step's gradients: sum each bucket as it fills. `in_parts`:
        the grouped tensors get their gradients in parts (their blocks run in tiles)."""
        self.armed, self.in_parts = True, in_parts
        self._ready, self._next, self._flights = [0] * len(self.buckets), 0, []
        self._group, self._open = None, set()

    def ready(self, param: torch.Tensor) -> None:
        """Autograd added into a tensor's gradient (its accumulate-grad hook)."""
        if not self.armed or id(param) not in self.bucket_of:
            return
        if not self.in_parts:
            self._complete([id(param)])
            return
        group = self.group_of.get(id(param))
        if group != self._group:  # backward has left the open block: its gradients are whole
            self._close_group()
        if group is None:
            self._complete([id(param)])
        else:
            self._group = group
            self._open.add(id(param))

    def _close_group(self) -> None:
        done, self._group, self._open = self._open, None, set()
        self._complete(done)

    def _complete(self, ids) -> None:
        for key in ids:
            self._ready[self.bucket_of[key]] += 1
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
        self._close_group()
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        flights, self._flights, self.armed = self._flights, [], False
        for flight in flights:
            self.dist.finish_sum(flight)
