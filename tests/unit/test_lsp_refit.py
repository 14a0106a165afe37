"""Engine lsp's refits start warm (issue 32 item 4): a refit starts from the matrix's current projector
values, which count as its first held-out reading, so a refit that cannot beat them keeps them bit for
bit and leaves the matrix exactly as it was (projectors, Z, W, moments, step count, the folds' random
draws), with no fold, no moment transfer and no re-measuring pass; the refit's pass ends with the
batch where the last fit stopped. float64 throughout."""

import math

import pytest
import torch

from test_lsp import _NoReading, model_of, run_cfg
from test_projectors import gradient_set, pair
from test_slide import batches
from slimtune.engines.lsp import learning
from slimtune.engines.lsp.engine import LspConfig, LspEngine
from slimtune.model.stack import Stack
from slimtune.optim import projectors as pj
from slimtune.optim import value_fit as vf

CPU = torch.device("cpu")
F64 = torch.float64


def held_out_error(fit_pair, h: torch.Tensor) -> float:
    return pj.relative_error(h, *fit_pair)


def test_a_warm_fit_starts_from_the_pairs_values_and_never_ends_worse_on_its_held_out_rows():
    """From a learned-looking start (a fit on other gradients) and from a poor one (random sparse):
    the warm fit's values start as copies of the pair's (the pair untouched), and the values it ends
    with are no worse on the held-out gradient than the start; from the poor start it improves."""
    train, held = gradient_set(1, seed=1)[0], gradient_set(1, seed=2)[0]
    learned = vf.ValueFit(*pair(seed=5), lr=0.05, steps=60, generator=torch.Generator().manual_seed(6))
    for grad in gradient_set(4, seed=3):
        learned.observe(grad)
    for start in (learned.pair(), pair(seed=7)):
        kept = [p.val.clone() for p in start]
        fit = vf.ValueFit(*start, lr=0.05, steps=60, generator=torch.Generator().manual_seed(8), warm=True)
        assert all(torch.equal(v, p.val) and v.data_ptr() != p.val.data_ptr() for v, p in zip(fit.values, start))
        fresh = vf.ValueFit(*start, lr=0.05, steps=60, generator=torch.Generator().manual_seed(8))
        assert not torch.equal(fresh.values[0], start[0].val)  # what warm=False would start from
        fit.observe(train, held)
        assert all(torch.equal(p.val, k) for p, k in zip(start, kept))
        assert held_out_error(fit.pair(), held) <= held_out_error(start, held) + 1e-12
    assert held_out_error(fit.pair(), held) < 0.9 * held_out_error(start, held)  # the poor start: it gains


def test_a_warm_fit_that_cannot_beat_its_start_stops_at_its_first_readings_and_keeps_it_bit_for_bit():
    """A learning rate of 10 overshoots at every step: the readings after the start never beat it, the
    fit is done after two of them (CHECK_EVERY * 2 steps, not the 100 offered) and its values are the
    start's, bit for bit, though its steps moved them."""
    start = pair(seed=5)
    fit = vf.ValueFit(*start, lr=10.0, steps=100, generator=torch.Generator().manual_seed(8), warm=True)
    moved = []
    step = fit.step

    def recorded(*args):
        step(*args)
        moved.append(not torch.equal(fit.values[0], start[0].val))

    fit.step = recorded
    train, held = gradient_set(1, seed=1)[0], gradient_set(1, seed=2)[0]
    fit.observe(train, held)
    assert fit.done and fit.iterations == 2 * vf.ValueFit.CHECK_EVERY and all(moved)
    assert all(torch.equal(v, p.val) for v, p in zip(fit.values, start))
    assert fit.held_out_error == pytest.approx(held_out_error(start, held), rel=1e-9)


def engine_state(engine: LspEngine) -> list:
    engine.flush()
    state = []
    for module, adam in zip(engine.modules, engine.adams):
        views = adam.member(0, 0)
        state.append([t.detach().clone() for t in (module.p_o.pos, module.p_o.val, module.p_i.pos, module.p_i.val,
                                                   module.z, module.weight, views.master, views.exp_avg,
                                                   views.exp_avg_sq)] + [module.scale, float(adam.state(0)["step"])])
    return state + [engine.learning.rounding.get_state().clone() if engine.learning.rounding else None]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class PassCounter:
    """The engine's probe passes, each as (matrices observed, batches run, batches offered)."""

    def __init__(self, engine: LspEngine):
        self.passes, self.probe = [], engine._probe_pass

    def __call__(self, batches_, observers, finished=None):
        ran = [0]

        def after_batch():
            ran[0] += 1
            return finished() if finished is not None else False

        self.probe(batches_, observers, after_batch)
        self.passes.append((len(observers), ran[0], len(batches_)))


def test_a_refit_that_cannot_improve_leaves_the_matrix_exactly_as_it_was():
    """alpha tiny: every matrix is chosen at the check after two training steps (Z and the moments are
    not zero); lsp.fit_lr 10 overshoots, so every fit keeps its start. The whole state is bit-identical
    to before the check (a fold would change W, a moment transfer the moments, a fresh start the
    projectors), the check runs two passes (measure on the first of the sample's three batches, refit on
    the other two: no re-measure), the refit's ends after its first batch, and each baseline is the
    check's own reading."""
    model = model_of()
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=2, alpha=1e-9, fit_iterations=60, fit_lr=10.0, check_samples=2), measure_memory=False)
    engine = LspEngine(Stack(model), cfg, CPU, "fp64")
    engine.use_sample(batches(model.config.vocab_size, 50, micro=3))
    for step in range(2):
        engine.step(batches(model.config.vocab_size, step))
    before = engine_state(engine)
    assert all(torch.count_nonzero(s[4]) > 0 and torch.count_nonzero(s[7]) > 0 for s in before[:-1])
    counter = PassCounter(engine)
    extras = engine.learning.check(engine.sample, counter)
    assert extras["lsp_refit"] == extras["lsp_refit_kept"] == len(engine.modules)
    assert same(engine_state(engine), before)
    assert counter.passes == [(len(engine.modules), 1, 1), (len(engine.modules), 1, 2)]
    measured = learning.ProjectorLearning.measure(engine.learning, engine.learning.check_batches(engine.sample),
                                                  engine._probe_pass)
    assert engine.learning.baseline == measured  # the same examples, projectors and weights: the same numbers


def test_a_warm_refit_starts_from_the_current_values_and_the_first_fit_from_fresh_ones(monkeypatch):
    """Every fit's starting values, recorded: the first fit's differ from the engine's initial random
    projectors; at the check after two steps every refit starts from the values the first fit left.
    The refits that changed their values are folded and measured again (three passes)."""
    by_positions = {}  # a matrix's starting values, by its positions tensor (a fit may hold several matrices)

    class Recorded(vf.ValueFit):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for member, values in enumerate(self.params):
                by_positions[id(self.given[0][member])] = [v.clone() for v in values]

    monkeypatch.setattr(learning.value_fit, "ValueFit", Recorded)
    model = model_of()
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=2, alpha=1e-9, fit_iterations=20), measure_memory=False)
    engine = LspEngine(Stack(model), cfg, CPU, "fp64")
    engine.use_sample(batches(model.config.vocab_size, 50, micro=2))
    initial = [(m.p_o.val.clone(), m.p_i.val.clone()) for m in engine.modules]
    engine.step(batches(model.config.vocab_size, 0))
    first = [(m.p_o.val.clone(), m.p_i.val.clone()) for m in engine.modules]
    starts = [by_positions[id(m.p_o.pos)] for m in engine.modules]
    assert len(by_positions) == len(engine.modules)
    assert not any(torch.equal(s[0], o) or torch.equal(s[1], i) for s, (o, i) in zip(starts, initial))
    by_positions.clear()
    engine.step(batches(model.config.vocab_size, 1))
    counter = PassCounter(engine)
    extras = engine.learning.check(engine.sample, counter)
    starts = [by_positions[id(m.p_o.pos)] for m in engine.modules]
    assert len(by_positions) == len(engine.modules)
    assert all(torch.equal(s[0], o) and torch.equal(s[1], i) for s, (o, i) in zip(starts, first))
    changed = len(engine.modules) - extras["lsp_refit_kept"]
    assert changed > 0 and len(counter.passes) == 3 and counter.passes[2][0] == changed
    assert all(b is not None and math.isfinite(b) for b in engine.learning.baseline)


def test_a_done_fit_stops_its_matrix_probing_and_every_fit_ends_as_it_would_have():
    """The first fit over a sample of four batches, where fits stop at different batches: with a done
    fit's matrix taken out of probe mode for the rest of the pass, no fit is handed a gradient after it
    is done (the reference pass, keeping every matrix probing, hands some), and every projector and
    baseline equals the reference's bit for bit (float64)."""
    def first_fit(stop_probing) -> tuple[list, list, list]:
        handed_when_done = []

        class Counted(vf.ValueFit):
            def observe_all(self, given):
                handed_when_done.extend(self.stopped[member] for member in given)
                super().observe_all(given)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(learning.value_fit, "ValueFit", Counted)
            patch.setattr(learning, "_stop_probing", stop_probing)
            model = model_of()
            cfg = run_cfg(LspConfig(d=8, r=3, fit_iterations=80, check_samples=2), measure_memory=False)
            engine = LspEngine(Stack(model), cfg, CPU, "fp64")
            engine.use_sample(batches(model.config.vocab_size, 50, micro=4))
            engine.learning.check(engine.sample, engine._probe_pass)
        values = [(m.p_o.val.clone(), m.p_i.val.clone()) for m in engine.modules]
        probing = [(m.probe, m.z.requires_grad) for m in engine.modules]
        assert all(p is None and wants for p, wants in probing)  # the pass restored every matrix
        return values, list(engine.learning.baseline), handed_when_done

    reference = first_fit(lambda module: None)
    stopped = first_fit(learning._stop_probing)
    assert any(reference[2]) and not any(stopped[2])
    assert same([list(v) for v in stopped[0]], [list(v) for v in reference[0]]) and stopped[1] == reference[1]


class BatchRecorder:
    """The engine's probe passes, each as the positions in the sample of the batches it was offered."""

    def __init__(self, engine: LspEngine):
        self.offered, self.engine, self.probe = [], engine, engine._probe_pass
        engine._probe_pass = self

    def __call__(self, batches_, observers, finished=None):
        self.offered.append([next(k for k, b in enumerate(self.engine.sample) if b is given) for given in batches_])
        return self.probe(batches_, observers, finished)


def test_the_fits_learn_only_on_the_batches_after_the_check_examples():
    """Every baseline and every check read e(G) on examples no fit learned on: with lsp.check_samples
    the first batch's rows, the first fit is offered the sample's other two batches and its baseline is
    read on the first; a check (alpha tiny: every matrix refit) measures on the first, fits on the
    other two and measures the changed matrices on the first again. A sample with nothing beyond the
    check examples is fit whole."""
    model = model_of()
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=2, alpha=1e-9, fit_iterations=20, check_samples=2),
                  measure_memory=False)
    engine = LspEngine(Stack(model), cfg, CPU, "fp64")
    engine.use_sample(batches(model.config.vocab_size, 50, micro=3))
    recorder = BatchRecorder(engine)
    engine.step(batches(model.config.vocab_size, 0))
    assert recorder.offered == [[1, 2], [0]]
    engine.step(batches(model.config.vocab_size, 1))
    recorder.offered.clear()
    engine.step(batches(model.config.vocab_size, 2))  # the check at step count 2
    assert recorder.offered == [[0], [1, 2], [0]]
    whole = LspEngine(Stack(model_of()), cfg, CPU, "fp64")
    whole.use_sample(batches(model.config.vocab_size, 50, micro=1))
    recorder = BatchRecorder(whole)
    whole.step(batches(model.config.vocab_size, 0))
    assert recorder.offered == [[0], [0]]


def test_a_baseline_read_after_the_fit_on_unseen_examples_equals_a_fresh_measure_there():
    """The first fit's baselines are e(G) of the new projectors on the check batch, which the fit never
    saw: measured again by hand on that batch alone they are the same numbers (float64)."""
    model = model_of()
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=0, fit_iterations=20, check_samples=2), measure_memory=False)
    engine = LspEngine(Stack(model), cfg, CPU, "fp64")
    sample = batches(model.config.vocab_size, 50, micro=3)
    engine.use_sample(sample)
    engine.learning.check(engine.sample, engine._probe_pass)
    assert engine.learning.baseline == engine.learning.measure(sample[:1], engine._probe_pass)


def test_a_blocks_matrices_of_one_shape_fit_together_as_each_would_alone():
    """Issue 32 item 3: the engine fits a block's matrices of one shape in one ValueFit (q and o, k and v,
    gate and up), stacked where the step works on the factors (taken here whatever the shapes say). The
    first fit and the refits at a later check end bit for bit where fitting every matrix on its own ends
    (float64): projectors, baselines, Adam steps, the matrices kept; and they were grouped and stacked."""
    def run(alone: bool):
        sizes, handed = [], []
        with pytest.MonkeyPatch.context() as patch:
            grouped, observe_all = learning.ProjectorLearning.groups, vf.ValueFit.observe_all
            patch.setattr(vf, "factored_is_cheaper", lambda *shape: True)  # the route on which members stack
            patch.setattr(vf.ValueFit, "observe_all",
                          lambda self, given: handed.append(len(given)) or observe_all(self, given))
            patch.setattr(learning.ProjectorLearning, "groups",
                          lambda self, chosen: sizes.append([len(g) for g in grouped(self, chosen)]) or
                          ([[i] for i in chosen] if alone else grouped(self, chosen)))
            model = model_of()
            cfg = run_cfg(LspConfig(d=8, r=3, check_every=2, drift=0.0, fit_iterations=40, check_samples=2),
                          measure_memory=False)
            engine = LspEngine(Stack(model), cfg, CPU, "fp64")
            engine.use_sample(batches(model.config.vocab_size, 50, micro=4))
            logs = [engine.step(batches(model.config.vocab_size, s)) for s in range(4)]
        values = [(m.p_o.val.clone(), m.p_i.val.clone()) for m in engine.modules]
        fitted = [{k: v for k, v in log.extras.items() if k.startswith("lsp_") and not k.endswith("_s")}
                  for log in logs]
        return values, list(engine.learning.baseline), fitted, sizes, handed

    together, alone = run(alone=False), run(alone=True)
    assert any(size > 1 for sizes in together[3] for size in sizes)  # grouped, at the first fit and the refits
    assert max(together[4]) == 2 and max(alone[4]) == 1  # and stacked
    assert len(together[3]) >= 2 and together[2][0]["lsp_fit_steps"] > 0
    assert all(torch.equal(a, b) for mine, theirs in zip(together[0], alone[0]) for a, b in zip(mine, theirs))
    assert together[1] == alone[1] and together[2] == alone[2]


def test_a_member_whose_gradient_never_comes_holds_no_other_back():
    """A block's q waits for its o (fit together); here o's gradients are never handed over (as a matrix the
    forward passed by would give none). q is handed on alone when the backward reaches the next block or the
    batch ends, and every matrix ends bit for bit where it ends with each matrix fit alone."""
    def first_fit(alone: bool):
        handed = []
        with pytest.MonkeyPatch.context() as patch:
            grouped, observe_all = learning.ProjectorLearning.groups, vf.ValueFit.observe_all
            patch.setattr(vf, "factored_is_cheaper", lambda *shape: True)  # the route on which members stack
            if alone:
                patch.setattr(learning.ProjectorLearning, "groups", lambda self, chosen: [[i] for i in chosen])
            patch.setattr(vf.ValueFit, "observe_all",
                          lambda self, given: handed.append((self.members, len(given))) or observe_all(self, given))
            model = model_of()
            cfg = run_cfg(LspConfig(d=8, r=3, fit_iterations=40, check_samples=2), measure_memory=False)
            engine = LspEngine(Stack(model), cfg, CPU, "fp64")
            engine.use_sample(batches(model.config.vocab_size, 50, micro=4))
            pairs = [g for g in grouped(engine.learning, list(range(len(engine.modules)))) if len(g) == 2]
            dropped = pairs[0][1]  # the later of a pair in forward order: its gradient comes first in backward
            probe = engine._probe_pass

            def dropping(batches_, observers, finished=None):
                return probe(batches_, {**observers, dropped: lambda halves: None}, finished)

            engine._probe_pass = dropping
            engine.learning.check(engine.sample, engine._probe_pass)
        return [(m.p_o.val.clone(), m.p_i.val.clone()) for m in engine.modules], handed

    together, alone = first_fit(alone=False), first_fit(alone=True)
    assert any(members == 2 and count == 2 for members, count in together[1])  # pairs were stacked
    assert any(members == 2 and count == 1 for members, count in together[1])  # and the one left waiting went alone
    assert all(torch.equal(a, b) for mine, theirs in zip(together[0], alone[0]) for a, b in zip(mine, theirs))
