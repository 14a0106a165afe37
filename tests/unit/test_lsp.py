"""Engine lsp against plain PyTorch in float64 (spec lsp-offload.md 5): with fixed projectors, 20 steps
equal torch.optim.Adam on Z with W = W0 + P_o Z P_i^T; the pipelined schedule gives bitwise the
weights of the synchronous one, also with random sleeps in the host jobs; pending updates are applied
before evaluation and checkpoints; the link moves 2 x sum d^2 x 4 bytes a step and the host AdamW
updates sum d^2 numbers; a refit carries the moments into the new subspace (never zeroed, step counts
kept); resume is exact; bf16 weights keep 1,000 small updates."""

import contextlib
import copy
import random
import time

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from conftest import engine_config, tiny_config
from test_slide import batches
from test_slide import model_of as slide_model_of
from slimtune.store import checkpoint
from slimtune.planning import estimate
from slimtune.config import TrainConfig
from slimtune.data.dataset import IGNORE_INDEX
from slimtune.engines import settings
from slimtune.engines.lsp.engine import LspConfig, LspEngine
from slimtune.model.stack import Stack
from slimtune.optim import projectors, rules
from slimtune.engines.lsp.projected_linear import ProjectedLinear

CPU = torch.device("cpu")
F64 = torch.float64


def model_of(layers=2, **kw) -> nn.Module:
    return slide_model_of(layers=layers, **kw)


def run_cfg(lsp: LspConfig | None = None, **train):
    base = dict(steps=20, batch_size=2, grad_accum=2, lr=5e-3, warmup_steps=2, schedule="cosine", max_grad_norm=0.0)
    return engine_config(TrainConfig(**{**base, **train}), engine="lsp", method="full",
                         sections={"lsp": lsp or LspConfig(d=8, r=3, check_every=0, fit_iterations=3)})


def fixed_projector_engine(model, cfg, precision="fp64") -> LspEngine:
    """An engine whose random projectors are never refit: the oracle's setting."""
    engine = LspEngine(Stack(model), cfg, CPU, precision)
    engine.learning.fitted = True
    return engine


def adam_on_z(model: nn.Module, engine: LspEngine, cfg, steps: int, train_other: bool):
    """Plain PyTorch: every projected W is s W0 + P_o Z P_i^T with Z a torch AdamW parameter (the run's
    weight decay) and s the product of the steps' decoupled decay factors (1 - lr wd): AdamW's decay of
    the whole effective weight. The rest frozen, or trained by AdamW with decay on matrices only (as
    rules.decay_groups); dense autograd, F.cross_entropy, clip_grad_norm_."""
    names = {engine.names[id(m.weight)]: m for m in engine.modules}
    frozen = {n: p.detach() for n, p in model.named_parameters()}
    dense = {n: (m.p_o.dense(), m.p_i.dense()) for n, m in names.items()}
    zs = {n: torch.zeros(m.z.shape, dtype=F64, requires_grad=True) for n, m in names.items()}
    others = [p for n, p in model.named_parameters() if n not in names] if train_other else []
    for n, p in model.named_parameters():
        p.requires_grad_(n not in names and train_other)
    wd = cfg.train.weight_decay
    opt = torch.optim.AdamW([{"params": list(zs.values()), "weight_decay": wd}]
                            + [{"params": [p], "weight_decay": wd if p.ndim >= 2 else 0.0} for p in others],
                            lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps)
    losses, scale = [], 1.0
    for step in range(steps):
        micro = batches(model.config.vocab_size, step, cfg.train.grad_accum)
        total = sum(b.num_targets for b in micro)
        loss_sum = 0.0
        for batch in micro:
            weights = {n: scale * frozen[n] + o @ zs[n] @ i.T for n, (o, i) in dense.items()}
            logits = functional_call(model, weights, (batch.input_ids,), {"position_ids": batch.position_ids}).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            (loss / total).backward()
            loss_sum += float(loss.detach())
        if cfg.train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(zs.values()) + others, cfg.train.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = rules.lr_at(cfg.train, step)
        opt.step()
        scale *= 1.0 - rules.lr_at(cfg.train, step) * wd
        opt.zero_grad()
        losses.append(loss_sum / total)
    with torch.no_grad():
        effective = {n: scale * frozen[n] + o @ zs[n] @ i.T for n, (o, i) in dense.items()}
        effective.update((n, p.detach()) for n, p in model.named_parameters() if n not in names and train_other)
    return losses, effective


@pytest.mark.parametrize("clip", [pytest.param(0.0, id="unclipped"), pytest.param(0.05, id="clipped", marks=pytest.mark.quick)])
@pytest.mark.parametrize("train_other", [False, True], ids=["blocks-only", "train-other"])
def test_twenty_steps_with_fixed_projectors_equal_adam_on_z(clip, train_other):
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=0, train_other=train_other), max_grad_norm=clip)
    model = model_of()
    engine = fixed_projector_engine(copy.deepcopy(model), cfg)
    results = [engine.step(batches(model.config.vocab_size, step, cfg.train.grad_accum)) for step in range(20)]
    losses, expected = adam_on_z(model, engine, cfg, 20, train_other)
    assert [r.loss for r in results] == pytest.approx(losses, abs=1e-10, rel=0)
    trained = engine.trainable_state()
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, atol=1e-10, rtol=0, msg=name)
    moved = max(float((expected[n] - p).abs().max()) for n, p in model.named_parameters() if n in expected)
    assert moved > 1e-3  # the steps did train


@pytest.mark.parametrize("clip", [pytest.param(0.0, id="unclipped"), pytest.param(0.05, id="clipped")])
def test_twenty_steps_with_weight_decay_equal_adamw_on_the_effective_weight(clip):
    """Decoupled decay of s W0 + P_o Z P_i^T (s and Z both times 1 - lr wd a step), random sparse
    projectors, the others trained with decay on their matrices: the oracle's recurrence to 1e-10;
    and the decay shows (the weights differ from the same run without it by far more than that)."""
    model = model_of()
    trained = {}
    for wd in (0.5, 0.0):
        cfg = run_cfg(LspConfig(d=8, r=3, check_every=0, train_other=True), max_grad_norm=clip, weight_decay=wd,
                      measure_memory=False)
        engine = fixed_projector_engine(copy.deepcopy(model), cfg)
        results = [engine.step(batches(model.config.vocab_size, step, cfg.train.grad_accum)) for step in range(20)]
        trained[wd] = engine.trainable_state()
        if wd:
            losses, expected = adam_on_z(copy.deepcopy(model), engine, cfg, 20, train_other=True)
            assert [r.loss for r in results] == pytest.approx(losses, abs=1e-10, rel=0)
            for name, value in expected.items():
                torch.testing.assert_close(trained[wd][name], value, atol=1e-10, rtol=0, msg=name)
    projected = [engine.names[id(m.weight)] for m in engine.modules]
    assert min(float((trained[0.5][n] - trained[0.0][n]).abs().max()) for n in projected) > 1e-4


def signed_permutation(n: int, g: torch.Generator) -> projectors.SparseProjector:
    """An n x n projector with one +-1 in each row and each column: orthogonal, so P_o Z P_i^T reaches
    every weight and each entry of Z is one entry of W (up to sign)."""
    signs = torch.randint(0, 2, (n, 1), generator=g).to(F64) * 2 - 1
    return projectors.SparseProjector(torch.randperm(n, generator=g).unsqueeze(1), signs, n)


@pytest.mark.parametrize("schedule", ["pipelined", "sync"])
def test_weight_decay_where_the_subspace_is_the_whole_space_equals_torch_adamw(schedule):
    """Square matrices, d = n, r = 1 and signed-permutation projectors: every gradient lies in the
    subspace and Adam on Z is Adam on W entry by entry, so 20 lsp steps with weight decay must equal
    torch.optim.AdamW with the same decay on the dense weights (resident full fine-tuning of the block
    linears, the rest frozen), losses and weights to 1e-10."""
    wd = 0.5
    cfg = run_cfg(LspConfig(d=32, r=1, check_every=0, schedule=schedule), weight_decay=wd, max_grad_norm=0.05,
                  measure_memory=False)
    model = model_of(intermediate_size=32, num_key_value_heads=4)
    engine = fixed_projector_engine(copy.deepcopy(model), cfg)
    g = torch.Generator().manual_seed(3)
    for module in engine.modules:
        assert module.out_features == module.in_features == module.d == 32
        module.p_o, module.p_i = signed_permutation(32, g), signed_permutation(32, g)
    results = [engine.step(batches(model.config.vocab_size, step, cfg.train.grad_accum)) for step in range(20)]
    names = {engine.names[id(m.weight)] for m in engine.modules}
    params = dict(model.named_parameters())
    for name, param in params.items():
        param.requires_grad_(name in names)
    trained = [params[n] for n in sorted(names)]
    opt = torch.optim.AdamW(trained, lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps, weight_decay=wd)
    losses = []
    for step in range(20):
        micro = batches(model.config.vocab_size, step, cfg.train.grad_accum)
        total = sum(b.num_targets for b in micro)
        loss_sum = 0.0
        for batch in micro:
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            (loss / total).backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(trained, cfg.train.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = rules.lr_at(cfg.train, step)
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum / total)
    assert [r.loss for r in results] == pytest.approx(losses, abs=1e-10, rel=0)
    state = engine.trainable_state()
    for name in names:
        torch.testing.assert_close(state[name], params[name].detach(), atol=1e-10, rtol=0, msg=name)
    assert all(m.scale < 0.99 for m in engine.modules)  # (1 - lr wd) over 20 steps: W's share decayed too


def test_weight_decay_is_applied_once_a_step_whatever_the_schedule():
    """Pipelined (given and derived knobs), synchronous and clipped runs with two micro-batches a step
    and an evaluation between steps: every matrix's scale is the product of the steps' (1 - lr wd),
    and the weights are the synchronous run's bit for bit."""
    model, wd = model_of(layers=3), 0.3
    eval_batches = batches(model.config.vocab_size, 99, micro=1)
    results = {}
    for name, lsp, clip in [("sync", LspConfig(d=8, r=3, check_every=0, schedule="sync"), 0.0),
                            ("given", LspConfig(d=8, r=3, check_every=0, k=4, p=1, h=2, u=3), 0.0),
                            ("derived", LspConfig(d=8, r=3, check_every=0), 0.0),
                            ("clipped", LspConfig(d=8, r=3, check_every=0, k=4, p=1, h=2, u=3), 1e3)]:
        cfg = run_cfg(lsp, weight_decay=wd, max_grad_norm=clip, measure_memory=False)
        engine = fixed_projector_engine(copy.deepcopy(model), cfg)
        expected = 1.0
        for step in range(5):
            engine.step(batches(model.config.vocab_size, step))
            expected *= 1.0 - rules.lr_at(cfg.train, step) * wd
            if step == 2:
                engine.evaluate(eval_batches)
        engine.flush()
        assert [m.scale for m in engine.modules] == [expected] * len(engine.modules), name
        results[name] = engine.trainable_state()
    for name in ("given", "derived", "clipped"):
        for key, value in results["sync"].items():
            assert torch.equal(results[name][key], value), (name, key)


def test_recomputed_blocks_with_mlp_chunks_train_like_the_oracle():
    """A checkpointed block recomputes its MLP in token chunks, so gate/up/down receive their G_c in
    parts: a matrix is complete only when backward leaves its block."""
    from slimtune.config import ActivationsConfig

    cfg = run_cfg(LspConfig(d=8, r=3, check_every=0), steps=6)
    cfg.activations = ActivationsConfig(checkpoint="recompute", mlp_chunk=5)
    model = model_of()
    engine = fixed_projector_engine(copy.deepcopy(model), cfg)
    results = [engine.step(batches(model.config.vocab_size, step, cfg.train.grad_accum)) for step in range(6)]
    losses, expected = adam_on_z(model, engine, cfg, 6, train_other=False)
    assert [r.loss for r in results] == pytest.approx(losses, abs=1e-10, rel=0)
    for name, value in expected.items():
        torch.testing.assert_close(engine.trainable_state()[name], value, atol=1e-10, rtol=0, msg=name)


def test_the_projector_check_sees_whole_gradients_under_chunked_recompute():
    """The probe pass of a checkpointed block hands its MLP matrices their gradient in token chunks:
    the check sums them, so e(G) is the same as without checkpointing."""
    from slimtune.config import ActivationsConfig

    model, errors = model_of(), []
    for activations in (ActivationsConfig(), ActivationsConfig(checkpoint="recompute", mlp_chunk=5)):
        cfg = run_cfg(LspConfig(d=8, r=3, check_every=0))
        cfg.activations = activations
        engine = fixed_projector_engine(copy.deepcopy(model), cfg)
        errors.append(engine.learning.measure(batches(model.config.vocab_size, 0), engine._probe_pass))
    assert errors[0] == pytest.approx(errors[1], abs=1e-10, rel=0)


@pytest.mark.parametrize("metered", [False, True])
def test_the_check_reads_each_matrix_error_off_its_whole_gradients(metered):
    """measure's e(G) of every matrix over several batches, (sum of |P_o P_o^T G P_i P_i^T - G|^2 over sum of
    |G|^2)^(1/2), against dense projectors on each batch's gradient; under a meter too, where a reading of
    a shape met before runs off the meter (memory.TransientReplay) and must still be added."""
    from slimtune.device import memory
    from slimtune.engines.lsp.learning import whole

    model = model_of(layers=3)
    engine = fixed_projector_engine(model, run_cfg(LspConfig(d=8, r=3, check_every=0)))
    sample = batches(model.config.vocab_size, 0) + batches(model.config.vocab_size, 1)
    grads = {i: [] for i in range(len(engine.modules))}
    for batch in sample:
        engine._probe_pass([batch], {i: (lambda i: lambda halves: grads[i].append(whole(halves).clone()))(i)
                                     for i in grads})
    with memory.LiveBytesMeter() if metered else contextlib.nullcontext():
        errors = engine.learning.measure(sample, engine._probe_pass)
    for index, module in enumerate(engine.modules):
        p_o, p_i = module.p_o.dense(), module.p_i.dense()
        residual = sum((p_o @ p_o.T @ g @ p_i @ p_i.T - g).pow(2).sum() for g in grads[index])
        energy = sum(g.pow(2).sum() for g in grads[index])
        assert len(grads[index]) == len(sample) and errors[index] == pytest.approx(float((residual / energy).sqrt()), abs=1e-10)


def test_the_link_moves_two_d_squared_fp32_numbers_a_matrix_a_step():
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=0), grad_accum=2)
    model = model_of(dtype=torch.float32)
    engine = fixed_projector_engine(model, cfg, precision="fp32")
    numbers = sum(m.d ** 2 for m in engine.modules)
    steps = [engine.step(batches(model.config.vocab_size, s, 2)) for s in range(6)]
    # From step 4 on (the schedule is derived after step 2, used from step 3) every step moves the
    # same bytes; a shallow matrix's Z goes up before the next step's forward, counted there.
    assert [r.host_link_bytes for r in steps[3:]] == [2 * numbers * 4] * 3, [r.host_link_bytes for r in steps]
    assert sum(a.groups[0].numel for a in engine.adams) == numbers
    predicted = estimate.estimate(tiny_config(num_hidden_layers=2), settings.load(
        None, ["engine=lsp", "method=full", "lsp.d=8", "lsp.r=3", "precision=fp32", "lsp.fit_iterations=2"],
        base={"model": "x", "data": "x.jsonl"}), 2, 12)
    assert predicted.host_link_bytes == 2 * numbers * 4


def instrumented(engine: LspEngine, sleeps: bool, log: list):
    """Random sleeps in every host job; every action logged with whether backward was still running."""
    updates = engine.updates
    update, act = updates._host_update, updates._act

    def slow_update(index, pending):
        if sleeps:
            time.sleep(random.random() * 0.004)
        return update(index, pending)

    def logged_act(action, index):
        log.append((action, index, updates.backward is not None))
        return act(action, index)

    updates._host_update, updates._act = slow_update, logged_act


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["unclipped", "clipped"])
def test_pipelined_and_synchronous_schedules_give_bitwise_equal_weights(clip):
    random.seed(0)
    model = model_of(layers=3)
    results, logs = {}, {}
    for name, lsp in {"sync": LspConfig(d=8, r=3, check_every=0, schedule="sync"),
                      "given": LspConfig(d=8, r=3, check_every=0, k=4, p=1, h=2, u=3),
                      "derived": LspConfig(d=8, r=3, check_every=0)}.items():
        engine = fixed_projector_engine(copy.deepcopy(model), run_cfg(lsp, max_grad_norm=clip))
        logs[name] = []
        instrumented(engine, sleeps=name != "sync", log=logs[name])
        for step in range(5):
            engine.step(batches(model.config.vocab_size, step))
        results[name] = engine.trainable_state()
    for name in ("given", "derived"):
        for key, value in results["sync"].items():
            assert torch.equal(results[name][key], value), (name, key)
    if clip == 0:  # deep matrices were uploaded and applied while backward still ran
        assert any(a == "apply" and during for a, _, during in logs["given"])
    assert not any(a == "apply" and during for a, _, during in logs["sync"])


def test_pending_updates_are_applied_before_evaluation_and_checkpoints():
    model = model_of()
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=0))
    pipelined = fixed_projector_engine(copy.deepcopy(model), cfg)
    sync = fixed_projector_engine(copy.deepcopy(model), run_cfg(LspConfig(d=8, r=3, check_every=0, schedule="sync")))
    eval_batches = batches(model.config.vocab_size, 99, micro=1)
    for engine in (pipelined, sync):
        engine.step(batches(model.config.vocab_size, 0))
    assert pipelined.updates.pending and not sync.updates.pending  # shallow updates wait for the next forward
    assert pipelined.evaluate(eval_batches) == sync.evaluate(eval_batches)
    assert not pipelined.updates.pending
    pipelined.step(batches(model.config.vocab_size, 1))
    assert pipelined.updates.pending
    pipelined.state_dict()
    assert not pipelined.updates.pending


def test_a_refit_carries_the_moments_into_the_new_subspace():
    model = model_of()
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=2, alpha=1e-9, fit_iterations=4))
    engine = LspEngine(Stack(model), cfg, CPU, "fp64")
    for step in range(2):
        engine.step(batches(model.config.vocab_size, step))
    engine.flush()
    before = [(m.p_o, m.p_i, a.member(0, 0).exp_avg.clone(), a.member(0, 0).exp_avg_sq.clone(),
               float(a.state(0)["step"]), m.effective_weight()) for m, a in zip(engine.modules, engine.adams)]
    engine._check_projectors(batches(model.config.vocab_size, 2), engine.meter.last_reading or _NoReading())
    changed = 0
    for (p_o, p_i, m, v, steps, weight), module, adam in zip(before, engine.modules, engine.adams):
        assert torch.equal(module.p_o.pos, p_o.pos) and torch.equal(module.p_i.pos, p_i.pos)
        if torch.equal(module.p_o.val, p_o.val) and torch.equal(module.p_i.val, p_i.val):
            # refit (alpha is tiny) but kept its values: left as it was (tests/unit/test_lsp_refit.py)
            assert torch.equal(adam.member(0, 0).exp_avg, m) and torch.equal(module.effective_weight(), weight)
            continue
        changed += 1
        m2, v2 = projectors.reproject_moments(m, v, (p_o, p_i), (module.p_o, module.p_i))
        assert torch.equal(adam.member(0, 0).exp_avg, m2) and torch.equal(adam.member(0, 0).exp_avg_sq, v2)
        assert torch.count_nonzero(m2) > 0
        assert float(adam.state(0)["step"]) == steps == 2
        assert torch.count_nonzero(module.z) == 0  # Z was folded into W first
        torch.testing.assert_close(module.effective_weight(), weight, atol=1e-13, rtol=0)
    assert changed > 0


def test_a_check_folds_the_matrices_it_changed_in_matrix_order():
    """A bf16 fold draws its rounding; under torchrun, ranks that changed the same matrices must draw alike for
    each, so the folds go in matrix order, not in the fits' order (q with o, k with v: not matrix order)."""
    model = model_of()
    engine = LspEngine(Stack(model), run_cfg(), CPU, "fp64")
    every = list(range(len(engine.modules)))
    assert [i for group in engine.learning.groups(every) for i in group] != every  # the fits' order differs
    engine.step(batches(model.config.vocab_size, 0))  # the first fit changes every matrix
    assert engine.learning.changed == every


class _NoReading:
    peak = None
    peak_breakdown = None


def test_resume_from_a_checkpoint_continues_bit_identically(tmp_path):
    model = model_of()
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=3, alpha=0.05, fit_iterations=3))
    straight = LspEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    for step in range(3):
        straight.step(batches(model.config.vocab_size, step))
    saved = checkpoint.save(tmp_path, 3, straight.state_dict(), {}, keep_last=1)
    for step in range(3, 6):
        straight.step(batches(model.config.vocab_size, step))
    _, state, _, _ = checkpoint.load(saved)
    resumed = LspEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    resumed.load_state_dict(state)
    assert resumed.learning.fitted and resumed.step_count == 3
    for step in range(3, 6):
        resumed.step(batches(model.config.vocab_size, step))
    for name, value in straight.trainable_state().items():
        assert torch.equal(resumed.trainable_state()[name], value), name


@pytest.mark.parametrize("fold_every", [10**6, 100], ids=["no-fold", "fold-every-100"])
def test_a_thousand_small_updates_survive_in_bf16_weights(fold_every):
    """Each update moves the weight by 1e-4 of its norm; after 1,000 of them the bf16 module's effective
    weight is within 1% of an fp32 reference: exactly the reference's update while Z holds them all,
    and still within 1% of the weights with a (stochastically rounded) fold every 100 updates, the worst
    case of a refit at every check; adding each update into the bf16 weight in place, the plain way,
    loses them all."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    p_o = projectors.SparseProjector.random(48, 16, 4, g, torch.float32, CPU)
    p_i = projectors.SparseProjector.random(64, 16, 4, g, torch.float32, CPU)
    module = ProjectedLinear(linear, 0, p_o, p_i)
    start = module.weight.float().clone()
    direction = torch.randn(16, 16, generator=g)
    unit = projectors.decompress(direction, p_o, p_i)
    delta = direction * (1e-4 * start.norm() / unit.norm())
    naive = module.weight.detach().clone()
    master, rounding = torch.zeros(16, 16), torch.Generator().manual_seed(2)
    for k in range(1000):
        master += delta  # the host AdamW's master Z, uploaded into the module each step
        with torch.no_grad():
            module.z.copy_(master)
            naive += projectors.decompress(delta, p_o, p_i).to(torch.bfloat16)
        if k % fold_every == fold_every - 1:
            module.fold(rounding)
            master.zero_()
    reference = start + 1000 * projectors.decompress(delta, p_o, p_i)
    moved = (reference - start).norm()
    assert moved / reference.norm() > 0.05  # the updates add up to a real change
    effective = module.weight.float() + module.delta()  # what forward computes with
    assert (effective - reference).norm() / reference.norm() < 0.01
    if fold_every > 1000:  # no fold: W + P_o Z P_i^T held every update exactly
        module_z_error = (effective - reference).norm() / moved
        assert module_z_error < 0.01
    assert (naive.float() - reference).norm() / reference.norm() > 0.05


def test_the_planner_weighs_lsp_plans_where_lsp_applies():
    from slimtune.planning import planner

    def engines_of(base):
        return {p["engine"] for p in planner.applicable_plans(base)}

    assert "lsp" in engines_of(planner.planning_config("full"))
    assert "lsp" in engines_of(planner.planning_config("full", weight_decay=0.01))  # exact with decay too
    assert "lsp" not in engines_of(planner.planning_config("lora"))


def llama_shapes(name: str) -> list[tuple[int, int]]:
    from slimtune import presets
    from slimtune.engines.lsp import sizing
    c = presets.model_config(name)
    return sizing.block_shapes(c) * c.num_hidden_layers


# SmolLM2-135M's block linears (hidden 576, 9 heads, 3 KV heads of 64, MLP 1536), 30 blocks
SMOLLM2_135M = ([(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30, 576)


@pytest.mark.parametrize("name, expected", [("Llama-3.2-1B", 1024), ("Llama-3.2-3B", 1536), ("Llama-3.1-8B", 2048),
                                            ("SmolLM2-135M", 256)])
def test_the_default_d_is_half_the_hidden_size_in_steps_of_64(name, expected):
    """The rule chosen from benchmarks/docs/smollm2_engines.md (quality against d on SmolLM2-135M)."""
    from slimtune import presets
    from slimtune.engines.lsp import sizing
    shapes, hidden = SMOLLM2_135M if name == "SmolLM2-135M" else (
        llama_shapes(name), presets.model_config(name).hidden_size)
    d = sizing.derived_d(shapes)
    assert d == expected and d % 64 == 0
    assert d <= hidden / 2 < d + 64  # the largest multiple of 64 within half the hidden size
    assert sizing.subspace_size(200, shapes) == 200  # a given lsp.d is kept
    assert sizing.derived_d([(32, 48), (16, 32)]) == 64  # a narrow model gets the smallest step (each matrix caps it)


def test_the_link_bytes_count_each_matrix_at_its_capped_d():
    from slimtune.engines.lsp import sizing
    shapes, _ = SMOLLM2_135M
    # at d = 512 the k and v matrices (192 wide) send 192^2, the others 512^2: 2 directions x fp32
    assert sizing.compressed_bytes(shapes, 512) == 30 * 2 * 4 * (5 * 512**2 + 2 * 192**2)
    assert sizing.compressed_bytes(shapes, 64) == 210 * 2 * 4 * 64**2


def test_an_engine_without_lsp_d_takes_the_derived_size_capped_by_each_matrix():
    cfg = run_cfg(LspConfig(r=3, check_every=0))
    engine = fixed_projector_engine(model_of(dtype=torch.float32), cfg, precision="fp32")
    assert engine.d == 64  # the tiny model's matrices are all below 64 on a side: the smallest step
    assert all(m.d == min(m.in_features, m.out_features) for m in engine.modules)


def adam_on_z_across_refits(model: nn.Module, used: list[dict], cfg) -> tuple[list[float], dict]:
    """The exact recurrence with projectors that change (spec 2.5), written out in plain PyTorch: step
    k computes with W0 + P_o Z P_i^T under `used[k]` (name -> dense P_o, P_i), Z a torch AdamW
    parameter (weight decay 0, the rest frozen). Where a matrix's projectors change, W0 takes P_o Z P_i^T,
    Z restarts at zero, the moments become M' = (P_o'^T P_o) M (P_i^T P_i') and V' = (P_o'^T P_o)^2 V
    (P_i^T P_i')^2 (element-wise squares) and the step count goes on."""
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    zs = {n: torch.zeros(o.shape[1], i.shape[1], dtype=F64, requires_grad=True) for n, (o, i) in used[0].items()}
    opt = torch.optim.AdamW(list(zs.values()), lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps,
                            weight_decay=0.0)
    losses, current = [], used[0]
    for step, pairs in enumerate(used):
        for n, (o, i) in pairs.items():
            old_o, old_i = current[n]
            if torch.equal(o, old_o) and torch.equal(i, old_i):
                continue
            z, state = zs[n], opt.state[zs[n]]
            with torch.no_grad():
                weights[n] += old_o @ z @ old_i.T
                z.zero_()
                left, right = o.T @ old_o, old_i.T @ i
                state["exp_avg"].copy_(left @ state["exp_avg"] @ right)
                state["exp_avg_sq"].copy_(left.pow(2) @ state["exp_avg_sq"] @ right.pow(2))
        current = pairs
        micro = batches(model.config.vocab_size, step, cfg.train.grad_accum)
        total = sum(b.num_targets for b in micro)
        loss_sum = 0.0
        for batch in micro:
            effective = {**weights, **{n: weights[n] + o @ zs[n] @ i.T for n, (o, i) in pairs.items()}}
            logits = functional_call(model, effective, (batch.input_ids,), {"position_ids": batch.position_ids}).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            (loss / total).backward()
            loss_sum += float(loss.detach())
        for group in opt.param_groups:
            group["lr"] = rules.lr_at(cfg.train, step)
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum / total)
    with torch.no_grad():
        return losses, {n: weights[n] + o @ zs[n] @ i.T for n, (o, i) in current.items()}


def test_steps_across_refits_with_no_checkpoint_between_follow_the_exact_recurrence():
    """Refits every 2 steps (alpha tiny: every matrix is refit at every check) and nothing else between
    them that folds Z or resets the host's copy of it (no checkpoint, no evaluation): each refit's new
    subspace must start from Z = 0 on the host as on the device, or the next update carries the old
    subspace's Z into the new one."""
    steps = 5
    cfg = run_cfg(LspConfig(d=8, r=3, check_every=2, alpha=1e-9, fit_iterations=1), steps=steps, measure_memory=False)
    model = model_of()
    engine = LspEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
    results, used = [], []
    for step in range(steps):
        results.append(engine.step(batches(model.config.vocab_size, step, cfg.train.grad_accum)))
        used.append({engine.names[id(m.weight)]: (m.p_o.dense(), m.p_i.dense()) for m in engine.modules})
    refits = [k for k in range(1, steps) if any(not torch.equal(used[k][n][0], used[k - 1][n][0]) for n in used[k])]
    assert refits == [2, 4]  # each after updates had moved Z
    assert [r.extras.get("lsp_refit") for r in results[2::2]] == [len(engine.modules)] * 2
    losses, expected = adam_on_z_across_refits(model, used, cfg)
    assert [r.loss for r in results] == pytest.approx(losses, abs=1e-10, rel=0)
    trained = engine.trainable_state()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, atol=1e-10, rtol=0, msg=name)
    moved = max(float((expected[n] - p).abs().max()) for n, p in model.named_parameters() if n in expected)
    assert moved > 1e-3


def test_the_drift_rule_refits_exactly_the_matrices_whose_error_grew():
    """After the first fit and two small steps, matrices 1 and 4 get fresh random values (their error on
    the sample jumps far past its value just after the fit); the check at step 3 refits those two and
    keeps every other matrix's projectors as they were (with the old rule, alpha = 0.3, it refits all,
    so this test fails if all are refit)."""
    model = model_of()
    sample = batches(model.config.vocab_size, 50, micro=2)
    counts = {}
    for alpha in (-1.0, 0.3):
        cfg = run_cfg(LspConfig(d=8, r=3, check_every=3, alpha=alpha, fit_iterations=20), lr=1e-4,
                      measure_memory=False)
        engine = LspEngine(Stack(copy.deepcopy(model)), cfg, CPU, "fp64")
        engine.use_sample(sample)
        first = [engine.step(batches(model.config.vocab_size, step)) for step in range(3)]
        assert first[0].extras["lsp_refit"] == len(engine.modules)  # the first fit: every matrix
        assert all(b is not None for b in engine.learning.baseline)
        g = torch.Generator().manual_seed(9)
        for index in (1, 4):
            module = engine.modules[index]
            module.p_o = projectors.SparseProjector(module.p_o.pos, projectors.random_values(
                module.p_o.n, module.p_o.r, g, F64, CPU), module.d)
        before = [(m.p_o.val.clone(), m.p_i.val.clone()) for m in engine.modules]
        result = engine.step(batches(model.config.vocab_size, 3))
        changed = {i for i, (m, (o, i_)) in enumerate(zip(engine.modules, before))
                   if not (torch.equal(m.p_o.val, o) and torch.equal(m.p_i.val, i_))}
        counts[alpha] = result.extras["lsp_refit"]
        if alpha == -1.0:
            assert changed == {1, 4} and result.extras["lsp_refit"] == 2
    assert counts[0.3] == len(engine.modules)  # every learned error on this model is above 0.3


def test_the_drift_rule_and_the_absolute_rule_on_given_errors():
    from slimtune.engines.lsp import learning

    def rule(alpha, drift):
        return learning.ProjectorLearning([None] * 4, [], LspConfig(alpha=alpha, drift=drift), None, None, False)

    drift = rule(-1.0, 0.1)
    assert drift.drifted([0.5, 0.6, 0.3, 0.9]) == []  # the first check without baselines sets them
    drift.baseline = [0.5, 0.6, 0.3, 0.9]
    assert drift.drifted([0.54, 0.67, 0.2, 0.99]) == [1]  # 0.67 > 0.66; 0.99 is not > 0.99
    assert rule(0.55, 0.1).drifted([0.54, 0.67, 0.2, 0.99]) == [1, 3]
    default = learning.ProjectorLearning([None] * 3, [], LspConfig(), None, None, False)
    default.baseline = [0.5, 0.5, 0.5]
    assert default.drifted([0.59, 0.61, 0.4]) == [1]  # the default margin, 20%: 18% is within it, 22% past it


def test_the_fit_shows_its_progress_in_matrices_and_batches(monkeypatch):
    from slimtune.engines.lsp import learning

    shown = []

    class Bar:
        def __init__(self, total, what, enabled):
            shown.append([total, 0, enabled, what])

        def update(self, n):
            shown[-1][1] += n

        def close(self):
            pass

    monkeypatch.setattr(learning, "_bar", Bar)
    model = model_of()
    engine = LspEngine(Stack(model), run_cfg(LspConfig(d=8, r=3, check_every=0, fit_iterations=4),
                                             measure_memory=False), CPU, "fp64")
    engine.progress = True
    engine.step(batches(model.config.vocab_size, 0, micro=3))
    assert shown == [[len(engine.modules) * 3, len(engine.modules) * 3, True, shown[0][3]]]
    assert str(len(engine.modules)) in shown[0][3]
