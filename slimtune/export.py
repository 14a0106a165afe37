"""A run's result: a PEFT-format adapter (LoRA) or a full HF model folder, and merged exports."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from slimtune import checkpoint, lora
from slimtune.checkpoint import atomic_folder
from slimtune.config import LoraConfig
from slimtune.errors import UserError


def save_adapter(model: torch.nn.Module, cfg, base_model: str, folder: Path,
                 trainable: dict[str, torch.Tensor] | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors, loadable by peft.PeftModel.from_pretrained.
    `trainable`: the adapter weights by parameter name (an engine's trainable_state()); default: the
    model's own."""
    trainable = trainable if trainable is not None else dict(model.named_parameters())
    with atomic_folder(folder) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(lora.peft_config(model, cfg, base_model), indent=2))
        state = {k: v.detach().cpu().contiguous() for k, v in lora.peft_state_dict(trainable).items()}
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def save_model(model: torch.nn.Module, tokenizer, folder: Path,
               trainable: dict[str, torch.Tensor] | None = None) -> Path:
    """A plain HF folder (config.json, safetensors, tokenizer) for AutoModelForCausalLM. `trainable`:
    trained weights by parameter name that replace the model's own (an engine's trainable_state())."""
    with atomic_folder(folder) as tmp:
        model.save_pretrained(str(tmp), state_dict=_with_trained(model, trainable or {}), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
    return folder


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
    if not run.dist.is_main:
        return out / ("adapter" if run.cfg.method == "lora" else "model")
    if run.cfg.method == "lora":
        return save_adapter(run.stack.model, run.cfg.lora, str(Path(run.cfg.model).resolve()), out / "adapter",
                            trainable)
    return save_model(run.stack.model, run.tokenizer, out / "model", trainable)


@dataclass
class Merged:
    folder: Path  # the merged HF model folder
    step: int | None  # the training step its adapter holds (None: a run folder from before steps were recorded)
    source: Path  # where the adapter came from: the result (adapter/) or a newer checkpoint


def merge_run(run_dir: Path, out: Path | None = None) -> Merged:
    """Base model + the run's newest adapter, merged into one HF folder (default: run_dir/merged). The
    newest is the result (adapter/) unless a checkpoint holds a later step (a run stopped or killed
    after it resumed): then the checkpoint's adapter weights are merged, and the return says so."""
    from slimtune.model import load_model, load_tokenizer

    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"'{run_dir}' is not a slimtune run folder (no config.yaml).")
    cfg = yaml.safe_load(config_path.read_text())
    out = Path(out) if out is not None else run_dir / "merged"
    if cfg["method"] == "full":
        raise UserError(f"'{run_dir}' was full fine-tuning; its model is already whole in {run_dir / 'model'}.")
    step, source = newest_adapter(run_dir)
    model = load_model(cfg["model"], torch.float32, torch.device("cpu"))
    if source.name == "adapter":
        lora.load_peft_adapter(model, source)
    else:  # a checkpoint: its trained tensors are the adapter's, by parameter name
        lora.apply(model, LoraConfig(**cfg["lora"]))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in load_file(str(source / "trainable.safetensors")).items():
                params[name].copy_(tensor)
    lora.merge(model)
    return Merged(save_model(model, load_tokenizer(cfg["model"]), out), step, source)


def newest_adapter(run_dir: Path) -> tuple[int | None, Path]:
    """(step, folder) of the newest trained adapter: the result's, or a later intact checkpoint's."""
    record = run_dir / "run.json"
    result = json.loads(record.read_text()).get("result") if record.is_file() else None
    found, _ = checkpoint.latest_intact(run_dir)
    newest = checkpoint.step_of(found) if found is not None else None
    if newest is not None and (result is None or newest > result["step"]):
        return newest, found
    if not (run_dir / "adapter").is_dir():
        raise UserError(f"'{run_dir}' holds no adapter and no intact checkpoint to export.")
    return (result["step"] if result else None), run_dir / "adapter"
