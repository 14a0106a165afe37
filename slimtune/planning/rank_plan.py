"""A plan's figures under data parallelism across machines x cards (`slimtune plan --nodes N
--gpus-per-node G`): how many ranks it runs as, what each device holds, and the job's speed.

Ranks. One per card (N x G), except for an engine that spreads one rank over all the cards of its
machine (EngineSpec.uses_cards: roundpipe's workers), which runs one rank per machine (N).

Per device. Under ddp every rank holds what one device holds alone: the measured estimate as it is.
Under fsdp the blocks' weights, gradients and AdamW moments are divided by the ranks, and two
blocks' weights (the one computing and the one prefetched) and one block's gradients are gathered
whole: *derived* from the one-device measurement by that formula (fake tensors cannot run FSDP's
collectives), and labelled so wherever it is printed.

Speed (modelled). A step on every rank takes the engine's own modelled time plus the sum of its
gradients across ranks: the bytes the fake step's engine hands to its all-reduces (counted:
Estimate.allreduce_bytes; under fsdp, two all-gathers and a reduce-scatter of the blocks), moved
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


def sharded(found: estimate.Estimate, model_config, ranks_: int, micro_batches: int = 1) -> estimate.Estimate:
    """The per-device figures of fsdp on `ranks_` ranks, derived from the one-device estimate; its
    payload too: every micro-batch gathers the blocks twice (forward, backward) and reduce-scatters
    their gradients. Weights are gathered in their own dtype, fp32 (sharding.py sets no
    MixedPrecisionPolicy)."""
    if ranks_ <= 1:
        return found
    share = block_params(model_config, found.total_params) / max(found.trainable_params, 1)
    kept = 1.0 / ranks_
    breakdown = dict(found.breakdown)
    saved = 0
    for category in ("weights", "gradients", "optimizer"):
        divided = int(breakdown.get(category, 0) * share * (1 - kept))
        breakdown[category] = breakdown.get(category, 0) - divided
        saved += divided
    per_block = 4 * block_params(model_config, found.total_params) / model_config.num_hidden_layers  # fp32
    gathered = int(FSDP_GATHERED_BLOCKS * per_block + per_block)  # two blocks' weights, one's gradients
    breakdown["weights"] = breakdown.get("weights", 0) + int(FSDP_GATHERED_BLOCKS * per_block)
    breakdown["gradients"] = breakdown.get("gradients", 0) + int(per_block)
    blocks = 4 * block_params(model_config, found.total_params)
    # As all-reduce payloads (sync_seconds applies the ring's 2(R-1)/R): two all-gathers and a
    # reduce-scatter a micro-batch, each half an all-reduce's traffic; the edges summed as under ddp.
    payload = int(1.5 * blocks * micro_batches + found.allreduce_bytes * (1 - share))
    return dataclasses.replace(found, device_peak_bytes=found.device_peak_bytes - saved + gathered,
                               breakdown=breakdown, allreduce_bytes=payload)


def job_tokens_per_s(step: speed.StepTime, tokens_per_rank: int, ranks_: int, sync_s: float) -> float:
    seconds = step.seconds + sync_s
    return ranks_ * tokens_per_rank / seconds if seconds > 0 else 0.0
