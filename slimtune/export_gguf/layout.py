"""Where each weight and setting of a Llama, Mistral, Qwen2 or Qwen3 model goes in llama.cpp's layout.

Tensor names come from the gguf package's own map (gguf.get_tensor_name_map), so they are the names
llama.cpp looks up. llama.cpp's `llama` architecture (Llama and Mistral) applies rotary embeddings to
interleaved pairs of a head's dimensions, where Hugging Face rotates its two halves: the query and
key rows are reordered here to match (Qwen2 and Qwen3 use the halves in llama.cpp too, so theirs
stay). A model this cannot map is refused in one sentence before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimtune.errors import UserError

# model_type -> llama.cpp's architecture name; Mistral is the Llama layout in llama.cpp.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# The biases each llama.cpp architecture reads, by its tensor kind's name (gguf.MODEL_TENSOR).
BIASES = {"llama": {"ATTN_Q", "ATTN_K", "ATTN_V", "ATTN_OUT", "FFN_GATE", "FFN_UP", "FFN_DOWN"},
          "qwen2": {"ATTN_Q", "ATTN_K", "ATTN_V"}, "qwen3": set()}

ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass
class Planned:
    """One tensor of the file: its GGUF name, the model's tensor, and the heads its rows are grouped
    in when they are reordered for llama.cpp's rotary pairs (None: written as it is)."""

    name: str
    source: torch.Tensor
    permute_heads: int | None = None

    def tensor(self) -> torch.Tensor:
        if self.permute_heads is None:
            return self.source.detach()
        return interleave_rotary_pairs(self.source.detach(), self.permute_heads)


@dataclass
class Layout:
    arch: str  # llama.cpp's architecture name
    config: object  # the model's transformers config
    context_length: int
    head_dim: int
    notes: list[str]  # what the file states differently from the config, and why


def interleave_rotary_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from Hugging Face's halves (x[:d/2] rotates with x[d/2:]) to
    llama.cpp's adjacent pairs (x[2i] with x[2i+1]): (heads*d, ...) -> (heads, 2, d/2, ...) ->
    (heads, d/2, 2, ...). Works for weights (2-D) and biases (1-D)."""
    rest = weight.shape[1:]
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *rest).transpose(1, 2).reshape(weight.shape)


def layout_of(config) -> Layout:
    """The llama.cpp layout of a model's config, or one sentence saying why there is none."""
    family = getattr(config, "model_type", None)
    if family not in ARCHITECTURES:
        raise UserError(f"model_type '{family}' has no GGUF layout here; supported: {', '.join(ARCHITECTURES)}.")
    if family == "qwen3" and getattr(config, "attention_bias", False):
        raise UserError("Qwen3 with attention_bias has no GGUF layout: llama.cpp's qwen3 reads no attention biases.")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    notes = []
    context = config.max_position_embeddings
    window = sliding_window(config)
    if window is not None and window < context:
        # llama.cpp's llama/qwen2/qwen3 attend to the whole context: up to the window both agree exactly
        notes.append(f"context length {window}, the model's sliding window (llama.cpp attends to the whole"
                     f" context, which agrees with the window only up to its length; the config says {context})")
        context = window
    rope_scaling(config)  # refused here, before anything is written
    return Layout(ARCHITECTURES[family], config, context, head_dim, notes)


def sliding_window(config) -> int | None:
    """The attention window of any layer that has one (Mistral's applies to every layer when set)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if config.model_type == "mistral":
        return window
    layer_types = getattr(config, "layer_types", None) or []
    return window if "sliding_attention" in layer_types else None


def rope_parameters(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def rope_scaling(config) -> dict:
    """The rope settings as llama.cpp states them: {} (none), linear or yarn keys, or llama3 (whose
    per-frequency factors travel as the rope_freqs tensor). Anything else is refused."""
    rope = rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"rope scaling '{kind}' has no GGUF form here; supported: {', '.join(ROPE_TYPES)}.")
    if kind == "linear":
        return {"type": "linear", "factor": float(rope["factor"])}
    if kind == "yarn":
        custom = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if rope.get(k) not in (None, 1, 1.0)]
        custom += [k for k, v in (("beta_fast", 32), ("beta_slow", 1)) if rope.get(k, v) != v]
        if custom:
            raise UserError(f"yarn rope scaling with {', '.join(custom)} set has no GGUF form here (llama.cpp"
                            " derives them from the factor).")
        return {"type": "yarn", "factor": float(rope["factor"]),
                "original_context_length": int(rope["original_max_position_embeddings"])}
    return {"type": kind}


def rope_frequency_factors(model, layout: Layout) -> torch.Tensor:
    """llama3 rope: per-frequency divisors llama.cpp applies (rope_freqs), read off the model's own
    rotary embedding: llama.cpp rotates pair i by pos * base^(-2i/d) / factor_i, so factor_i is the
    plain inverse frequency over the one the model uses."""
    base = rope_parameters(layout.config)["rope_theta"]
    steps = torch.arange(0, layout.head_dim, 2, dtype=torch.float64)
    plain = 1.0 / base ** (steps / layout.head_dim)
    used = model.model.rotary_emb.inv_freq.detach().to(torch.float64)
    return (plain / used).to(torch.float32)


def plan_tensors(model, layout: Layout) -> list[Planned]:
    """Every tensor of the file in the model's order, each with its GGUF name; the head is left out
    when it is the embedding (llama.cpp then uses token_embd for the output)."""
    import gguf

    arch = _arch_enum(layout.arch)
    names = gguf.get_tensor_name_map(arch, layout.config.num_hidden_layers)
    kinds = set(gguf.MODEL_TENSORS[arch])
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    planned = []
    for hf_name, tensor in model.state_dict(keep_vars=True).items():
        base, _, suffix = hf_name.rpartition(".")
        found = names.get_type_and_name(base)
        if found is None or found[0] not in kinds:
            raise UserError(f"weight '{hf_name}' has no place in llama.cpp's {layout.arch} layout.")
        kind, name = found
        if kind == gguf.MODEL_TENSOR.OUTPUT and tied:
            continue
        if suffix == "bias" and kind.name not in BIASES[layout.arch]:
            raise UserError(f"bias '{hf_name}' has no place in llama.cpp's {layout.arch} layout (it reads no"
                            f" {name} bias).")
        planned.append(Planned(f"{name}.{suffix}", tensor, _rotary_heads(layout, kind.name)))
    if rope_scaling(layout.config)["type"] == "llama3":
        planned.append(Planned(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                               rope_frequency_factors(model, layout)))
    return planned


def _rotary_heads(layout: Layout, kind: str) -> int | None:
    if layout.arch != "llama":
        return None
    return {"ATTN_Q": layout.config.num_attention_heads, "ATTN_K": layout.config.num_key_value_heads}.get(kind)


def _arch_enum(arch: str):
    import gguf

    return next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def add_hyperparameters(writer, layout: Layout) -> None:
    """The settings llama.cpp reads for these architectures, under its key names."""
    config = layout.config
    writer.add_context_length(layout.context_length)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(layout.head_dim)
    writer.add_value_length(layout.head_dim)
    writer.add_rope_dimension_count(layout.head_dim)
    writer.add_rope_freq_base(float(rope_parameters(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    _add_rope_scaling(writer, rope_scaling(config))


def _add_rope_scaling(writer, scaling: dict) -> None:
    import gguf

    if scaling["type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling["type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_context_length"])
