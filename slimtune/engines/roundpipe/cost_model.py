"""Per-layer costs the pipeline simulator plays: modelled from a preset and a card, measured from a
JSON file, or the measured inputs of the RoundPipe paper's own simulator (roundpipe.md section 3).

Layers are the model's sequential layers: an optional prefix (the embedding), the decoder blocks,
and last the postfix (final norm + LM head + loss). Times are seconds per micro-batch: `forward`
(also the recompute) and `backward` (the backward alone). Bytes: `weight_bytes` cross the host link
up whenever a stage is loaded, `grad_bytes` down after a stage's backward.

Modelled (labelled so wherever printed): a block's forward is its matmul FLOPs (speed.py's
formulas: 2 per multiply-add, causal attention at half) over the card's bf16 peak times
speed.ASSUMED_MFU, backward twice the forward; the LM head + loss is its matmul (2 x tokens x hidden
x vocab FLOPs) the same way; the embedding is a gather, its bytes over the device bandwidth. Weights
and gradients are bf16 (2 bytes a parameter, full fine-tuning: every layer trains). A hop, the
boundary activation going GPU -> host -> GPU, is 2 x (tokens x hidden x 2 bytes) over the card's
host link. The host AdamW takes every parameter's ADAMW_BYTES_PER_PARAM over HOST_ADAMW_GBPS.

Measured JSON (`--costs FILE`):
    {"label": "4090, Qwen3-1.7B, 4 x 2048 tokens",        optional, default: the file name
     "layers": [{"forward_ms": 0.05, "backward_ms": 0.1,   required per layer
                 "weight_bytes": 622329856,                 optional, default 0
                 "grad_bytes": 622329856,                   optional, default weight_bytes
                 "repeat": 1},                              optional: this entry for n layers
                ...],                                       in model order, the LM head + loss last
     "hop_ms": 1.6, "optimizer_ms": 2400.0,                 optional, default 0
     "link_gbps": 25.0,                                     optional, default the --gpu card's
     "prefix_layers": 1}                                    optional, default 0 (layers before the
                                                            blocks, bound to the first stage by
                                                            the baselines)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from slimtune.model import config_json
from slimtune import presets
from slimtune.device import speed
from slimtune.errors import UserError
from slimtune.engines.roundpipe.stages import LayerCost

BF16 = 2  # bytes a weight, gradient or activation element
MEMORY_SHARE = 0.3  # a stage may hold 0.6 x the card's memory / 2 (roundpipe.md 2.5; all of it taken as free)

# roundpipe.md section 3: ms per layer per micro-batch (forward, backward), LM head (forward,
# backward), hop, for the paper's models; the preset gives the shapes for bytes and optimizer time.
SPEC_INPUTS = {
    "1.7B": dict(blocks=28, forward=7.43, backward=15.83, head=(22.07, 43.71), hop=1.6, preset="Qwen3-1.7B"),
    "8B": dict(blocks=32, forward=18.50, backward=41.21, head=(37.23, 74.50), hop=3.2, preset="Llama-3.1-8B"),
    "32B": dict(blocks=64, forward=40.56, backward=91.17, head=(54.93, 108.29), hop=4.0, preset="Qwen3-32B"),
}
# The partitions the paper's simulator ran (ITcarrot/RoundPipe-artifact, pp-simulate/run.sh), as
# forward / tail / backward layer counts for partition_from_text; roundpipe.md 2.6 quotes the 1.7B one.
REFERENCE_PARTITIONS = {
    "1.7B": "7,7,7,7/1/" + ",".join(["3"] * 8 + ["2", "2"]),
    "8B": "5,5,5,5,6,6/1/" + ",".join(["2"] * 16),
    "32B": "2,2," + ",".join(["3"] * 20) + "/1/" + ",".join(["1"] * 64),
}
# The measured inputs were timed at 4 sequences of 2048 tokens per micro-batch (artifact
# roundpipe-timing/run.sh: batch 480 = 12 accumulation steps x 10 micro-batches x 4 rows, 1.7B).
SPEC_TOKENS = (4, 2048)


@dataclass(frozen=True)
class Costs:
    """Everything the simulator needs about a model on a card, per micro-batch."""

    layers: tuple[LayerCost, ...]  # seconds; memory = weights + gradients bytes (the partitioner's cap)
    weight_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    hop_s: float  # one boundary activation (or its gradient) between two different workers
    link_gbps: float  # host <-> device, one direction, per worker
    optimizer_s: float  # the host AdamW over all trainable weights
    prefix_layers: int = 0
    memory_cap: int | None = None  # bytes a stage may hold on a worker
    label: str = "modelled"
    kind: str = "modelled"  # modelled | measured | spec
    # Per layer, the parameters the host AdamW updates for it (a tied table once, with the embedding):
    # each layer's share of optimizer_s. None: grad_bytes' shares.
    update_params: tuple[int, ...] | None = None
    tied_table: bool = False  # the head's weight is the embedding table: the runtime updates it first

    def update_order(self) -> list[int]:
        """The layers in the order the host AdamW updates them (the runtime's: the embedding table,
        with a tied head, first; then the layers in forward order)."""
        last = len(self.layers) - 1
        first = [0, last] if self.tied_table and last > 0 else [0]
        return first + [i for i in range(1, len(self.layers)) if i not in first]

    def update_shares(self) -> list[float]:
        weights = self.update_params if self.update_params is not None else self.grad_bytes
        total = sum(weights) or 1
        return [w / total for w in weights]

    def transfer_s(self, nbytes: float) -> float:
        return nbytes / (self.link_gbps * 1e9) if nbytes else 0.0

    def ideal(self) -> "Costs":
        """As the paper's simulator: no weight or gradient transfers, no optimizer time."""
        zeros = tuple(0 for _ in self.layers)
        return replace(self, weight_bytes=zeros, grad_bytes=zeros, optimizer_s=0.0,
                       label=self.label + "; no weight/gradient transfers, no optimizer (as the paper's simulator)")


def _model_shape(model: str) -> tuple[str, SimpleNamespace]:
    """A preset's (or an HF folder's config.json) shape, read as plain JSON: no transformers needed."""
    folder = Path(model)
    if folder.is_dir():
        try:
            data = json.loads((folder / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UserError(f"'{model}' has no readable config.json ({err}).") from None
        if not isinstance(data, dict):
            raise UserError(f"{folder / 'config.json'} must hold a JSON object of model settings.")
        config_json.check_fields(data, folder / "config.json")  # as every loader checks it
        data["num_key_value_heads"] = data.get("num_key_value_heads") or data["num_attention_heads"]
        return folder.name, SimpleNamespace(**data)
    key = next((k for k in presets.preset_names() if k.lower() == model.strip().lower()), None)
    if key is None:
        raise UserError(f"'{model}' is neither a model folder nor a preset; presets: {', '.join(presets.preset_names())}.")
    return key, SimpleNamespace(**presets.MODEL_PRESETS[key])


def _shape_params(config) -> tuple[int, int, int]:
    """Parameters of the embedding, of one block (linears + norms) and of the postfix (norm + head)."""
    d, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    block = speed.block_linear_params(config) + 2 * d + 2 * head_dim  # + the q/k norms some families have
    head = d + (vocab * d)  # tied or not, the head's weights are uploaded for its stage
    return vocab * d, block, head


def _params(config) -> int:
    embedding, block, head = _shape_params(config)
    tied = getattr(config, "tie_word_embeddings", False)
    return embedding + config.num_hidden_layers * block + (head - embedding if tied else head)


def _optimizer_s(params: int) -> float:
    return params * speed.ADAMW_BYTES_PER_PARAM / (speed.HOST_ADAMW_GBPS * 1e9)


def modelled_costs(model: str, gpu: str, seq_len: int = 2048, batch_size: int = 4,
                   mfu: float = speed.ASSUMED_MFU) -> Costs:
    """Per-layer costs of a preset (or HF folder) on a card, from FLOPs and bytes (module docstring)."""
    if seq_len < 1 or batch_size < 1:
        raise UserError(f"--seq-len and --batch-size must be at least 1, got {seq_len} and {batch_size}.")
    name, config = _model_shape(model)
    card = presets.gpu_profile(gpu)
    tokens, d, blocks = batch_size * seq_len, config.hidden_size, config.num_hidden_layers
    head_flops = 2.0 * tokens * d * config.vocab_size
    block_flops = (speed.forward_flops(config, batch_size, seq_len) - head_flops) / blocks
    embedding_p, block_p, head_p = _shape_params(config)
    gather = tokens * d * BF16 * 2 / (card.memory_gbps * 1e9)  # read the rows, write the activations
    block_s = speed.compute_seconds(block_flops, card, "bf16", mfu=mfu)
    head_s = speed.compute_seconds(head_flops, card, "bf16", mfu=mfu)
    times = [(gather, 2 * gather)] + [(block_s, 2 * block_s)] * blocks + [(head_s, 2 * head_s)]
    params = [embedding_p] + [block_p] * blocks + [head_p]
    weights = tuple(p * BF16 for p in params)
    tied = getattr(config, "tie_word_embeddings", False)
    updated = tuple(params[:-1]) + (head_p - embedding_p if tied else head_p,)
    layers = tuple(LayerCost(f, b, 2 * w) for (f, b), w in zip(times, weights))
    label = (f"modelled: {name} on {card.name}, {batch_size} x {seq_len} tokens a micro-batch, "
             f"{card.bf16_tflops:g} TFLOPS bf16 at {mfu:.0%} MFU (assumed), host link {card.host_link_gbps:g} GB/s, "
             f"host AdamW {speed.HOST_ADAMW_GBPS:g} GB/s (assumed)")
    return Costs(layers, weights, weights, 2 * tokens * d * BF16 / (card.host_link_gbps * 1e9),
                 card.host_link_gbps, _optimizer_s(_params(config)), prefix_layers=1,
                 memory_cap=int(MEMORY_SHARE * card.memory_bytes), label=label, kind="modelled",
                 update_params=updated, tied_table=tied)


def spec_costs(name: str, gpu: str = "rtx4090") -> Costs:
    """The paper simulator's measured per-layer times (roundpipe.md section 3) for '1.7B', '8B' or
    '32B'; weight and gradient bytes and the host AdamW are modelled from the preset's shapes."""
    if name not in SPEC_INPUTS:
        raise UserError(f"spec inputs exist for {', '.join(SPEC_INPUTS)}, not '{name}'.")
    spec = SPEC_INPUTS[name]
    _, config = _model_shape(spec["preset"])
    card = presets.gpu_profile(gpu)
    embedding_p, block_p, head_p = _shape_params(config)
    layers = [LayerCost(spec["forward"] / 1e3, spec["backward"] / 1e3)] * spec["blocks"]
    layers.append(LayerCost(spec["head"][0] / 1e3, spec["head"][1] / 1e3))
    # no embedding layer in the paper's inputs: its bytes ride with the first block
    weights = tuple(p * BF16 for p in [embedding_p + block_p] + [block_p] * (spec["blocks"] - 1) + [head_p])
    layers = tuple(replace(c, memory=2 * w) for c, w in zip(layers, weights))
    label = (f"measured (roundpipe.md section 3, {spec['preset']} shapes, {SPEC_TOKENS[0]} x {SPEC_TOKENS[1]} "
             f"tokens a micro-batch); weight/gradient transfers over {card.host_link_gbps:g} GB/s and host AdamW "
             f"at {speed.HOST_ADAMW_GBPS:g} GB/s modelled")
    return Costs(layers, weights, weights, spec["hop"] / 1e3, card.host_link_gbps, _optimizer_s(_params(config)),
                 prefix_layers=0, memory_cap=int(MEMORY_SHARE * card.memory_bytes), label=label, kind="spec")


def _number(value, where: str, default: float | None = None) -> float:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise UserError(f"{where} must be a number >= 0, got {value!r}.")
    return float(value)


def _file_layers(entries, path: str) -> list[tuple[float, float, int, int]]:
    if not isinstance(entries, list) or not entries:
        raise UserError(f"costs file '{path}' needs a non-empty list 'layers'.")
    out = []
    for i, entry in enumerate(entries):
        where = f"costs file '{path}' layers[{i}]"
        if not isinstance(entry, dict) or "forward_ms" not in entry or "backward_ms" not in entry:
            raise UserError(f"{where} must be an object with forward_ms and backward_ms.")
        forward = _number(entry["forward_ms"], f"{where}.forward_ms") / 1e3
        backward = _number(entry["backward_ms"], f"{where}.backward_ms") / 1e3
        weights = int(_number(entry.get("weight_bytes"), f"{where}.weight_bytes", 0))
        grads = int(_number(entry.get("grad_bytes"), f"{where}.grad_bytes", weights))
        repeat = entry.get("repeat", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise UserError(f"{where}.repeat must be a whole number >= 1, got {repeat!r}.")
        out += [(forward, backward, weights, grads)] * repeat
    return out


def file_costs(path: str, gpu: str = "rtx4090") -> Costs:
    """Measured per-layer costs from a JSON file (format in the module docstring)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"costs file '{path}' is not readable JSON ({err}).") from None
    if not isinstance(data, dict):
        raise UserError(f"costs file '{path}' must hold a JSON object with a list 'layers'.")
    rows = _file_layers(data.get("layers"), path)
    card = presets.gpu_profile(gpu)
    link = _number(data.get("link_gbps"), f"costs file '{path}' link_gbps", card.host_link_gbps)
    if link <= 0:
        raise UserError(f"costs file '{path}' link_gbps must be positive, got {link}.")
    prefix = data.get("prefix_layers", 0)
    if isinstance(prefix, bool) or not isinstance(prefix, int) or not 0 <= prefix < len(rows) - 1:
        raise UserError(f"costs file '{path}' prefix_layers must be a whole number from 0 to {len(rows) - 2}.")
    layers = tuple(LayerCost(f, b, w + g) for f, b, w, g in rows)
    label = f"measured: {data.get('label') or Path(path).name}"
    return Costs(layers, tuple(r[2] for r in rows), tuple(r[3] for r in rows),
                 _number(data.get("hop_ms"), f"costs file '{path}' hop_ms", 0) / 1e3, link,
                 _number(data.get("optimizer_ms"), f"costs file '{path}' optimizer_ms", 0) / 1e3,
                 prefix_layers=prefix, memory_cap=int(MEMORY_SHARE * card.memory_bytes), label=label, kind="measured")
