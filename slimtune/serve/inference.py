"""What a folder holds (a run, an adapter, a model), and loading it to generate and evaluate.

    resolve(folder)   a run's output_dir (config.yaml), a PEFT adapter folder (adapter_config.json),
                      a Hugging Face model folder (config.json) or a Hub model's name (org/name, fetched
                      into the Hub cache: model/hub.py), named in one sentence otherwise
    load(source)      the model and tokenizer on the device, frozen, in eval mode

A LoRA run is its base model with the adapter applied by slimtune.model.lora, never a merged copy written
to disk: the newest adapter, the result's (adapter/) or a later checkpoint's, picked as `slimtune
export` picks it. A full run is its model/ folder. Nothing trains, so the weights load as a frozen
LoRA base does (assembly.weight_dtype): fp32 on the CPU, bf16 on CUDA, where generation and the
loss run under bf16 autocast (the fp32 adapters over a bf16 base need it, as in training).

Paths a run recorded (config.yaml `model`, data.chat_template) may be relative to the folder its
training ran in. That folder is found from output_dir: a run written to `runs/a` from /w sits at
/w/runs/a, so /w is the run folder's path less output_dir's parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimtune import progress
from slimtune.store import results
from slimtune.errors import UserError


@dataclass(frozen=True)
class Source:
    """What resolve found: the folder the user named and what loads from it."""

    folder: Path
    kind: str  # "lora run" | "full run" | "adapter" | "model"
    weights: Path  # the HF folder loaded first: an adapter's base, else the model itself
    adapter: Path | None = None  # a PEFT adapter folder, or a checkpoint folder holding the adapter's tensors
    lora: dict | None = None  # the run's lora settings: a checkpoint's adapter is rebuilt from them
    step: int | None = None  # the training step the weights hold, where the run recorded it
    data: dict = field(default_factory=dict)  # the run's data settings (format, fields, chat template)
    base: Path | None = None  # the model a run started from: what --compare-base scores beside it
    base_error: str | None = None  # why a run's base cannot be found (said only when it is needed)

    def describe(self) -> str:
        step = f" at step {self.step}" if self.step is not None else ""
        if self.adapter is not None:
            origin = "a checkpoint's adapter" if self.adapter.name.startswith("step-") else "its adapter"
            return f"{self.kind} '{self.folder}' ({origin}{step} over '{self.weights}')"
        where = f" ({self.weights}{step})" if self.weights != self.folder else ""
        return f"{self.kind} '{self.folder}'{where}"

    def base_source(self) -> Source:
        """The model this one was trained from, as a Source of its own."""
        if self.base is None:
            raise UserError(self.base_error or f"'{self.folder}' is a model folder, not a run: it has no base model "
                                               "to compare with.")
        return Source(self.base, "base model", self.base, data=self.data)


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    precision: str  # "fp32" | "bf16": bf16 runs under autocast (step.precision.autocast_for)
    source: Source

    def describe(self) -> str:
        return f"{self.source.describe()} on {self.device} ({self.precision})"


# ---------------------------------------------------------------- what a folder is


def resolve(folder: str | Path) -> Source:
    from slimtune.model import hub

    if hub.is_hub_name(str(folder)):  # a Hub model by name: its snapshot folder, fetched when not cached
        folder = hub.folder(str(folder))
    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"'{folder}' does not exist; give a run's output_dir or a model folder.")
    if not folder.is_dir():
        raise UserError(f"'{folder}' is a file; give a run's output_dir or a model folder.")
    if (folder / "config.yaml").is_file():
        return _run(folder)
    if (folder / "adapter_config.json").is_file():
        return _adapter(folder)
    if (folder / "config.json").is_file():
        from slimtune.model.stack import read_config

        read_config(folder)  # a supported family, or one sentence saying which are
        return Source(folder, "model", folder)
    raise UserError(f"'{folder}' is neither a slimtune run (config.yaml), an adapter (adapter_config.json) nor a "
                    "model folder (config.json).")


def _run(folder: Path) -> Source:
    from slimtune.model import hub

    cfg = results.run_config(folder / "config.yaml")
    data = dict(cfg.get("data") or {})
    if data.get("chat_template"):
        found = results.trained_path(folder, cfg, data["chat_template"])
        data["chat_template"] = str(found) if found is not None else data["chat_template"]
    base = results.trained_path(folder, cfg, cfg["model"])
    missing = (f"the base model '{cfg['model']}' that run '{folder}' trained from (config.yaml `model`) is not "
               "found.")
    if cfg.get("method") == "full":
        model = folder / "model"
        if not (model / "config.json").is_file():
            raise UserError(f"run '{folder}' has no model/ yet (the run has not finished); finish it with "
                            "`slimtune train` first.")
        return Source(folder, "full run", model, step=_result_step(folder), data=data, base=base,
                      base_error=None if base else missing)
    from slimtune import export

    step, adapter = export.newest_adapter(folder)  # the same choice `slimtune export` makes, or its sentence
    if adapter.name == "adapter":
        recorded = _adapter_base(adapter)
        base = recorded if recorded is not None and recorded.is_dir() else base
    if base is None and hub.origin(cfg["model"]) is not None:  # a Hub snapshot a cleaned cache lost: fetched again
        base = Path(hub.folder(cfg["model"]))
    if base is None:
        raise UserError(missing)
    return Source(folder, "lora run", base, adapter, cfg.get("lora"), step, data, base)


def _adapter(folder: Path) -> Source:
    base = _adapter_base(folder)
    if base is None or not (base / "config.json").is_file():
        raise UserError(f"the base model '{base}' named by {folder / 'adapter_config.json'} "
                        "(base_model_name_or_path) is not a local model folder.")
    return Source(folder, "adapter", base, folder, base=base)


def _adapter_base(folder: Path) -> Path | None:
    """The base model's folder an adapter_config.json names: a local folder, or a Hub name (org/name,
    at its recorded revision) resolved to its snapshot, fetched if the cache lacks it."""
    from slimtune.model import hub

    path = folder / "adapter_config.json"
    try:
        named = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not readable JSON ({err}).") from None
    base = named.get("base_model_name_or_path")
    if base and not Path(base).exists() and hub.is_hub_name(base):
        return Path(hub.folder(base, named.get("revision")))
    return Path(base) if base else None


def _result_step(folder: Path) -> int | None:
    record = folder / "run.json"
    try:
        result = json.loads(record.read_text()).get("result") if record.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None
    return result.get("step") if isinstance(result, dict) else None


# ---------------------------------------------------------------- loading


def load_tokenizer(source: Source):
    from slimtune.model.stack import load_tokenizer as load

    return load(source.weights)


def load(source: Source, device_name: str = "auto", tokenizer=None) -> Loaded:
    """The model of `source` on the device (`auto`: CUDA when there is one), frozen and in eval mode."""
    from slimtune import assembly
    from slimtune.model.stack import load_model

    device = assembly.resolve_device(device_name, flag=True)
    precision = assembly.resolve_precision("auto", device)
    results.verify(source.weights, "model folder")  # a model/ or merged export slimtune wrote is whole
    if source.adapter is not None:
        results.verify(source.adapter, "adapter folder")  # said before the base model loads
    model = load_model(source.weights, assembly.weight_dtype(precision, "lora"), device)
    if source.adapter is not None:
        _apply_adapter(model, source)
    model.requires_grad_(False)
    model.eval()
    return Loaded(model, tokenizer if tokenizer is not None else load_tokenizer(source), device, precision, source)


def _apply_adapter(model: torch.nn.Module, source: Source) -> None:
    from slimtune.model import lora

    if (source.adapter / "adapter_config.json").is_file():
        lora.load_peft_adapter(model, source.adapter)
        return
    # A checkpoint: its trained tensors are the adapter's, by parameter name (as export.merge_run reads them).
    from safetensors.torch import load_file

    from slimtune.config import LoraConfig

    lora.apply(model, LoraConfig(**source.lora))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(str(source.adapter / "trainable.safetensors")).items():
            params[name].copy_(tensor)


# ---------------------------------------------------------------- generation


def stop_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """Tokens that end an answer: the tokenizer's eos and any the model's generation config adds
    (chat models often end a turn with a marker of their own)."""
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    own = own if isinstance(own, list) else [own]
    return list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *own] if i is not None))


def generation_settings(model: torch.nn.Module, tokenizer, max_new_tokens: int, temperature: float = 0.0):
    """Exactly the decoding asked for: greedy at temperature 0, else plain sampling at `temperature`
    (no top-k or top-p); none of the model's own generation defaults apply."""
    from transformers import GenerationConfig

    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=stop_ids(model, tokenizer),
                            pad_token_id=tokenizer.pad_token_id, use_cache=True, **sampling)


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, tokenizer, device: torch.device, prompts: list[list[int]],
                   max_new_tokens: int, batch_size: int = 50, precision: str = "fp32",
                   shown: progress.Mode = "none") -> list[str]:
    """Each prompt's greedy completion, decoded without special tokens: batches of left-padded
    prompts, so that every prompt ends where generation starts. An empty prompt (an empty prompt field,
    with a tokenizer that adds no bos) has no token to continue from: its answer is empty."""
    from slimtune.step.precision import autocast_for

    model.eval()
    settings = generation_settings(model, tokenizer, max_new_tokens)
    answers = [""] * len(prompts)
    asked = [i for i, p in enumerate(prompts) if p]
    for start in progress.shown(range(0, len(asked), batch_size), "eval: answers", "batch", shown, "batches"):
        which = asked[start : start + batch_size]
        chunk = [prompts[i] for i in which]
        width = max(map(len, chunk))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with autocast_for(device, precision):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
        for i, row in zip(which, out[:, width:]):
            answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    return answers


def context_length(model: torch.nn.Module) -> int | None:
    """The most positions the model takes (max_position_embeddings), where its config says."""
    return getattr(model.config, "max_position_embeddings", None)
