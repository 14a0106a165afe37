"""device_checks' long-context section: blocks tiled along the sequence on a card capped to a smaller one.

A Llama-3.2-1B-shaped random model cut to a few blocks (the blocks are alike: more would only
lengthen the run), LoRA over bf16 weights, resident with block inputs in host RAM, at 32K and 64K
tokens (quick, on the CPU: a narrow model at 512 and 1,024). Each length runs tiled (the auto rule's
tile, and 1,024-token tiles) and untiled (one tile of the whole row), with the card capped by
torch.cuda.set_per_process_memory_fraction to CAP_GIB as a smaller card would be. Recorded: the
fake-tensor estimate of the same batch beside the allocator's peak of step 2, the median step time
and tokens/s, and an out-of-memory where the cap is too small (untiled rows at 64K may be). One more
row at the first length holds two packed examples (auto tile): its tiles carry a segment mask, and with
the model's grouped-query attention they fold their query heads (seq_tiles._Block.folded_attention); a
measured peak near the estimate says no tile fell to SDPA's math kernel, whose scores the estimate
does not hold.
"""

from __future__ import annotations

import gc
import statistics

import torch

from slimtune.data.dataset import IGNORE_INDEX, Batch

CAP_GIB = 24
LENGTHS, QUICK_LENGTHS = (32 * 1024, 64 * 1024), (512, 1024)
LAYERS = 4
PLAN = {"engine": "resident", "method": "lora", "precision": "bf16", "activations.checkpoint": "host"}


def tilings(seq: int, quick: bool) -> dict[str, int]:
    """Name -> activations.seq_tile: the auto rule (0), fixed tiles, and one whole tile (untiled)."""
    fixed = 256 if quick else 1024
    return {"auto": 0, f"tile_{fixed}": fixed, "untiled": seq}


def long_context(quick: bool, output_dir: str, helpers) -> dict:
    """helpers: the device_checks module (shapes, random_model, one_batch, run_config, build_engine,
    measured_step2, estimate, device)."""
    config = helpers.shapes(quick, LAYERS)
    config.max_position_embeddings = max(config.max_position_embeddings, 2 * max(LENGTHS))
    model = helpers.random_model(config, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    out = {"layers": LAYERS, "plan": PLAN, "cap_bytes": _cap(), "rows": []}
    try:
        for seq in QUICK_LENGTHS if quick else LENGTHS:
            batch = helpers.one_batch(config.vocab_size, seq)
            for name, tile in tilings(seq, quick).items():
                out["rows"].append(_one(helpers, model, config, batch, seq, name, tile, output_dir))
        seq = (QUICK_LENGTHS if quick else LENGTHS)[0]
        out["rows"].append(_one(helpers, model, config, _packed(helpers.one_batch(config.vocab_size, seq)), seq,
                                "auto_packed", 0, output_dir))
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(1.0)
    _speedups(out["rows"])
    return out


def _packed(batch: Batch) -> Batch:
    """The batch's row as two examples: position ids restart halfway (as the planner's synthetic rows)."""
    half = batch.position_ids.shape[1] // 2
    positions, targets = batch.position_ids.clone(), batch.targets.clone()
    positions[:, half:] -= half
    targets[:, half - 1] = IGNORE_INDEX  # no target across the examples' boundary
    return Batch(batch.input_ids, targets, positions)


def _cap() -> int | None:
    """Cap the card at CAP_GIB (None on the CPU or on a card no larger)."""
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    cap = min(CAP_GIB * 2**30, total)
    torch.cuda.set_per_process_memory_fraction(cap / total)
    return cap


def _one(helpers, model, config, batch, seq: int, name: str, tile: int, output_dir: str) -> dict:
    cfg = helpers.run_config({**PLAN, "activations.seq_tile": tile}, output_dir)
    row = {"seq": seq, "tiling": name, "seq_tile": tile,
           "estimate_bytes": helpers.estimate(config, cfg, 1, seq, batch=batch).device_peak_bytes}
    engine = None
    try:
        engine = helpers.build_engine(model, cfg, helpers.device())
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        peak, times = helpers.measured_step2(engine, batch)
        step = statistics.median(times)
        row.update(measured_bytes=peak, median_step_s=step, tokens_per_s=seq / step,
                   difference_pct=100 * (peak - row["estimate_bytes"]) / row["estimate_bytes"])
        print(f"long_context {seq} {name}: estimate {row['estimate_bytes'] / 2**30:.2f} GiB, measured "
              f"{peak / 2**30:.2f} GiB ({row['difference_pct']:+.2f}%), {row['tokens_per_s']:,.0f} tokens/s", flush=True)
    except torch.OutOfMemoryError as error:
        row["out_of_memory"] = str(error).splitlines()[0]
        print(f"long_context {seq} {name}: out of memory under the cap", flush=True)
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def _speedups(rows: list[dict]) -> None:
    """Each tiled row's tokens/s over the untiled row's at its length (tiled against untiled time)."""
    untiled = {r["seq"]: r for r in rows if r["tiling"] == "untiled" and "tokens_per_s" in r}
    for row in rows:
        base = untiled.get(row["seq"])
        if base and "tokens_per_s" in row and row is not base:
            row["step_time_over_untiled"] = base["tokens_per_s"] / row["tokens_per_s"]
