"""Engine slide under the default clipping: the host AdamW overlapped with the next step's forward
(issue 30 item 6) against the old order (a barrier after every step), on the CPU.

Full fine-tuning of a 12-block Llama (hidden 384, vocabulary 2000, 21M parameters: the embedding
and block 0, whose updates the next forward needs before anything else, are 11% of the weights),
fp32, clipping at 1.0, one micro-batch of 2 x 64 tokens, so that the forward takes a few times the
update (on a CPU that ratio is set by the tokens a step: a block's forward is 2 x params x tokens
FLOPs, its AdamW about 28 bytes a parameter). The host worker (a thread of its own) runs the per-unit
AdamW; the main thread computes. Two settings of torch's intra-op threads: 1 (the compute on one
core, the worker free to use the other) and 2 (the compute takes both cores; the update can only
share them).

Per step (the steady ones: neither the first nor the last of a run): the update's time (the
worker's AdamW jobs), the forward's (the block forwards), the step's wall time (call to call), the
main thread's time blocked on updates in it (the step-end barrier in the old order; with the
overlap, the waits of bind, the embedding rows and the head tiles for a unit still updating) and the
rest, its compute. A timeline of two steady steps of each run: every unit's update job (worker
thread), every block's forward and bind and every wait and barrier (main thread). Two figures of the
update's time taken off the critical path (goal >= 0.8):

    hidden (waits) = 1 - median blocked time, overlapped / median update time, overlapped
    hidden (steps) = (median step, barrier after each - median step, overlapped) / median update time

The first is what the main thread no longer waits for; the second also counts what running the
update beside the compute costs the compute (the cores and memory bandwidth they share), and carries
the step-time noise of a shared machine. The runs alternate (barrier, overlapped, three times) so
drift falls on both. Before and after them, how free the second core is: a thread of matmuls and a
thread of fused AdamW, each alone and side by side (their slowdowns side by side: 1.0 on free cores).

    python benchmarks/run.py update_overlap      # ~2 minutes on 2 cores
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from contextlib import contextmanager

import torch

from slimtune.data.dataset import IGNORE_INDEX, Batch
from slimtune.device import runtime
from slimtune.engines import settings
from slimtune.engines.slide.engine import SlideEngine
from slimtune.model.stack import Stack
from slimtune.optim.host_unit import HostUnit
from slimtune.step import activations

WARMUP, ROUNDS = 2, 3
SHOWN = 2  # steady steps of each run whose every event goes into the result


def model_and_batches(quick: bool, count: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden, layers = (256, 2) if quick else (384, 12)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=2000, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    rows, seq = 2, 64
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config.vocab_size, (rows, seq), generator=g)
        targets = torch.roll(ids, -1, dims=1)
        targets[:, -1] = IGNORE_INDEX
        out.append([Batch(ids, targets, torch.arange(seq).expand(rows, seq).clone())])
    return model, out


def run_config():
    base = {"model": "(bench)", "data": "(bench)", "output_dir": "/tmp/slimtune-bench", "method": "full",
            "engine": "slide", "precision": "fp32",
            "train": {"lr": 1e-4, "batch_size": 2, "max_grad_norm": 1.0, "measure_memory": False}}
    return settings.load(None, [], base=base)


class Timeline:
    """Start and stop of every unit's AdamW on the worker thread, and on the main thread every block's
    forward and bind, every wait for a unit's update and every worker barrier; seconds from `origin`."""

    def __init__(self):
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.origin = time.perf_counter()

    def note(self, what: str, unit: str, began: float) -> None:
        stopped = time.perf_counter()
        with self.lock:
            self.events.append({"thread": "worker" if threading.current_thread().name.startswith("slimtune-host")
                                else "main", "what": what, "unit": unit, "start": began - self.origin,
                                "stop": stopped - self.origin})

    def timed(self, what: str, name_of, fn):
        def wrapped(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.note(what, name_of(*args), began)
        return wrapped

    def waited(self, unit: HostUnit | None) -> None:
        """Wait for the unit's update, noted as a wait when there was one to wait for."""
        job = None if unit is None else unit.update_job
        if job is not None and not job.done():
            began = time.perf_counter()
            job.result()
            self.note("wait", unit.name, began)

    @contextmanager
    def recording(self):
        """Wraps HostUnit.update and bind, activations.block_forward, SlideEngine._await_update and
        HostWorker.barrier while the runs go, then restores them (the engine looks each up when it
        calls it). A bind first waits here for the unit's update (its own wait then finds it done)."""
        saved = (HostUnit.update, HostUnit.bind, activations.block_forward, SlideEngine.__dict__["_await_update"],
                 runtime.HostWorker.barrier)
        update, bind, forward, _, barrier = saved

        def bind_after_wait(unit, *args):
            self.waited(unit)
            return bind(unit, *args)

        HostUnit.update = self.timed("update", lambda unit, *_: unit.name, update)
        HostUnit.bind = self.timed("bind", lambda unit, *_: unit.name, bind_after_wait)
        activations.block_forward = self.timed("forward", lambda stack, index, *_: f"block {index}", forward)
        SlideEngine._await_update = staticmethod(self.waited)
        runtime.HostWorker.barrier = self.timed("barrier", lambda worker: "worker", barrier)
        try:
            yield self
        finally:
            (HostUnit.update, HostUnit.bind, activations.block_forward, SlideEngine._await_update,
             runtime.HostWorker.barrier) = saved


def within(events: list[dict], what: str, start: float, stop: float) -> list[dict]:
    return [e for e in events if e["what"] == what and start <= e["start"] < stop]


def seconds(events: list[dict]) -> float:
    return sum(e["stop"] - e["start"] for e in events)


def per_step(timeline: Timeline, calls: list[float], units: int, overlapped: bool) -> list[dict]:
    """Figures of the steps between the first and the last (in steady state: a step before each that
    may leave updates running into it). Step k's updates are the k-th `units` update jobs; its main
    thread runs from calls[k] to calls[k + 1], and is blocked on updates there by the waits (for the
    step before's updates) or, in the old order, by its last barrier (for its own)."""
    events = timeline.events
    updates = sorted((e for e in events if e["what"] == "update"), key=lambda e: e["start"])
    rows = []
    for k in range(1, len(calls) - 2):
        mine, window, nxt = updates[k * units:(k + 1) * units], (calls[k], calls[k + 1]), (calls[k + 1], calls[k + 2])
        blocked = seconds(within(events, "wait", *window) if overlapped else within(events, "barrier", *window)[-1:])
        step = calls[k + 1] - calls[k]
        rows.append({"step_s": step, "update_s": seconds(mine), "forward_s": seconds(within(events, "forward", *window)),
                     "blocked_on_updates_s": blocked, "compute_s": step - blocked,
                     "update_under_next_forward_s": sum(max(0.0, min(u["stop"], f["stop"]) - max(u["start"], f["start"]))
                                                        for u in mine for f in within(events, "forward", *nxt))})
    return rows


def measure(model, data, steps: int, overlapped: bool) -> tuple[dict, dict]:
    """WARMUP + `steps` steps; `overlapped`: each handed the next one's batches (then=), as train.fit
    does, so its updates run on into the next forward; otherwise a barrier ends every step."""
    engine = SlideEngine(Stack(copy.deepcopy(model)), run_config(), torch.device("cpu"), "fp32")
    for k in range(WARMUP):
        engine.step(data[k])
    units = sum(u.adam is not None for u in engine._all_units())
    timeline, calls = Timeline(), []
    with timeline.recording():
        for k in range(steps):
            calls.append(time.perf_counter() - timeline.origin)
            then = (data[WARMUP + k + 1], None) if overlapped and k + 1 < steps else None
            engine.step(data[WARMUP + k], then=then)
        if overlapped:
            engine.worker.barrier()  # the last step's updates, on its clock
        calls.append(time.perf_counter() - timeline.origin)
    rows = per_step(timeline, calls, units, overlapped)
    shown = (calls[steps // 2], calls[steps // 2 + SHOWN])
    events = [{**e, "start": round(e["start"] - shown[0], 6), "stop": round(e["stop"] - shown[0], 6)}
              for e in sorted(timeline.events, key=lambda e: e["start"]) if shown[0] <= e["start"] < shown[1]]
    return {"overlapped": overlapped, "units_updated": units, "steps": rows,
            "timeline": {"first_step": steps // 2, "steps": SHOWN, "events": events}}, engine.trainable_state()


def median(runs: list[dict], key: str) -> float:
    return statistics.median(row[key] for run in runs for row in run["steps"])


def compare(model, data, steps: int) -> dict:
    """ROUNDS of (barrier after each step, overlapped), alternating; the weights of each pair compared."""
    runs = {False: [], True: []}
    same = True
    for _ in range(ROUNDS):
        barrier, want = measure(model, data, steps, overlapped=False)
        overlapped, got = measure(model, data, steps, overlapped=True)
        runs[False].append(barrier)
        runs[True].append(overlapped)
        same = same and want.keys() == got.keys() and all(torch.equal(got[n], w) for n, w in want.items())
    figures = {name: {key: median(runs[flag], key) for key in
                      ("step_s", "update_s", "forward_s", "blocked_on_updates_s", "compute_s",
                       "update_under_next_forward_s")}
               for name, flag in (("barrier_after_each_step", False), ("overlapped", True))}
    old, new = figures["barrier_after_each_step"], figures["overlapped"]
    return {"weights_bit_identical": same, "median": figures,
            "hidden_by_waits": 1 - new["blocked_on_updates_s"] / new["update_s"],
            "hidden_by_steps": (old["step_s"] - new["step_s"]) / old["update_s"],
            "forward_over_update": old["forward_s"] / old["update_s"],
            "runs": {"barrier_after_each_step": runs[False], "overlapped": runs[True]}}


def second_core(quick: bool) -> dict:
    """How free the machine's second core is now: one thread of matmuls (the compute's kind of work)
    and one of torch's fused AdamW over 20M numbers (the update's), each alone and then side by side,
    on one intra-op thread each. Free cores: side by side each takes as long as alone."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 2048)
    numel = 2_000_000 if quick else 20_000_000
    p, g, m, v = torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    count = torch.tensor(1.0)

    def matmuls() -> float:
        began = time.perf_counter()
        for _ in range(8 if quick else 60):
            a @ b
        return time.perf_counter() - began

    def adamw() -> float:
        began = time.perf_counter()
        for _ in range(3 if quick else 15):
            torch._fused_adamw_([p], [g], [m], [v], [], [count], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0,
                                eps=1e-8, amsgrad=False, maximize=False)
        return time.perf_counter() - began

    alone = {"matmul_s": matmuls(), "adamw_s": adamw()}
    beside: dict = {}
    worker = threading.Thread(target=lambda: beside.setdefault("adamw_s", adamw()))
    worker.start()
    beside["matmul_s"] = matmuls()
    worker.join()
    return {"alone": alone, "side_by_side": beside,
            "matmul_slowdown": beside["matmul_s"] / alone["matmul_s"],
            "adamw_slowdown": beside["adamw_s"] / alone["adamw_s"]}


def run(quick: bool) -> dict:
    steps = 4 if quick else 12
    model, data = model_and_batches(quick, WARMUP + steps)
    threads_before = torch.get_num_threads()
    rows = []
    try:
        cores_before = second_core(quick)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rows.append({"torch_threads": threads, **compare(model, data, steps)})
        cores_after = second_core(quick)
    finally:
        torch.set_num_threads(threads_before)
    return {"model": {"hidden": model.config.hidden_size, "layers": model.config.num_hidden_layers,
                      "vocab": model.config.vocab_size, "params": sum(p.numel() for p in model.parameters())},
            "batch": list(data[0][0].input_ids.shape), "warmup_steps": WARMUP, "steps": steps, "rounds": ROUNDS,
            "goal_hidden_fraction": 0.8, "second_core": {"before": cores_before, "after": cores_after}, "rows": rows}
