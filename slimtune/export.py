"""A run's result: a PEFT-format adapter (LoRA) or a full HF model folder, and merged exports."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from slimtune import lora
from slimtune.checkpoint import atomic_folder
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
    """The run's result from its engine's trainable_state(): the adapter (LoRA) or the whole model."""
    trainable = run.engine.trainable_state()
    if run.cfg.method == "lora":
        return save_adapter(run.stack.model, run.cfg.lora, str(Path(run.cfg.model).resolve()), out / "adapter",
                            trainable)
    return save_model(run.stack.model, run.tokenizer, out / "model", trainable)


def merge_run(run_dir: Path, out: Path | None = None) -> Path:
    """Base model + the run's adapter, merged into one HF folder (default: run_dir/merged)."""
    from slimtune.model import load_model, load_tokenizer

    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"'{run_dir}' is not a slimtune run folder (no config.yaml).")
    cfg = yaml.safe_load(config_path.read_text())
    out = Path(out) if out is not None else run_dir / "merged"
    if cfg["method"] == "full":
        raise UserError(f"'{run_dir}' was full fine-tuning; its model is already whole in {run_dir / 'model'}.")
    model = load_model(cfg["model"], torch.float32, torch.device("cpu"))
    lora.load_peft_adapter(model, run_dir / "adapter")
    lora.merge(model)
    return save_model(model, load_tokenizer(cfg["model"]), out)
