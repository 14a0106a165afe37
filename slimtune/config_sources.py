"""Where each setting the user gave came from (a YAML file's line, or the command line), for the sentence
that names a mistyped key; and which given settings the run will not read (another engine's section),
said once as a warning. config.read keeps one Sources while it reads the file and the overrides."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from slimtune.errors import UserError


class Sources:
    """Dotted key -> 'in FILE line N' or 'on the command line'; an override replaces what the file
    said under its key. A key given by neither is placed by `default` (the file as a whole, or the
    settings a caller handed in)."""

    def __init__(self, default: str):
        self.default = default
        self.places: dict[str, str] = {}
        self.texts: dict[str, str] = {}  # a scalar's text as written (a text setting YAML read as a number: 0755)

    def give(self, key: str, place: str, text: str | None = None) -> None:
        self.places = {k: v for k, v in self.places.items() if k != key and not k.startswith(key + ".")}
        self.texts = {k: v for k, v in self.texts.items() if k != key and not k.startswith(key + ".")}
        self.places[key] = place
        if text is not None:
            self.texts[key] = text

    def note_lines(self, node: yaml.Node, prefix: str, path: Path) -> None:
        """Each key's line in a composed YAML document, nested sections' keys dotted. A key given twice
        in one mapping is refused: YAML readers keep the last without a word."""
        if not isinstance(node, yaml.MappingNode):
            return
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
            if key in seen:
                raise UserError(f"{path} line {line}: '{key}' is given twice (first on line {seen[key]}); keep one.")
            seen[key] = line
            text = value_node.value if isinstance(value_node, yaml.ScalarNode) else None
            self.give(key, f"in {path} line {line}", text)
            self.note_lines(value_node, key + ".", path)

    def of(self, key: str) -> str:
        """Where `key` was given: its own place, else that of a key given under it (`trian.steps=3` on
        the command line gives `trian`), else that of the section it sits in."""
        if key not in self.places:
            inner = next((place for k, place in self.places.items() if k.startswith(key + ".")), None)
            if inner is not None:
                return inner
        parts = key.split(".")
        while parts:
            place = self.places.get(".".join(parts))
            if place is not None:
                return place
            parts.pop()
        return self.default

    def given(self) -> list[str]:
        """The keys given, the innermost of each (chunk.n_chunks rather than chunk), in order."""
        return [k for k in self.places if not any(other.startswith(k + ".") for other in self.places)]


def unread_sections(cfg, given: list[str]) -> list[str]:
    """The given keys of engine sections the run (a RunConfig) does not read. A section is read by its
    own engine, or by another that says so (the section's `read_by(cfg)`: slide's chunk working set
    reads chunk.*). None under plan=auto: the planner chooses the engine later."""
    if cfg.plan == "auto":
        return []
    unread = set(cfg.sections) - _read_sections(cfg)
    return [key for key in given if key.split(".")[0] in unread]


def _read_sections(cfg) -> set[str]:
    """The engine sections the run reads: its engine's, and any whose `read_by(cfg)` says so."""
    read = set()
    for name, section in cfg.sections.items():
        read_by = getattr(section, "read_by", None)
        if read_by(cfg) if read_by is not None else cfg.engine == name:
            read.add(name)
    return read


def unread_by_choice(cfg, given: list[str], typed: list[str], settles_open: bool) -> list[str]:
    """Given settings that the run's method or plan leaves unread, each group with why: lora.* under
    method=full and freeze under method=lora when typed on the command line (a file's lora section under
    a `method=full` override is a file kept for both), gpu (--gpu) wherever given when neither plan=auto
    nor settings the engine leaves to the planner (`settles_open`: chunk.n_chunks=0) read it."""
    unread = []
    lora = [key for key in typed if key == "lora" or key.startswith("lora.")]
    if lora and cfg.method == "full":
        unread.append(f"{listed(lora)} {'is' if len(lora) == 1 else 'are'} set but method is full: ignored")
    if "freeze" in typed and cfg.method == "lora":
        unread.append("freeze is set but method is lora (only the adapters train): ignored")
    if "gpu" in given and cfg.plan != "auto" and not settles_open:
        unread.append("gpu (--gpu) is set but plan is manual: ignored; add plan=auto to plan for that card")
    unread += [f"{listed(keys)} {'is' if len(keys) == 1 else 'are'} set but {why}: ignored"
               for keys, why in [*_unread_by_setting(cfg, given), *_unread_in_sections(cfg, given)]]
    return unread


def _unread_in_sections(cfg, given: list[str]) -> list[tuple[list[str], str]]:
    """What the run's engine sections say their own settings leave unread (a section's optional
    `unread_given(given)`: slide.moments_dir without slide.moments=disk), for the sections the run reads."""
    if cfg.plan == "auto":  # the planner picks the engine, and its options, later
        return []
    return [found for name in sorted(_read_sections(cfg)) if hasattr(cfg.sections[name], "unread_given")
            for found in cfg.sections[name].unread_given(given)]


def _unread_by_setting(cfg, given: list[str]) -> list[tuple[list[str], str]]:
    """Given settings that another setting's value leaves unread: the block files' folder without
    checkpoint=disk, a tracker's options with the tracker off (each ran without a word)."""
    found, acts = [], cfg.activations
    for keys, off, why in (
            (["activations.disk_dir"], acts.checkpoint != "disk", f"activations.checkpoint is {acts.checkpoint}, not disk"),
            (["activations.seq_tile", "activations.mlp_chunk", "activations.cache"], acts.checkpoint == "none",
             "activations.checkpoint is none (tiles and the cache are checkpointed blocks')"),
            (["activations.last_k"], acts.cache != "last_k", f"activations.cache is {acts.cache}, not last_k"),
            (["log.wandb_project", "log.wandb_mode"], not cfg.log.wandb, "log.wandb is false"),
            (["log.mlflow_tracking_uri", "log.mlflow_experiment"], not cfg.log.mlflow, "log.mlflow is false")):
        named = [key for key in keys if key in given]
        if named and off:
            found.append((named, why))
    return found


def listed(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"


def say_warning(text: str) -> None:
    """A line on stderr; under torchrun every rank loads the settings, and rank 0 alone says it."""
    if os.environ.get("RANK", "0") == "0":
        print(f"slimtune: warning: {text}", file=sys.stderr)
