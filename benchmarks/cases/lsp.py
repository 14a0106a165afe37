"""Engine lsp (learned sparse projectors, spec lsp-offload.md): how good the projectors are on real
gradients, and how fast it reaches the accuracy of full fine-tuning. What crosses the host link and
what it needs on the device are the case lsp_link (parts 1 and 2 of this case until the default d
became derived; results before 2026-12-01 12:00 hold them at d = 512).

Part 3, projector quality on real gradients: the demo's pretrained base model (slimtune/demo/base),
dense autograd gradients of every block linear on 8 fit and 8 held-out batches of the demo task
(16 rows each). Held-out e(G), energy-weighted over matrices and batches, for: learned sparse
(values fit on the fit batches, 100 Adam steps, positions fixed), random sparse (the same positions,
values +-1/sqrt(r)), dense Gaussian N(0, 1/d) projectors, a two-sided SVD of the fit batches' summed
gradient (top-d singular vectors each side: the same d x d state), and GaLore-style one-sided SVD
at equal optimizer state (rank d^2 / n_i). Then e(G) against d at r = 4, and against r at d = 64.
The same five on a larger real model, SmolLM2-135M-Instruct (scripts/make_smollm2.py), at d = 64, 128.

Part 4, time to accuracy on the demo task (CPU, 2 cores): resident full fine-tuning, lsp (d = 64,
its fit before step 1 and checks every 100 steps inside the measured steps) and the demo's LoRA,
the same data, seed and schedule (constant after 10 warm-up steps); held-out exact-match accuracy
every 50 steps; time is the sum of the runs' step times (metrics.jsonl step_s), fitting included.
Goal: lsp within 1 point of resident full fine-tuning's accuracy.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

from _accuracy import time_to_accuracy
from slimtune import config, demo
from slimtune.data import dataset as data
from slimtune.model.stack import load_model, load_tokenizer
from slimtune.optim import projectors, value_fit

GIB = 2**30
SEQ = 1024


def model_gradients(folder: Path, batches: int, every_block: int = 1) -> tuple[dict[str, list[torch.Tensor]], dict]:
    """name -> dense gradients of the block linear weights (of every `every_block`-th block), one per
    batch of the demo task, for the model in `folder`."""
    model = load_model(folder, torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(folder)
    settings = demo.SETTINGS["data"]
    cfg = config.DataConfig(path=settings["path"], format=settings["format"], max_length=settings["max_length"])
    splits = data.load_splits(cfg, tokenizer, seed=0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stream = data.BatchStream(splits.train, 16, cfg.max_length, True, pad, seed=0)
    chosen = {f"model.layers.{b}." for b in range(0, model.config.num_hidden_layers, every_block)}
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n.startswith(c) for c in chosen)}
    grads = {n: [] for n in linears}
    for _ in range(batches):
        batch = stream.next_batch()
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100).backward()
        for n, m in linears.items():
            grads[n].append(m.weight.grad.detach().clone())
    shapes = {n: tuple(m.weight.shape) for n, m in linears.items()}
    return grads, shapes


def _energy_error(residuals: list[float], energies: list[float]) -> float:
    return math.sqrt(sum(residuals) / sum(energies))


def dense_error(g: torch.Tensor, left: torch.Tensor, right: torch.Tensor | None) -> float:
    """|L L^T G R R^T - G|^2 (right None: one-sided)."""
    approx = left @ (left.T @ g)
    if right is not None:
        approx = approx @ right @ right.T
    return float((approx - g).pow(2).sum())


def quality(grads: dict, shapes: dict, d: int, r: int, methods: tuple[str, ...], fit: int) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for method in methods:
        residuals, energies = [], []
        for name, series in grads.items():
            n_o, n_i = shapes[name]
            dd = min(d, n_o, n_i)
            train_set, held_out = series[:fit], series[fit:]
            energies += [float(x.pow(2).sum()) for x in held_out]
            if method in ("learned", "random"):
                pair = [projectors.SparseProjector.random(n, dd, min(r, dd), g, torch.float32, torch.device("cpu"))
                        for n in (n_o, n_i)]
                if method == "learned":
                    fitter = value_fit.ValueFit(*pair, lr=0.05, steps=-(-100 // len(train_set)), generator=g)
                    for grad in train_set:
                        fitter.observe(grad)
                    pair = fitter.pair()
                residuals += [float(projectors.squared_residual(x, *pair)) for x in held_out]
            elif method == "gaussian":
                left, right = (torch.randn(n, dd, generator=g) / math.sqrt(dd) for n in (n_o, n_i))
                residuals += [dense_error(x, left, right) for x in held_out]
            elif method == "svd_two_sided":
                u, _, vh = torch.linalg.svd(sum(train_set), full_matrices=False)
                residuals += [dense_error(x, u[:, :dd], vh[:dd].T) for x in held_out]
            elif method == "galore_equal_state":
                rank = max(1, round(dd * dd / n_i))
                u, _, _ = torch.linalg.svd(sum(train_set), full_matrices=False)
                residuals += [dense_error(x, u[:, :rank], None) for x in held_out]
        out[method] = _energy_error(residuals, energies)
    return out


def part3(quick: bool) -> dict:
    fit = 4 if quick else 8
    grads, shapes = model_gradients(demo.ASSETS / "base", 2 * fit)
    all_methods = ("learned", "random", "gaussian", "svd_two_sided", "galore_equal_state")
    result = {"model": "slimtune demo base (pretrained; hidden 192, 4 blocks, 28 block linears)",
              "fit_batches": fit, "held_out_batches": fit, "rows_per_batch": 16,
              "at_d64_r4": quality(grads, shapes, 64, 4, all_methods, fit)}
    result["against_d"] = {d: quality(grads, shapes, d, 4, ("learned", "random"), fit)
                           for d in ((32, 64) if quick else (16, 32, 64, 128))}
    result["against_r"] = {r: quality(grads, shapes, 64, r, ("learned", "random"), fit)
                           for r in ((2, 4) if quick else (1, 2, 4, 8, 16))}
    return result


def part3_larger(quick: bool) -> dict:
    """The same comparison on SmolLM2-135M-Instruct (scripts/make_smollm2.py: pretrained, from PyPI),
    every 5th block (6 of 30, 42 matrices), 4 fit and 4 held-out batches."""
    from _smollm2 import smollm2_folder  # benchmarks/cases/ is on the path (run.py)

    folder = smollm2_folder()
    fit = 2 if quick else 4
    grads, shapes = model_gradients(folder, 2 * fit, every_block=5)
    methods = ("learned", "random", "gaussian", "svd_two_sided", "galore_equal_state")
    return {"model": "SmolLM2-135M-Instruct (pretrained; hidden 576, FFN 1536; blocks 0, 5, ..., 25)",
            "fit_batches": fit, "held_out_batches": fit, "rows_per_batch": 16,
            **{f"at_d{d}_r4": quality(grads, shapes, d, 4, methods, fit) for d in ((64,) if quick else (64, 128))}}


# ---------------------------------------------------------------- part 4: time to accuracy


# Each method at two learning rates (its best is compared: no method is held to another's lr); LoRA
# at the demo's own.
VARIANTS = {
    **{f"resident full lr={lr:g}": ("resident full", {"method": "full", "engine": "resident", "train": {"lr": lr}})
       for lr in (3e-4, 1e-3)},
    **{f"lsp d=64 lr={lr:g}": ("lsp d=64", {"method": "full", "engine": "lsp", "train": {"lr": lr},
                                            "lsp": {"d": 64, "check_every": 100, "fit_samples": 64}})
       for lr in (1e-3, 3e-3)},
    "lora r=16 lr=0.002 (demo)": ("lora r=16", {"method": "lora", "engine": "resident", "train": {"lr": 2.0e-3}}),
}


def part4(quick: bool) -> dict:
    steps, every = (20, 10) if quick else (300, 50)
    variants = list(VARIANTS.items())
    if quick:
        variants = [v for v in variants if "lr=0.001" in v[0] or "demo" in v[0]]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [{"method": method, **time_to_accuracy(name, variant, steps, every, Path(tmp))}
                for name, (method, variant) in variants]
    best = {}
    for r in runs:
        best[r["method"]] = max(best.get(r["method"], 0.0), max(p["accuracy"] for p in r["curve"]))
    target = best["resident full"] - 0.01
    fastest = {}
    for r in runs:
        reached = [p for p in r["curve"] if p["accuracy"] >= target]
        r["seconds_to_target"] = reached[0]["train_seconds"] if reached else None
        if r["seconds_to_target"] is not None:
            fastest[r["method"]] = min(fastest.get(r["method"], math.inf), r["seconds_to_target"])
    return {"task": "slimtune demo (heldout.jsonl, greedy exact match)", "target_accuracy": target,
            "best_accuracy": best, "seconds_to_target": fastest,
            "lsp_within_1_point": best["lsp d=64"] >= target, "runs": runs}


def run(quick: bool) -> dict:
    began = time.perf_counter()
    result = {"projector_quality": part3(quick),
              "projector_quality_larger": part3_larger(quick), "time_to_accuracy": part4(quick)}
    result["seconds"] = time.perf_counter() - began
    return result
