"""Every check that needs a GPU, in one prepared run: the planner's estimate against the CUDA allocator,
the CUDA context bytes, slide's parity and its copy/compute overlap.

    python benchmarks/run.py device_checks            # on a CUDA machine: ~5 minutes on one GPU
    python benchmarks/run.py device_checks --quick    # the same on the CPU (small shapes): exercises the script

On CUDA every device figure is the caching allocator's peak (torch.cuda.max_memory_allocated),
on the CPU the live-tensor meter. What it records:
1. context: the bytes a CUDA process holds beyond its tensors (mem_get_info used minus
   memory_reserved after one step), beside the planner's assumed CUDA_OVERHEAD_BYTES.
2. estimate_vs_device: the fake-tensor estimate beside the measured peak of step 2, for resident
   LoRA plans (bf16, nf4, nf4 + host / disk checkpoints, the loss stack) and slide (full, bf16),
   on a Llama-3.2-1B-shaped random model cut to a few blocks.
3. parity: slide against resident on the device, fp32, 3 steps, a tiny model: loss differences.
4. speed: slide against resident step time (bf16, the 1B shapes; medians), and a profiler summary
   of slide's step: time in host<->device copies, in compute kernels, and the copy time that
   overlapped compute (copy spans intersected with kernel spans on other streams).
5. lsp: the bf16 compressed gradient against float64 (rtol 1e-3); lsp's step time (d = 512) against
   resident full fine-tuning (goal <= 1.17x) and against its own synchronous schedule, with a
   profiler summary of its step (lsp also joins estimate_vs_device).
6. chunk: the fake-tensor estimate (the planned chunk's step) beside the measured peak of every
   chunk's step over a sweep, for chunk (N = 4, recompute), chunk with the gradient on the host and
   slide with a chunk working set; the device peak for N in {1, 2, 4, 8} (gradients scale as 1/N
   beside fixed weights and activations); chunk's median step time against resident full
   fine-tuning (bf16, the 1B shapes); chunk.gradients=host against the device mode (losses, peak,
   step time).
7. roundpipe: 1-4 virtual workers on the one card (threads, each with its own streams) against
   resident, fp32, 3 steps, a tiny model: loss and weight differences (goal 1e-5), also with the
   tail cut into 3 token shards on 3 workers (hand-made cut); async with each step handed the next
   one's batches (then=, so the next step starts early) against async step by step (bitwise, in
   fp32 and in bf16, where one of the two weight versions is the HostAdam's shadow); the estimate
   beside the measured peak for one worker (bf16, the 1B shapes); median step time for 1, 2 and 4
   workers, and a profiler summary of the 2-worker step.
8. long_context: blocks tiled along the sequence (_long_context.py): a Llama-3.2-1B-shaped model
   (4 blocks, LoRA, block inputs on the host) at 32K and 64K tokens on the card capped to 24 GiB
   (torch.cuda.set_per_process_memory_fraction): the estimate beside the allocator's peak, tokens/s
   tiled (auto tile, 1,024-token tiles) against untiled, or the out-of-memory under the cap; and one
   row of two packed examples at 32K (auto tile): grouped-query tiles under a segment mask fold their
   query heads, and its peak beside the estimate says whether any fell to SDPA's math kernel.
9. fsdp_rank: one rank of a 2-rank fsdp job on the one card (rank 0 under torch's fake process group:
   its collectives move nothing, its memory is real; slimtune/dist/fake_ranks.py), a Llama-3.2-1B-shaped
   model (4 blocks): QLoRA sharded (NF4, recompute), the same with dist.offload=cpu, and full
   fine-tuning (bf16 gathers, recompute). The allocator's peak while the engine is built (the model
   loaded on the host; FSDP moves one unit at a time to the card: assembly.kept_on_host) beside the
   whole model's bytes, and step 2's peak beside the planner's fake rank (estimate with ranks=2).
10. lsp_fit_together: one projector-fit step for both matrices of a same-shape pair, stacked against
   two fits (Llama-3.2-1B's pairs, d = 512, 32 and 128 rows; values equal bit for bit).
11. sdpa_routes: the attention kernel torch's dispatcher picks (and the allocator's peak of one forward
   and backward) for each call seq_tiles makes of a grouped-query tile (flash-shaped, folded under a
   mask, keys and values repeated) and for the two it avoids (masked or fp32 with fewer key heads), on
   Llama-3.1-8B's heads: whether seq_tiles.fused_grouped_attention's rules hold on the card (_sdpa_routes.py).
12. host_optimizer: slide's step with clipping on, its host updates overlapped with the next forward
   against exposed, and overlapped with train.host_threads=1 against its default (the default's threads
   could compete with torch's own on the driving process); the host AdamW's time for one block (split master, fp32 and 8-bit moments) on one
   thread and on train.host_threads' default there (the cores less one), the gradient drawn untimed.
13. host_adam_vs_copy: issue 30's one-thread goal on this machine's host CPU (host_adam_bandwidth cut to the
   split and 8-bit layouts in memory against a one-thread copy, and the 8-bit loop in the L3), with the CPU's name.
Data parallelism (torchrun, NCCL) is not checked here: ranks sharing the one lent card would measure
contention, not data parallelism. The result says so ("data_parallel"); the CPU case data_parallel
(gloo) records what two processes do, and the tests check every engine's sums.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from slimtune import assembly, presets
from slimtune.engines import settings
from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.planning.estimate import estimate
from slimtune.engines.roundpipe.stages import uniform_partition
from _long_context import long_context  # benchmarks/cases/ is on the path (run.py)
from _sdpa_routes import sdpa_routes

GIB = 2**30
RESIDENT_PLANS = (
    {"quant.scheme": "none"},
    {"quant.scheme": "nf4"},
    {"quant.scheme": "nf4", "activations.checkpoint": "host"},
    {"quant.scheme": "nf4", "activations.checkpoint": "disk", "loss.mode": "subset"},
)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def shapes(quick: bool, layers: int):
    """Llama-3.2-1B's shapes with `layers` blocks (quick: a narrow model for a CPU run)."""
    config = presets.model_config("Llama-3.2-1B")
    config.num_hidden_layers = layers
    if quick:
        config.hidden_size, config.intermediate_size, config.vocab_size = 256, 512, 4096
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
    return config


def random_model(config, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def one_batch(vocab: int, seq: int, rows: int = 1, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, : seq * 7 // 10] = IGNORE_INDEX  # the last 30% trained
    targets[:, -1] = IGNORE_INDEX
    return Batch(ids, targets, torch.arange(seq).expand(rows, seq).clone())


def run_config(overrides: dict, output_dir: str):
    # a roundpipe worker that waits a minute for a hand-off has hung: end the check, not the device time
    base = {"model": "(checks)", "data": "(checks)", "output_dir": output_dir, "train": {"batch_size": 1},
            "roundpipe": {"timeout_s": 60.0}}
    return settings.load(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


def build_engine(model, cfg, where: torch.device):
    """What train.build does after loading, on a copy of an in-memory model."""
    precision = assembly.resolve_precision(cfg.precision, where)
    stack = assembly.stack_of(copy.deepcopy(model), cfg, where, precision)
    return assembly.assemble(cfg, stack, where, precision)


def measured_step2(engine, batch: Batch) -> tuple[int, list[float]]:
    results, times = [], []
    for _ in range(3):
        began = time.perf_counter()
        results.append(engine.step([batch]))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return results[1].device_peak_bytes, times[1:]


def estimate_vs_device(quick: bool, output_dir: str) -> list[dict]:
    config = shapes(quick, 4)
    seq = 256 if quick else 1024
    model, batch, rows = random_model(config), one_batch(config.vocab_size, seq), []
    plans = [{"engine": "resident", "method": "lora", "precision": "bf16", **p} for p in RESIDENT_PLANS]
    plans.append({"engine": "slide", "method": "full", "precision": "bf16", "activations.checkpoint": "host"})
    plans.append({"engine": "lsp", "method": "full", "precision": "bf16", "lsp.fit_iterations": 10})
    for plan in plans:
        cfg = run_config(plan, output_dir)
        found = estimate(config, cfg, 1, seq, batch=batch)
        peak, _ = measured_step2(build_engine(model, cfg, device()), batch)
        rows.append({"plan": plan, "seq": seq, "estimate_bytes": found.device_peak_bytes, "measured_bytes": peak,
                     "difference_pct": 100 * (peak - found.device_peak_bytes) / found.device_peak_bytes})
        print(f"{plan}: estimate {found.device_peak_bytes / GIB:.3f} GiB, measured {peak / GIB:.3f} GiB "
              f"({rows[-1]['difference_pct']:+.2f}%)", flush=True)
    return rows


def context_bytes() -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the CPU has no context to measure"}
    free, total = torch.cuda.mem_get_info()
    from slimtune.planning import planner

    held = total - free - torch.cuda.memory_reserved()
    return {"held_beyond_reserved_bytes": held, "reserved_bytes": torch.cuda.memory_reserved(),
            "allocated_bytes": torch.cuda.memory_allocated(), "planner_assumes_bytes": planner.CUDA_OVERHEAD_BYTES}


def parity(output_dir: str) -> dict:
    config = shapes(True, 3)
    model = random_model(config)
    batch = one_batch(config.vocab_size, 64, rows=2)
    losses = {}
    for engine in ("resident", "slide"):
        cfg = run_config({"engine": engine, "method": "full", "precision": "fp32",
                          **({"activations.checkpoint": "host"} if engine == "slide" else {})}, output_dir)
        built = build_engine(model, cfg, device())
        losses[engine] = [built.step([batch]).loss for _ in range(3)]
    diff = max(abs(a - b) for a, b in zip(losses["resident"], losses["slide"]))
    print(f"parity: max loss difference {diff:.2e}", flush=True)
    return {"losses": losses, "max_abs_difference": diff}


def speed(quick: bool, output_dir: str) -> dict:
    config = shapes(quick, 4 if quick else 8)
    seq = 256 if quick else 2048
    model, batch, out = random_model(config), one_batch(config.vocab_size, seq), {}
    for engine in ("resident", "slide"):
        cfg = run_config({"engine": engine, "method": "full", "precision": "bf16",
                          "activations.checkpoint": "host" if engine == "slide" else "none"}, output_dir)
        built = build_engine(model, cfg, device())
        peak, times = measured_step2(built, batch)
        out[engine] = {"median_step_s": statistics.median(times), "device_peak_bytes": peak}
        if engine == "slide":
            out["slide_profile"] = profile_summary(built, batch)
    out["slide_over_resident_time"] = out["slide"]["median_step_s"] / out["resident"]["median_step_s"]
    print(f"speed: slide/resident step time {out['slide_over_resident_time']:.2f}", flush=True)
    return out


def profile_summary(engine, batch: Batch) -> dict:
    """Copy and compute time in one slide step, and how much of the copying overlapped compute."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        engine.step([batch])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")]
    copies = [(s, t) for n, s, t in spans if "Memcpy" in n or "memcpy" in n]
    kernels = [(s, t) for n, s, t in spans if not ("Memcpy" in n or "memcpy" in n or "Memset" in n)]
    copy_us = sum(t - s for s, t in copies)
    busy = merged(kernels)  # kernels of several streams at once count once: the overlap never exceeds the copy
    overlap_us = sum(max(0, min(t, kt) - max(s, ks)) for s, t in copies for ks, kt in busy)
    return {"copy_us": copy_us, "kernel_us": sum(t - s for s, t in kernels),
            "kernel_busy_us": sum(t - s for s, t in busy), "copy_overlapping_kernels_us": overlap_us,
            "events": len(spans),
            "note": "CUDA spans only; on the CPU these are empty"}


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of time spans, as disjoint spans in order."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def lsp_compressed_gradient(quick: bool) -> dict:
    """G_c of a bf16 ProjectedLinear on the device against P_o^T (dY^T X) P_i in float64 (rtol 1e-3)."""
    from slimtune.optim.projectors import SparseProjector
    from slimtune.engines.lsp.projected_linear import ProjectedLinear

    n_o, n_i, tokens, d = (256, 512, 256, 64) if quick else (4096, 14336, 2048, 512)
    where, g = device(), torch.Generator().manual_seed(0)
    pair = [SparseProjector.random(n, d, 4, g, torch.float32, where) for n in (n_o, n_i)]
    linear = torch.nn.Linear(n_i, n_o, bias=False, device=where, dtype=torch.bfloat16)
    module = ProjectedLinear(linear, 0, *pair)
    x = torch.randn(tokens, n_i, device=where, dtype=torch.bfloat16)
    dy = torch.randn(tokens, n_o, device=where, dtype=torch.bfloat16)
    module(x).backward(dy)
    dense = dy.double().T @ x.double()
    reference = pair[0].dense().double().T @ dense @ pair[1].dense().double()
    error = float((module.z.grad.double() - reference).norm() / reference.norm())
    print(f"lsp: bf16 G_c relative error {error:.2e}", flush=True)
    return {"shape": [n_o, n_i], "tokens": tokens, "d": d, "relative_error": error, "within_rtol_1e-3": error <= 1e-3}


def lsp_speed(quick: bool, output_dir: str) -> dict:
    """Step time of lsp (d = 512, updates overlapping backward: no clipping) against all-on-device full
    fine-tuning (goal: <= 17% slower), the synchronous schedule beside it (what the schedule buys), and
    a profiler summary of the pipelined step (copies overlapping kernels; host AdamW seconds)."""
    config = shapes(quick, 4 if quick else 8)
    seq = 256 if quick else 2048
    model, batch, out = random_model(config), one_batch(config.vocab_size, seq), {}
    common = {"method": "full", "precision": "bf16", "train.max_grad_norm": 0, "lsp.fit_iterations": 10}
    for name, plan in {"resident": {"engine": "resident"}, "lsp": {"engine": "lsp", "lsp.d": 512},
                       "lsp_sync": {"engine": "lsp", "lsp.d": 512, "lsp.schedule": "sync"}}.items():
        built = build_engine(model, run_config({**common, **plan}, output_dir), device())
        results, times = [], []
        for _ in range(5):  # step 1 fits the projectors; the schedule is derived after step 2
            began = time.perf_counter()
            results.append(built.step([batch]))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        out[name] = {"median_step_s": statistics.median(times[2:]), "first_step_s": times[0],
                     "device_peak_bytes": results[-1].device_peak_bytes, "link_bytes": results[-1].host_link_bytes}
        if name == "lsp":
            out["lsp"]["schedule"] = vars(built.updates.schedule)
            out["lsp_profile"] = profile_summary(built, batch)
            out["lsp_profile"]["host_adamw_s"] = sum(built.updates.clock.updates)
    out["lsp_over_resident_time"] = out["lsp"]["median_step_s"] / out["resident"]["median_step_s"]
    out["sync_over_pipelined_time"] = out["lsp_sync"]["median_step_s"] / out["lsp"]["median_step_s"]
    out["goal_slowdown"] = 1.17
    print(f"lsp: step time over resident {out['lsp_over_resident_time']:.2f}, sync over pipelined "
          f"{out['sync_over_pipelined_time']:.2f}", flush=True)
    return out


def timed_steps(engine, batch: Batch, steps: int) -> list[tuple[object, float]]:
    """(StepResult, wall seconds) of each of `steps` steps, each from a fresh allocator peak."""
    out = []
    for _ in range(steps):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        result = engine.step([batch])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append((result, time.perf_counter() - began))
    return out


def sweep_peaks(engine, batch: Batch, steps: int) -> tuple[list[int], list[float]]:
    """The measured peak and wall time of each of `steps` steps (a sweep's chunks, one each)."""
    steps_run = timed_steps(engine, batch, steps)
    return [r.device_peak_bytes for r, _ in steps_run], [t for _, t in steps_run]


def chunk_checks(quick: bool, output_dir: str) -> dict:
    config = shapes(quick, 4 if quick else 8)
    seq = 256 if quick else 1024
    model, batch, out = random_model(config), one_batch(config.vocab_size, seq), {"estimate_vs_device": []}
    plans = {"chunk": {"engine": "chunk", "activations.checkpoint": "recompute", "chunk.n_chunks": 4},
             "chunk_host": {"engine": "chunk", "activations.checkpoint": "recompute", "chunk.n_chunks": 4,
                            "chunk.gradients": "host"},
             "slide_chunk": {"engine": "slide", "activations.checkpoint": "host", "slide.working_set": "chunk",
                             "chunk.n_chunks": 4}}
    for name, plan in plans.items():
        cfg = run_config({"method": "full", "precision": "bf16", **plan}, output_dir)
        found = estimate(config, cfg, 1, seq, batch=batch)
        peaks, _ = sweep_peaks(build_engine(model, cfg, device()), batch, 2 * 4)
        out["estimate_vs_device"].append({"plan": plan, "estimate_bytes": found.device_peak_bytes,
                                          "measured_bytes_by_step": peaks, "max_measured_bytes": max(peaks),
                                          "difference_pct": 100 * (max(peaks) - found.device_peak_bytes)
                                          / found.device_peak_bytes})
        print(f"{name}: estimate {found.device_peak_bytes / GIB:.3f} GiB, measured max {max(peaks) / GIB:.3f} GiB",
              flush=True)
    out["peak_by_n"] = {}
    for n in (1, 2, 4, 8):
        cfg = run_config({"method": "full", "precision": "bf16", "engine": "chunk",
                          "activations.checkpoint": "recompute", "chunk.n_chunks": n}, output_dir)
        peaks, times = sweep_peaks(build_engine(model, cfg, device()), batch, n + 2)
        out["peak_by_n"][n] = {"max_peak_bytes": max(peaks), "median_step_s": statistics.median(times[1:])}
    resident_cfg = run_config({"method": "full", "precision": "bf16", "engine": "resident",
                               "activations.checkpoint": "recompute"}, output_dir)
    _, times = sweep_peaks(build_engine(model, resident_cfg, device()), batch, 4)
    out["resident_median_step_s"] = statistics.median(times[1:])
    out["chunk_n4_over_resident_time"] = out["peak_by_n"][4]["median_step_s"] / out["resident_median_step_s"]
    out["gradients_on_host"] = host_gradient_checks(model, batch, output_dir)
    print(f"chunk: peaks by N {[(n, round(v['max_peak_bytes'] / GIB, 3)) for n, v in out['peak_by_n'].items()]} GiB,"
          f" N=4 step time over resident {out['chunk_n4_over_resident_time']:.2f}", flush=True)
    return out


def host_gradient_checks(model, batch: Batch, output_dir: str) -> dict:
    """chunk.gradients=host against the device mode, N = 4, a sweep of steps each: the losses (the
    same numbers but for the order of fp32 additions in a head tile: bf16 keeps them apart only by
    rounding), the peaks and the median step times (the cost of the per-op copies on a real link)."""
    runs = {}
    for mode in ("device", "host"):
        cfg = run_config({"method": "full", "precision": "bf16", "engine": "chunk",
                          "activations.checkpoint": "recompute", "chunk.n_chunks": 4, "chunk.gradients": mode},
                         output_dir)
        steps_run = timed_steps(build_engine(model, cfg, device()), batch, 5)
        runs[mode] = {"losses": [r.loss for r, _ in steps_run],
                      "max_peak_bytes": max(r.device_peak_bytes for r, _ in steps_run),
                      "median_step_s": statistics.median(t for _, t in steps_run[1:])}
    runs["max_loss_difference"] = max(abs(a - b) for a, b in zip(runs["device"]["losses"], runs["host"]["losses"]))
    runs["host_over_device_time"] = runs["host"]["median_step_s"] / runs["device"]["median_step_s"]
    print(f"chunk.gradients=host: loss difference {runs['max_loss_difference']:.2e}, peak"
          f" {runs['host']['max_peak_bytes'] / GIB:.3f} against {runs['device']['max_peak_bytes'] / GIB:.3f} GiB,"
          f" step time {runs['host_over_device_time']:.2f}x", flush=True)
    return runs


def roundpipe_checks(quick: bool, output_dir: str) -> dict:
    out = {"parity": {}, "step_s": {}}
    tiny = shapes(True, 4)
    small, batch = random_model(tiny), one_batch(tiny.vocab_size, 64, rows=4)
    reference = build_engine(small, run_config({"method": "full", "precision": "fp32"}, output_dir), device())
    expected = [reference.step([batch]).loss for _ in range(3)]
    weights = {k: v.detach().float().cpu() for k, v in reference.trainable_state().items()}
    def parity(workers: int, tail_shards: int = 0) -> dict:
        cfg = run_config({"method": "full", "precision": "fp32", "engine": "roundpipe", "activations.checkpoint": "none",
                          "roundpipe.workers": workers, "roundpipe.replan": not tail_shards}, output_dir)
        engine = build_engine(small, cfg, device())
        if tail_shards:  # the head + loss as that many token-shard jobs, whatever the partitioner would pick
            engine.partition = uniform_partition(len(engine.units), 2, 1, tail_shards=tail_shards)
        losses = [engine.step([batch]).loss for _ in range(3)]
        found = engine.trainable_state()
        return {"max_loss_diff": max(abs(a - b) for a, b in zip(losses, expected)),
                "max_weight_diff": max((found[k].float().cpu() - w).abs().max().item() for k, w in weights.items())}

    def begun_early(precision: str, workers: int = 3, steps: int = 4) -> dict:
        """async: each step handed the next one's batches (the loop's then=) against step by step,
        on real streams: the early step's uploads wait for the updates its flags name, and each
        update for its own step's uploads (bf16: one of the two weight versions is the shadow)."""
        cfg = run_config({"method": "full", "precision": precision, "engine": "roundpipe", "activations.checkpoint": "none",
                          "roundpipe.workers": workers, "roundpipe.optimizer": "async", "roundpipe.replan": False},
                         output_dir)
        found = []
        for early in (False, True):
            engine = build_engine(small, cfg, device())
            data = [[one_batch(tiny.vocab_size, 64, rows=4, seed=k)] for k in range(steps)]
            losses = [engine.step(data[k], then=(data[k + 1], None) if early and k + 1 < steps else None).loss
                      for k in range(steps)]
            found.append((losses, {k: v.float().cpu() for k, v in engine.trainable_state().items()}))
        (a, wa), (b, wb) = found
        return {"losses_equal": a == b, "max_weight_diff": max((wa[k] - wb[k]).abs().max().item() for k in wa)}

    for workers in (1, 2, 3, 4):
        out["parity"][workers] = parity(workers)
    out["parity"]["3, the tail in 3 token shards"] = parity(3, tail_shards=3)
    out["async_begun_early_vs_step_by_step"] = {p: begun_early(p) for p in ("fp32", "bf16")}
    config = shapes(quick, 4 if quick else 8)
    seq = 256 if quick else 2048
    model, big = random_model(config), one_batch(config.vocab_size, seq, rows=4)
    for workers in (1, 2, 4):
        cfg = run_config({"method": "full", "precision": "bf16", "engine": "roundpipe", "activations.checkpoint": "none",
                          "roundpipe.workers": workers, "train.batch_size": 4}, output_dir)
        engine = build_engine(model, cfg, device())
        peak, times = measured_step2(engine, big)
        out["step_s"][workers] = {"median_step_s": statistics.median(times), "device_peak_bytes": peak}
        if workers == 1:
            out["estimate_bytes"] = estimate(config, cfg, 4, seq, batch=big).device_peak_bytes
        if workers == 2:
            out["profile_2_workers"] = profile_summary(engine, big)
    print(f"roundpipe: parity {out['parity']}, step s {out['step_s']}", flush=True)
    return out


def slide_steps(engine, batch: Batch, overlapped: bool) -> list[float]:
    """Four steps' times: overlapped, each step handed the next one's batches (then=), so the host
    updates run beside the next forward; else with a barrier after each step (the updates exposed)."""
    times = []
    for step in range(4):
        began = time.perf_counter()
        engine.step([batch], then=([batch], None) if overlapped and step < 3 else None)
        if not overlapped:
            engine.worker.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    engine.worker.barrier()
    return times


def host_optimizer(quick: bool, output_dir: str) -> dict:
    """Issue 30 on a card: slide's step with clipping on, the host updates overlapped with the next
    forward (then=) against exposed (a barrier after each step), overlapped on train.host_threads'
    default against one thread, and the host AdamW's time per block with the split master (fp32
    moments, native loop or torch tiles) and with 8-bit moments."""
    import gc

    from slimtune.optim import host_adam
    from slimtune.optim.native import adamw as native

    config = shapes(quick, 4 if quick else 8)
    seq = 256 if quick else 2048
    model, batch = random_model(config), one_batch(config.vocab_size, seq)
    out: dict = {"native_kernel": native.enabled() and native.library() is not None}
    plan = {"engine": "slide", "method": "full", "precision": "bf16", "activations.checkpoint": "host",
            "train.max_grad_norm": 1.0}
    cfg = run_config(plan, output_dir)
    # The overlapped step also runs with the host updates on one thread: whether train.host_threads'
    # default (the cores less one) helps the step or competes with torch's own CPU threads here. The
    # three runs alternate twice and the best of each is kept, so none gains from its place in the order.
    one_thread = run_config({**plan, "train.host_threads": 1}, output_dir)
    runs = (("exposed", cfg), ("overlapped", cfg), ("overlapped_one_host_thread", one_thread)) * 2
    for mode, mode_cfg in runs:
        times = slide_steps(build_engine(model, mode_cfg, device()), batch, overlapped=mode != "exposed")
        gc.collect()  # the run's engine and host state gone before the next is built
        # A step handed the next batches starts that step's forward inside this call: compare the
        # steps after the warm-up together, not one call against another.
        if mode not in out or sum(times[1:]) < out[mode]["steps_1_to_3_s"]:
            out[mode] = {"step_s": times, "steps_1_to_3_s": sum(times[1:])}
    out["overlapped_over_exposed"] = out["overlapped"]["steps_1_to_3_s"] / out["exposed"]["steps_1_to_3_s"]
    out["default_host_threads_over_one"] = (out["overlapped"]["steps_1_to_3_s"]
                                            / out["overlapped_one_host_thread"]["steps_1_to_3_s"])
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    threads = host_adam.host_threads(cfg.train, device())  # train.host_threads' default here: what slide ran on
    out["host_threads"] = threads
    for moments in ("fp32", "8bit"):
        by_threads = out[f"host_adamw_block_s_by_threads_{moments}"] = {}
        for count in sorted({1, threads}):
            adam = host_adam.HostAdam("block", [host_adam.Group((torch.Size([block]),), 0.0)], torch.float32,
                                      device(), {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8},
                                      shadow_dtype=torch.bfloat16, threads=count,
                                      layout=host_adam.Layout(grad_dtype=torch.bfloat16, moments=moments))
            seconds = []
            for _ in range(4):  # the first a warm-up; the gradient drawn outside the timing
                adam.grads[0].normal_(0, 1e-3)
                began = time.perf_counter()
                adam.update(1e-5)
                seconds.append(time.perf_counter() - began)
            by_threads[str(count)] = min(seconds[1:])
    out["block_params"] = block
    fp32, eight = (out[f"host_adamw_block_s_by_threads_{m}"][str(threads)] * 1e3 for m in ("fp32", "8bit"))
    print(f"host_optimizer: overlapped/exposed {out['overlapped_over_exposed']:.2f}, default host threads/one "
          f"{out['default_host_threads_over_one']:.2f}, host AdamW a block on {threads}"
          f" thread(s) {fp32:.1f} ms (fp32 moments), {eight:.1f} ms (8-bit)", flush=True)
    return out


FSDP_PLANS = (
    {"method": "lora", "quant.scheme": "nf4", "activations.checkpoint": "recompute"},
    {"method": "lora", "quant.scheme": "nf4", "activations.checkpoint": "recompute", "dist.offload": "cpu"},
    {"method": "full", "activations.checkpoint": "recompute"},
)


def fsdp_rank(quick: bool, output_dir: str) -> list[dict]:
    """Rank 0 of a 2-rank fsdp job on this device (section 9 of the docstring)."""
    from slimtune.dist import fake_ranks
    from slimtune.model.stack import Stack

    config = shapes(quick, 4)
    seq = 256 if quick else 1024
    model, batch, rows = random_model(config), one_batch(config.vocab_size, seq), []
    whole = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for plan in FSDP_PLANS:
        cfg = run_config({"engine": "resident", "precision": "bf16", "dist.strategy": "fsdp", **plan}, output_dir)
        found = estimate(config, cfg, 1, seq, batch=batch, ranks=2)  # before the fake job: it makes its own
        with fake_ranks.rank_of(2) as dist:
            precision = assembly.resolve_precision(cfg.precision, device())
            stack = Stack(copy.deepcopy(model).to(assembly.run_weight_dtype(cfg, precision)))  # loaded on the host
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            engine = assembly.assemble(cfg, stack, device(), precision, dist)
            built = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
            peak, times = measured_step2(engine, batch)
            del engine, stack
        rows.append({"plan": plan, "seq": seq, "ranks": 2, "whole_model_fp32_bytes": whole,
                     "peak_while_building_bytes": built,
                     # the point of building on the host: never the whole model on the card at once
                     "whole_model_on_the_card_while_building": None if built is None else built >= whole,
                     "estimate_bytes": found.device_peak_bytes,
                     "measured_bytes": peak, "difference_pct": 100 * (peak - found.device_peak_bytes) / found.device_peak_bytes,
                     "step_s": times})
        print(f"fsdp rank 0 of 2 {plan}: estimate {found.device_peak_bytes / GIB:.3f} GiB, measured {peak / GIB:.3f} GiB"
              f" ({rows[-1]['difference_pct']:+.2f}%), building {built}", flush=True)
    return rows


SECTIONS = (("estimate_vs_device", lambda quick, out: estimate_vs_device(quick, out)),
            ("context", lambda quick, out: context_bytes()), ("parity", lambda quick, out: parity(out)),
            ("speed", speed), ("lsp_compressed_gradient", lambda quick, out: lsp_compressed_gradient(quick)),
            ("lsp_speed", lsp_speed), ("chunk", chunk_checks), ("roundpipe", roundpipe_checks),
            ("host_optimizer", host_optimizer),
            ("long_context", lambda quick, out: long_context(quick, out, _helpers())), ("fsdp_rank", fsdp_rank),
            ("lsp_fit_together", lambda quick, out: lsp_fit_together(quick)),
            ("sdpa_routes", lambda quick, out: sdpa_routes(quick, device())),
            ("host_adam_vs_copy", lambda quick, out: host_adam_vs_copy(quick)))


def host_adam_vs_copy(quick: bool) -> dict:
    """Issue 30 item 7 on this machine's host CPU (a server part, unlike our 2-core VM): host_adam_bandwidth's
    one-thread reading, cut to what the goal asks: the native loop's split and split_8bit layouts on 2^25
    numbers (2^20 with --quick) in memory, each as a fraction of a one-thread copy measured just before it
    (goal 0.70), and the 8-bit loop in the L3. About 6 s here."""
    import host_adam_bandwidth as bandwidth  # benchmarks/cases/ is on the path (run.py)

    if not bandwidth.native_available():
        return {"skipped": "no native host AdamW here"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n, reps = (bandwidth.QUICK_N, 1) if quick else (bandwidth.ADAM_N, 15)
        beside = bandwidth.copy_meter(bandwidth.COPY_N if not quick else n, 3 if not quick else 1)
        flush = torch.empty(bandwidth.FLUSH_BYTES // 4)
        out = {"cpu": _cpu_model(), "vbmi": bandwidth.vbmi_available(), "numbers": n, "goal_of_copy": bandwidth.GOAL}
        for name in ("split", "split_8bit"):
            found = beside(lambda: bandwidth.measure_layout(name, n, reps, flush, True))
            out[name] = {"ns_a_number": found["best_s"] / n * 1e9, "gbps": found["gbps"],
                         "copy_gbps_before": found["copy_gbps_before"],
                         "of_copy": found["gbps"] / found["copy_gbps_before"]}
        cached = bandwidth.measure_layout("split_8bit", bandwidth.CACHED_N, 3 if quick else 100, None, True)
        out["split_8bit_in_l3_ns_a_number"] = cached["best_s"] / bandwidth.CACHED_N * 1e9
    finally:
        torch.set_num_threads(threads)
    eight = out["split_8bit"]
    print(f"host_adam_vs_copy ({out['cpu']}): 8-bit {eight['ns_a_number']:.2f} ns a number, {eight['of_copy']:.0%}"
          f" of a {eight['copy_gbps_before']:.1f} GB/s one-thread copy (goal {bandwidth.GOAL:.0%}); split"
          f" {out['split']['of_copy']:.0%}", flush=True)
    return out


def _cpu_model() -> str:
    """The host CPU's model name as Linux gives it (host_adam_vs_copy's figures depend on it)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.partition(":")[2].strip() for line in info if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def lsp_fit_together(quick: bool) -> dict:
    """Issue 32 item 3 on the card: one projector-fit step for both matrices of a same-shape pair
    (Llama-3.2-1B's q/o, k/v, gate/up at d = 512), stacked against two fits, at 32 and 128 rows: on a GPU a
    small step is mostly launch cost, which stacking halves (the CPU case lsp_fit_together: 0.7-1.1x)."""
    from lsp_fit_together import pair_timing  # benchmarks/cases/ is on the path (run.py)

    g = torch.Generator().manual_seed(0)
    pairs = {"q_o": (64, 64)} if quick else {"q_o": (2048, 2048), "k_v": (512, 2048), "gate_up": (8192, 2048)}
    return {f"{name}_t{t}": pair_timing(n_o, n_i, t, g, d=16 if quick else 512, where=device())
            for t in ((16,) if quick else (32, 128)) for name, (n_o, n_i) in pairs.items()}


def _helpers():
    """What the long-context section (_long_context.py) uses of this file."""
    from types import SimpleNamespace

    return SimpleNamespace(shapes=shapes, random_model=random_model, one_batch=one_batch, run_config=run_config,
                           build_engine=build_engine, measured_step2=measured_step2, estimate=estimate,
                           device=device)


def run(quick: bool) -> dict:
    """Each section on its own: one that raises is recorded with its error and the others still run;
    after each, the result so far goes to $SLIMTUNE_CHECKS_PARTIAL when set (the device machine's
    $OUT), so a run cut off by its time limit keeps what it measured."""
    import gc
    import json
    import os
    import tempfile
    import traceback

    partial = os.environ.get("SLIMTUNE_CHECKS_PARTIAL")
    result = {"device": str(device()),
              "data_parallel": "skipped: ranks on one card measure contention, not data parallelism"}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slimtune-checks-") as out:
        for name, section in SECTIONS:
            started = time.perf_counter()
            try:
                result[name] = section(quick, out)
            except Exception as error:  # noqa: BLE001 - recorded, and the next section runs
                result[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
                print(f"{name}: FAILED {type(error).__name__}: {error}", flush=True)
            result.setdefault("section_seconds", {})[name] = time.perf_counter() - started
            gc.collect()  # the section's engines, weights and optimizer state off the card before the next
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if partial:
                with open(partial, "w") as f:
                    json.dump(result, f, indent=2, default=str)
    result["seconds"] = time.perf_counter() - began
    return result
