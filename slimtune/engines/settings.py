"""A run's settings as the registered engines shape them. config.py reads YAML and overrides into
plain dataclasses and knows no engine; here the registry's engines are handed to it: the sections a
file may hold, each engine's section filled with its defaults when not given (so a plan can switch
engine), the help's engine list, and the checks that need an engine (its name, its own check, the
dist.strategy it runs, the engines a 4-bit base can train with, the card a plan is for).

Every RunConfig slimtune runs comes from `load` here (the CLI, train, the planner, the demo), or from
`complete` for one built in code."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Callable

from slimtune import config, presets
from slimtune.config import RunConfig
from slimtune.config_sources import listed, say_warning, unread_by_choice, unread_sections
from slimtune.engines import registry
from slimtune.errors import UserError


def load(path: str | Path | None, overrides: list[str] = (), base: dict | None = None,
         warn: Callable[[str], None] | None = None) -> RunConfig:
    """Read YAML (or start from `base`), apply `a.b=value` overrides, build, complete and validate. A
    key is named by where the user gave it (the YAML file's line, or the command line). `warn` hears,
    once, of settings the user gave (in the file or an override, not in `base`) that the run will not
    read: another engine's section; by default a line on stderr (rank 0's alone under torchrun)."""
    found = config.read(path, overrides, base, sections=sections())
    cfg = complete(found.cfg)
    validate(cfg)
    ignored = unread_sections(cfg, found.given)
    if ignored:
        (warn or say_warning)(f"{listed(ignored)} {'is' if len(ignored) == 1 else 'are'} set but engine is"
                              f" {cfg.engine}: ignored.")
    settles_open = bool(registry.get(cfg.engine).open_settings(cfg))
    for sentence in unread_by_choice(cfg, found.given, found.typed, settles_open):
        (warn or say_warning)(f"{sentence}.")
    planned = _chosen_by_the_planner(cfg, found.given)
    if planned:
        (warn or say_warning)(f"{listed(planned)} {'is' if len(planned) == 1 else 'are'} set, but plan=auto chooses the"
                              " engine and its options and may replace them (the plan it picks is said when the run"
                              " starts); leave plan=auto out to train as set.")
    return cfg


def _chosen_by_the_planner(cfg: RunConfig, given: list[str]) -> list[str]:
    """The given settings that plan=auto's plans set (engine, precision, activations.checkpoint, ...):
    its choice replaces them (a run that asked for engine=slide and plan=auto trained resident, unsaid)."""
    if cfg.plan != "auto":
        return []
    keys = {key for cards in (1, 2) for plan in registry.plans_for(cfg.method, cards) for key in plan}
    return [key for key in given if key in keys]


def sections() -> dict[str, type]:
    """Each registered engine's settings section (a dataclass) by engine name; an engine may have none."""
    return {spec.name: spec.section for spec in registry.specs() if spec.section is not None}


def complete(cfg: RunConfig) -> RunConfig:
    """`cfg` with every registered engine's section: the one it holds, else that section's defaults."""
    return dataclasses.replace(cfg, sections={name: cfg.sections.get(name) or section()
                                              for name, section in sections().items()})


def help_text(width: int | None = None) -> list[str]:
    """`slimtune train --help`'s settings: one entry per key, every engine listed under `engine` with its
    section; `width`: each help wrapped to that many columns."""
    return config.help_text(summaries={spec.name: spec.summary for spec in registry.specs()}, sections=sections(),
                            width=width)


def validate(cfg: RunConfig) -> None:
    """Refuse a complete RunConfig's first mistake in one sentence: each section's own check, the
    engine's name, a 4-bit base with method=full, the settings across sections, the card, the
    engine's dist.strategy and last the engine's own check."""
    cfg.check_sections()
    _known_engine(cfg.engine)
    if cfg.quant.scheme != "none" and cfg.method == "full":
        raise UserError(_quant_needs_lora(cfg))
    if cfg.loss.mode == "subset" and cfg.method == "full":
        raise UserError("loss.mode=subset needs a frozen LM head; with method=full the head trains. Use loss.mode=exact.")
    if cfg.plan == "auto" and cfg.gpu is None and cfg.device == "cpu":
        raise UserError("plan=auto needs gpu (e.g. --gpu 8GiB) when training on the CPU.")
    if cfg.gpu is not None:
        presets.gpu_profile(cfg.gpu)  # a card the planner knows, a size or a profile: said now, not when planning
    spec = registry.get(cfg.engine)
    if cfg.dist.strategy not in spec.strategies:
        raise UserError(f"dist.strategy={cfg.dist.strategy} is not available with engine {cfg.engine}, which offers"
                        f" {' or '.join(spec.strategies)}; use dist.strategy={spec.strategies[0]} or engine=resident.")
    spec.validate(cfg)


def _known_engine(name: str) -> None:
    names = registry.names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(f"engine must be one of {', '.join(names)}; got {name!r}{hint}.")


def _quant_needs_lora(cfg: RunConfig) -> str:
    """What is true of a 4-bit base with method=full: the engines that take it with LoRA (each
    engine's own check says, on the run's other settings as given), and whether this one is among them."""
    lora_engines = [name for name in registry.names() if _accepts(dataclasses.replace(cfg, engine=name, method="lora"))]
    said = f"quant.scheme={cfg.quant.scheme} quantizes frozen weights, but method=full trains every weight"
    if cfg.engine in lora_engines:
        return f"{said}; use method=lora (a 4-bit base with LoRA adapters)."
    where = f"engine {_either(lora_engines)}" if lora_engines else "no engine with these settings"
    return (f"{said}, and engine={cfg.engine} trains full weights only; a 4-bit base needs method=lora, on {where}"
            f" (or set quant.scheme=none to train every weight with engine={cfg.engine}).")


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _accepts(cfg: RunConfig) -> bool:
    try:
        validate(cfg)
    except UserError:
        return False
    return True
