"""Which way a projector fit step is quicker: from the gradient's factors dY, X (t rows) or from G = dY^T X
itself (optim/factored_gradient.py), and how well factored_is_cheaper's fitted times choose.

Each of SmolLM2-135M's four matrix shapes (576 x 576, 192 x 576, 1536 x 576, 576 x 1536) at d 64, 128,
256, 512 and t 32, 64, 128, 192, 256, 384 rows (r 4, fp32, random factors): one ValueFit step timed each
way (the best of 3 runs of 10 steps) on one torch thread, and a held-out reading each way. Then the two
linear time models of factored_gradient.py are fitted again to these timings by least squares (in
relative error), and the committed constants are scored: how many of the 96 shape pairs they send the slower way, and the time
that costs.

    OMP_NUM_THREADS=1 python benchmarks/run.py lsp_first_fit_routes    # ~3 minutes
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from slimtune.optim import factored_gradient as fg
from slimtune.optim import projectors as pj
from slimtune.optim import value_fit as vf

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
DS, TS, R = (64, 128, 256, 512), (32, 64, 128, 192, 256, 384), 4


def _best_ms(fn, calls: int = 10, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - began) / calls)
    return best * 1e3


def _timed(n_o: int, n_i: int, d: int, t: int, g: torch.Generator) -> dict:
    pair = [pj.SparseProjector.random(n, d, R, g, torch.float32, torch.device("cpu")) for n in (n_o, n_i)]
    factors = fg.Factors(torch.randn(t, n_o, generator=g), torch.randn(t, n_i, generator=g))
    fit = vf.ValueFit(*pair, lr=0.05, steps=1, generator=g)
    factored, formed = fg.FactoredGradient(factors, fit), vf._DenseGradient([factors.dense()], fit, (0,))
    return {"n_o": n_o, "n_i": n_i, "d": d, "t": t,
            "step_ms_factored": _best_ms(lambda: fit.step(factored)),
            "step_ms_formed": _best_ms(lambda: fit.step(formed)),
            "reading_ms_factored": _best_ms(factored.error_sq), "reading_ms_formed": _best_ms(formed.error_sq),
            "chosen": "factored" if fg.factored_is_cheaper(t, n_o, n_i, d, R) else "formed"}


def _features(row: dict) -> tuple[list[float], list[float]]:
    n_o, n_i, d, t = row["n_o"], row["n_i"], row["d"], row["t"]
    gram = sum(min(d ** 3, 16 * n * R * d) for n in (n_o, n_i))
    return [t * t * d, (n_o + n_i) * R * t, 1.0], [n_o * n_i * R, gram, 1.0]


def _refit(rows: list[dict]) -> dict:
    """Least-squares ns coefficients of both time models on these timings, in relative error (each timing
    weighs alike whatever its size), as factored_gradient's constants were fitted."""
    a = np.array([_features(r)[0] for r in rows]) * 1e-6
    b = np.array([_features(r)[1] for r in rows]) * 1e-6
    y_fac = np.array([r["step_ms_factored"] for r in rows])
    y_formed = np.array([r["step_ms_formed"] for r in rows])
    fac = np.linalg.lstsq(a / y_fac[:, None], np.ones(len(rows)), rcond=None)[0]
    formed = np.linalg.lstsq(b / y_formed[:, None], np.ones(len(rows)), rcond=None)[0]
    return {"factored_ns": fac.tolist(), "formed_ns": formed.tolist()}


def _score(rows: list[dict]) -> dict:
    wrong = [r for r in rows if (r["chosen"] == "factored") != (r["step_ms_factored"] < r["step_ms_formed"])]
    lost = sum(abs(r["step_ms_factored"] - r["step_ms_formed"]) for r in wrong)
    ratios = [max(r["step_ms_factored"], r["step_ms_formed"]) / min(r["step_ms_factored"], r["step_ms_formed"])
              for r in wrong]
    return {"pairs": len(rows), "sent_the_slower_way": len(wrong), "ms_lost_over_those": lost,
            "worst_ratio": max(ratios, default=1.0)}


def run(quick: bool) -> dict:
    began, load = time.perf_counter(), os.getloadavg()[0]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = [_timed(n_o, n_i, d, t, g) for d in (DS[2:3] if quick else DS) for (n_o, n_i) in SHAPES
            for t in (TS[1:3] if quick else TS)]
    return {"what": "one ValueFit step (and one held-out reading) from the factors and from G, one thread, fp32, r 4",
            "rows": rows, "committed_model": {"factored_ns": list(fg.FACTORED_NS), "formed_ns": list(fg.FORMED_NS)},
            "refit_on_these": _refit(rows), "committed_model_score": _score(rows),
            "load_1min_before": load, "load_1min_after": os.getloadavg()[0], "wall_s": time.perf_counter() - began}
