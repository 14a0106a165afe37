"""Engines: how a training step runs on the device and the host, one module each.

An engine is a module here, or a folder whose engine.py registers it (with the engine's own parts
beside it); it registers itself (registry.register) when imported. Importing this package imports
every engine in it, so the built-in engines are always known. The interface they implement
is engines.base.Engine; train.py runs any of them through it. engines.settings reads a run's
settings with the registered engines' sections and checks (config.py knows no engine).
"""

from __future__ import annotations

import importlib
import pkgutil

from slimtune.engines.registry import EngineSpec, get, names, plans_for, register, unregister

__all__ = ["EngineSpec", "get", "names", "plans_for", "register", "unregister"]

_NOT_ENGINES = {"base", "registry", "settings"}

for _found in pkgutil.iter_modules(__path__):
    if _found.name not in _NOT_ENGINES:
        importlib.import_module(f"{__name__}.{_found.name}" + (".engine" if _found.ispkg else ""))
