"""The host AdamW against this machine's memory speed (issue 30, item 7).

AdamW over a run far larger than the caches does little arithmetic per number and moves many bytes,
so its ceiling is the memory's bandwidth. This case measures that ceiling and how near each host
optimizer layout comes to it, on 1 and 2 threads (torch.set_num_threads):
- STREAM-style references on fp32 runs of 2^26 numbers (256 MiB each, far beyond the L3): copy
  (b = a, the issue's yardstick), triad (a = b + s c) and an in-place add (a += s c: read-modify-write
  like AdamW's state, no write-allocate reads). Best of N; bytes as STREAM counts them (what the
  program reads and writes, not the cache lines the hardware fetches to write).
- torch's fused CPU AdamW (torch.optim.AdamW(fused=True)) on one fp32 parameter of 2^25 numbers:
  28 bytes a number (read p, g, m, v; write p, m, v).
- HostAdam.update for four layouts (whole fp32 master, split master, 8-bit moments, moments in
  memory-mapped files), bytes counted from what the code touches, the accumulator's zeroing included.
- The pieces of the tiled update, each on one cache-resident tile (tiled_adamw.TILE numbers), so the
  time a layout spends computing can be set beside the time its bytes need.

    python benchmarks/run.py host_adam_bandwidth        # ~2 minutes on 2 cores
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

COPY_N, ADAM_N, QUICK_N = 1 << 26, 1 << 25, 1 << 20
THREADS = (1, 2)
GOAL = 0.70  # of the copy bandwidth, on one thread
SETTINGS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
FLUSH_BYTES = 64 << 20  # twice the L3: written before each timed update so no operand starts in cache

# name -> (split master, gradient dtype (None: the masters'), moments, moments in files)
LAYOUTS = {
    "whole": (False, None, "fp32", False),
    "split": (True, torch.bfloat16, "fp32", False),
    "split_8bit": (True, torch.bfloat16, "8bit", False),
    "split_disk": (True, torch.bfloat16, "fp32", True),
}


def timed(step, prepare, reps: int) -> dict:
    """Seconds of `step` after one untimed warm-up (it faults fresh pages in), `prepare` untimed
    before each call; the best (STREAM's convention) and the median."""
    prepare()
    step()
    times = []
    for _ in range(reps):
        prepare()
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return {"best_s": min(times), "median_s": statistics.median(times), "reps": reps}


def rate(found: dict, nbytes: float) -> dict:
    return {**found, "bytes": nbytes, "gbps": nbytes / found["best_s"] / 1e9}


# ------------------------------------------------------------ the references


def stream(n: int, reps: int) -> dict:
    """Copy, triad and in-place add over fp32 runs of n numbers."""
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    nothing = lambda: None  # noqa: E731
    return {
        "copy": rate(timed(lambda: b.copy_(a), nothing, reps), 2 * 4 * n),
        "triad": rate(timed(lambda: torch.add(b, c, alpha=0.5, out=a), nothing, reps), 3 * 4 * n),
        "add_in_place": rate(timed(lambda: a.add_(c, alpha=1e-9), nothing, reps), 3 * 4 * n),
    }


def torch_fused(n: int, reps: int, flush: torch.Tensor) -> dict:
    """torch.optim.AdamW(fused=True) on one fp32 parameter, small random gradients each step."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n) * 0.02)
    source = torch.randn(n) * 1e-3
    param.grad = source.clone()
    opt = torch.optim.AdamW([param], lr=SETTINGS["lr"], betas=SETTINGS["betas"], eps=SETTINGS["eps"],
                            weight_decay=0.01, fused=True)

    def prepare():
        param.grad.copy_(source)
        flush.fill_(1.0)

    return rate(timed(opt.step, prepare, reps), 28 * n)


# ------------------------------------------------------------ HostAdam


def traffic(name: str, n: int) -> dict:
    """Bytes one update moves, from the layout: state read and written, the gradient read (widened in
    cache when narrower) and zeroed, the bf16 weight written under a whole master (its shadow)."""
    from slimtune.optim import moments8

    split, grad_dtype, moments, _ = LAYOUTS[name]
    grad = (grad_dtype or torch.float32).itemsize * n
    master_read, master_write = (2 * n + 2 * n, 2 * n + 2 * n) if split else (4 * n, 4 * n + 2 * n)
    moment = n + 4 * -(-n // moments8.BLOCK) if moments == "8bit" else 4 * n  # codes and a block's fp32 absmax
    read = master_read + grad + 2 * moment
    written = master_write + 2 * moment + grad  # the last term: the accumulator emptied after the update
    return {"read": read, "written": written, "total": read + written, "per_number": (read + written) / n}


def host_adam(name: str, n: int, folder: Path | None):
    from slimtune.optim.host_adam import Group, HostAdam, Layout

    split, grad_dtype, moments, _ = LAYOUTS[name]
    adam = HostAdam(f"bench-{name}", [Group((torch.Size([n]),), 0.01)], torch.float32, torch.device("cpu"),
                    SETTINGS, shadow_dtype=torch.bfloat16, moments_dir=folder,
                    layout=Layout(split=split, grad_dtype=grad_dtype, moments=moments))
    torch.manual_seed(0)
    adam.load_group_masters([[torch.randn(n) * 0.02]])
    return adam


def measure_layout(name: str, n: int, reps: int, flush: torch.Tensor) -> dict:
    """One layout's update, timed; the accumulator's zeroing alone, timed, for the split of its cost."""
    with tempfile.TemporaryDirectory(prefix="host-adam-bench-", dir=bench_root()) as root:
        adam = host_adam(name, n, Path(root) if LAYOUTS[name][3] else None)
        grad = adam.grads[0]
        source = (torch.randn(n) * 1e-3).to(grad.dtype)

        def prepare():
            grad.copy_(source)
            flush.fill_(1.0)

        found = rate(timed(lambda: adam.update(SETTINGS["lr"]), prepare, reps), traffic(name, n)["total"])
        zeroing = timed(grad.zero_, lambda: flush.fill_(1.0), reps)
        del adam  # its memory-mapped files close before the folder goes
    return {**found, "zero_grad_ns_a_number": zeroing["best_s"] / n * 1e9,
            "bytes_a_number": traffic(name, n)["per_number"], "ns_a_number": found["best_s"] / n * 1e9}


def bench_root() -> str:
    """Where the disk layout's files go: the system's temp folder (a disk here, not tmpfs)."""
    return os.environ.get("SLIMTUNE_BENCH_TMP", tempfile.gettempdir())


# ------------------------------------------------------------ the pieces, on one cache-resident tile


def pieces(repeat: int) -> dict:
    """ns a number of each piece of the tiled update on one tile of TILE numbers that stays in cache:
    what a layout costs in arithmetic (and calls) once its bytes have arrived."""
    from slimtune.optim import moments8, split_master, tiled_adamw

    n, step = tiled_adamw.TILE, torch.tensor(1.0)
    torch.manual_seed(0)
    p, g, m, v = torch.randn(n) * 0.02, torch.randn(n) * 1e-3, torch.randn(n) * 1e-4, torch.rand(n) * 1e-6
    out, weights, residuals = torch.empty(n), torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    split_master.split(p, weights, residuals)
    grad16, shadow = g.to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    m8, v8 = moments8.Moment8(n, True), moments8.Moment8(n, False)
    m8.quantize(0, n, m)
    v8.quantize(0, n, v)
    kwargs = dict(amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False)
    work = {
        "fused_adamw": lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step], **kwargs),
        "combine": lambda: split_master.combine(weights, residuals, out),
        "split": lambda: split_master.split(p, weights, residuals),
        "widen_grad_bf16": lambda: out.copy_(grad16),
        "shadow_bf16": lambda: shadow.copy_(p),
        "dequantize_m": lambda: m8.dequantize(0, n, out),
        "quantize_m": lambda: m8.quantize(0, n, m),
        "dequantize_v": lambda: v8.dequantize(0, n, out),
        "quantize_v": lambda: v8.quantize(0, n, v),
    }
    return {name: per_number(fn, n, repeat) for name, fn in work.items()}


def per_number(fn, n: int, repeat: int) -> float:
    """Best of 5 loops of `repeat` calls, in ns a number."""
    fn()
    best = min(loop_seconds(fn, repeat) for _ in range(5))
    return best / repeat / n * 1e9


def loop_seconds(fn, repeat: int) -> float:
    began = time.perf_counter()
    for _ in range(repeat):
        fn()
    return time.perf_counter() - began


PIECES_OF = {  # the tile pieces each layout runs (tiled_adamw's forms); m and v each
    "whole": ("fused_adamw", "shadow_bf16"),
    "split": ("fused_adamw", "combine", "split", "widen_grad_bf16"),
    "split_8bit": ("fused_adamw", "combine", "split", "widen_grad_bf16", "dequantize_m", "quantize_m",
                   "dequantize_v", "quantize_v"),
    "split_disk": ("fused_adamw", "combine", "split", "widen_grad_bf16"),
}


def reading(layouts: dict, tile: dict, copy_gbps: float) -> dict:
    """Per layout: ns a number its bytes need at the copy bandwidth, ns its pieces compute in cache,
    ns the zeroing pass, and the measured total."""
    out = {}
    for name, found in layouts.items():
        memory_ns = found["bytes_a_number"] / copy_gbps
        out[name] = {"measured_ns": found["ns_a_number"], "bytes_at_copy_speed_ns": memory_ns,
                     "pieces_in_cache_ns": sum(tile[p] for p in PIECES_OF[name]),
                     "zero_grad_ns": found["zero_grad_ns_a_number"]}
    return out


# ------------------------------------------------------------ the run


def run(quick: bool) -> dict:
    copy_n, adam_n = (QUICK_N, QUICK_N) if quick else (COPY_N, ADAM_N)
    copy_reps, adam_reps, tile_repeat = (1, 1, 5) if quick else (10, 5, 40)
    load_before, threads_before = os.getloadavg(), torch.get_num_threads()
    flush = torch.empty(FLUSH_BYTES // 4)
    by_threads = {}
    try:
        for threads in THREADS:
            torch.set_num_threads(threads)
            by_threads[str(threads)] = measure_at(threads, copy_n, adam_n, copy_reps, adam_reps, tile_repeat, flush)
    finally:
        torch.set_num_threads(threads_before)
    result = {"copy_numbers": copy_n, "adam_numbers": adam_n, "goal_of_copy_one_thread": GOAL,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "threads": by_threads}
    summarize(result)
    return result


def measure_at(threads: int, copy_n: int, adam_n: int, copy_reps: int, adam_reps: int, tile_repeat: int,
               flush: torch.Tensor) -> dict:
    refs = stream(copy_n, copy_reps)
    copy_gbps = refs["copy"]["gbps"]
    fused = torch_fused(adam_n, adam_reps, flush)
    fused["of_copy"] = fused["gbps"] / copy_gbps
    fused["ns_a_number"] = fused["best_s"] / adam_n * 1e9
    out = {"stream": refs, "torch_fused_adamw": fused}
    try:
        layouts = {name: measure_layout(name, adam_n, adam_reps, flush) for name in LAYOUTS}
    except ImportError as err:  # the host optimizer's new modules not landed yet
        out["host_adam_error"] = str(err)
        return out
    for found in layouts.values():
        found["of_copy"] = found["gbps"] / copy_gbps
    tile = pieces(tile_repeat)
    out.update(host_adam=layouts, tile_pieces_ns=tile, reading=reading(layouts, tile, copy_gbps))
    return out


def summarize(result: dict) -> None:
    for threads, found in result["threads"].items():
        refs = found["stream"]
        print(f"{threads} thread(s): copy {refs['copy']['gbps']:.1f} GB/s, triad {refs['triad']['gbps']:.1f}, "
              f"add in place {refs['add_in_place']['gbps']:.1f}; torch fused AdamW "
              f"{found['torch_fused_adamw']['gbps']:.1f} ({found['torch_fused_adamw']['of_copy']:.0%} of copy)")
        for name, layout in found.get("host_adam", {}).items():
            print(f"  {name:11s} {layout['bytes_a_number']:5.2f} B/number {layout['best_s'] * 1e3:7.1f} ms "
                  f"{layout['gbps']:5.1f} GB/s {layout['of_copy']:4.0%} of copy {layout['ns_a_number']:.2f} ns/number")
