"""estimate.estimate: the real training step of the real engine, run on fake tensors.

The model is built on the meta device and given fake parameters (FakeTensorMode on the
CPU device: fake `cuda` tensors cannot exist on a CPU-only torch), the run is assembled
by assembly.assemble exactly as `train.build` assembles it, and one step runs under the
same meter the training loop uses. Nothing is computed and no weight is allocated. The engines
create their optimizer state when they are built, so that first step holds what every later
step holds (tests/unit/test_estimate.py compares it with a real run's second step).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from slimtune import assembly, engines
from slimtune.dist import fake_ranks, ranks as distributed
from slimtune.device import memory
from slimtune.config import RunConfig
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.model.stack import Stack
from slimtune.device.speed import StepCounts

# Steps run: one. Engines hold their optimizer state from construction (rules.init_adamw_state,
# HostAdam), so the first step is already the steady state every later step repeats.
STEPS = 1


@dataclass
class Estimate:
    device_peak_bytes: int
    breakdown: dict[str, int]  # by memory.CATEGORIES, at the peak
    host_bytes: int  # host RAM the plan holds beyond the loaded model files (offloaded state)
    disk_bytes: int
    host_link_bytes: int  # per optimizer step
    trainable_params: int
    total_params: int
    # Bytes a rank's engine sums across ranks per step under data parallelism (counted on the fake
    # step's real code path: distributed.Counting): the gradient payload of every all-reduce.
    allreduce_bytes: int = 0
    # Whether a block of the step ran in tiles of tokens (activations.seq_tile): a shorter tile would
    # then weigh less at this length (the planner's --max-seq takes the shortest).
    tiled_blocks: bool = False
    # The estimate by depth's peak of each class of segment at the full depth (its largest is the
    # device peak), by label; None where the step ran at full depth. Each grows with the length along
    # its own line where the peak, their largest, turns from one to another (--max-seq solves each).
    segment_peaks: dict[str, int] | None = None

    def counts(self) -> StepCounts:
        """What the time model needs of it."""
        return StepCounts(self.trainable_params, self.host_link_bytes, self.disk_bytes)


def synthetic_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int = 0) -> Batch:
    """A packed-looking batch: each row holds two examples (position ids restart halfway), and
    the first quarter of each example is prompt (no loss), as response-only training has."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    half = seq_len // 2
    positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).expand(batch_size, -1).clone()
    targets = torch.roll(ids, -1, dims=1)
    targets[positions < max(1, half // 4)] = IGNORE_INDEX
    targets[:, [half - 1, seq_len - 1]] = IGNORE_INDEX
    return Batch(ids, targets, positions)


def meta_model(config, dtype: torch.dtype) -> nn.Module:
    """An HF model of `config`'s shape with no storage at all. It gets a copy of `config`: building sets
    the config's dtype and the step its use_cache, and the caller's config keys the estimate cache (a
    changed one read as another model, so a plan made again weighed afresh the plans weighed first)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def make_fake(model: nn.Module, mode) -> nn.Module:
    """Give every parameter and buffer a fake tensor of its shape (tied weights stay tied).
    Assigned directly: Module.to() cannot move parameters onto fake tensors."""
    replaced: dict[int, nn.Parameter] = {}
    with mode:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    if id(param) not in replaced:
                        fake = torch.empty(param.shape, dtype=param.dtype)
                        replaced[id(param)] = nn.Parameter(fake, requires_grad=param.requires_grad)
                    module._parameters[name] = replaced[id(param)]
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)
    return model


def fake_model(config, dtype: torch.dtype, mode) -> nn.Module:
    return make_fake(meta_model(config, dtype), mode)


def estimate(config, cfg: RunConfig, batch_size: int, seq_len: int, batch: Batch | None = None,
             by_depth: bool = True, ranks: int = 1) -> Estimate:
    """Device peak of one steady-state optimizer step of `cfg` on a model of `config`'s shape, on
    `batch` (real tensors; its shape wins) or else a synthetic_batch(batch_size, seq_len); under
    dist.strategy=fsdp on `ranks` ranks, rank 0's step of a fake job (fake_ranks: the real sharded
    step, the other ranks a fake process group). A deep
    stack of identical blocks is estimated from two shallow ones (`by_depth`, see _by_depth): the
    same bytes as the full-depth step, in the time of a few blocks."""
    real_batch = batch if batch is not None else synthetic_batch(batch_size, seq_len, config.vocab_size)
    margin = engines.get(cfg.engine).block_margin(cfg)
    probes = (2 * margin + 1, 2 * margin + 2)
    by_depth = by_depth and engines.get(cfg.engine).by_depth(cfg)
    if by_depth and _repeats_one_block(config, cfg) and config.num_hidden_layers > probes[1]:
        found = _by_depth(config, cfg, real_batch, margin, probes, ranks)
        if found is not None:
            return found
    return _step(config, cfg, real_batch, ranks=ranks)[0]


def _step(config, cfg: RunConfig, real_batch: Batch, segments: bool = False,
          replays: dict | None = None, ranks: int = 1) -> tuple[Estimate, dict | None]:
    """One fake step at `config`'s depth; with `segments`, the peak of each marked segment too.
    `replays`: memory.replayed's table, shared with another step of the same plan and batch."""
    with fake_ranks.rank_of(ranks if fake_ranks.needed(cfg, ranks) else 1) as dist:
        return _fake_step(config, cfg, real_batch, segments, replays, dist if dist.active else distributed.Counting())


def _fake_step(config, cfg: RunConfig, real_batch: Batch, segments: bool, replays: dict | None,
               counting: distributed.Counting) -> tuple[Estimate, dict | None]:
    precision = assembly.resolve_precision(cfg.precision, torch.device("cuda"))  # planned for a GPU
    mode = memory.MeteredFakeMode(allow_non_fake_inputs=True, replays=replays)  # the step's meter counts inside it
    stack = Stack(fake_model(config, assembly.run_weight_dtype(cfg, precision), mode))
    with mode:
        engine = assembly.assemble(cfg, stack, assembly.HOST, precision, counting)
        if segments:
            engine.meter = memory.CpuMeter(segments=True)
        tensors = (real_batch.input_ids, real_batch.targets, real_batch.position_ids, real_batch.trained_positions)
        batch = Batch(*(mode.from_tensor(t) for t in tensors), num_targets=real_batch.num_targets,
                      segmented=real_batch.segmented)
        results = [engine.step([batch] * cfg.train.grad_accum) for _ in range(STEPS)]
    model = stack.model
    found = Estimate(  # params: the whole model's, a sharded weight counted whole (DTensor.numel)
        device_peak_bytes=results[-1].device_peak_bytes,
        breakdown=results[-1].device_peak_breakdown,
        host_bytes=results[-1].host_peak_bytes,
        disk_bytes=results[-1].disk_peak_bytes,
        host_link_bytes=results[-1].host_link_bytes,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in model.parameters()),
        allreduce_bytes=counting.take_reduced_bytes() // STEPS,
        tiled_blocks=mode.tiled_blocks,
    )
    return found, (engine.meter.last_reading.segments if segments else None)


# ---------------------------------------------------------------- the estimate by depth
#
# Why two shallow steps give the deep one's bytes. The engines run one loop over identical blocks,
# marking where each block's forward and backward begins (memory.mark). Inside block i's segment the
# memory is what was live when the segment began plus what the block's own ops hold, and the block's
# ops are the same for every i and every depth. What was live is affine in the depth D (weights,
# optimizer state, per-block host or device state of every block) and in i (activations or inputs
# kept for the blocks before it, gradients of the blocks after it). So each segment's peak is affine
# in (D, i), and the step's peak is the largest of them: at D, max over the non-block segments and the
# blocks at each end (affine in D) and over the blocks between (affine in D and i, largest at one of
# the two ends of the range). The `margin` blocks at each end behave unlike the others (the first
# block's input needs no gradient, the last one feeds the loss, a slot prefetches `margin` ahead) and
# are fitted one by one. Probes at depths 2m+1 and 2m+2 give every coefficient: the blocks between
# have one member at the first depth and two at the second. The envelope is exact, so the peak may
# sit in another segment at depth D than in the probes. Layers that differ (sliding-window mixes) or
# caches tied to positions (activations.cache) are estimated at full depth instead. What the argument
# needs of the code: no segment holds two phases whose live bytes grow with D at different rates (the
# loss forward, with every block's activations; the tied embedding's backward, with every block's
# gradients), or its peak is the larger of two lines, which two probes cannot see. Every loop over the
# blocks marks each one (Stack.run_blocks, activations, slide), and the loss's and the embedding's
# backward are marked apart from what precedes them (loss.causal_lm_loss, Stack.body_hidden), which
# keeps such phases apart; the plans benchmark checks every preset's plans against the full depth.


def _repeats_one_block(config, cfg: RunConfig) -> bool:
    types = getattr(config, "layer_types", None)
    return (not types or len(set(types)) == 1) and cfg.activations.cache == "none"


def at_depth(config, depth: int):
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = depth
    if getattr(shallow, "layer_types", None):
        shallow.layer_types = shallow.layer_types[:depth]
    if hasattr(shallow, "max_window_layers"):
        shallow.max_window_layers = min(shallow.max_window_layers, depth)
    return shallow


def _by_depth(config, cfg: RunConfig, real_batch: Batch, margin: int, probes: tuple[int, int],
              ranks: int = 1) -> Estimate | None:
    """The full-depth estimate from steps at the two probe depths; None when their segments do not
    line up as the loop structure says they must (then the caller runs the full depth)."""
    replays: dict = {}  # the two depths run the same blocks on the same batch
    shallow, deep = (_step(at_depth(config, d), cfg, real_batch, segments=True, replays=replays, ranks=ranks)
                     for d in probes)
    fits = _segment_fits(shallow[1], deep[1], probes, margin)
    if fits is None:
        return None
    depth = config.num_hidden_layers
    by_segment = {f"{key} {end}": f(depth, i) for key, f, spans in fits for end, i in enumerate(spans(depth))}
    peak, breakdown = max(by_segment.values(), key=lambda v: v[0])

    def line(field: str) -> int:
        low, high = getattr(shallow[0], field), getattr(deep[0], field)
        return low + (high - low) * (depth - probes[0])

    return Estimate(device_peak_bytes=peak, breakdown=breakdown, host_bytes=line("host_bytes"),
                    disk_bytes=line("disk_bytes"), host_link_bytes=line("host_link_bytes"),
                    trainable_params=line("trainable_params"), total_params=line("total_params"),
                    allreduce_bytes=line("allreduce_bytes"),
                    tiled_blocks=shallow[0].tiled_blocks or deep[0].tiled_blocks,
                    segment_peaks={label: value[0] for label, value in by_segment.items()})


def _segment_fits(low: dict, high: dict, probes: tuple[int, int], margin: int) -> list | None:
    """[(class, f(D, i) -> (peak, breakdown), spans(D) -> the i to evaluate)] for every class of segment."""
    low_classes, high_classes = _classes(low, probes[0], margin), _classes(high, probes[1], margin)
    if set(low_classes) != set(high_classes):
        return None
    fits = []
    for key, at_low in low_classes.items():
        at_high = high_classes[key]
        if key[1] != "between":
            fits.append((key, _line(at_low[None], at_high[None], probes[0]), lambda depth: [None]))
            continue
        if set(at_low) != {margin} or set(at_high) != {margin, margin + 1}:
            return None
        fits.append((key, _plane(at_low[margin], at_high[margin], at_high[margin + 1], probes[0], margin),
                     lambda depth: [margin, depth - margin - 1]))
    return fits


def _classes(segments: dict, depth: int, margin: int) -> dict:
    """(kind, position, occurrence) -> {block index or None: (peak, breakdown)}. Positions: a
    non-block segment (None), the `margin` blocks at either end ("first", k) / ("last", k), or
    "between"."""
    classes: dict = {}
    for label, value in segments.items():
        if len(label) == 3 and isinstance(label[1], int):
            kind, index, occurrence = label
            if index < margin:
                position, key_index = ("first", index), None
            elif index >= depth - margin:
                position, key_index = ("last", depth - 1 - index), None
            else:
                position, key_index = "between", index
        else:
            kind, position, occurrence, key_index = label[0], None, label[-1], None
        classes.setdefault((kind, position, occurrence), {})[key_index] = value
    return classes


def _line(at_low: tuple, at_high: tuple, low_depth: int):
    """A segment's peak and breakdown, affine in the depth, through two probes."""
    def at(depth: int, index=None) -> tuple[int, dict]:
        step = depth - low_depth
        return (at_low[0] + (at_high[0] - at_low[0]) * step,
                {k: at_low[1][k] + (at_high[1][k] - at_low[1][k]) * step for k in at_low[1]})
    return at


def _plane(low: tuple, high: tuple, high_next: tuple, low_depth: int, margin: int):
    """The blocks between the ends: affine in the depth and in the block index (three probes' worth)."""
    def at(depth: int, index: int) -> tuple[int, dict]:
        steps, later = depth - low_depth, index - margin
        return (low[0] + (high[0] - low[0]) * steps + (high_next[0] - high[0]) * later,
                {k: low[1][k] + (high[1][k] - low[1][k]) * steps + (high_next[1][k] - high[1][k]) * later
                 for k in low[1]})
    return at
