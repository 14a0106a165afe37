"""A run's result: a PEFT-format adapter (LoRA) or a full HF model folder, and merged exports."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from slimtune import local_paths
from slimtune.store import checkpoint, results
from slimtune.model import hub, lora
from slimtune.config import LoraConfig
from slimtune.errors import UserError


def save_adapter(model: torch.nn.Module, cfg, base_model: str, folder: Path,
                 trainable: dict[str, torch.Tensor] | None = None, recorded: bool = False) -> Path:
    """adapter_config.json + adapter_model.safetensors, loadable by peft.PeftModel.from_pretrained.
    `base_model`: the base's folder, or a Hub snapshot of it, which the config names as org/name at
    its commit (hub.public_name), so the adapter loads wherever that model can be fetched.
    `trainable`: the adapter weights by parameter name (an engine's trainable_state()); default: the
    model's own. `recorded`: the run's record names `folder` as its result (results.writing)."""
    trainable = trainable if trainable is not None else dict(model.named_parameters())
    state = {k: v.detach().cpu().contiguous() for k, v in lora.peft_state_dict(trainable).items()}
    with results.writing(folder, "adapter", _bytes(state.values()), recorded) as tmp:
        named = lora.peft_config(model, cfg, *hub.public_name(base_model))
        (tmp / "adapter_config.json").write_text(json.dumps(named, indent=2))
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def save_model(model: torch.nn.Module, tokenizer, folder: Path, trainable: dict[str, torch.Tensor] | None = None,
               kind: str = "model", recorded: bool = False) -> Path:
    """A plain HF folder (config.json, safetensors, tokenizer) for AutoModelForCausalLM. `trainable`:
    trained weights by parameter name that replace the model's own (an engine's trainable_state()).
    `kind`: "model" (a full run's result) or "merged" (an export); `recorded` as in save_adapter."""
    state = _with_trained(model, trainable or {})
    with results.writing(folder, kind, _bytes(state.values()), recorded) as tmp:
        model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
    return folder


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _with_trained(model: torch.nn.Module, trainable: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict with each trained weight taken from `trainable`; a tied weight's every
    key (embedding and head) gets the same tensor."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = name_of.get(id(value), key)
        state[key] = (trainable[name] if name in trainable else value).detach()
    return state


def save_result(run, out: Path) -> Path:
    """The run's result from its engine's trainable_state(): the adapter (LoRA) or the whole model.
    Every rank calls it (a sharded engine gathers its weights: a collective); rank 0 writes."""
    trainable = run.engine.trainable_state()
    name = "adapter" if run.cfg.method == "lora" else "model"
    if not run.dist.is_main:
        return out / name
    recorded = _recorded_result(out) == name
    if run.cfg.method == "lora":
        return save_adapter(run.stack.model, run.cfg.lora, run.cfg.model, out / name,
                            trainable, recorded)
    tokenizer = with_template(run.tokenizer, run.cfg.data.format, run.cfg.data.chat_template)
    return save_model(run.stack.model, tokenizer, out / name, trainable, recorded=recorded)


def _recorded_result(run_dir: Path) -> str | None:
    """The result folder's name run.json records (None: none recorded, or no readable run.json)."""
    result = _recorded(run_dir)
    return result.get("path") if result else None


def _recorded(run_dir: Path) -> dict | None:
    record = Path(run_dir) / "run.json"
    try:
        result = json.loads(record.read_text()).get("result") if record.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return result if isinstance(result, dict) else None


@dataclass
class Merged:
    folder: Path  # the merged HF model folder
    step: int | None  # the training step its adapter holds (None: a run folder from before steps were recorded)
    source: Path  # where the adapter came from: the result (adapter/) or a newer checkpoint
    dtype: torch.dtype  # its weights' dtype: the base's


def merge_run(run_dir: Path, out: Path | None = None) -> Merged:
    """Base model + the run's newest adapter, merged into one HF folder (default: run_dir/merged). The
    newest is the result (adapter/) unless a checkpoint holds a later step (a run stopped or killed
    after it resumed) or adapter/ is gone: then the checkpoint's adapter weights are merged, and the
    return says so. Where it writes is checked before anything loads (check_out)."""
    from slimtune.model.stack import load_tokenizer, stored_float_dtype

    run_dir, cfg = Path(run_dir), run_config(run_dir)
    if cfg.get("method") == "full":
        raise UserError(f"'{run_dir}' was full fine-tuning; its model is already whole in {run_dir / 'model'}.")
    setting = "--out" if out is not None else "the export folder"
    out = Path(out) if out is not None else run_dir / "merged"
    check_out(run_dir, cfg, out, setting)
    base = base_model(run_dir, cfg)
    model, step, source = _merged(run_dir, cfg, base)
    # Merged in float32, written in the base's dtype (a bf16 base's merged folder is its size, not twice it),
    # as PEFT's merge_and_unload leaves a model loaded in that dtype.
    dtype = stored_float_dtype(base)
    tokenizer = with_trained_template(load_tokenizer(base), run_dir, cfg)
    return Merged(save_model(model.to(dtype), tokenizer, out, kind="merged"), step, source, dtype)


def run_config(run_dir: Path) -> dict:
    """The config.yaml a run wrote, or one sentence saying `run_dir` is no run folder."""
    config_path = Path(run_dir) / "config.yaml"
    if not Path(run_dir).exists():
        raise UserError(local_paths.missing("run folder", run_dir))
    if not config_path.is_file():
        raise UserError(f"'{run_dir}' is not a slimtune run folder (no config.yaml).")
    return results.run_config(config_path)


def base_model(run_dir: Path, cfg: dict) -> str:
    """The model a LoRA run trained from, as it exists now: config.yaml's `model` from here or from the
    folder the training ran in (a relative path: results.trained_path, as chat and eval find it), or a
    Hub snapshot that a cleaned cache lost, fetched again; one sentence when it is nowhere."""
    found = results.trained_path(run_dir, cfg, str(cfg["model"]))
    if found is None and hub.origin(cfg["model"]) is not None:
        return hub.folder(cfg["model"])
    if found is None:
        raise UserError(f"the base model '{cfg['model']}' that run '{run_dir}' trained from (config.yaml `model`) is"
                        " not found.")
    return str(found)


def with_trained_template(tokenizer, run_dir: Path, cfg: dict):
    """with_template for a run folder's config.yaml (its data.chat_template file perhaps relative to the
    folder the training ran in)."""
    data = cfg.get("data") or {}
    template = data.get("chat_template")
    if template:
        found = results.trained_path(run_dir, cfg, str(template))
        template = str(found) if found is not None and found.is_file() else template
    return with_template(tokenizer, data.get("format"), template)


def with_template(tokenizer, data_format: str | None, template: str | None):
    """`tokenizer` carrying the chat template a run on chat data trained with (data.chat_template, else
    its own, else slimtune's default: resolve_template), so a result or an export is prompted as
    training formatted it (transformers' and llama.cpp's apply_chat_template, `slimtune chat`, the
    GGUF's tokenizer.chat_template); other formats leave the tokenizer as it is."""
    from slimtune.data.chat_templates import resolve_template

    if data_format != "chat":
        return tokenizer
    tokenizer.chat_template = resolve_template(tokenizer, template)
    return tokenizer


@dataclass
class Trained:
    model: torch.nn.Module  # the whole trained model on the CPU, float32 (LoRA: merged)
    tokenizer: object
    step: int | None  # as Merged.step
    source: Path  # the adapter or checkpoint merged (LoRA), or the model/ folder (full fine-tuning)


def trained_model(run_dir: Path) -> Trained:
    """The run's trained model, whole, in memory: LoRA's newest adapter merged into its base (as
    merge_run merges it, nothing written), or a full run's model/."""
    from slimtune.model.stack import load_model, load_tokenizer

    run_dir, cfg = Path(run_dir), run_config(run_dir)
    if cfg.get("method") != "full":
        base = base_model(run_dir, cfg)
        model, step, source = _merged(run_dir, cfg, base)
        return Trained(model, with_trained_template(load_tokenizer(base), run_dir, cfg), step, source)
    folder = run_dir / "model"
    if not folder.is_dir():
        raise UserError(f"full fine-tuning run '{run_dir}' has no model/ yet: it has not finished a result.")
    results.verify(folder, "model folder")
    result = _recorded(run_dir)
    model = load_model(folder, torch.float32, torch.device("cpu"))
    tokenizer = with_trained_template(load_tokenizer(folder), run_dir, cfg)
    return Trained(model, tokenizer, result.get("step") if result else None, folder)


def _merged(run_dir: Path, cfg: dict, base: str) -> tuple[torch.nn.Module, int | None, Path]:
    """(the `base` model folder with the newest adapter merged in, its step, where the adapter came from)."""
    from slimtune.model.stack import load_model

    step, source = newest_adapter(run_dir)
    if source.name == "adapter":
        results.verify(source, "adapter folder")  # said before the base model loads
    model = load_model(base, torch.float32, torch.device("cpu"))
    if source.name == "adapter":
        lora.load_peft_adapter(model, source)
    else:  # a checkpoint: its trained tensors are the adapter's, by parameter name
        lora.apply(model, LoraConfig(**cfg["lora"]))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in load_file(str(source / "trainable.safetensors")).items():
                params[name].copy_(tensor)
    lora.merge(model)
    return model, step, source


def write_gguf(run_dir: Path, path: Path, file_type: str, progress: bool = True):
    """The run's trained model (trained_model) as one GGUF file for llama.cpp and Ollama. Where it
    writes is checked before anything loads: a GGUF file or nothing, and nowhere among what the run
    and its inputs keep (the run's own files, the base model's folder, the data)."""
    from slimtune.export_gguf import writer

    run_dir, cfg, path = Path(run_dir), run_config(run_dir), Path(path)
    check_gguf(run_dir, path)
    trained = trained_model(run_dir)
    name = hub.public_name(cfg["model"])[0].rsplit("/", 1)[-1]  # a Hub snapshot's model name, not its commit
    return writer.write(trained.model, trained.tokenizer, path, file_type, name, progress), trained


def check_gguf(run_dir: Path, path: Path) -> None:
    """What write_gguf checks before anything loads (and `slimtune export --merge --gguf` before it
    merges): the file may be written, and the model's layout and tokenizer map to GGUF."""
    from slimtune.export_gguf import writer
    from slimtune.model.stack import load_tokenizer

    run_dir, cfg, path = Path(run_dir), run_config(run_dir), Path(path)
    writer.check_target(path)
    results.check_kept(path, f"--gguf '{path}'", kept_by_run(run_dir, cfg, ()), "choose another file")
    folder = run_dir / "model" if cfg.get("method") == "full" else base_model(run_dir, cfg)
    writer.check_model(_config(folder), load_tokenizer(folder))


def _config(folder):
    from transformers import AutoConfig

    from slimtune.model.stack import read_config

    read_config(folder)  # its sentences for a missing or foreign config.json
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def check_out(run_dir: Path, cfg: dict, out: Path, setting: str) -> None:
    """The export's folder may be written: not the run's folder or anything of it but its merged/, not
    the base model's folder nor the data, absent, empty or a merged model slimtune wrote; writable.
    `setting`: how the sentences name it ("--out", or "the export folder" when it is the default)."""
    from slimtune.run import folder as run_folder

    results.check_target(out, "merged", f"{setting} '{out}'", kept_by_run(run_dir, cfg, ("merged",)),
                         "choose another --out")
    run_folder.check_writable(out.resolve() if out.is_symlink() else out, setting, replaced=True)


def kept_by_run(run_dir: Path, cfg: dict, replaceable: tuple[str, ...]) -> list[results.Kept]:
    """What an export must not write over: the run's own files (but those named `replaceable`; the
    run's folder itself may hold the export), the base model's folder and the data."""
    from slimtune.run import folder as run_folder

    own = [results.Kept(run_dir, "the run's folder", inside_ok=True)]
    own += [results.Kept(run_dir / name, f"the run's {name}") for name in run_folder.RUN_FILES
            if name not in replaceable and (run_dir / name).exists()]
    data = cfg.get("data") or {}
    recorded = {"the base model's folder": cfg.get("model"), "the training data (data.path)": data.get("path"),
                "the evaluation data (data.eval_path)": data.get("eval_path")}
    places = {what: results.trained_path(run_dir, cfg, str(value)) for what, value in recorded.items() if value}
    return own + results.existing(places)


def newest_adapter(run_dir: Path) -> tuple[int | None, Path]:
    """(step, folder) of the newest trained adapter: the result's, or an intact checkpoint's when it
    holds a later step or the result's adapter/ is gone."""
    result = _recorded(run_dir)
    found, damaged = checkpoint.latest_intact(run_dir)
    newest = checkpoint.step_of(found) if found is not None else None
    has_result = (run_dir / "adapter").is_dir()
    if newest is not None and (not has_result or result is None or newest > result.get("step", -1)):
        return newest, found
    if has_result:
        return (result.get("step") if result else None), run_dir / "adapter"
    why = f" ({'; '.join(damaged)})" if damaged else ""
    raise UserError(f"run '{run_dir}' holds no adapter/ and no intact checkpoint{why}: it has no trained adapter yet.")
