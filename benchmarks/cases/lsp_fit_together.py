"""A block's matrices of one shape fit together (issue 32 item 3; optim/value_fit.py) against each fit
alone: the time of one fit step for both members of a pair.

SmolLM2-135M's three pairs of one shape in a block (q and o 576 x 576, k and v 192 x 576, gate and up
1536 x 576) at the default d 256, r 4, fp32, on random factors of t = 128 rows (a probe pass's half batch
of 8 x 32 tokens, where the step works on the factors, as the engine's fits on that task do) and of
t = 32 (a smaller batch: less arithmetic, so the dispatch stacking saves weighs more). Each way: the
best of 5 runs of 15 steps (a batch's budget at the default lsp.fit_iterations over the sample), one
torch thread, no held-out reading; the two fits' values are checked equal to the stacked fit's after
(bit for bit).

    OMP_NUM_THREADS=1 python benchmarks/run.py lsp_fit_together    # ~1 minute
"""

from __future__ import annotations

import os
import time

import torch

from slimtune.optim import factored_gradient as fg
from slimtune.optim import projectors as pj
from slimtune.optim import value_fit as vf

PAIRS = {"q_o": (576, 576), "k_v": (192, 576), "gate_up": (1536, 576)}
D, R, STEPS = 256, 4, 15


def _fits(n_o: int, n_i: int, d: int, g: torch.Generator, where: torch.device):
    pairs = [[pj.SparseProjector.random(n, d, R, g, torch.float32, where) for n in (n_o, n_i)] for _ in range(2)]
    starts = [vf.start(p_o, p_i, g, fresh=True, warm=False) for p_o, p_i in pairs]
    apart = [vf.ValueFit(p_o, p_i, 0.05, STEPS, None, starts=[tuple(v.clone() for v in s)])
             for (p_o, p_i), s in zip(pairs, starts)]
    together = vf.ValueFit([p[0] for p in pairs], [p[1] for p in pairs], 0.05, STEPS, None,
                           starts=[tuple(v.clone() for v in s) for s in starts])
    return apart, together


def _best_ms_a_step(run, where: torch.device, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        _synchronize(where)
        began = time.perf_counter()
        run()
        _synchronize(where)
        best = min(best, time.perf_counter() - began)
    return best / STEPS * 1e3


def _synchronize(where: torch.device) -> None:
    if where.type == "cuda":
        torch.cuda.synchronize(where)


def pair_timing(n_o: int, n_i: int, t: int, g: torch.Generator, d: int = D,
                where: torch.device = torch.device("cpu")) -> dict:
    """One step for both members of a pair of this shape on `where`: two fits against one stacked fit
    (device_checks runs it on the card)."""
    factors = [fg.Factors(torch.randn(t, n_o, generator=g).to(where), torch.randn(t, n_i, generator=g).to(where))
               for _ in range(2)]
    apart, together = _fits(n_o, n_i, d, g, where)
    alone_ms = _best_ms_a_step(lambda: [fit.observe(f) for fit, f in zip(apart, factors)], where)
    together_ms = _best_ms_a_step(lambda: together.observe_all({0: (factors[0], None), 1: (factors[1], None)}), where)
    same = all(torch.equal(a, b) for member, fit in enumerate(apart)
               for a, b in zip(fit.values, together.params[member]))
    return {"n_o": n_o, "n_i": n_i, "t": t, "d": d, "stacked": together.stacks(factors[0]),
            "two_fits_ms_a_step": alone_ms, "together_ms_a_step": together_ms, "ratio": together_ms / alone_ms,
            "values_equal": same}


def run(quick: bool) -> dict:
    began = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    rows = {f"{name}_t{t}": pair_timing(*shape, t, g) for t in (128, 32) for name, shape in PAIRS.items()}
    return {"what": "one fit step for both matrices of a pair: two ValueFits against one of two members "
                    f"(factors, d {D}, r {R}, fp32, {STEPS} steps a run, best of 5)",
            "torch_threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0], "pairs": rows,
            "wall_s": time.perf_counter() - began}
