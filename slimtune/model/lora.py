"""LoRA adapters: LoRALinear over a frozen base, applied by name pattern, merged, and
saved/loaded in PEFT's on-disk format (adapter_config.json + adapter_model.safetensors).

The base may be any module that maps (..., in) -> (..., out) and exposes `in_features`
and `out_features`, so a 4-bit base slots in without a second code path.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from slimtune.config import LoraConfig
from slimtune.errors import UserError

PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * B(A(dropout(x))), with A, B trainable and base frozen."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scaling = alpha / rank
        weight = getattr(base, "weight", None)
        # A 4-bit base keeps its dense dtype beside the codes; adapters follow that, not uint8.
        dense_dtype = base.qweight.dtype if hasattr(base, "qweight") else getattr(weight, "dtype", None)
        factory = dict(dtype=_adapter_dtype(dense_dtype), device=weight.device if weight is not None else None)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **factory)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # PEFT's default init: A Kaiming-uniform, B zero, so the adapter starts as a no-op. (The planner's
        # fake tensors hold no values: their in-place init allocates nothing and is skipped.)
        if not is_fake(self.lora_A.weight):
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.weight, self.lora_B.weight
        kind = x.device.type
        if torch.is_autocast_enabled(kind) and a.dtype != torch.get_autocast_dtype(kind):
            # Cast here, as autocast would: autocast's own cast of a weight (a leaf that trains) stays
            # in its cache until the autocast region ends, so a checkpointed backward, one region over
            # every block, would keep each block's cast adapters to its end. Same values, same gradients.
            cast = torch.get_autocast_dtype(kind)
            a, b = a.to(cast), b.to(cast)
        return self.base(x) + F.linear(F.linear(self.dropout(x), a), b) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """(out, in): the dense update this adapter adds to the base weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain nn.Linear equal to this module (base must expose a dense `weight`)."""
        base = self.base
        dense = base.dequantized_weight() if hasattr(base, "dequantized_weight") else base.weight
        out = nn.Linear(self.in_features, self.out_features, bias=base.bias is not None,
                        dtype=self.lora_A.weight.dtype, device=dense.device)
        with torch.no_grad():
            out.weight.copy_(dense.to(out.weight.dtype) + self.delta_weight())
            if base.bias is not None:
                out.bias.copy_(base.bias)
        return out


def _adapter_dtype(dense_dtype: torch.dtype | None) -> torch.dtype:
    """Adapters train in fp32 over a half-precision base, else in the base's dtype (fp64 in tests)."""
    if dense_dtype is None or not dense_dtype.is_floating_point or dense_dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dense_dtype


def _is_linear(module: nn.Module) -> bool:
    return hasattr(module, "in_features") and hasattr(module, "out_features") and not isinstance(module, LoRALinear)


def select_targets(model: nn.Module, targets: str | list[str], blocks_prefix: str = "model.layers.") -> list[str]:
    """Module names to adapt, all inside the blocks: every linear there for 'all-linear', else those
    whose leaf name equals a pattern or whose full name matches it (fnmatch). A pattern that names
    only linears outside the blocks (the LM head) is refused: the engines stream, tile and shard the
    head as a plain weight, and PEFT's all-linear leaves it out too."""
    names = [n for n, m in model.named_modules() if _is_linear(m) and n.startswith(blocks_prefix)]
    if targets == "all-linear":
        return names
    patterns = [targets] if isinstance(targets, str) else targets
    leaves = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in names}))
    outside = [n for n, m in model.named_modules() if _is_linear(m) and not n.startswith(blocks_prefix)]
    for pattern in patterns:
        if any(_matches(n, pattern) for n in names):
            continue
        if any(_matches(n, pattern) for n in outside):
            raise UserError(f"lora.targets: '{pattern}' names {', '.join(n for n in outside if _matches(n, pattern))},"
                            f" outside the decoder blocks, where slimtune puts no adapter; the blocks have {leaves}.")
        raise UserError(f"lora.targets: '{pattern}' matches no linear layer of the blocks; they have {leaves}.")
    return [n for n in names if any(_matches(n, p) for p in patterns)]


def _matches(name: str, pattern: str) -> bool:
    return name.rsplit(".", 1)[-1] == pattern or fnmatch.fnmatchcase(name, pattern)


def apply(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Freeze the model and wrap the target linears in LoRALinear. Returns their names."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = select_targets(model, cfg.targets)
    for name in names:
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), cfg.rank, cfg.alpha, cfg.dropout))
    return names


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by its merged nn.Linear, in place."""
    for name, module in list(adapters(model).items()):
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, module.merged())
    return model


# ---------------------------------------------------------------- PEFT format


def peft_state_dict(trainable: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter weights among `trainable` (parameter name -> tensor) under PEFT's names."""
    return {f"{PEFT_PREFIX}{name}": tensor.detach().contiguous() for name, tensor in trainable.items()
            if name.endswith((".lora_A.weight", ".lora_B.weight"))}


def peft_target_modules(model: nn.Module) -> list[str] | str:
    """Leaf names when they pick out exactly the adapted modules (PEFT's usual form), else a regex."""
    adapted = set(adapters(model))
    leaves = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    by_leaf = {n for n, m in model.named_modules()
               if n.rsplit(".", 1)[-1] in leaves and (_is_linear(m) or isinstance(m, LoRALinear))}
    if by_leaf == adapted:
        return leaves
    return "^(" + "|".join(re.escape(n) for n in sorted(adapted)) + ")$"


def peft_config(model: nn.Module, cfg: LoraConfig, base_model: str, revision: str | None = None) -> dict:
    """PEFT's adapter_config.json. `revision`: the Hub commit of a base named org/name (PEFT fetches
    the base at it)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": revision,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": peft_target_modules(model),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def load_peft_adapter(model: nn.Module, folder: str | Path) -> LoraConfig:
    """Apply and load an adapter saved in PEFT format (ours or peft's). One written by slimtune is
    checked against its manifest first (results.verify: sizes and CRC-32s); any adapter whose files
    cannot be read is named in one sentence."""
    from slimtune.store import results

    folder = Path(folder)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise UserError(f"'{folder}' is not a PEFT adapter folder (needs adapter_config.json and adapter_model.safetensors).")
    results.verify(folder, "adapter folder")
    raw = _read_adapter_config(config_path)
    targets = raw["target_modules"]
    cfg = LoraConfig(rank=raw["r"], alpha=raw["lora_alpha"], dropout=0.0, targets=targets)
    if isinstance(targets, str):  # a regex, as PEFT allows
        names = [n for n, m in model.named_modules() if _is_linear(m) and re.fullmatch(targets, n)]
        cfg.targets = names
    apply(model, cfg)
    # PEFT writes keys without the adapter name: base_model.model.<module>.lora_A.weight
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in _read_adapter_weights(weights_path).items()}
    with torch.no_grad():
        for name, module in adapters(model).items():
            for part in ("lora_A", "lora_B"):
                tensor = state.get(f"{name}.{part}.weight")
                if tensor is None:
                    raise UserError(f"adapter in '{folder}' has no weight for {name}.{part}.")
                getattr(module, part).weight.copy_(tensor)
    return cfg


def _read_adapter_config(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is not readable JSON ({err}); the adapter is damaged: write it again.") from None
    missing = [key for key in ("target_modules", "r", "lora_alpha") if key not in raw] if isinstance(raw, dict) else \
        ["target_modules"]
    if missing:
        raise UserError(f"{path} is not a LoRA adapter's config (it has no '{missing[0]}').")
    return raw


def _read_adapter_weights(path: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors; a damaged or cut-short file is one sentence, as model.read_headers says
    it of a model's weights (safetensors checks that the header's offsets cover the file exactly)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        detail = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise UserError(f"adapter folder '{path.parent}': {path.name} is not a readable safetensors file"
                        f" ({detail[-1] if detail else type(err).__name__}); it is damaged or incomplete: write or"
                        " download it again.") from None
