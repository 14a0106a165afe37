"""Engine slide's CPU step time with the split master against a whole fp32 master (issue 30, goal:
"CPU step time of slide with the split master within 1.1x of today's").

The split master (optim/split_master.py) only acts where weights go up in bf16 over fp32 masters, so
every run here computes in bf16 (precision=bf16), which this CPU does slowly (bf16 matmuls are 7-140x
slower than fp32 here, PLATFORM.md): the model is small enough that a step still takes well under a
second. Full fine-tuning of a 4-block Llama (hidden 384, FFN 1024, vocabulary 4000, untied head:
9.4M parameters), one micro-batch of 1 x SEQ tokens, AdamW with the default clipping (1.0), so every
unit's update runs after the backward and a barrier ends the step (engine.step without `then=`, the
order before issue 30's overlap: the whole update is inside the step's time). Two lengths: 128
tokens (the compute dominates) and 16 (the update is a larger share, nearer a GPU's case, where the
compute leaves the CPU and the host AdamW is what the host does).

Variants, each in a process of its own (SLIMTUNE_NATIVE is set before anything imports):
- train.master=fp32 and =split, on the native host AdamW (SLIMTUNE_NATIVE=1) and on the torch tile
  path (SLIMTUNE_NATIVE=0). Both keep the gradient accumulators in bf16 (issue 30 item 2), so the
  pair isolates the master's layout.
- "before issue 30": the same script on the tree of commit BEFORE (the last one before the host
  optimizer changed: whole fp32 masters beside bf16 shadows, fp32 accumulators, torch's fused AdamW
  per tensor), exported with `git archive` to a temporary folder and put first on PYTHONPATH: the
  literal "today's" of the goal.

Per process: WARMUP steps, then STEPS timed steps (wall clock of engine.step), and for each step the
time the host worker spent in HostUnit.update (every unit's AdamW, wrapped for timing in the child
only; the wrapper adds a perf_counter pair per unit). The variants run ROUNDS times in an order that
alternates, so a shared machine's drift falls on all of them. Other engineers' work on the same 2
cores slows whole processes at random (a round's median moves by up to 2x), so the headline is each
variant's best round (the median of its least disturbed process); the median over every timed step
of every round is given beside it. The 1-minute load average is recorded before and after each
process.

Losses (each step's, first round): native and torch tiles give the same bits for a layout. split and
fp32 give the same losses for about ten steps, then differ in the 4th-5th digit: the split's one
lossy case (a master exactly half a bf16 ulp above an even weight moves one fp32 ulp,
split_master.py's docstring) moves about 140 of the 9.4M masters in the first step. The old tree's
losses differ from the third step on (1e-5 relative at first, 0.1-0.3% by step 14): commit acfe352
sends the LM head's tile gradients down in bf16 (they were fp32), a change of the numbers that is
not the split's (acfe352's parent gives the old losses).

torch runs on THREADS intra-op thread(s): one thread is the figure least disturbed by the others.

    python benchmarks/run.py split_step_time      # ~8 minutes on 2 cores
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
BEFORE = "a8ffa98"  # the commit before 2e115f6 ("host optimizer: the split master ..."): today's layout
WARMUP, STEPS, ROUNDS, THREADS = 2, 12, 6, 1
MODEL = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
         "num_key_value_heads": 2, "vocab_size": 4000, "max_position_embeddings": 512}
ROWS, SEQS = 1, (128, 16)
GOAL = 1.1

LAYOUTS = ("fp32", "split")  # train.master, the pair each process of today's tree times step by step
# process kind -> (SLIMTUNE_NATIVE, old tree)
PROCESSES = {"native": ("1", False), "torch tiles": ("0", False), "before issue 30": ("1", True)}


# ---------------------------------------------------------------- the child: one process's steps


def engine_for(model, master: str | None):
    import torch

    from slimtune.engines import settings
    from slimtune.engines.slide.engine import SlideEngine
    from slimtune.model.stack import Stack

    train = {"lr": 1e-4, "batch_size": ROWS, "max_grad_norm": 1.0, "measure_memory": False}
    if master is not None:  # the old tree has no train.master
        train["master"] = master
    cfg = settings.load(None, [], base={"model": "(benchmark)", "data": "(benchmark)", "method": "full",
                                        "engine": "slide", "precision": "bf16", "output_dir": tempfile.mkdtemp(),
                                        "train": train})
    return SlideEngine(Stack(copy.deepcopy(model)), cfg, torch.device("cpu"), "bf16")


def child(masters: list[str | None], seq: int, steps: int, warmup: int) -> dict:
    """Times `steps` slide steps after `warmup` of one engine per entry of `masters` (None: the
    tree's only layout), taking turns step by step (the order swapped every step), so that whatever
    else runs on the machine falls on them alike; and the host updates' time in each step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import slimtune
    from slimtune.data.dataset import IGNORE_INDEX, Batch
    from slimtune.optim.host_unit import HostUnit

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model.config.use_cache = False
    engines = [engine_for(model, m) for m in masters]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (ROWS, seq), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    batch = Batch(ids, targets, torch.arange(seq).expand(ROWS, seq).clone())

    spent = []  # seconds of each HostUnit.update call (on the host worker thread)
    update = HostUnit.update

    def timed_update(unit, *args, **kwargs):
        began = time.perf_counter()
        try:
            return update(unit, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - began)

    HostUnit.update = timed_update
    found = [{"master": m, "losses": [], "step_s": [], "update_s": []} for m in masters]
    try:
        for k in range(warmup + steps):
            for e in (range(len(engines)) if k % 2 == 0 else reversed(range(len(engines)))):
                spent.clear()
                began = time.perf_counter()
                result = engines[e].step([batch])
                took = time.perf_counter() - began
                found[e]["losses"].append(result.loss)
                if k >= warmup:
                    found[e]["step_s"].append(took)
                    found[e]["update_s"].append(sum(spent))
    finally:
        HostUnit.update = update
    kernel = Path(slimtune.__file__).parent / "optim" / "native" / "adamw.c"
    return {"slimtune_from": str(Path(slimtune.__file__).parent),
            "adamw_c_sha256": hashlib.sha256(kernel.read_bytes()).hexdigest() if kernel.is_file() else None,
            "params": sum(p.numel() for p in model.parameters()),
            "engines": found}


# ---------------------------------------------------------------- the parent: processes and figures


def old_tree(into: Path) -> Path:
    """The repository at BEFORE, exported (not checked out: the working tree is left alone)."""
    archive = into / "before.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", BEFORE, "slimtune"], cwd=REPO, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "before", filter="data")
    return into / "before"


def spawn(kind: str, seq: int, steps: int, warmup: int, old: Path, round_: int) -> dict:
    native, is_old = PROCESSES[kind]
    env = {**os.environ, "SLIMTUNE_NATIVE": native, "OMP_NUM_THREADS": str(THREADS)}
    masters = [None] if is_old else list(LAYOUTS)
    if is_old:
        env["PYTHONPATH"] = os.pathsep.join([str(old), env.get("PYTHONPATH", "")])
    load_before = os.getloadavg()[0]
    done = subprocess.run([sys.executable, str(HERE), "--child", json.dumps([masters, seq, steps, warmup])],
                          env=env, capture_output=True, text=True, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    said = [line for line in done.stderr.splitlines() if "native" in line.lower() or "adamw" in line.lower()]
    return {"process": kind, "stderr_about_native": said, "seq": seq, "round": round_, **found,
            "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0]}


def med(values) -> float:
    return statistics.median(list(values))


def layout_figures(engines: list[dict]) -> dict:
    """One layout's steps over every process that ran it."""
    step, update = med(s for e in engines for s in e["step_s"]), med(s for e in engines for s in e["update_s"])
    shares = [u / s for e in engines for s, u in zip(e["step_s"], e["update_s"])]
    return {"median_step_s": step, "median_update_s": update, "median_update_share": med(shares),
            "fastest_step_s": min(s for e in engines for s in e["step_s"])}


def paired_ratio(processes: list[dict]) -> float:
    """Median over every turn of (split's step / fp32's step), the two taken one after the other."""
    return med(split / whole for p in processes
               for whole, split in zip(p["engines"][0]["step_s"], p["engines"][1]["step_s"]))


def at_length(runs: list[dict], seq: int) -> dict:
    mine = [r for r in runs if r["seq"] == seq]
    by_kind = {kind: [r for r in mine if r["process"] == kind] for kind in PROCESSES}
    layouts = {f"{m} master, {kind}": layout_figures([p["engines"][i] for p in by_kind[kind]])
               for kind in ("native", "torch tiles") for i, m in enumerate(LAYOUTS)}
    layouts["before issue 30"] = layout_figures([p["engines"][0] for p in by_kind["before issue 30"]])
    # The old tree runs in a process of its own: set each against the native process of its round.
    before = {p["round"]: med(p["engines"][0]["step_s"]) for p in by_kind["before issue 30"]}
    against_before = [med(p["engines"][1]["step_s"]) / before[p["round"]] for p in by_kind["native"]]
    tiles_before = [med(p["engines"][1]["step_s"]) / before[p["round"]] for p in by_kind["torch tiles"]]
    return {"seq": seq,
            "split_over_fp32": {"native": paired_ratio(by_kind["native"]),
                                "torch tiles": paired_ratio(by_kind["torch tiles"])},
            "split_over_before_by_round": {"native": against_before, "torch tiles": tiles_before},
            "split_over_before": {"native": med(against_before), "torch tiles": med(tiles_before)},
            "layouts": layouts, "losses": losses(by_kind)}


def losses(by_kind: dict) -> dict:
    """Each layout's losses step by step (first round), and where they part."""
    native, tiles = by_kind["native"][0]["engines"], by_kind["torch tiles"][0]["engines"]
    old = by_kind["before issue 30"][0]["engines"][0]["losses"]
    whole, split = native[0]["losses"], native[1]["losses"]

    def parting(a: list[float], b: list[float]) -> dict:
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        return {"first_differing_step": first, "largest_relative_difference": max(abs(x - y) / abs(y)
                                                                                     for x, y in zip(a, b))}

    return {"native_equals_torch_tiles": {"fp32": whole == tiles[0]["losses"], "split": split == tiles[1]["losses"]},
            "split_vs_fp32": parting(split, whole), "split_vs_before": parting(split, old),
            "fp32_vs_before": parting(whole, old),
            "first_round": {"fp32": whole, "split": split, "before issue 30": old}}


def run(quick: bool) -> dict:
    steps, warmup, rounds = (3, 1, 1) if quick else (STEPS, WARMUP, ROUNDS)
    began = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        old = old_tree(Path(tmp))
        kinds = list(PROCESSES)
        for r in range(rounds):
            for seq in SEQS:
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    runs.append(spawn(kind, seq, steps, warmup, old, r))
                    print(f"T={seq} {kind}: median steps " + ", ".join(
                        f"{e['master'] or 'whole'} {med(e['step_s']):.3f} s" for e in runs[-1]["engines"]), flush=True)
    lengths = [at_length(runs, seq) for seq in SEQS]
    loads = [x for r in runs for x in (r["load_1min_before"], r["load_1min_after"])]
    return {"model": {**MODEL, "params": runs[0]["params"], "tie_word_embeddings": False},
            "rows": ROWS, "seqs": list(SEQS), "precision": "bf16", "method": "full", "max_grad_norm": 1.0,
            "torch_threads": THREADS, "warmup_steps": warmup, "timed_steps": steps, "rounds": rounds,
            "before_commit": BEFORE, "goal_ratio": GOAL,
            "goal_met": {f"T={x['seq']} {name} {kind}": v <= GOAL for x in lengths
                         for name in ("split_over_fp32", "split_over_before") for kind, v in x[name].items()},
            "lengths": lengths,
            "load_1min": {"min": min(loads), "max": max(loads), "median": med(loads)},
            "runs": runs, "seconds": time.perf_counter() - began}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        masters, seq, steps, warmup = json.loads(sys.argv[2])
        print(json.dumps(child(masters, seq, steps, warmup)))
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
