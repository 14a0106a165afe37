"""How engine lsp learns its projectors (spec lsp-offload.md 2.5): before step 1 every matrix's
projectors are fit; every lsp.check_every steps each matrix's relative error e(G) is measured on
the full gradients of a fixed sample, and the matrices whose projectors have drifted are refit.

Drift. The sample is fixed, so a matrix's checked error changes only as training moves the weights
(and their gradients) away from where its projectors were fit. Right after each fit the error is
measured on the sample's first lsp.check_samples examples (`baseline`), which no fit learns on (the fits
take the sample's other batches: `fit_batches`); a check measures on the same examples and refits a
matrix when its error has grown past that by the relative margin lsp.drift. A fixed threshold does not
do this: learned projectors sit at e(G) 0.6 to 1.0 on real models, above any threshold low enough to
matter, so every check refit every matrix for no gain. lsp.alpha, if set, is the spec's absolute rule
instead: refit above it.

Both run on a probe pass (the engine's: forward and backward over the sample with the observed
ProjectedLinears in probe mode, each batch's full gradient handed over in backward, in two halves
of its rows, and dropped, one matrix at a time). A fit learns the values on the fixed positions with
Adam: on each batch, up to fit_iterations // batches steps (at least one) on one half's gradient while the other
half (examples the fit has not seen) is the held-out gradient whose error stops the fit once it
stops falling (value_fit.ValueFit); the halves swap roles from batch to batch, and the pass ends
after the batch where the last fit stopped. The first fit starts from fresh values; a refit starts
warm, from the matrix's current values, which are its first held-out reading: a refit that cannot
beat them stops after that batch's first readings and keeps them bit for bit, and the matrix is left
exactly as it was (no fold, no moment transfer, no re-measure). A matrix whose values changed folds
Z into W (the old subspace's update goes into the weight) and its AdamW moments move into the new
subspace with the spec's formulas; the step counts go on; its error is measured again on the check
examples as its new baseline.

A block's matrices of one shape (q and o, k and v, gate and up) are fit together, in one ValueFit that
stacks them (optim/value_fit.py): each ends bit for bit where its own fit would, and one product (and one
fused Adam call) serves the members where there was one a matrix. Where they stack (the step works on
the gradients' factors), a member's gradient waits for the others' within the block's backward
(`_Handing`); a member that stops early is dropped from the stack.

The fit's ops run off the device meter after the first of each matrix shape (memory.TransientReplay:
its peak is counted once per shape and stands for the rest); a progress bar counts the matrices. The
gradients arrive as their factors dY, X and the fit works on them where that is quicker (optim/
factored_gradient.py); the first fit's passes skip the Z correction, which is zero before step 1.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from collections.abc import Callable

import torch

from slimtune.device import memory
from slimtune.optim import projectors, value_fit
from slimtune.optim.factored_gradient import Factors
from slimtune.optim.host_adam import HostAdam
from slimtune.engines.lsp.projected_linear import ProjectedLinear

# A batch's gradient in two halves of its rows, each as its factors dY, X (projected_linear.py) or, once
# summed over a tiled block's parts, as the product dY^T X.
Gradient = torch.Tensor | Factors
Halves = tuple[Gradient, Gradient | None]


class Collector:
    """Hands each matrix's full gradient of a batch (two halves) to its observer once it is complete,
    one at a time. A checkpointed block runs in tiles of tokens, so each of its matrices (`in_parts`)
    gets its gradient in parts: they are summed half by half, and such a matrix is complete when
    backward reaches another block, or ends (`finish`), as in updates.py; the others are observed as
    they come."""

    def __init__(self, blocks: list[int], observers: dict[int, Callable[[Halves], None]], in_parts: set[int]):
        self.blocks, self.observers, self.in_parts = blocks, observers, in_parts
        self.parts: dict[int, Halves] = {}
        self.block: int | None = None

    def take(self, index: int, halves: Halves) -> None:
        if self.block is not None and self.blocks[index] != self.block:
            self.finish()
        self.block = self.blocks[index]
        if index not in self.in_parts:
            self.observers[index](halves)
        elif index in self.parts:
            self.parts[index] = _sum_halves(self.parts[index], _formed(halves))
        else:
            self.parts[index] = _formed(halves)

    def finish(self) -> None:
        while self.parts:
            index = next(iter(self.parts))
            self.observers[index](self.parts.pop(index))
        self.block = None


def _formed(halves: Halves) -> Halves:
    """The halves as products dY^T X: a tiled block's parts are summed as they come, as before the factors
    (a part's factors are views of its tile's tensors; keeping them would keep every tile's rows)."""
    return tuple(h.dense() if isinstance(h, Factors) else h for h in halves)


def _sum_halves(into: Halves, more: Halves) -> Halves:
    first = into[0].add_(more[0])
    if into[1] is None or more[1] is None:  # a part of one row has no second half: it joins the first
        rest = [h for h in (into[1], more[1]) if h is not None]
        for h in rest:
            first.add_(h)
        return first, None
    return first, into[1].add_(more[1])


def whole(halves: Halves) -> torch.Tensor:
    """The batch's whole gradient dY^T X (in place into the first half, when it was formed already)."""
    first, second = _formed(halves)
    return first if second is None else first.add_(second)


class ProjectorLearning:
    def __init__(self, modules: list[ProjectedLinear], adams: list[HostAdam], settings, generator: torch.Generator,
                 rounding: torch.Generator | None, fake: bool, blocks: list[int] | None = None):
        """`settings`: the lsp section; `generator`: the draws of fresh values; `rounding`: the folds'
        stochastic rounding; `fake`: fake tensors (no values: nothing is measured or drawn); `blocks`: each
        matrix's block (a block's matrices of one shape are fit together), or None: each fit alone."""
        self.modules, self.adams, self.settings = modules, adams, settings
        self.blocks = blocks if blocks is not None else list(range(len(modules)))
        self.generator, self.rounding, self.fake = generator, rounding, fake
        self.fitted = False  # projectors learned (before step 1, or loaded from a checkpoint)
        self.baseline: list[float | None] = [None] * len(modules)  # e(G) on the sample just after each fit
        self.progress = False  # show the fit's progress bar (the training loop's choice)
        self.changed: list[int] = []  # the matrices the last check gave new projectors (folded, moments moved)

    def due(self, step_count: int) -> bool:
        every = self.settings.check_every
        return not self.fitted or bool(every and step_count % every == 0)

    def check(self, batches: list, probe_pass: Callable) -> dict:
        """Fit (first time) or check and refit the drifted; `probe_pass(batches, {matrix: observe(halves)})`
        runs the model. Returns the figures for the log."""
        with _zero_corrections(self.modules, not self.fitted and (self.fake or _all_zero(self.modules))):
            return self._check(batches, probe_pass)

    def _check(self, batches: list, probe_pass: Callable) -> dict:
        began, cpu_began = time.perf_counter(), time.process_time()
        extras, chosen, errors = {}, list(range(len(self.modules))), None
        self.changed = []
        checked = self.check_batches(batches)
        if self.fitted:
            errors = self.measure(checked, probe_pass)
            chosen = self.drifted(errors)
            finite = [e for e in errors if math.isfinite(e)]
            extras = {"lsp_error_mean": sum(finite) / len(finite) if finite else float("nan"),
                      "lsp_error_max": max(finite, default=float("nan"))}
        if chosen:
            extras["lsp_fit_steps"], changed = self.refit(self.fit_batches(batches, checked), chosen, probe_pass)
            self.changed = changed
            extras["lsp_refit_kept"] = len(chosen) - len(changed)
            self._new_baselines(chosen, changed, errors if self.fitted else None, checked, probe_pass)
            finite = [self.baseline[i] for i in chosen if self.baseline[i] is not None]
            if finite:
                extras["lsp_fit_error_mean"] = sum(finite) / len(finite)
        extras["lsp_refit"] = len(chosen)
        extras["lsp_check_s"] = time.perf_counter() - began
        # The process's CPU seconds beside the wall time: on shared cores the wall time counts other work too.
        extras["lsp_check_cpu_s"] = time.process_time() - cpu_began
        self.fitted = True
        return extras

    def _new_baselines(self, chosen: list[int], changed: list[int], errors: list[float] | None, checked: list,
                       probe_pass: Callable) -> None:
        """Each fit matrix's error just after its fit, on the check examples: measured again (one more pass)
        for those whose projectors changed; one that kept its values takes this check's reading, made on the
        same examples with the same projectors and weights (up to the rounding of other matrices' folds), so
        when no matrix changed no pass is run."""
        after = dict(zip(changed, self.measure(checked, probe_pass, changed))) if changed else {}
        for index in chosen:
            error = after[index] if index in after else errors[index]
            self.baseline[index] = error if math.isfinite(error) else None

    def check_batches(self, batches: list) -> list:
        """The sample's first batches holding lsp.check_samples examples (rows): what every check and
        every baseline measures on. The same examples each time, so a change in e(G) is the weights'
        doing, not the draw's; one batch of 8 by default, a quarter of the default sample of 32."""
        taken, rows = [], 0
        for batch in batches:
            if rows >= self.settings.check_samples:
                break
            taken.append(batch)
            rows += batch.input_ids.shape[0]
        return taken

    @staticmethod
    def fit_batches(batches: list, checked: list) -> list:
        """The batches a fit learns on: the sample's batches after the check examples, so that every baseline
        and every check reads e(G) on examples no fit has seen. Measured where the fit had trained, a
        baseline carries the fit's own advantage on those examples, which fades as the weights move and
        reads as drift (benchmarks/docs/lsp_fit.md, run 5). A sample with no batch beyond the check
        examples (the planner's estimate on the step's own batches; tiny samples) is fit whole, as before."""
        return batches[len(checked):] or batches

    def drifted(self, errors: list[float]) -> list[int]:
        """The matrices to refit: above lsp.alpha when it is set; otherwise those whose error grew past
        its baseline by the margin lsp.drift (a matrix with no baseline, as after a resume from a
        checkpoint that has none, takes this check's error as its baseline)."""
        alpha, margin = self.settings.alpha, self.settings.drift
        if alpha > 0:
            return [i for i, e in enumerate(errors) if e > alpha]
        chosen = []
        for index, error in enumerate(errors):
            if self.baseline[index] is None:
                self.baseline[index] = error if math.isfinite(error) else None
            elif error > self.baseline[index] * (1 + margin):
                chosen.append(index)
        return chosen

    def measure(self, batches: list, probe_pass: Callable, which: list[int] | None = None) -> list[float]:
        """e(G) of the matrices' projectors (all, or `which`) over the sample's gradients (energy-weighted)."""
        which = list(range(len(self.modules))) if which is None else which
        sums: dict[int, torch.Tensor] = {}  # per matrix: its residual and its energy, summed over the batches
        replay = memory.TransientReplay()  # the reading's peak counted once per shape, as the fits' are

        def observe(index: int, halves: Halves) -> None:
            module, grad = self.modules[index], whole(halves)
            into = sums.setdefault(index, grad.new_zeros(2))
            key = (tuple(grad.shape), module.d, module.p_o.r, grad.dtype)
            replay.run(key, grad, _add_squared_residual, into, grad, module)

        probe_pass(batches, {i: functools.partial(observe, i) for i in which})
        if self.fake:
            return [float("nan")] * len(which)
        return [math.sqrt(max(float(res / tot), 0.0)) if float(tot) > 0 else 0.0
                for res, tot in (sums[i] if i in sums else (0.0, 0.0) for i in which)]

    def refit(self, batches: list, chosen: list[int], probe_pass: Callable) -> tuple[int, list[int]]:
        """New values for the chosen matrices' projectors: fresh at the first fit, from their current values
        after it (warm). A matrix whose values changed folds Z into W, then its moments move into the new
        subspace; one whose fit kept its values exactly (no held-out reading beat the start) is left as it
        is. Returns the fit's Adam steps, summed over the matrices, and the matrices that changed."""
        steps = max(1, self.settings.fit_iterations // len(batches))  # lsp.fit_iterations is the most a fit takes
        # Starting values drawn matrix by matrix, as when every matrix was fit on its own.
        starts = {i: value_fit.start(self.modules[i].p_o, self.modules[i].p_i, self.generator, fresh=not self.fake,
                                     warm=self.fitted) for i in chosen}
        fits: dict[int, tuple[value_fit.ValueFit, int]] = {}  # matrix -> its fit and its place among the members
        for group in self.groups(chosen):
            fit = value_fit.ValueFit([self.modules[i].p_o for i in group], [self.modules[i].p_i for i in group],
                                     self.settings.fit_lr, steps, self.generator, starts=[starts[i] for i in group])
            fits.update((i, (fit, member)) for member, i in enumerate(group))
        del starts  # (a fit of several matrices copied them into its stack)
        bar = _bar(len(chosen) * len(batches), f"lsp: fitting {len(chosen)} matrices' projectors",
                   self.progress and not self.fake)
        handing = _Handing(self.modules, self.blocks, fits, len(batches), bar)

        def finished() -> bool:
            handing.flush()  # a batch is over: no member of it is still to come
            # Once every fit has stopped (held-out error no longer falling) the sample's other batches are not run.
            return not self.fake and all(fit.done for fit, _ in fits.values())

        try:
            probe_pass(batches, {i: functools.partial(handing.observe, i) for i in fits}, finished)
            handing.flush()
        finally:
            bar.close()
        # Folded in matrix order: a bf16 fold draws its rounding, so ranks that changed the same matrices
        # fold them alike only if the order is the set's, not the fits' (which follows each rank's choice).
        changed = sorted(i for i, (fit, member) in fits.items() if not self._kept(i, fit, member))
        for index in changed:
            fit, member = fits[index]
            self._adopt(index, fit.pair(member))
        iterations = sum(fit.iterations for fit in {id(f): f for f, _ in fits.values()}.values())
        return iterations, changed

    def groups(self, chosen: list[int]) -> list[list[int]]:
        """The chosen matrices in fits: those of one block and one shape (its q and o, k and v, gate and up)
        together, in the order of their first matrix. Their gradients arrive in the same backward of the
        block, so a member waits at most for the rest of that block's backward for the others."""
        together: dict[tuple, list[int]] = {}
        for index in chosen:
            module = self.modules[index]
            shape = (module.p_o.n, module.p_i.n, module.d, module.p_o.r, module.p_o.val.dtype, module.p_o.val.device)
            together.setdefault((self.blocks[index], shape), []).append(index)
        return list(together.values())

    def _kept(self, index: int, fit: value_fit.ValueFit, member: int) -> bool:
        """The warm fit of matrix `index` ended on its starting values, bit for bit (never under fake
        tensors: the planner's estimate counts the adoption's memory)."""
        module, (o, i) = self.modules[index], fit.params[member]
        return (not self.fake and self.fitted and torch.equal(o, module.p_o.val) and torch.equal(i, module.p_i.val))

    def _adopt(self, index: int, new: tuple[projectors.SparseProjector, projectors.SparseProjector]) -> None:
        """Matrix `index` takes the new projectors: Z (and the decay's scale) into W, moments moved."""
        module, views = self.modules[index], self.adams[index].member(0, 0)
        old = (module.p_o, module.p_i)
        module.fold(self.rounding)
        device = module.z.device
        with torch.no_grad():
            views.master.zero_()
            moments = projectors.reproject_moments(views.exp_avg.to(device), views.exp_avg_sq.to(device), old, new)
            views.exp_avg.copy_(moments[0])
            views.exp_avg_sq.copy_(moments[1])
        module.p_o, module.p_i = new


class _Handing:
    """A refit's gradients handed to the fits: each matrix's halves of a batch, the first and second half
    taking turns as the one fit on, to its fit; the members of a stacked fit (a block's matrices of one
    shape, ValueFit.stacks) wait for each other within the block's backward. Whatever waits is handed over
    when the backward reaches another block or the batch ends (`flush`), as far as it came: a matrix whose
    gradient never comes (one the forward passed by) holds no other back. Each handing runs under the
    meter's replay (the fit's peak counted once per shape of what is handed); a member that stops
    probes no more, and the bar counts the batches each matrix no longer needs."""

    def __init__(self, modules: list[ProjectedLinear], blocks: list[int], fits: dict, batches: int, bar):
        self.modules, self.blocks, self.fits, self.batches, self.bar = modules, blocks, fits, batches, bar
        self.seen = dict.fromkeys(fits, 0)
        self.waiting: dict[int, tuple[value_fit.ValueFit, int, dict]] = {}  # id(fit) -> (fit, block, arrived)
        self.replay = memory.TransientReplay()

    def observe(self, index: int, halves: Halves) -> None:
        fit_on, held_out = halves if self.seen[index] % 2 == 0 or halves[1] is None else halves[::-1]
        self.seen[index] += 1
        self.flush(but_block=self.blocks[index])
        fit, member = self.fits[index]
        _, _, arrived = self.waiting.setdefault(id(fit), (fit, self.blocks[index], {}))
        arrived[member] = (index, fit_on, held_out)
        if fit.stacks(fit_on) and len(arrived) < fit.members - sum(fit.stopped):
            return  # the other members' gradients of this batch come later in this block's backward
        self._hand(id(fit))

    def flush(self, but_block: int | None = None) -> None:
        """Hand over what waits, but for the fits of `but_block`."""
        for waiting in [key for key, (_, block, _) in self.waiting.items() if block != but_block]:
            self._hand(waiting)

    def _hand(self, waiting: int) -> None:
        fit, _, arrived = self.waiting.pop(waiting)
        given = {b: (f, h) for b, (_, f, h) in sorted(arrived.items())}
        tensors = tuple(t for f, h in given.values() for t in _tensors(f) + _tensors(h))
        module = self.modules[next(iter(arrived.values()))[0]]
        key = (tuple(tuple(t.shape) for t in tensors), module.d, module.p_o.r, tensors[0].dtype)
        # The given tensors exist already (the meter tracks them): not the fit's transient.
        self.replay.run(key, tensors[0], lambda *_: fit.observe_all(given), *tensors)
        for member, (index, _, _) in arrived.items():
            if fit.stopped[member]:  # its later gradients would be passed over: not made at all
                _stop_probing(self.modules[index])
                self.bar.update(self.batches - self.seen[index] + 1)  # this batch and the ones it no longer needs
            else:
                self.bar.update(1)


@contextlib.contextmanager
def _zero_corrections(modules: list[ProjectedLinear], zero: bool):
    """The first fit runs before any update has reached Z: its passes skip each matrix's correction
    (ProjectedLinear.z_is_zero), a flag the fake pass takes alike (it cannot read Z). Folds keep Z zero."""
    for module in modules:
        module.z_is_zero = zero
    try:
        yield
    finally:
        for module in modules:
            module.z_is_zero = False


def _all_zero(modules: list[ProjectedLinear]) -> bool:
    """Z is zero in every matrix: true before step 1 (Z starts at zero, and a checkpoint is written with Z
    folded); checked, not assumed, where values exist."""
    return all(not bool(module.z.detach().any()) for module in modules)


def _add_squared_residual(into: torch.Tensor, grad: torch.Tensor, module: ProjectedLinear) -> None:
    """into += (the residual of grad off the module's projectors, grad's energy), squared, in place: a
    reading leaves the memory as it found it (memory.TransientReplay)."""
    total = grad.pow(2).sum()
    into[0].add_(projectors.fast_squared_residual(grad, module.p_o, module.p_i, total))
    into[1].add_(total)


def _tensors(gradient: Gradient | None) -> tuple[torch.Tensor, ...]:
    if gradient is None:
        return ()
    return gradient.tensors() if isinstance(gradient, Factors) else (gradient,)


def _stop_probing(module: ProjectedLinear) -> None:
    """The rest of the pass runs `module` as a frozen linear: no gradient halves, no saved input, no dZ; and where every matrix below it is done too, or not observed,
    autograd no longer runs the backward down there at all (nothing below requires grad: the engine's pass
    freezes every other parameter). The pass restores probe mode and Z's requires_grad when it ends."""
    module.probe = None
    module.z.requires_grad_(False)


def _bar(total: int, what: str, enabled: bool):
    """A bar like the training loop's (a refresh every 30 s into a log file or pipe)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=what, unit="fit", disable=not enabled, dynamic_ncols=True, leave=False,
                mininterval=0.1 if sys.stderr.isatty() else 30.0)
