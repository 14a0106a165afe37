"""Engine roundpipe's settings (the `roundpipe.*` section), what it refuses, its workers' devices and
the plans the planner weighs for it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from slimtune.config import RunConfig, setting
from slimtune.errors import UserError
from slimtune.engines.roundpipe.optimizer import variant_of

_CUDA_NAME = re.compile(r"^cuda(:\d+)?$")


@dataclass
class RoundPipeConfig:
    workers: int | list[str] = setting(
        2, "engine=roundpipe: the workers, as a count (CUDA devices in turn, several per card when more than the"
           " cards; CPU threads without CUDA) or a list of devices, e.g. [cuda:0, cuda:1].")
    micro_batches: int = setting(0, "engine=roundpipe: micro-batches each batch is cut into by rows (0: workers + 1).")
    grain: Literal["stage", "layer"] = setting(
        "stage", "engine=roundpipe: backward recomputes a whole stage (stage) or layer by layer from every layer's"
                 " saved input (layer: less device memory, more host RAM and traffic).")
    optimizer: Literal["sync", "async"] = setting(
        "sync", "engine=roundpipe: sync: exact AdamW after each step; async: the update runs during the next step,"
                " which sees weights one update old (not exact; see the engine's docs).")
    memory_fraction: float = setting(
        0.6, "engine=roundpipe: share of the smallest free device memory (when the engine is built) the workers on a"
             " card may fill: a stage's weights and gradients stay under half of their part of it (CUDA only).")
    replan: bool = setting(
        True, "engine=roundpipe: cut the stages again after each step from the measured per-layer times (EMA);"
              " false: keep the first cut (from the layers' bytes). A replan keeps the first cut's tail shard count,"
              " so results do not depend on the cut or on how fast anything ran.")
    tail_shards: int = setting(
        0, "engine=roundpipe: at most this many jobs the LM head + loss may be cut into by tokens, each a"
           " slice of every micro-batch (0: up to the workers; 1: never). A large vocabulary's head is several"
           " blocks' worth; cut, it stops setting the pace of every stage. The partitioner picks the count.")
    timeout_s: float = setting(600.0, "engine=roundpipe: a worker waiting longer than this for a hand-off stops the run.")

    def validate(self) -> None:
        if isinstance(self.workers, int) and self.workers < 1:
            raise UserError(f"roundpipe.workers must be at least 1, got {self.workers}.")
        if isinstance(self.workers, list) and not self.workers:
            raise UserError("roundpipe.workers is an empty list; name at least one device.")
        for i, name in enumerate(self.workers if isinstance(self.workers, list) else ()):
            if not _CUDA_NAME.match(name):
                raise UserError(f"roundpipe.workers[{i}] is '{name}', not a CUDA device such as cuda:0; list CUDA"
                                " devices, or give a count (CPU threads without CUDA).")
        if self.micro_batches < 0:
            raise UserError(f"roundpipe.micro_batches must be 0 (workers + 1) or more, got {self.micro_batches}.")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise UserError(f"roundpipe.memory_fraction must be in (0, 1], got {self.memory_fraction}.")
        if self.tail_shards < 0:
            raise UserError(f"roundpipe.tail_shards must be 0 (up to the workers) or more, got {self.tail_shards}.")
        if self.timeout_s <= 0:
            raise UserError(f"roundpipe.timeout_s must be positive, got {self.timeout_s}.")


def validate(cfg: RunConfig) -> None:
    """What engine=roundpipe does not do, refused in one sentence each."""
    if cfg.loss.mode != "exact":
        raise UserError("engine=roundpipe computes the exact loss in its fused tail; set loss.mode=exact.")
    if cfg.quant.embeddings:
        raise UserError("engine=roundpipe gathers embedding rows on the host in full precision; set quant.embeddings=false.")
    if cfg.activations.checkpoint != "none" or cfg.activations.cache != "none":
        raise UserError("engine=roundpipe recomputes every backward stage from its saved input on the host; set"
                        " activations.checkpoint=none and activations.cache=none (roundpipe.grain chooses the grain).")
    if cfg.method == "lora" and cfg.lora.dropout > 0:
        raise UserError("engine=roundpipe cannot redraw dropout masks when a stage is recomputed on another worker;"
                        " set lora.dropout=0.")
    _refuse_missing_devices(cfg)
    variant_of(cfg).refuse(cfg)


def _refuse_missing_devices(cfg: RunConfig) -> None:
    """Listed workers are this machine's CUDA devices, said before anything is built (a run without
    CUDA would otherwise run them as CPU threads, not what was asked)."""
    workers = cfg.section("roundpipe").workers
    if not isinstance(workers, list):
        return
    found = torch.cuda.device_count() if cfg.device != "cpu" else 0
    for name in workers:
        index = int(name.partition(":")[2] or 0)
        if index >= found:
            here = "device=cpu" if cfg.device == "cpu" else f"this machine has {found} CUDA device(s)"
            raise UserError(f"roundpipe.workers names '{name}', which this run cannot use ({here}); list devices from"
                            " cuda:0 up, or give a count (CPU threads without CUDA).")


def worker_devices(section: RoundPipeConfig, device: torch.device) -> list[torch.device]:
    """The workers' devices: a list as given; a count over the CUDA cards in turn (virtual workers
    share a card); on a CPU run (or the planner's fake step), that many CPU workers."""
    if isinstance(section.workers, list):
        if device.type != "cuda":
            return [torch.device("cpu")] * len(section.workers)
        found = [torch.device(name) for name in section.workers]
        for d in found:
            if d.type != "cuda" or (d.index or 0) >= torch.cuda.device_count():
                raise UserError(f"roundpipe.workers names '{d}', which is not a CUDA device of this machine"
                                f" ({torch.cuda.device_count()} found).")
        return found
    if device.type != "cuda":
        return [torch.device("cpu")] * section.workers
    return [torch.device("cuda", i % torch.cuda.device_count()) for i in range(section.workers)]


def plans(method: str) -> list[dict]:
    """bf16 with the exact (sync) optimizer; LoRA over a bf16 or a 4-bit base. The stale async
    optimizer changes the result, so it is the user's choice, never the planner's."""
    plan = {"precision": "bf16", "activations.checkpoint": "none"}
    return [plan, {**plan, "quant.scheme": "nf4"}] if method == "lora" else [plan]


def on_cards(plan: dict, cards: int) -> dict | None:
    """A worker per card, from two cards: on one, slide's window is the better streaming plan (its
    updates overlap the backward; a lone worker waits for each whole stage)."""
    return {**plan, "roundpipe.workers": cards} if cards > 1 else None
