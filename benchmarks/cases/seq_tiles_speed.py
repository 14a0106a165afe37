"""CPU step time with blocks tiled along the sequence (activations.seq_tile, step/seq_tiles.py)
against untiled checkpointed blocks: a small Llama (hidden 256, 2 blocks, GQA 8/2 heads, vocab 8000),
LoRA r=16 on every linear, fp32, activations.checkpoint=recompute, one row of 8,192 tokens.

Rows: a plain row (one example: each tile's causal band is the only mask) and a packed row (two
examples of 4,096 tokens: every tile carries a mask over its keys, and packed rows get shorter
tiles), on one torch thread; and the plain row on two threads. The machine's 2 cores are shared
(load average 5-9 while this was written): a parallel region then waits for a descheduled thread,
which costs per op, and a tiled step runs many more, smaller ops (one SDPA call per tile); one
thread measures the work itself. Per row the untiled and the auto-tiled engine step alternately on
the same batch, the first of a pair alternating (pairs cancel drift in the load); reported: median
seconds a step, the median of the pairs' ratios, the tile size, and the meter's device peak of each
(a separate metered step: the meter is a dispatch mode that slows a step). Load averages recorded.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slimtune import assembly
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.engines import settings
from slimtune.step import activations

SEQ = 8192
MODEL = dict(vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=SEQ)


def save_model(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**MODEL)).save_pretrained(folder, safe_serialization=True)
    return folder


def batch_of(packed: bool) -> Batch:
    ids = torch.randint(3, MODEL["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(1, SEQ).clone()
    if packed:
        positions[:, SEQ // 2 :] = torch.arange(SEQ - SEQ // 2)
    targets = ids.roll(-1, 1)
    targets[:, -1] = IGNORE_INDEX
    return Batch(ids, targets, positions)


def engine_of(folder: Path, seq_tile: int, measure: bool):
    cfg = settings.load(None, [f"activations.seq_tile={seq_tile}", f"train.measure_memory={str(measure).lower()}"],
                        base={"model": str(folder), "data": "x.jsonl", "method": "lora",
                              "lora": {"rank": 16, "alpha": 32, "targets": "all-linear"},
                              "activations": {"checkpoint": "recompute"}, "train": {"batch_size": 1, "lr": 1e-4}})
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    return cfg, assembly.assemble(cfg, assembly.load_stack(cfg, cpu, "fp32"), cpu, "fp32")


def timed_step(engine, batch: Batch) -> float:
    began = time.perf_counter()
    engine.step([batch])
    return time.perf_counter() - began


def one_row(folder: Path, packed: bool, threads: int, pairs: int) -> dict:
    torch.set_num_threads(threads)
    load = os.getloadavg()
    batch = batch_of(packed)
    untiled_cfg, untiled = engine_of(folder, SEQ, measure=False)
    tiled_cfg, tiled = engine_of(folder, 0, measure=False)
    tile = activations.tile_tokens(tiled.stack, SEQ, tiled_cfg.activations, batch.segmented)
    timed_step(untiled, batch), timed_step(tiled, batch)  # warm-up: first allocations, lazy imports
    times = {"untiled": [], "tiled": []}
    for k in range(pairs):  # alternate which goes first: neither always meets a freshly busy machine
        order = (("untiled", untiled), ("tiled", tiled)) if k % 2 == 0 else (("tiled", tiled), ("untiled", untiled))
        for name, engine in order:
            times[name].append(timed_step(engine, batch))
    ratios = [t / u for t, u in zip(times["tiled"], times["untiled"])]
    peaks = {name: engine_of(folder, seq_tile, measure=True)[1].step([batch]).device_peak_bytes
             for name, seq_tile in (("untiled", SEQ), ("tiled", 0))}
    row = {"row": "packed (2 x 4,096)" if packed else "plain (1 x 8,192)", "threads": threads,
           "load_average": [load, os.getloadavg()], "seq_tile": tile,
           "tiles": -(-SEQ // tile), "median_step_s": {k: statistics.median(v) for k, v in times.items()},
           "step_s": times, "median_ratio": statistics.median(ratios), "ratios": ratios,
           "device_peak_bytes": peaks}
    print(f"{row['row']}, {threads} thread(s): tile {tile}, untiled {row['median_step_s']['untiled']:.2f} s, tiled "
          f"{row['median_step_s']['tiled']:.2f} s, ratio {row['median_ratio']:.3f}, peaks {peaks}", flush=True)
    return row


def run(quick: bool) -> dict:
    threads = torch.get_num_threads()
    cases = [(False, 1, 5), (True, 1, 5), (False, threads, 3)]
    with tempfile.TemporaryDirectory(prefix="slimtune-seq-tiles-") as tmp:
        folder = save_model(Path(tmp) / "model")
        rows = [one_row(folder, packed, n, 1 if quick else pairs) for packed, n, pairs in cases]
    torch.set_num_threads(threads)
    return {"model": MODEL, "seq": SEQ, "method": "lora r=16 all-linear, fp32", "checkpoint": "recompute",
            "rows": rows}
