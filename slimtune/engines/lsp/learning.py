"""How engine lsp learns its projectors (spec lsp-offload.md 2.5): before step 1 every matrix's
projectors are fit; every lsp.check_every steps each matrix's relative error e(G) is measured on
the full gradients of a fixed sample, and the matrices above lsp.alpha are refit.

Both run on a probe pass (the engine's: forward and backward over the sample with the observed
ProjectedLinears in probe mode, each full gradient handed over in backward and dropped, one matrix
at a time). A refit draws fresh values on the fixed positions and fits them with Adam, `fit_iterations`
steps spread over the sample's gradients; then the matrix folds Z into W (the old subspace's update
goes into the weight) and its AdamW moments move into the new subspace with the spec's formulas;
the step counts go on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from slimtune.device import memory
from slimtune.optim import projectors
from slimtune.optim.host_adam import HostAdam
from slimtune.engines.lsp.projected_linear import ProjectedLinear


class Collector:
    """Hands each matrix's full gradient of a batch to its observer once it is complete, one at a
    time. A checkpointed block runs in tiles of tokens, so each of its matrices (`in_parts`) gets
    its gradient in parts: they are summed, and such a matrix is complete when backward reaches
    another block, or ends (`finish`), as in updates.py; the others are observed as they come."""

    def __init__(self, blocks: list[int], observers: dict[int, Callable[[torch.Tensor], None]], in_parts: set[int]):
        self.blocks, self.observers, self.in_parts = blocks, observers, in_parts
        self.parts: dict[int, torch.Tensor] = {}
        self.block: int | None = None

    def take(self, index: int, grad: torch.Tensor) -> None:
        if self.block is not None and self.blocks[index] != self.block:
            self.finish()
        self.block = self.blocks[index]
        if index not in self.in_parts:
            self.observers[index](grad)
        elif index in self.parts:
            self.parts[index].add_(grad)
        else:
            self.parts[index] = grad

    def finish(self) -> None:
        while self.parts:
            index = next(iter(self.parts))
            self.observers[index](self.parts.pop(index))
        self.block = None


class ProjectorLearning:
    def __init__(self, modules: list[ProjectedLinear], adams: list[HostAdam], settings, generator: torch.Generator,
                 rounding: torch.Generator | None, fake: bool):
        """`settings`: the lsp section; `generator`: the draws of fresh values; `rounding`: the folds'
        stochastic rounding; `fake`: fake tensors (no values: nothing is measured or drawn)."""
        self.modules, self.adams, self.settings = modules, adams, settings
        self.generator, self.rounding, self.fake = generator, rounding, fake
        self.fitted = False  # projectors learned (before step 1, or loaded from a checkpoint)

    def due(self, step_count: int) -> bool:
        every = self.settings.check_every
        return not self.fitted or bool(every and step_count % every == 0)

    def check(self, batches: list, probe_pass: Callable) -> dict:
        """Fit (first time) or check and refit; `probe_pass(batches, {matrix: observe(G)})` runs the
        model. Returns the figures for the log."""
        extras, chosen = {}, list(range(len(self.modules)))
        if self.fitted:
            errors = self.measure(batches, probe_pass)
            chosen = [i for i, e in enumerate(errors) if e > self.settings.alpha]
            finite = [e for e in errors if math.isfinite(e)]
            extras = {"lsp_error_mean": sum(finite) / len(finite) if finite else float("nan"),
                      "lsp_error_max": max(finite, default=float("nan"))}
        if chosen:
            self.refit(batches, chosen, probe_pass)
        extras["lsp_refit"] = len(chosen)
        self.fitted = True
        return extras

    def measure(self, batches: list, probe_pass: Callable) -> list[float]:
        """e(G) of every matrix's projectors over the sample's gradients (energy-weighted)."""
        sums = {i: [0.0, 0.0] for i in range(len(self.modules))}

        def observe(index: int, grad: torch.Tensor) -> None:
            module, total = self.modules[index], grad.pow(2).sum()
            sums[index][0] = sums[index][0] + projectors.squared_residual(grad, module.p_o, module.p_i, total)
            sums[index][1] = sums[index][1] + total

        probe_pass(batches, {i: functools.partial(observe, i) for i in sums})
        if self.fake:
            return [float("nan")] * len(self.modules)
        return [math.sqrt(max(float(res / tot), 0.0)) if float(tot) > 0 else 0.0 for res, tot in sums.values()]

    def refit(self, batches: list, chosen: list[int], probe_pass: Callable) -> None:
        """New values for the chosen matrices' projectors; each folds Z into W first, then its moments
        move into the new subspace."""
        steps = max(1, -(-self.settings.fit_iterations // len(batches)))
        fits = {i: projectors.ValueFit(self.modules[i].p_o, self.modules[i].p_i, self.settings.fit_lr, steps,
                                       self.generator, fresh=not self.fake) for i in chosen}
        replay = memory.TransientReplay()  # under fake tensors: one fit step per matrix shape

        def observe(index: int, grad: torch.Tensor) -> None:
            module = self.modules[index]
            replay.run((tuple(grad.shape), module.d, module.p_o.r, grad.dtype), grad, fits[index].observe, grad)

        probe_pass(batches, {i: functools.partial(observe, i) for i in fits})
        for index, fit in fits.items():
            module, views = self.modules[index], self.adams[index].member(0, 0)
            old, new = (module.p_o, module.p_i), fit.pair()
            module.fold(self.rounding)
            device = module.z.device
            with torch.no_grad():
                views.master.zero_()
                moments = projectors.reproject_moments(views.exp_avg.to(device), views.exp_avg_sq.to(device), old, new)
                views.exp_avg.copy_(moments[0])
                views.exp_avg_sq.copy_(moments[1])
            module.p_o, module.p_i = new
