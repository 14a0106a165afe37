"""A model folder's config.json: the fields every loader needs, checked in one place, and the model's
size from them (nothing built).

transformers builds whatever a config.json says: a zero head count divides by zero in the attention,
a zero vocabulary fails deep in the embedding or the loss, and a claimed million layers are built one
module at a time before anything else is looked at. So model.read_config (train, chat, eval, export),
presets.model_config (plan) and the simulator's shapes (engines/roundpipe/cost_model.py) check the fields
here first, each mistake one sentence naming the file and the field. Plain JSON: no torch, no
transformers (the simulator imports neither).
"""

from __future__ import annotations

from pathlib import Path

from slimtune.errors import UserError

# Every supported family's config.json gives these (transformers' defaults are not this model's).
REQUIRED_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Given or null (transformers then derives them: kv heads = heads, head_dim = hidden / heads).
OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
BYTES_16BIT = 2  # the fewest bytes a weight is loaded in (bf16; a 4-bit base is quantized after loading)


def check_fields(config: dict, path: str | Path) -> None:
    """The counts positive whole numbers, the heads' arithmetic whole; one sentence naming `path`
    (the config.json) and the field."""
    for name in REQUIRED_COUNTS:
        if name not in config:
            raise UserError(f"{path} has no {name}; a model's config.json gives it as a positive whole number.")
        _positive_whole(config, name, path)
    for name in OPTIONAL_COUNTS:
        if config.get(name) is not None:
            _positive_whole(config, name, path)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") is None and hidden % heads:
        raise UserError(f"{path}: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}) when "
                        "head_dim is not given (each head gets hidden_size / num_attention_heads).")
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UserError(f"{path}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads}); "
                        "each key/value head serves the same number of query heads.")


def _positive_whole(config: dict, name: str, path: str | Path) -> None:
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{path}: {name} must be a positive whole number, got {value!r}.")


def parameter_count(config) -> int:
    """The weights a checked config describes (a dict or a transformers config): the embedding, the
    blocks' linears and norms, the final norm and an untied head. Biases and per-head norms, which
    some families add, are left out: a lower bound, within a fraction of a percent."""
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    d, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or d // heads
    kv_heads = get("num_key_value_heads") or heads
    block = d * head_dim * (2 * heads + 2 * kv_heads) + 3 * d * get("intermediate_size") + 2 * d
    embedding = get("vocab_size") * d
    head = embedding if get("tie_word_embeddings", True) is False else 0  # unsaid: counted as tied
    return embedding + get("num_hidden_layers") * block + d + head


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"
