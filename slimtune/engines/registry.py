"""The engine registry: an engine is one module that declares itself here, once.

`register(EngineSpec(...))`, called at the engine module's import, puts in one place everything the
rest of slimtune needs to know of an engine: its settings section and their check (engines.settings
reads a run's settings with them: config knows no engine), the plans the planner weighs for it,
where the model is placed before it is built, its modelled step time, and its constructor. config,
train, planner and speed name no engine.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Callable

from slimtune import config


def _accepts_everything(cfg: config.RunConfig) -> None:
    del cfg


def _no_plans(method: str) -> list[dict]:
    del method
    return []


def _no_scratch(cfg: config.RunConfig) -> dict[str, str]:
    del cfg
    return {}


def _no_sample(cfg: config.RunConfig) -> int:
    del cfg
    return 0


def _nothing_open(cfg: config.RunConfig) -> list[dict]:
    del cfg
    return []


def _always(cfg: config.RunConfig) -> bool:
    del cfg
    return True


def _one_card(plan: dict, cards: int) -> dict:
    del cards
    return plan


def _one_block(cfg: config.RunConfig) -> int:
    del cfg
    return 1


def _one_pass(cfg: config.RunConfig) -> int:
    del cfg
    return 1


@dataclass(frozen=True)
class EngineSpec:
    name: str
    summary: str  # one line, for `slimtune train --help`
    # (stack, cfg: RunConfig, device, precision, dist: distributed.Dist) -> an engines.base.Engine;
    # every engine takes these five (dist: the ranks it sums its gradients across; SINGLE alone).
    build: Callable
    # (model_config, cfg, counts: speed.StepCounts, gpu, batch_size, seq_len) -> speed.StepTime, modelled.
    step_time: Callable
    section: type | None = None  # its settings: a dataclass of config.setting fields, read as cfg.section(name)
    validate: Callable[[config.RunConfig], None] = _accepts_everything  # refuses what it does not do, in a sentence
    plans: Callable[[str], list[dict]] = _no_plans  # method -> option sets (dotted keys) the planner weighs
    model_on_host: bool = False  # True: the model stays on the host and the engine moves what it needs
    # cfg -> {setting: folder} where it keeps scratch files of its own (checked writable before a run
    # loads anything; folders a killed run left there are removed at the next start).
    scratch: Callable[[config.RunConfig], dict[str, str]] = _no_scratch
    # cfg -> how many blocks at each end of the stack the engine treats unlike the blocks between
    # (e.g. it prefetches that far ahead): the estimate by depth fits those blocks one by one.
    block_margin: Callable[[config.RunConfig], int] = _one_block
    # cfg -> False: the estimate runs this engine's step at full depth (what its step holds depends on
    # a partition of the whole model, so two shallow probes cannot give the deep step; see
    # estimate._by_depth).
    by_depth: Callable[[config.RunConfig], bool] = _always
    # cfg -> the passes over the model (forward and backward) its estimate's fake step makes: the
    # planner hands out the plans with the most first, so that the longest estimates do not come last.
    estimate_passes: Callable[[config.RunConfig], int] = _one_pass
    # (precision, method) -> the dtype the model is loaded in; None: assembly.weight_dtype's rule.
    weight_dtype: Callable | None = None
    # cfg -> settings the run left to the planner (e.g. chunk.n_chunks=0): candidate overrides, in
    # order of preference, of which a run takes the first that fits its card (train.build); [] if none.
    open_settings: Callable[[config.RunConfig], list[dict]] = _nothing_open
    # cfg -> how many training examples the engine wants as its own sample (e.g. to fit projectors),
    # held out of training and handed to engine.use_sample(batches) by train.build; 0: none.
    sample_examples: Callable[[config.RunConfig], int] = _no_sample
    # (plan, cards) -> the plan on a machine with `cards` cards (e.g. one worker per card), or None
    # where the engine has nothing to offer with that many; the default runs on one card whatever the count.
    on_cards: Callable[[dict, int], dict | None] = _one_card
    # dist.strategy values it runs under torchrun: every engine sums its gradients across ranks (ddp);
    # one that also shards its state across ranks names fsdp too.
    strategies: tuple[str, ...] = ("ddp",)
    # True: one rank spreads over every card of its machine it is given (on_cards), so data
    # parallelism has one rank per machine, not one per card (planner.Machine.ranks).
    uses_cards: bool = False
    module: str = field(default="", compare=False)  # who registered it (set by register)


_SPECS: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> EngineSpec:
    """Declare an engine. A second registration under the same name must come from the same module
    (a re-import), never from another engine."""
    # The caller's frame alone: inspect.stack() reads every frame's source, 70 ms a register.
    module = sys._getframe(1).f_globals.get("__name__", "")
    known = _SPECS.get(spec.name)
    if known is not None and known.module != module:
        raise ValueError(f"engine {spec.name!r} is already registered by {known.module}")
    if spec.name in {f.name for f in dataclasses.fields(config.RunConfig)}:  # its section is a top-level key
        raise ValueError(f"engine name {spec.name!r} collides with the setting of that name")
    spec = EngineSpec(**{**spec.__dict__, "module": module})
    _SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Forget an engine (a test's own, or a notebook's that is about to be redefined)."""
    _SPECS.pop(name, None)


def get(name: str) -> EngineSpec:
    return _SPECS[name]


def names() -> list[str]:
    return list(_SPECS)


def specs() -> list[EngineSpec]:
    """Every registered engine, in the order they registered."""
    return list(_SPECS.values())


def plans_for(method: str, cards: int = 1) -> list[dict]:
    """Every engine-and-options combination the planner weighs for `method` on `cards` cards, as
    dotted-key settings."""
    found = ((spec.name, spec.on_cards(options, cards)) for spec in _SPECS.values() for options in spec.plans(method))
    return [{"engine": name, **options} for name, options in found if options is not None]
