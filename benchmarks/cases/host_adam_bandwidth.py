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
- HostAdam.update for six layouts (whole fp32 master, split master with a bf16 gradient or an fp32
  one (split_accum: train.grad_accum > 1), 8-bit moments, moments in memory-mapped files, fp32 or
  8-bit), bytes counted from what the code touches, the accumulator's
  emptying included: on the tiled torch path (SLIMTUNE_NATIVE=0) and on the native C loop where it
  applies; 8-bit moments also on the native loop's portable path (SLIMTUNE_NATIVE_VBMI=0) where
  its AVX-512 VBMI path runs.
- The pieces of the tiled update, each on one cache-resident tile (tiled_adamw.TILE numbers), so the
  time a layout spends computing can be set beside the time its bytes need.

    python benchmarks/run.py host_adam_bandwidth        # ~2 minutes on 2 cores
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

COPY_N, ADAM_N, QUICK_N = 1 << 26, 1 << 25, 1 << 20
CACHED_N = 1 << 20  # the native loop itself on a run whose 16-28 MiB stay in the L3 (32 MiB): its arithmetic alone
THREADS = (1, 2)
GOAL = 0.70  # of the copy bandwidth, on one thread
SETTINGS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
NATIVE_ENV = "SLIMTUNE_NATIVE"  # 0: HostAdam takes tiled_adamw's torch path where the native loop would run
FLUSH_BYTES = 64 << 20  # twice the L3: written before each timed update so no operand starts in cache

# name -> (split master, gradient dtype (None: the masters'), moments, moments in files)
LAYOUTS = {
    "whole": (False, None, "fp32", False),
    "split": (True, torch.bfloat16, "fp32", False),
    "split_accum": (True, None, "fp32", False),  # train.grad_accum > 1: the gradient an fp32 accumulator
    "split_8bit": (True, torch.bfloat16, "8bit", False),
    "split_disk": (True, torch.bfloat16, "fp32", True),
    "split_8bit_disk": (True, torch.bfloat16, "8bit", True),
}
VBMI_ENV = "SLIMTUNE_NATIVE_VBMI"  # 0: 8-bit moments on the native loop's portable path (no AVX-512 VBMI)


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


def copy_meter(n: int, reps: int):
    """measure(fn): fn's result with the copy bandwidth measured just before it (`copy_gbps_before`)."""
    a, b = torch.rand(n), torch.empty(n)

    def measure(fn) -> dict:
        copy = rate(timed(lambda: b.copy_(a), lambda: None, reps), 2 * 4 * n)["gbps"]
        return {**fn(), "copy_gbps_before": copy}

    return measure


def stream(n: int, reps: int) -> dict:
    """Copy, triad and in-place add over fp32 runs of n numbers."""
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    nothing = lambda: None  # noqa: E731
    return {
        "copy": rate(timed(lambda: b.copy_(a), nothing, reps), 2 * 4 * n),
        "triad": rate(timed(lambda: torch.add(b, c, alpha=0.5, out=a), nothing, reps), 3 * 4 * n),
        "add_in_place": rate(timed(lambda: a.add_(c, alpha=1e-9), nothing, reps), 3 * 4 * n),
    }


def torch_fused(n: int, reps: int, flush: torch.Tensor, folder: Path | None = None) -> dict:
    """torch.optim.AdamW(fused=True) on one fp32 parameter, small random gradients each step; with
    `folder`, its moments moved into memory-mapped files there (the same kernel on page-cache memory)."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n) * 0.02)
    source = torch.randn(n) * 1e-3
    param.grad = source.clone()
    opt = torch.optim.AdamW([param], lr=SETTINGS["lr"], betas=SETTINGS["betas"], eps=SETTINGS["eps"],
                            weight_decay=0.01, fused=True)
    opt.step()  # makes the moments
    for key in ("exp_avg", "exp_avg_sq") if folder is not None else ():
        (folder / key).write_bytes(b"")
        os.truncate(folder / key, 4 * n)
        opt.state[param][key] = torch.from_file(str(folder / key), shared=True, size=n).copy_(opt.state[param][key])

    def prepare():
        param.grad.copy_(source)
        flush.fill_(1.0)

    return rate(timed(opt.step, prepare, reps), 28 * n)


def spacing(n: int, reps: int, flush: torch.Tensor) -> dict:
    """torch's fused kernel on p, g, m, v cut from one buffer at a given distance apart: equal-sized
    tensors allocated one after another (as torch.optim's are) start 2^k + 4 KiB apart, and on this
    CPU some distances halve the kernel's speed (an address-aliasing effect, not the memory's)."""
    found = {}
    for apart in (4 * n, 4 * n + 4096, 4 * n + 8192):
        buffer = torch.zeros(3 * apart // 4 + n)
        p, g, m, v = (buffer[k * apart // 4:][:n] for k in range(4))
        p.normal_(0, 0.02)
        g.normal_(0, 1e-3)
        step = torch.zeros(())

        def kernel():
            step.add_(1)
            torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=SETTINGS["lr"], beta1=0.9,
                                beta2=0.999, weight_decay=0.01, eps=SETTINGS["eps"], maximize=False)

        found[f"bytes_apart_{apart}"] = rate(timed(kernel, lambda: flush.fill_(1.0), reps), 28 * n)
        del buffer, p, g, m, v
    return found


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


def measure_layout(name: str, n: int, reps: int, flush: torch.Tensor | None, native: bool) -> dict:
    """One layout's update, timed: HostAdam.update on the tiled path, or on the native one (which
    HostAdam runs on one thread; at more, the native loop itself on HostAdam's tensors). With no
    `flush`, nothing is written between updates: a run that fits the caches stays there."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="host-adam-bench-", dir=bench_root()) as root, native_path(native):
        adam = host_adam(name, n, Path(root) if LAYOUTS[name][3] else None)
        grad = adam.grads[0]
        source = (torch.randn(n) * 1e-3).to(grad.dtype)

        def prepare():
            grad.copy_(source)
            if flush is not None:
                flush.fill_(1.0)

        direct = native and (threads > 1 or flush is None)  # (in the cache, HostAdam's own calls would weigh)
        step = (lambda: native_step(adam, threads)) if direct else (lambda: adam.update(SETTINGS["lr"]))
        found = rate(timed(step, prepare, reps), traffic(name, n)["total"])
        del adam  # its memory-mapped files close before the folder goes
    return found


def native_step(adam, threads: int) -> None:
    """adam's next step (one group) by the native loop on `threads` threads."""
    from slimtune.optim import tiled_adamw
    from slimtune.optim.native import adamw

    adam.steps[0].add_(1)
    hyper = tiled_adamw.Hyper(SETTINGS["lr"], *SETTINGS["betas"], SETTINGS["eps"], adam.groups[0].weight_decay)
    assert adamw.step(hyper, float(adam.steps[0]), adam.groups[0].numel, native_tensors(adam), threads=threads)


def native_tensors(adam) -> dict[str, torch.Tensor]:
    """adam's first group by the native loop's roles (native.step's `tensors`)."""
    masters = ({"weight": adam.shadows[0], "residual": adam.residuals[0]} if adam.split
               else {"master": adam.masters[0], "shadow": adam.shadows[0]})
    tensors = {**masters, "grad": adam.grads[0]}
    for name, held in adam.moments[0].items():  # fp32, or moments8.Moment8's codes and absmax
        tensors.update({name: held} if isinstance(held, torch.Tensor) else
                       {f"{name}_codes": held.codes, f"{name}_absmax": held.absmax})
    return tensors


@contextlib.contextmanager
def native_path(on: bool, name: str = NATIVE_ENV):
    """SLIMTUNE_NATIVE (or another switch) set for the block (0: off), as it was after."""
    before = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def vbmi_available() -> bool:
    """The native loop runs 8-bit moments on its AVX-512 VBMI path here."""
    from slimtune.optim.native import adamw
    with native_path(True):
        return adamw.library() is not None and adamw.fast_path()


def native_available() -> bool:
    """The native host AdamW (slimtune/optim/native) is built and agrees with torch on this machine."""
    try:
        from slimtune.optim.native import adamw
    except ImportError:
        return False
    with native_path(True):
        return adamw.library() is not None


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
        "clear_grad_fp32": g.zero_,  # (then the next call's gradient is 0: the kernel's time does not depend on it)
        "clear_grad_bf16": grad16.zero_,
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


SPLIT_PIECES = ("fused_adamw", "combine", "split", "widen_grad_bf16", "clear_grad_bf16")
PIECES_OF = {  # the tile pieces each layout runs on the tiled path (tiled_adamw's forms)
    "whole": ("fused_adamw", "shadow_bf16", "clear_grad_fp32"),
    "split": SPLIT_PIECES,
    "split_accum": ("fused_adamw", "combine", "split", "clear_grad_fp32"),  # the fp32 gradient read as it rests
    "split_8bit": (*SPLIT_PIECES, "dequantize_m", "quantize_m", "dequantize_v", "quantize_v"),
    "split_disk": SPLIT_PIECES,
    "split_8bit_disk": (*SPLIT_PIECES, "dequantize_m", "quantize_m", "dequantize_v", "quantize_v"),
}


def reading(tiled: dict, native: dict, tile: dict) -> dict:
    """Per layout, in ns a number: the update on each path, the time its bytes need at the copy
    bandwidth, and the tiled path's pieces computed in cache."""
    out = {}
    for name, found in tiled.items():
        out[name] = {"tiled_ns": found["ns_a_number"],
                     "native_of_copy": native[name]["of_copy"] if name in native else None,
                     "native_ns": native[name]["ns_a_number"] if name in native else None,
                     "bytes_at_copy_speed_ns": found["bytes_a_number"] / found["copy_gbps_before"],
                     "tiled_pieces_in_cache_ns": sum(tile[p] for p in PIECES_OF[name])}
    return out


# ------------------------------------------------------------ the run


class Sizes(NamedTuple):  # (a dataclass needs the module in sys.modules; run.py loads cases without it)
    copy_n: int
    adam_n: int
    copy_reps: int
    adam_reps: int
    native_reps: int  # the native loop's updates are short (~30-100 ms): more of them find the quiet moments
    cached_reps: int
    tile_repeat: int


FULL, QUICK = Sizes(COPY_N, ADAM_N, 10, 5, 15, 100, 40), Sizes(QUICK_N, QUICK_N, 1, 1, 1, 3, 5)


def run(quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    load_before, threads_before = os.getloadavg(), torch.get_num_threads()
    flush = torch.empty(FLUSH_BYTES // 4)
    by_threads = {}
    native = native_available()
    try:
        for threads in THREADS:
            torch.set_num_threads(threads)
            by_threads[str(threads)] = measure_at(sizes, flush, native)
    finally:
        torch.set_num_threads(threads_before)
    result = {"copy_numbers": sizes.copy_n, "adam_numbers": sizes.adam_n, "goal_of_copy_one_thread": GOAL,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native": native,
              "native_8bit_vbmi": native and vbmi_available(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(), "threads": by_threads}
    summarize(result)
    return result


def measure_at(sizes: Sizes, flush: torch.Tensor, native: bool) -> dict:
    """Everything at the current torch thread count. Each update's fraction is of a copy measured
    just before it: on shared cores the load changes within a run, and a ratio should compare like
    with like."""
    refs = stream(sizes.copy_n, sizes.copy_reps)
    n, beside = sizes.adam_n, copy_meter(sizes.copy_n, sizes.copy_reps)
    fused = beside(lambda: torch_fused(n, sizes.adam_reps, flush))
    with tempfile.TemporaryDirectory(prefix="host-adam-bench-", dir=bench_root()) as root:
        fused_files = beside(lambda: torch_fused(n, sizes.adam_reps, flush, Path(root)))
    apart = spacing(n, sizes.adam_reps, flush)
    tiled = {name: beside(lambda: measure_layout(name, n, sizes.adam_reps, flush, False)) for name in LAYOUTS}
    natives = {name: beside(lambda: measure_layout(name, n, sizes.native_reps, flush, True))
               for name in LAYOUTS} if native else {}
    cached = {name: measure_layout(name, CACHED_N, sizes.cached_reps, None, True)
              for name in ("split", "split_8bit")} if native else {}  # the arithmetic alone, its bytes in the L3
    if native and vbmi_available():  # the same 8-bit layout on the portable loops, for comparison
        with native_path(False, VBMI_ENV):
            natives["split_8bit_portable"] = beside(
                lambda: measure_layout("split_8bit", n, sizes.native_reps, flush, True))
            cached["split_8bit_portable"] = measure_layout("split_8bit", CACHED_N, sizes.cached_reps, None, True)
    for found in cached.values():
        found["ns_a_number"] = found["best_s"] / CACHED_N * 1e9
    for found in (fused, fused_files, *tiled.values(), *natives.values()):
        found["of_copy"] = found["gbps"] / found["copy_gbps_before"]
        found["ns_a_number"] = found["best_s"] / n * 1e9
        found["bytes_a_number"] = found["bytes"] / n
    tile = pieces(sizes.tile_repeat)
    return {"stream": refs, "torch_fused_adamw": fused, "host_adam_native_in_l3": cached,
            "torch_fused_adamw_moments_in_files": fused_files,
            "torch_fused_kernel_by_spacing": apart, "host_adam_native": natives, "host_adam_tiled": tiled,
            "tile_pieces_ns": tile,
            "reading": reading(tiled, natives, tile)}


def summarize(result: dict) -> None:
    for threads, found in result["threads"].items():
        refs = found["stream"]
        print(f"{threads} thread(s): copy {refs['copy']['gbps']:.1f} GB/s, triad {refs['triad']['gbps']:.1f}, "
              f"add in place {refs['add_in_place']['gbps']:.1f}; fused kernel by spacing "
              + ", ".join(f"{k[12:]} B: {v['gbps']:.1f}" for k, v in found["torch_fused_kernel_by_spacing"].items()))
        rows = [("torch fused", found["torch_fused_adamw"]),
                ("torch fused files", found["torch_fused_adamw_moments_in_files"]),
                *(("tiled " + k, v) for k, v in found["host_adam_tiled"].items()),
                *(("native " + k, v) for k, v in found["host_adam_native"].items())]
        for name, row in rows:
            print(f"  {name:17s} {row['bytes_a_number']:5.2f} B/number {row['best_s'] * 1e3:7.1f} ms "
                  f"{row['gbps']:5.1f} GB/s {row['of_copy']:4.0%} of the copy before ({row['copy_gbps_before']:.1f}) "
                  f"{row['ns_a_number']:.2f} ns/number")
        print("  native loop in the L3 (2^20 numbers, no flush): " + ", ".join(
            f"{k} {v['ns_a_number']:.2f} ns/number" for k, v in found["host_adam_native_in_l3"].items()))
