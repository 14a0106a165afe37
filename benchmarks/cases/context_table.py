"""The context table: the longest sequence (batch 1) each engine trains on an 8, 16, 24 and 80 GiB card,
for Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B, LoRA (rank 16; a 4-bit NF4 base where the engine's
plans offer one) and full fine-tuning, on a host with 64 GiB of RAM and a disk for the rest (4 TiB).
And the issue's goal figures beside it: Llama-3.1-8B LoRA over NF4 on 24 GiB (goal >= 256K tokens), and
Llama-3.2-3B LoRA at 16K tokens, the smallest device peak of any plan (goal <= 1.0 GiB), each with
what its peak is made of and where in the step it sits.

Every figure is an estimate: the real step of the real engine on fake tensors, counted by the training
loop's meter (slimtune.planning.estimate), found by `slimtune plan --max-seq`'s search (planning/
longest_seq.py: it fits, one token more does not). The search looks past the presets' 131,072
positions (to 2^20 tokens), as a run that extends its RoPE would: the table says what memory allows,
and marks the lengths beyond the model's positions. Plans whose blocks run in tiles are searched with
256-token tiles (planner._longest_with_tile), the tile that fits the longest.

The plans: per engine those built for long rows (block checkpoints on disk or slide's window, and for
LoRA a 4-bit base beside the bf16 one), from each engine's own list (engines.plans_for). Left out:
roundpipe (two cards or more), chunk (its estimate runs the whole depth: minutes a length for 8B, and
it keeps every weight on the device, as resident does) and resident with checkpoints in host RAM
(the disk plan's device bytes, less room: 64 GiB of checkpoints end it first).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
import sys
import time
from pathlib import Path

from slimtune import engines, presets
from slimtune.planning import estimate, planner
from slimtune.units import human_bytes

MODELS = ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B")
CARDS = ("8GiB", "16GiB", "24GiB", "80GiB")
HOST_RAM, DISK = "64GiB", "4096GiB"
SEQ = 2048  # where each search starts (the plan's own estimate, as `slimtune plan` makes it)
SEQ_LIMIT = 2**20
GOAL_MODEL, GOAL_CARD, GOAL_SEQ = "Llama-3.1-8B", "24GiB", 256 * 1024
PEAK_MODEL, PEAK_SEQ, PEAK_GOAL = "Llama-3.2-3B", 16 * 1024, 2**30

# The plans searched, a subset of engines.plans_for(method): each engine's long-row plans.
PLANS = {
    "lora": [
        {"engine": "resident", "precision": "bf16", "activations.checkpoint": "disk"},
        {"engine": "resident", "precision": "bf16", "quant.scheme": "nf4", "activations.checkpoint": "disk"},
        {"engine": "slide", "precision": "bf16", "quant.scheme": "nf4"},
    ],
    "full": [
        {"engine": "resident", "precision": "bf16", "activations.checkpoint": "disk"},
        {"engine": "lsp", "precision": "bf16", "activations.checkpoint": "recompute"},
        {"engine": "slide", "precision": "bf16", "activations.checkpoint": "host"},
        {"engine": "slide", "precision": "bf16", "activations.checkpoint": "host", "slide.working_set": "chunk",
         "chunk.n_chunks": 8, "chunk.state": "disk"},
    ],
}


def _importable_self():
    """This module under a name a spawned process can import (run.py loads cases by file path)."""
    benchmarks = str(Path(__file__).resolve().parent.parent)
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    return importlib.import_module("cases.context_table")


def machine(card: str) -> planner.Machine:
    return planner.Machine.named(card, HOST_RAM, DISK)


def plan_row(model: str, method: str, plan: dict, cards: tuple[str, ...] = CARDS) -> dict:
    """One plan's longest sequence on each card, what binds one token beyond it, and the peak there."""
    model_config, began = presets.model_config(model), time.perf_counter()
    base = planner.planning_config(method)
    row = {"model": model, "method": method, "engine": plan["engine"],
           "options": {k: v for k, v in plan.items() if k != "engine"}, "cards": {}}
    for card in cards:
        found = planner.weigh(model_config, base, plan, machine(card), 1, SEQ, max_seq=True, seq_limit=SEQ_LIMIT)
        row["cards"][card] = _at_longest(model_config, base, plan, machine(card), found)
        print(f"{model} {method} {plan['engine']} {found.label} {card}: {found.max_seq:,}"
              f" (tile {found.max_seq_tile})", flush=True)
    row["seconds"] = round(time.perf_counter() - began, 1)
    return row


def _at_longest(model_config, base, plan: dict, where: planner.Machine, found: planner.PlanResult) -> dict:
    """The longest sequence, its tile, the step's figures there and which resource one token more lacks."""
    longest, tile = found.max_seq, found.max_seq_tile
    out = {"max_seq": longest, "tile": tile,
           "beyond_positions": longest > model_config.max_position_embeddings}
    if not longest:
        return out
    cfg = planner._run_config(base, {**plan, **({"activations.seq_tile": tile} if tile else {})})
    at = planner.per_device_estimate(model_config, cfg, where, 1, longest)  # cached by the search
    over = planner.per_device_estimate(model_config, cfg, where, 1, longest + 1)
    out.update(device_peak_bytes=at.device_peak_bytes, breakdown=at.breakdown, host_bytes=at.host_bytes,
               disk_bytes=at.disk_bytes,
               binding=sorted(where.shortfalls(over)) if longest < SEQ_LIMIT else ["the search's limit"])
    return out


def peak_at_16k() -> dict:
    """Llama-3.2-3B LoRA at 16K tokens: every LoRA plan's device peak, the smallest with its parts and
    the segment of the step where it sits (the segments of the step at the estimate's shallow depth)."""
    model_config = presets.model_config(PEAK_MODEL)
    results = planner.plan(model_config, planner.planning_config("lora"), machine("80GiB"), 1, PEAK_SEQ)
    least = planner.smallest(results)
    plans = [{"engine": r.engine, "options": r.options, "device_peak_bytes": r.estimate.device_peak_bytes,
              "breakdown": r.estimate.breakdown} for r in results]
    cfg = planner._run_config(planner.planning_config("lora"), {"engine": least.engine, **least.options})
    return {"model": PEAK_MODEL, "seq": PEAK_SEQ, "goal_bytes": PEAK_GOAL, "plans": plans,
            "smallest": {"engine": least.engine, "options": least.options,
                         "device_peak_bytes": least.estimate.device_peak_bytes,
                         "with_cuda_context_bytes": least.estimate.device_peak_bytes + planner.CUDA_OVERHEAD_BYTES,
                         "breakdown": least.estimate.breakdown,
                         "segments_at_depth_3": segments(model_config, cfg, PEAK_SEQ)},
            "meets_goal": least.estimate.device_peak_bytes <= PEAK_GOAL}


def segments(model_config, cfg, seq: int, depth: int = 3) -> dict:
    """Each segment's peak (block forward/backward, loss, embedding, update) of the step at a shallow
    depth: where in the step the bytes are held (the full depth adds blocks, not segments)."""
    batch = estimate.synthetic_batch(1, seq, model_config.vocab_size)
    _, found = estimate._step(estimate.at_depth(model_config, depth), cfg, batch, segments=True)
    return {" ".join(map(str, label)): {"peak_bytes": peak, "breakdown": {k: v for k, v in parts.items() if v}}
            for label, (peak, parts) in found.items()}


def goal_256k(rows: list[dict]) -> dict:
    """Llama-3.1-8B LoRA over NF4 on 24 GiB: the longest of its plans, and where its peak sits one
    tile-aligned step past it (at the goal length when it falls short)."""
    nf4 = [r for r in rows if r["model"] == GOAL_MODEL and r["method"] == "lora" and r["options"].get("quant.scheme")]
    best = max(nf4, key=lambda r: r["cards"][GOAL_CARD]["max_seq"])
    at = best["cards"][GOAL_CARD]
    out = {"model": GOAL_MODEL, "card": GOAL_CARD, "goal_seq": GOAL_SEQ, "engine": best["engine"],
           "options": best["options"], **at, "meets_goal": at["max_seq"] >= GOAL_SEQ}
    if not out["meets_goal"]:
        plan = {"engine": best["engine"], **best["options"],
                **({"activations.seq_tile": at["tile"]} if at["tile"] else {})}
        cfg = planner._run_config(planner.planning_config("lora"), plan)
        model_config = presets.model_config(GOAL_MODEL)
        full = planner.per_device_estimate(model_config, cfg, machine(GOAL_CARD), 1, GOAL_SEQ)
        out["at_goal"] = {"device_peak_bytes": full.device_peak_bytes, "breakdown": full.breakdown,
                          "host_bytes": full.host_bytes, "disk_bytes": full.disk_bytes,
                          "segments_at_depth_3": segments(model_config, cfg, GOAL_SEQ)}
    return out


def run(quick: bool) -> dict:
    models = MODELS[:1] if quick else MODELS
    jobs = [(m, method, plan) for m in reversed(models) for method in PLANS for plan in PLANS[method]]
    jobs = [(m, method, plan) for m, method, plan in jobs if _applies(method, plan)]
    began, load = time.perf_counter(), os.getloadavg()
    me = _importable_self()
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = list(pool.map(me.plan_row, *zip(*jobs)))
    result = {"models": list(models), "cards": list(CARDS), "host_ram": HOST_RAM, "disk": DISK, "seq_start": SEQ,
              "seq_limit": SEQ_LIMIT, "cuda_context_bytes_assumed": planner.CUDA_OVERHEAD_BYTES, "rows": rows,
              "figure_kind": "estimate (fake tensors, training meter); lengths found by plan --max-seq's search"}
    if not quick:
        result["goal_256k"] = goal_256k(rows)
        result["peak_3b_16k"] = peak_at_16k()
    result["seconds"] = round(time.perf_counter() - began, 1)
    result["load_average_at_start"] = load
    result["load_average_at_end"] = os.getloadavg()
    _print_table(result)
    return result


def _applies(method: str, plan: dict) -> bool:
    """A listed plan that its engine still offers (the lists drift when an engine's plans change)."""
    return plan in engines.plans_for(method)


def _print_table(result: dict) -> None:
    for row in result["rows"]:
        cells = [f"{row['cards'][c]['max_seq']:,}" + ("*" if row["cards"][c].get("beyond_positions") else "")
                 for c in result["cards"]]
        print(f"{row['model']:14} {row['method']:5} {row['engine']:9} {' '.join(f'{k}={v}' for k, v in row['options'].items()):70} "
              + "  ".join(f"{c:>9}" for c in cells))
    for key in ("goal_256k", "peak_3b_16k"):
        if key in result:
            print(key, {k: v for k, v in result[key].items() if k in ("max_seq", "meets_goal", "engine")},
                  human_bytes(result[key].get("device_peak_bytes") or result[key].get("smallest", {}).get("device_peak_bytes", 0)))
