"""Modelled step time: FLOPs and bytes moved over a card's rates.

Memory is measured (estimate.py); time is not, so everything here is labelled "modelled"
wherever it is printed. The parts: matmul FLOPs of the step over the card's dense peak times an
assumed model-FLOPs utilisation; device memory traffic (a device optimizer, 4-bit dequantization)
over the device bandwidth; host-link and disk bytes over their rates; a host AdamW over the host's
memory bandwidth. Each engine composes its own step time from these parts in its registration
(`EngineSpec.step_time`): `serial_step_time` when nothing overlaps, `overlapped_step_time` when
copies run beside compute. The bytes that cross the link come from the estimate (`StepCounts`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Model-FLOPs utilisation a well-fed training step reaches on a GPU: assumed (no GPU figure is
# measured yet); benchmarks/README.md holds the CPU calibration.
ASSUMED_MFU = 0.5
ADAMW_BYTES_PER_PARAM = 28  # fused AdamW, fp32: reads param, grad, m, v (16 B), writes param, m, v (12 B)
DEQUANT_BYTES_PER_PARAM = 4.5  # 4-bit: read the codes (0.5 B), write and re-read the bf16 weight (2 x 2 B)
HOST_ADAMW_GBPS = 20.0  # a desktop CPU's memory bandwidth as a vectorised AdamW sees it (assumed)
DISK_GBPS = 2.0  # an NVMe SSD's sustained write/read rate (assumed; the card profiles carry no disk figure)


@dataclass
class StepCounts:
    """What the estimate counted for one optimizer step: the inputs of the time model that are not FLOPs."""

    trainable_params: int
    host_link_bytes: int
    disk_bytes: int  # held on disk at once (each byte is written once and read once a step)


@dataclass
class StepTime:
    seconds: float
    compute_s: float
    optimizer_s: float
    link_s: float
    flops: float

    def tokens_per_s(self, tokens: int) -> float:
        return tokens / self.seconds if self.seconds > 0 else 0.0


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def block_linear_params(config) -> int:
    """Weights of the matmuls in one block: q, k, v, o and the gated MLP."""
    d, hd = config.hidden_size, _head_dim(config)
    attention = d * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    return attention + 3 * d * config.intermediate_size


def forward_flops(config, batch_size: int, seq_len: int) -> float:
    """Matmul FLOPs of one forward pass (2 per multiply-add); causal attention counts half."""
    tokens = batch_size * seq_len
    linears = config.num_hidden_layers * block_linear_params(config) + config.vocab_size * config.hidden_size
    width = config.num_attention_heads * _head_dim(config)
    attention = config.num_hidden_layers * 2 * 2 * batch_size * seq_len * seq_len * width * 0.5
    return 2.0 * tokens * linears + attention


def step_flops(config, method: str, batch_size: int, seq_len: int, recompute: bool = False) -> float:
    """Forward + backward. Full fine-tuning's backward computes input and weight gradients
    (2x forward); LoRA's computes input gradients only (1x; the adapters' share is negligible).
    Checkpointing runs every block's forward once more in backward."""
    forward = forward_flops(config, batch_size, seq_len)
    return forward * ((3.0 if method == "full" else 2.0) + (1.0 if recompute else 0.0))


def dequant_bytes(config, passes: int) -> float:
    """Memory traffic of dequantizing every 4-bit block weight `passes` times in a step."""
    return config.num_hidden_layers * block_linear_params(config) * DEQUANT_BYTES_PER_PARAM * passes


def compute_seconds(flops: float, gpu, precision: str, memory_bytes: float = 0.0, mfu: float = ASSUMED_MFU) -> float:
    """Matmuls at the card's peak times the MFU, plus device memory traffic at its bandwidth."""
    rate = (gpu.bf16_tflops if precision == "bf16" else gpu.fp32_tflops) * 1e12
    return flops / (rate * mfu) + memory_bytes / (gpu.memory_gbps * 1e9)


def link_seconds(link_bytes: float, disk_bytes: float, gpu) -> float:
    return link_bytes / (gpu.host_link_gbps * 1e9) + disk_bytes / (DISK_GBPS * 1e9)


def serial_step_time(flops: float, trainable_params: int, gpu, precision: str, link_bytes: float = 0.0,
                     disk_bytes: float = 0.0, memory_bytes: float = 0.0, mfu: float = ASSUMED_MFU) -> StepTime:
    """Nothing overlaps: compute (with its device memory traffic `memory_bytes`, e.g. 4-bit
    dequantization), a device AdamW over the trainable weights, and the link add up (a conservative
    figure: the resident engine prefetches one block, which this ignores)."""
    compute = compute_seconds(flops, gpu, precision, memory_bytes, mfu)
    optimizer = trainable_params * ADAMW_BYTES_PER_PARAM / (gpu.memory_gbps * 1e9)
    link = link_seconds(link_bytes, disk_bytes, gpu)
    return StepTime(compute + optimizer + link, compute, optimizer, link, flops)


def overlapped_step_time(flops: float, trainable_params: int, gpu, precision: str, link_bytes: float,
                         disk_bytes: float, updates_exposed: bool, memory_bytes: float = 0.0,
                         mfu: float = ASSUMED_MFU, hidden_under: float = 1.0) -> StepTime:
    """Copies overlap compute (the slower of the two sets the pace), and AdamW runs on the host: its
    whole time is added when every update waits for the step's device work (`updates_exposed`), else
    it runs beside the share `hidden_under` of that work (the backward and recompute, about 3/4 of a
    step, without clipping; the next step's forward, about 1/4, under it) and only what outlasts that
    share is added. `memory_bytes`: device memory traffic of the compute (4-bit dequantization)."""
    compute = compute_seconds(flops, gpu, precision, memory_bytes, mfu)
    link = link_seconds(link_bytes, disk_bytes, gpu)
    optimizer = trainable_params * ADAMW_BYTES_PER_PARAM / (HOST_ADAMW_GBPS * 1e9)
    paced = max(compute, link)
    exposed = optimizer if updates_exposed else max(0.0, optimizer - hidden_under * paced)
    return StepTime(paced + exposed, compute, optimizer, link, flops)
