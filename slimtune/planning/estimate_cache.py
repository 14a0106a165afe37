"""The planner's estimates, kept on disk: an estimate depends only on the model's shape, the plan's
settings, the batch's shape and slimtune's own code, not on the card, so planning the same model for
another card, or bisecting --max-seq over lengths already tried, costs nothing the second time.

One JSON file per estimate under $XDG_CACHE_HOME/slimtune/estimates (default ~/.cache/...), named by
a hash of: the model config, the settings that shape a step (every RunConfig field but paths, data
and output), batch size and length, the versions of torch and transformers, and the bytes of every
slimtune source file, so a code change never reads an old answer. A file that cannot be read or
written is ignored: the cache only ever saves time.

The sequence tile is keyed as the tile the step runs, not as set: a step reads activations.seq_tile
only through activations.tile_tokens, so the auto rule's tile and the same tile set by hand are one
step (the planner asks for both: a plan's own row, and --max-seq's probe with MIN_TILE-token tiles).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

from slimtune.planning import estimate
from slimtune.config import RunConfig, to_dict

# Settings that name files, not shapes: they never change an estimate.
_NOT_SHAPE = ("model", "data", "output_dir", "plan", "gpu", "device", "log")


def cached_estimate(model_config, cfg: RunConfig, batch_size: int, seq_len: int, ranks: int = 1) -> estimate.Estimate:
    """estimate.estimate on a synthetic batch (`ranks`: rank 0 of a sharded job), read from the cache
    when this exact question was asked."""
    path = _folder() / f"{_key(model_config, cfg, batch_size, seq_len, ranks)}.json"
    try:
        return estimate.Estimate(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    found = estimate.estimate(model_config, cfg, batch_size, seq_len, ranks=ranks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(found)))
        os.replace(tmp, path)  # whole or absent, also with two planners at once
    except OSError:
        pass
    return found


def is_cached(model_config, cfg: RunConfig, batch_size: int, seq_len: int) -> bool:
    return (_folder() / f"{_key(model_config, cfg, batch_size, seq_len)}.json").is_file()


def _folder() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "slimtune" / "estimates"


def _key(model_config, cfg: RunConfig, batch_size: int, seq_len: int, ranks: int = 1) -> str:
    settings = {k: v for k, v in to_dict(cfg).items() if k not in _NOT_SHAPE}
    settings["activations"] = {**settings["activations"], "mlp_chunk": 0,
                               "seq_tile": tile_run(model_config, cfg, seq_len)}
    question = {"model": model_config.to_dict(), "settings": settings, "batch": [batch_size, seq_len],
                "code": _code_version(), **({"ranks": ranks} if ranks > 1 else {})}
    return hashlib.sha256(json.dumps(question, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tile_run(model_config, cfg: RunConfig, seq_len: int) -> int:
    """The tile a checkpointed block of the estimate's synthetic batch runs in (seq_len: untiled),
    whether cfg sets it or leaves it to the auto rule: what the step reads of the setting."""
    from types import SimpleNamespace

    from slimtune.step import activations

    segmented = estimate.synthetic_batch(1, seq_len, 2).segmented  # packed-looking rows, as estimated
    return activations.tile_tokens(SimpleNamespace(config=model_config), seq_len, cfg.activations, segmented)


@functools.cache
def _code_version() -> str:
    import torch
    import transformers

    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for path in sources():
        digest.update(path.relative_to(PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


PACKAGE = Path(__file__).parents[1]  # the whole slimtune package: an engine's change changes its estimates


def sources() -> list[Path]:
    """Every file of slimtune's whose bytes key the cache: its Python sources and JSON presets
    (and the C kernels, which the host optimizer's estimate does not depend on but cost nothing)."""
    return [path for pattern in ("*.py", "*.json", "*.c") for path in sorted(PACKAGE.rglob(pattern))]
