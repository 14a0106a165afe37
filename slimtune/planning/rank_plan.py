"""A plan's figures under data parallelism across machines x cards (`slimtune plan --nodes N
--gpus-per-node G`): how many ranks it runs as, what each device holds, and the job's speed.

Ranks. One per card (N x G), except for an engine that spreads one rank over all the cards of its
machine (EngineSpec.uses_cards: roundpipe's workers), which runs one rank per machine (N).

Per device. Under ddp every rank holds what one device holds alone: the measured estimate as it is.
Under fsdp the estimate is rank 0's own step, measured: the real sharded step run under torch's fake
process group on fake tensors (estimate.estimate with ranks: dist/fake_ranks.py), equal to a gloo
rank's meter to the byte (tests/unit/test_fsdp.py). Only where no fake job can start (a planner asked
from inside a launched job, which already has a process group) is it *derived* from the one-device
measurement by a formula (sharded: every weight, gradient and AdamW moment divided by the ranks, plus
what FSDP gathers whole at once), and labelled so wherever it is printed.

Speed (modelled). A step on every rank takes the engine's own modelled time plus the sum of its
gradients across ranks: the bytes the fake step's engine hands to its all-reduces (counted:
Estimate.allreduce_bytes; under fsdp, the all-gathers and reduce-scatters by formula: fsdp_payload), moved
2(R-1)/R times by a ring over the slowest link it crosses (the card's host link within a machine, an
assumed network between machines), not overlapped with compute. The job's tokens/s is R times a
rank's tokens over that time.
"""

from __future__ import annotations

import dataclasses

from slimtune.planning import estimate
from slimtune.device import speed

NETWORK_GBPS = 12.5  # between machines: 100 Gb/s Ethernet or InfiniBand (assumed)
FSDP_GATHERED_BLOCKS = 2  # blocks whose weights FSDP holds whole at once: the computing one and the next


def ranks(uses_cards: bool, nodes: int, cards: int) -> int:
    return nodes if uses_cards and cards > 1 else nodes * cards


def sync_seconds(payload_bytes: float, ranks_: int, nodes: int, gpu) -> float:
    """A ring all-reduce of `payload_bytes` per rank over the slowest link it crosses (modelled)."""
    if ranks_ <= 1 or payload_bytes <= 0:
        return 0.0
    gbps = min(gpu.host_link_gbps, NETWORK_GBPS) if nodes > 1 else gpu.host_link_gbps
    return 2 * (ranks_ - 1) / ranks_ * payload_bytes / (gbps * 1e9)


def block_params(model_config, total_params: int) -> int:
    """Parameters inside the decoder blocks: all but the embedding, an untied head and the final norm."""
    vocab, hidden = model_config.vocab_size, model_config.hidden_size
    tied = getattr(model_config, "tie_word_embeddings", False)
    return total_params - vocab * hidden * (1 if tied else 2) - hidden


def gather_bytes(cfg) -> int:
    """Bytes a weight (and its unsharded gradient) takes gathered: bf16 under mixed precision (the
    default under precision=bf16: sharding.gather_dtype), else the weights' own (fp32, fp64)."""
    if cfg.precision == "bf16" and cfg.dist.param_dtype in ("auto", "bf16"):
        return 2
    return 8 if cfg.precision == "fp64" else 4


def gathered_bytes(model_config, total_params: int, width: int) -> tuple[int, int]:
    """(weights, gradients) FSDP holds whole at once, `width` bytes a number (sharding.shard_model),
    every weight trained: two blocks' weights (the computing one and the next) and one block's
    gradients; the root's head
    and final norm (a tied embedding with them) gathered from the step's forward to the end of its
    backward, the head's gradient with them (the loss makes it in forward); an untied embedding and
    its gradient at its backward, the last the step runs."""
    per_block = block_params(model_config, total_params) / model_config.num_hidden_layers
    head = model_config.vocab_size * model_config.hidden_size + model_config.hidden_size
    embed = 0 if getattr(model_config, "tie_word_embeddings", False) else model_config.vocab_size * model_config.hidden_size
    weights = FSDP_GATHERED_BLOCKS * per_block + head + embed
    return int(width * weights), int(width * (per_block + head + embed))


def sharded(found: estimate.Estimate, model_config, ranks_: int, micro_batches: int = 1, width: int = 4) -> estimate.Estimate:
    """The per-device figures of fsdp on `ranks_` ranks derived from the one-device estimate (where no
    fake job can run: fake_ranks.available): every
    weight, gradient and AdamW moment divided by the ranks, plus what FSDP gathers whole at once
    (gathered_bytes, `width` bytes a number: gather_bytes); its payload too: every micro-batch
    gathers the blocks and an untied embedding twice (forward, backward), the root once, and
    reduce-scatters every gradient in fp32."""
    if ranks_ <= 1:
        return found
    breakdown = dict(found.breakdown)
    saved = 0
    for category in ("weights", "gradients", "optimizer"):
        divided = int(breakdown.get(category, 0) * (1 - 1.0 / ranks_))
        breakdown[category] = breakdown.get(category, 0) - divided
        saved += divided
    weights, gradients = gathered_bytes(model_config, found.total_params, width)
    gradients = int(gradients * found.trainable_params / max(found.total_params, 1))  # LoRA: the adapters' alone
    breakdown["weights"] = breakdown.get("weights", 0) + weights
    breakdown["gradients"] = breakdown.get("gradients", 0) + gradients
    return dataclasses.replace(found, device_peak_bytes=found.device_peak_bytes - saved + weights + gradients,
                               breakdown=breakdown, allreduce_bytes=fsdp_payload(found, model_config, micro_batches,
                                                                                 width))


def fsdp_payload(found: estimate.Estimate, model_config, micro_batches: int, width: int) -> int:
    """What a rank moves a step under fsdp, as all-reduce payloads (sync_seconds applies the ring's
    2(R-1)/R; an all-gather or a reduce-scatter moves half an all-reduce's traffic), by formula: every
    micro-batch gathers the blocks and an untied embedding twice (forward, backward) and the root
    once, `width` bytes a number (gather_bytes), and reduce-scatters every trained gradient in fp32.
    FSDP's own collectives run inside torch, where distributed.Counting does not see them."""
    root = model_config.vocab_size * model_config.hidden_size + model_config.hidden_size  # head, final norm
    twice = found.total_params - root  # the blocks, an untied embedding
    return int(0.5 * (width * (2 * twice + root) + 4 * found.trainable_params) * micro_batches)


def job_tokens_per_s(step: speed.StepTime, tokens_per_rank: int, ranks_: int, sync_s: float) -> float:
    seconds = step.seconds + sync_s
    return ranks_ * tokens_per_rank / seconds if seconds > 0 else 0.0
