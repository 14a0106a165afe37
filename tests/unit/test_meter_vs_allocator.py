"""The CPU meter against the CPU allocator's own count, on the same real step.

The meter (memory.LiveBytesMeter) sees op outputs only: a buffer an op allocates and frees inside
itself passes below it, while a GPU's caching allocator counts it (torch.logsumexp's (c, V) copy of
z - max was one, at the loss's peak). Here torch.profiler reports every allocation of the CPU
allocator with the running total it keeps ("Total Allocated" of its [memory] events); storages the
runtime declares host memory (memory.mark_host_resident: offloaded block inputs, slide's host copies)
are taken out of that total, as a GPU's allocator would never see them. For every kind of plan, the
second step's peak above the bytes resident at its start must be the same in both, within 1%.

On a failure the message names the op running at the allocator's peak and the ops that hid the most
bytes (allocated inside a call beyond what the call returned). One op still hides bytes, away from
every peak here: CPU attention (aten._scaled_dot_product_flash_attention_for_cpu and its backward)
allocates per-thread scratch, a CPU kernel's own that a GPU kernel does not hold in that form; the
tests run on one thread so that it stays small on any machine.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import gc
import json
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from slimtune import assembly
from slimtune.engines import settings
from slimtune.device import memory
from slimtune.data.dataset import IGNORE_INDEX, Batch

CPU = torch.device("cpu")
VOCAB, SEQ = 4000, 256
PLANS = {
    "lora": {"engine": "resident", "method": "lora"},
    "full": {"engine": "resident", "method": "full"},
    "lora-int4-recompute-subset": {"engine": "resident", "method": "lora", "quant.scheme": "int4",
                                   "activations.checkpoint": "recompute", "loss.mode": "subset",
                                   "loss.subset_k": 256},
    "full-recompute": {"engine": "resident", "method": "full", "activations.checkpoint": "recompute"},
    "lora-host": {"engine": "resident", "method": "lora", "activations.checkpoint": "host"},
    "lora-disk": {"engine": "resident", "method": "lora", "activations.checkpoint": "disk"},
    "slide-full": {"engine": "slide", "method": "full", "activations.checkpoint": "host"},
    "slide-lora": {"engine": "slide", "method": "lora", "activations.checkpoint": "host"},
}


@pytest.fixture(autouse=True)
def one_thread():
    """CPU attention's hidden scratch grows with the thread count; one thread keeps it small anywhere."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def model_of(hidden: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    built = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    built.config.use_cache = False
    return built


def one_batch() -> Batch:
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, dims=1)
    targets[:, : SEQ * 7 // 10] = IGNORE_INDEX  # the last 30% trained
    targets[:, -1] = IGNORE_INDEX
    return Batch(ids, targets, torch.arange(SEQ)[None].clone())


class _StartMeter(memory.CpuMeter):
    """The CPU meter, remembering each step's reading and the bytes resident when it started; the
    step's span is marked in the trace."""

    def __init__(self):
        super().__init__()
        self.readings = []

    @contextlib.contextmanager
    def measure(self, resident):
        with super().measure(resident) as reading:
            self.readings.append((reading, reading.current))
            with record_function("step"):
                yield reading


@contextlib.contextmanager
def _traced(monkeypatch):
    """The profiler on, each op the meter sees in a 'meter::<op>' range, and a 'host::<address>'
    mark for each storage declared host memory (wherever mark_host_resident was imported)."""
    dispatch, mark = memory.LiveBytesMeter.__torch_dispatch__, memory.mark_host_resident

    def labelled(self, func, types, args=(), kwargs=None):
        with record_function(f"meter::{func}"):
            return dispatch(self, func, types, args, kwargs)

    def marked(tensor):
        with record_function(f"host::{tensor.untyped_storage().data_ptr()}"):
            return mark(tensor)

    monkeypatch.setattr(memory.LiveBytesMeter, "__torch_dispatch__", labelled)
    for name, module in list(sys.modules.items()):
        if name.startswith("slimtune") and getattr(module, "mark_host_resident", None) is mark:
            monkeypatch.setattr(module, "mark_host_resident", marked)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


def device_totals(events: list[dict]) -> list[dict]:
    """[memory] events in order, each given 'device': the allocator's Total Allocated less the
    allocations of storages later declared host memory (from their allocation to their free)."""
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: (e["ts"], e["args"]["Ev Idx"]))
    marks = [(e["ts"], 1, int(e["name"][6:])) for e in events if e.get("name", "").startswith("host::")]
    host, last_alloc = set(), {}
    for _, kind, item in sorted([(e["ts"], 0, i) for i, e in enumerate(mem)] + marks):
        if kind == 1:  # a host mark: the latest allocation at that address made it
            if item in last_alloc:
                host.add(last_alloc[item])
            continue
        address = mem[item]["args"]["Addr"]
        if mem[item]["args"]["Bytes"] > 0:
            last_alloc[address] = item
        elif last_alloc.pop(address, None) in host:
            host.add(item)
    host_bytes = 0
    for i, e in enumerate(mem):
        host_bytes += e["args"]["Bytes"] if i in host else 0
        e["device"] = e["args"]["Total Allocated"] - host_bytes
    return mem


def hidden_by_op(ops: list[dict], mem: list[dict]) -> dict[str, int]:
    """op -> the most bytes one call allocated inside itself beyond what it held at its end."""
    times, out = [e["ts"] for e in mem], {}
    for op in ops:
        i, j = bisect.bisect_left(times, op["ts"]), bisect.bisect_right(times, op["ts"] + op["dur"])
        if i < j:
            start = mem[i - 1]["device"] if i else 0
            hidden = max(e["device"] for e in mem[i:j]) - start - max(mem[j - 1]["device"] - start, 0)
            out[op["name"]] = max(out.get(op["name"], 0), hidden)
    return out


def step_peaks(model, plan: dict, tmp_path, monkeypatch) -> tuple[int, int, str]:
    """(allocator peak, meter peak) of the second step above the bytes at its start, and a diagnosis."""
    base = {"model": "(test)", "data": "(test)", "output_dir": str(tmp_path), "train": {"batch_size": 1}}
    cfg = settings.load(None, [f"{k}={v}" for k, v in {**plan, "precision": "fp32"}.items()], base=base)
    batch = one_batch()
    gc.collect()
    # The profiler runs from the build on, so every storage the step frees is one it saw allocated.
    with _traced(monkeypatch) as prof:
        engine = assembly.assemble(cfg, assembly.stack_of(copy.deepcopy(model), cfg, CPU, "fp32"), CPU, "fp32")
        engine.meter = _StartMeter()
        for _ in range(2):
            engine.step([batch])
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    reading, resident = engine.meter.readings[-1]
    del engine
    step = max((e for e in events if e.get("name") == "step" and e.get("ph") == "X"), key=lambda e: e["ts"])
    lo, hi = step["ts"], step["ts"] + step["dur"]
    mem = device_totals(events)
    before = [e["device"] for e in mem if e["ts"] < lo]
    peak = max((e for e in mem if lo <= e["ts"] <= hi), key=lambda e: e["device"])
    ops = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("meter::") and lo <= e["ts"] <= hi]
    at_peak = [op["name"] for op in ops if op["ts"] <= peak["ts"] <= op["ts"] + op["dur"]]
    hiders = sorted(hidden_by_op(ops, mem).items(), key=lambda kv: -kv[1])[:3]
    why = f"at the allocator's peak: {at_peak or 'no op the meter saw'}; ops hiding the most bytes: {hiders}"
    return peak["device"] - (before[-1] if before else 0), reading.peak - resident, why


@pytest.mark.parametrize("plan", PLANS)
def test_meter_peak_equals_allocator_peak(plan, tmp_path, monkeypatch):
    allocator, meter, why = step_peaks(model_of(64), PLANS[plan], tmp_path, monkeypatch)
    assert meter == pytest.approx(allocator, rel=0.01), (
        f"{plan}: meter {meter} B above resident, allocator {allocator} B ({meter / allocator:.3f}); {why}")


def test_slide_full_with_a_head_gradient_wider_than_the_logits(tmp_path, monkeypatch):
    """runtime.host_empty makes host memory inside memory.host_allocation: no meter counts it, not even
    for the moment before it is declared host memory (here the host copy of the LM head's gradient,
    V x D, wider than the (N, V) logits it follows, set the meter's peak)."""
    allocator, meter, why = step_peaks(model_of(256), PLANS["slide-full"], tmp_path, monkeypatch)
    assert meter == pytest.approx(allocator, rel=0.01), (
        f"slide-full: meter {meter} B above resident, allocator {allocator} B ({meter / allocator:.3f}); {why}")
