"""Autograd hooks that call back into an engine without keeping it alive."""

from __future__ import annotations

import weakref
from collections.abc import Callable


def weak_hook(method, *bound) -> Callable:
    """A tensor hook that calls an engine's bound `method` (with `bound` arguments first) while the
    engine lives. Autograd holds hooks from C++, where Python's collector cannot see the cycle
    engine -> model -> parameter -> hook -> engine: a hook holding the engine strongly keeps it,
    its weights and its optimizer state alive after the last reference (a second engine in one
    process, as device_checks and tests build, then shares the card with the first)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        target = ref()
        if target is not None:
            target(*bound, *args)
    return hook
