"""Architecture-only presets: popular causal LMs (config, no weights) and GPU profiles.

The planner builds a preset's model on the meta device to count bytes, and times a plan
against a GPU profile's spec-sheet rates, so every time derived from these is modelled.
Values, and where each was checked, live in models.json and gpus.json beside this file.
`MODEL_PRESETS` is read on first use, so importing costs no file I/O.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from slimtune.errors import UserError

_HERE = Path(__file__).parent
# Keys in models.json that describe a preset rather than configure the model.
_META_KEYS = ("hf_id", "source", "params")
# The card whose rates a plain memory size borrows: a common, well-documented consumer GPU.
GENERIC_RATES_FROM = "rtx4090"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(tib|tb|t|gib|gb|g|mib|mb|m)\s*$", re.IGNORECASE)
_CARD_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|g|mib|mb|m)\s*$", re.IGNORECASE)  # no card holds a TB
# What a user meant as a size, right or wrong: a number of any form (signed, exponent, nan) and a unit.
_SIZE_LIKE = re.compile(r"^\s*[-+]?[\d.]*(?:e[-+]?\d+|nan|inf)?\s*(tib|tb|t|gib|gb|g|mib|mb|m|kib|kb|k|b)\s*$",
                        re.IGNORECASE)
# A user typing 24GB means the nominal 24 (GiB) size: GB and G count as GiB, TB as TiB, MB as MiB.
# That is how cards and RAM are sold; disks are sold in decimal units (disk_size).
_UNIT_BYTES = {"t": 2**40, "g": 2**30, "m": 2**20}
_DECIMAL_BYTES = {"t": 10**12, "g": 10**9, "m": 10**6}


@functools.cache
def _load(name: str) -> dict:
    return json.loads((_HERE / name).read_text())


def __getattr__(name: str):
    # PEP 562: the module-level dicts exist on first access, not at import.
    if name == "MODEL_PRESETS":
        return _load("models.json")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def preset_names() -> list[str]:
    return list(_load("models.json"))


def _find_preset(name: str) -> str | None:
    wanted = name.strip().lower()
    return next((key for key in _load("models.json") if key.lower() == wanted), None)


def model_config(name_or_folder: str):
    """A `transformers.PretrainedConfig` for a preset name (any case), a local model folder or a Hub
    name (org/name).

    From a folder only config.json is read, so a planner can size a model whose weights
    are not there; from the Hub only config.json is fetched (into the Hub cache). A real folder
    wins over a preset of the same name: it is the truth about that checkpoint."""
    from transformers import AutoConfig

    if Path(name_or_folder).is_dir():
        from slimtune.model.stack import check_depth_of_folder, read_config

        # refuses a missing config.json, an unsupported family, or fields no model has
        config = read_config(name_or_folder)
        check_depth_of_folder(name_or_folder, config)  # weights beside it: a damaged config.json is said at once
        try:
            return AutoConfig.from_pretrained(str(name_or_folder), local_files_only=True)
        except (OSError, ValueError) as err:
            raise UserError(f"config.json in '{name_or_folder}' is not a usable model config ({err}).") from None
    key = _find_preset(name_or_folder)
    if key is None:
        from slimtune.model import hub

        if hub.is_hub_name(name_or_folder):  # a Hub model: its config.json alone is fetched, then read as a folder
            return model_config(hub.config_folder(name_or_folder))
        raise UserError(
            f"'{name_or_folder}' is neither a model folder, a preset nor a Hub name (org/name); presets:"
            f" {', '.join(preset_names())}."
        )
    settings = {k: v for k, v in _load("models.json")[key].items() if k not in _META_KEYS}
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


@dataclass(frozen=True)
class GpuProfile:
    """What the planner knows of a GPU: spec-sheet rates, not measurements (unless probed)."""

    name: str
    memory_bytes: int
    bf16_tflops: float  # dense bf16 tensor-core peak, fp32 accumulate
    fp32_tflops: float  # dense fp32 peak without tensor cores (PyTorch's default for fp32 matmuls)
    memory_gbps: float  # device memory bandwidth, GB/s
    host_link_gbps: float  # realistic one-direction pinned host<->device, GB/s
    description: str = ""
    generic_rates: bool = False  # the rates are GENERIC_RATES_FROM's: this device's own are unknown
    rates: str = "spec-sheet"  # where the rates come from, as the planner's footnote says it


_NUMBERS = ("memory_bytes", "bf16_tflops", "fp32_tflops", "memory_gbps", "host_link_gbps")
_FORMS = (
    "a named card ({names}), a memory size such as 24GiB, 24GB, 8G, 12.5GiB or 500MiB, "
    "or a JSON file with the fields {fields}"
)


def _normal(text: str) -> str:
    # "RTX-4090", "rtx 4090" and "4090" should all find the card.
    key = re.sub(r"[^a-z0-9]", "", text.lower())
    for prefix in ("nvidia", "geforce", "rtx"):
        key = key.removeprefix(prefix)
    return key


@functools.cache
def _card_index() -> dict[str, str]:
    index = {}
    for name, card in _load("gpus.json").items():
        for alias in (name, *card.get("aliases", ())):
            index[_normal(alias)] = name
    return index


def _named(name: str) -> GpuProfile:
    card = _load("gpus.json")[name]
    return GpuProfile(name=name, description=card["description"], **{k: card[k] for k in _NUMBERS})


def memory_size(text: str, what: str) -> int:
    """Bytes of a memory size such as 64GiB, 64GB, 64G, 512MiB or 2TB (GB counts as GiB, as memory is
    sold); `what` names it in the sentence."""
    number, unit = _size_parts(text, what)
    return int(number * _UNIT_BYTES[unit[0]])


def disk_size(text: str, what: str) -> int:
    """Bytes of a disk size such as 200GB, 1TB or 500GiB: GB, TB and MB are decimal, as disks are sold
    (and as `df -H` counts), GiB, TiB and MiB binary; `what` names it in the sentence."""
    number, unit = _size_parts(text, what)
    return int(number * (_UNIT_BYTES if "i" in unit else _DECIMAL_BYTES)[unit[0]])


def _size_parts(text: str, what: str) -> tuple[float, str]:
    """A size's number and its unit (lower case), or one sentence naming `what`."""
    size = _SIZE.match(str(text))
    if not size or float(size.group(1)) <= 0:
        raise UserError(f"{what} must be {_size_fault(str(text))} such as 64GiB, 64GB, 512MiB or 2TB, got '{text}'.")
    return float(size.group(1)), size.group(2).lower()


def _size_fault(text: str) -> str:
    """What a size that did not parse lacks, for the sentence: its unit, its number's form, or its sign."""
    like = _SIZE_LIKE.match(text)
    if not like:
        return "a size"
    if like.group(1).lower() in ("kib", "kb", "k", "b"):
        return "a size in MiB, MB, GiB, GB, TiB or TB"
    if re.search(r"\de[-+]?\d", text, re.IGNORECASE):
        return "a plain number (no exponent) with a unit"
    return "a positive size"


def physical_ram_bytes() -> int:
    """This machine's RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _sized(number: str, unit: str) -> GpuProfile:
    size = memory_size(number + unit, "a GPU size")
    rates = _named(GENERIC_RATES_FROM)
    return GpuProfile(
        name=f"generic-{number}{unit}",
        memory_bytes=size,
        bf16_tflops=rates.bf16_tflops,
        fp32_tflops=rates.fp32_tflops,
        memory_gbps=rates.memory_gbps,
        host_link_gbps=rates.host_link_gbps,
        description=f"generic card with {size / 2**30:g} GiB; rates of the {GENERIC_RATES_FROM} (generic)",
    )


def _from_file(path: Path, spec: str) -> GpuProfile:
    """A profile JSON (as `slimtune probe` writes): the number fields required, others optional."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"GPU profile file '{spec}' is not readable JSON ({err}).") from None
    if not isinstance(data, dict):
        raise UserError(f"GPU profile file '{spec}' must hold a JSON object.")
    missing = [k for k in _NUMBERS if k not in data]
    bad = [k for k in _NUMBERS if k in data and not _positive(data[k])]
    if "memory_bytes" in data and "memory_bytes" not in bad and data["memory_bytes"] < 1:
        bad.append("memory_bytes")  # a fraction of a byte: a 0 B card
    if missing or bad:
        raise UserError(f"GPU profile file '{spec}' needs positive finite numbers for: {', '.join(missing + bad)}.")
    known = {f.name for f in fields(GpuProfile)}
    values = {k: v for k, v in data.items() if k in known}
    values.setdefault("name", path.stem)
    values.setdefault("description", f"profile from {path}")
    values.setdefault("rates", "profile file's")  # `slimtune probe` writes "measured"
    values["memory_bytes"] = int(values["memory_bytes"])
    return GpuProfile(**values)


def _positive(value) -> bool:
    """A finite number above 0 (json reads 1e400 as inf, and Infinity and NaN as themselves)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def gpu_profile(spec: str) -> GpuProfile:
    """A named card (any case, with aliases), a plain memory size, or a profile JSON file."""
    text = str(spec).strip()
    name = _card_index().get(_normal(text)) if text else None
    if name:
        return _named(name)
    size = _CARD_SIZE.match(text)
    if size and float(size.group(1)) > 0:
        return _sized(size.group(1), size.group(2))
    if text and Path(text).is_file():
        return _from_file(Path(text), text)
    if text.lower().endswith(".json") or os.sep in text:  # meant as a profile file: say what is wrong with it
        where = "is a folder, not a JSON file" if Path(text).is_dir() else "does not exist"
        raise UserError(f"GPU profile file '{spec}' {where}; `slimtune probe --out FILE` writes one.")
    if _SIZE_LIKE.match(text):  # 0GiB, -8GB, 1e3GiB: meant as a size, not a card's name
        raise UserError(f"a GPU size must be a positive number of GiB, GB, G, MiB, MB or M, such as 24GiB or 500MiB;"
                        f" got '{spec}'.")
    forms = _FORMS.format(names=", ".join(_load("gpus.json")), fields=", ".join(_NUMBERS))
    raise UserError(f"unknown GPU '{spec}': give {forms}.")


def device_profile(device) -> GpuProfile:
    """The card a run is on: its real memory size, with the rates of the named card of the same
    name when there is one, else generic rates (modelled speed only; memory decides fits)."""
    import torch

    if device.type != "cuda":
        return replace(_named(GENERIC_RATES_FROM), name="cpu", memory_bytes=physical_ram_bytes(),
                       description="this machine's RAM", generic_rates=True)
    props = torch.cuda.get_device_properties(device)
    name = _card_index().get(_normal(props.name))
    base = _named(name or GENERIC_RATES_FROM)
    return replace(base, name=props.name, memory_bytes=props.total_memory, generic_rates=name is None)
