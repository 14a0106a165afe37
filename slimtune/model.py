"""Load a local Hugging Face causal LM and view it as a Stack: embed -> blocks -> norm -> head.

Every engine runs the model through the Stack, so anything family-specific lives here.
Llama, Mistral, Qwen2 and Qwen3 share one layout (`model.embed_tokens`, `model.layers`,
`model.norm`, `model.rotary_emb`, `lm_head`) and one block: input_layernorm -> self_attn ->
residual add -> post_attention_layernorm -> mlp -> residual add, which `attention_half` and
`mlp_half` compose from the block's own submodules. Tied or untied embeddings, GQA, attention
bias, rope scaling and sliding-window layers are all handled by the family's own modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimtune.errors import UserError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# The fixed order in which a run transforms its model (ARCHITECTURE.md, "The flow of one run").
BUILD_ORDER = ("loaded", "quant", "adapters", "engine")


def read_config(folder: str | Path) -> dict:
    """config.json of a model folder, checked for a supported family."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise UserError(f"model folder '{folder}' does not exist.")
    if not path.is_file():
        raise UserError(f"model folder '{folder}' has no config.json.")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} line {err.lineno}: not valid JSON ({err.msg}).") from None
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise UserError(
            f"model_type '{family}' in {path} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}."
        )
    return config


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Weights from safetensors only (never pickle), memory-mapped and loaded once onto `device`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    read_config(folder)
    hf_logging.disable_progress_bar()  # our own progress bar is the one the user watches
    if not any(Path(folder).glob("*.safetensors")):
        found = sorted(p.name for p in Path(folder).glob("*.bin"))
        extra = f" (found {', '.join(found)}; slimtune loads safetensors only)" if found else ""
        raise UserError(f"model folder '{folder}' has no *.safetensors weights{extra}.")
    model = AutoModelForCausalLM.from_pretrained(
        str(folder),
        local_files_only=True,
        use_safetensors=True,
        dtype=dtype,
        device_map={"": device},
        attn_implementation="sdpa",
    )
    model.config.use_cache = False
    return model


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"model folder '{folder}' has no usable tokenizer ({err}).") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class BlockInputs:
    """What every block needs, prepared once per batch."""

    position_ids: torch.Tensor  # (B, T)
    position_embeddings: tuple[torch.Tensor, torch.Tensor]  # cos, sin: (B, T, head_dim)
    masks: dict[str, torch.Tensor | None]  # by layer type: full_attention / sliding_attention


class Stack:
    """The one view of a causal LM every engine uses."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.stages: list[str] = ["loaded"]

    # Read through the model each time: quantization replaces the embedding and head modules.
    @property
    def embed(self) -> nn.Module:
        return self.model.model.embed_tokens

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def norm(self) -> nn.Module:
        return self.model.model.norm

    @property
    def head(self) -> nn.Module:
        return self.model.lm_head

    @property
    def rotary(self) -> nn.Module:
        return self.model.model.rotary_emb

    def advance(self, stage: str) -> None:
        """Record a build stage, refusing one that comes before a stage already applied."""
        last = BUILD_ORDER.index(self.stages[-1])
        assert BUILD_ORDER.index(stage) > last, f"build stage {stage!r} after {self.stages[-1]!r}: order is {BUILD_ORDER}"
        self.stages.append(stage)

    @property
    def tied(self) -> bool:
        head, embed = self.head, self.embed
        if hasattr(head, "qweight"):  # a quantized tied pair shares one set of codes
            return head.qweight is getattr(embed, "qweight", None)
        return head.weight is embed.weight

    def layer_type(self, index: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[index]
        # Mistral names no layer types: a set sliding_window applies to every layer.
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def prepare(self, hidden: torch.Tensor, position_ids: torch.Tensor, segmented: bool = True) -> BlockInputs:
        """Rotary tables and attention masks. Position ids that restart at 0 mark packed
        examples; the family's own mask builders turn them into block-diagonal causal masks.
        segmented=False (every row is 0..T-1, data.Batch.segmented) skips that search, which
        reads tensor values: SDPA then gets no mask (is_causal), so no (T, T) tensor is built."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
            position_ids=position_ids if segmented else None,
        )
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if any(self.layer_type(i) == "sliding_attention" for i in range(len(self.blocks))):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return BlockInputs(position_ids, self.rotary(hidden, position_ids), masks)

    def run_block(self, index: int, hidden: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """hidden (B, T, D) -> (B, T, D) through block `index`."""
        return self.blocks[index](
            hidden,
            attention_mask=inputs.masks[self.layer_type(index)],
            position_ids=inputs.position_ids,
            position_embeddings=inputs.position_embeddings,
        )

    def attention_half(self, index: int, hidden: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """hidden (B, T, D) -> hidden + attention(norm(hidden)): the first residual branch of block
        `index`. With mlp_half it is run_block, split where the MLP's per-token work begins."""
        layer = self.blocks[index]
        out, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden),
            attention_mask=inputs.masks[self.layer_type(index)],
            position_ids=inputs.position_ids,
            position_embeddings=inputs.position_embeddings,
        )
        return hidden + out

    def mlp_half(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, t, D) -> hidden + mlp(norm(hidden)): the second residual branch. Every
        token is independent here, so any slice of tokens can run alone (activations' chunks)."""
        layer = self.blocks[index]
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def body_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, run_blocks=None,
                    segmented: bool = True) -> torch.Tensor:
        """input_ids (B, T) -> the last block's output (B, T, D), before the final norm (the loss
        normalises only the rows it scores). `run_blocks(stack, hidden, inputs)` replaces the plain
        loop, e.g. by a checkpointed one. segmented: as in `prepare`."""
        hidden = self.embed(input_ids)
        inputs = self.prepare(hidden, position_ids, segmented)
        if run_blocks is not None:
            return run_blocks(self, hidden, inputs)
        for index in range(len(self.blocks)):
            hidden = self.run_block(index, hidden, inputs)
        return hidden

    def final_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> normed hidden states (B, T, D), ready for the head."""
        return self.norm(self.body_hidden(input_ids, position_ids))
