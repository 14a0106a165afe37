"""Engine lsp's first projector fit skips what Z = 0 makes zero and fits from the gradients' factors
(issue 32 item 3): a ProjectedLinear told Z is zero computes, bit for bit, what it computes without being
told; the first fit with the flag ends bit for bit where the first fit without it ends (float64); the
planner's fake first fit holds the same peak as the metered real one, to the byte, from the factors
and from the formed gradients."""

import pytest
import torch
from torch import nn

from conftest import save_tiny_model, tiny_config
from test_lsp import model_of, run_cfg
from test_projectors import pair
from test_slide import batches
from slimtune import assembly
from slimtune.engines import settings
from slimtune.engines.lsp import learning
from slimtune.engines.lsp.engine import LspConfig, LspEngine
from slimtune.engines.lsp.projected_linear import ProjectedLinear
from slimtune.model.stack import Stack
from slimtune.optim import value_fit as vf
from slimtune.planning import estimate

CPU = torch.device("cpu")
F64 = torch.float64


def module_pass(zero: bool, scale: float, probing: bool):
    """y, dX, db and what the module hands on (dZ, or the probe's two halves formed) for one input."""
    torch.manual_seed(0)
    module = ProjectedLinear(nn.Linear(40, 24, dtype=F64), 0, *pair())
    module.scale, module.z_is_zero = scale, zero
    seen = []
    if probing:
        module.probe = seen.append
    x = torch.randn(2, 5, 40, dtype=F64, requires_grad=True)
    y = module(x)
    y.sin().sum().backward()
    handed = [h.dense() for h in seen[0]] if probing else [module.z.grad]
    return [y.detach(), x.grad, module.bias.grad, *handed]


@pytest.mark.parametrize("scale", [1.0, 0.9], ids=["no-decay", "decayed"])
@pytest.mark.parametrize("probing", [False, True], ids=["training", "probing"])
def test_a_module_told_z_is_zero_computes_what_it_computes_untold(scale, probing):
    told, untold = module_pass(True, scale, probing), module_pass(False, scale, probing)
    assert all(torch.equal(a, b) for a, b in zip(told, untold))


def first_fit(skip: bool):
    """The first fit of a two-block float64 engine over four sample batches; `skip` False runs the passes
    with every correction made (the flag never set). Returns the projectors, baselines, steps and
    what the flag read in each forward."""
    flags = []
    with pytest.MonkeyPatch.context() as patch:
        if not skip:
            patch.setattr(learning, "_all_zero", lambda modules: False)
        forward = ProjectedLinear.forward
        patch.setattr(ProjectedLinear, "forward", lambda self, x: flags.append(self.z_is_zero) or forward(self, x))
        model = model_of()
        cfg = run_cfg(LspConfig(d=8, r=3, fit_iterations=16, check_samples=2), measure_memory=False)
        engine = LspEngine(Stack(model), cfg, CPU, "fp64")
        engine.use_sample(batches(model.config.vocab_size, 50, micro=4))
        extras = engine.learning.check(engine.sample, engine._probe_pass)
    values = [(m.p_o.val.clone(), m.p_i.val.clone(), m.weight.clone()) for m in engine.modules]
    assert not any(m.z_is_zero for m in engine.modules)  # set for the check only
    return values, list(engine.learning.baseline), extras["lsp_fit_steps"], flags


def test_the_first_fit_skipping_the_corrections_ends_bit_for_bit_where_the_full_passes_end():
    skipped, full = first_fit(skip=True), first_fit(skip=False)
    assert skipped[3] and all(skipped[3]) and not any(full[3])  # every forward of the check told, or none
    assert all(torch.equal(a, b) for mine, theirs in zip(skipped[0], full[0]) for a, b in zip(mine, theirs))
    assert skipped[1] == full[1] and skipped[2] == full[2] > 0


@pytest.mark.parametrize("factored", [True, False], ids=["from-factors", "formed"])
def test_the_first_fits_peak_estimated_equals_the_meter(tmp_path, tokenizer, monkeypatch, factored):
    """The check's pass peak (engine.check_peak) of the fake step (the planner's estimate) against the real
    step's on the CPU meter, with the corrections skipped and the fit from the factors (or from the
    formed gradients, whichever the monkeypatched cost model says)."""
    monkeypatch.setattr(vf, "factored_is_cheaper", lambda *shape: factored)
    folder = save_tiny_model(tmp_path, tokenizer)
    cfg = settings.load(None, ["engine=lsp", "method=full", "precision=fp32"],
                        base={"model": str(folder), "data": "x.jsonl", "train": {"batch_size": 2},
                              "lsp": {"fit_iterations": 4, "d": 8}})
    made, assemble = [], assembly.assemble
    monkeypatch.setattr(assembly, "assemble", lambda *a, **k: made.append(assemble(*a, **k)) or made[-1])
    estimate.estimate(tiny_config(vocab_size=len(tokenizer)), cfg, 2, 48, by_depth=False)
    fake = made[0].check_peak
    engine = assemble(cfg, assembly.load_stack(cfg, CPU, "fp32"), CPU, "fp32")
    engine.step([estimate.synthetic_batch(2, 48, len(tokenizer))])
    assert fake is not None and fake[0] > 0 and engine.check_peak == fake
