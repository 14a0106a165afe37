"""A resume applies what it announces or refuses it (issue 28, items 2, 8 and 15), through train.fit
in-process on the tiny model: a two-step run of each engine is resumed for one more step with one
setting changed, for every setting of each engine's section (resident: the train.* settings, and a
few others), and either

- the change is refused (its rule in resume_settings.RULES says so) in one sentence naming the
  setting, both values and train.overwrite=true, and the run's folder is byte for byte as it was; or
- it is announced ("key: old -> new", with the effect when applied), recorded in config.yaml, and
  the run changes as announced: where the new value acts on the one step after the resume, the
  weights differ from the unchanged continuation's; where it is said to change nothing the step
  computes (cadences, where state lives, a schedule of the same updates), they are equal bit for bit.

lsp.r and lsp.d have their own tests: the projectors are fit afresh at the new rank and size, and a
resume after that is exact."""

import gc
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import write_jsonl
from slimtune import config, train
from slimtune.engines import settings
from slimtune.run import resume_settings
from slimtune.errors import UserError
from slimtune.run.resume_settings import APPLIED, REFUSED

# One xdist worker runs this module (scripts/test.sh: --dist loadgroup), so its module fixture
# (runs) is built once, not once on each worker.
pytestmark = pytest.mark.xdist_group("test_resume_changed_settings")

BASE = {"resident": [], "slide": ["method=full", "activations.checkpoint=host"],
        "lsp": ["method=full", "lsp.fit_samples=4", "lsp.fit_iterations=3", "lsp.d=8"],
        "chunk": ["method=full", "chunk.n_chunks=2", "chunk.order=round_robin", "chunk.switch_every=1"],
        "roundpipe": ["method=full"]}
DIFFERS, SAME = "differs", "same"  # the weights after the resumed step against the unchanged continuation's
LSP_SHAPES = [("lsp.r", 2), ("lsp.d", 16)]  # changed in their own test below

# (engine, the settings changed together, the weights after the resumed step against the unchanged
# continuation's). A setting that acts on the step is changed alone (its effect shows); the ones said
# to change nothing the step computes are changed together, as are those whose effect one step cannot
# show (None: announced and recorded only); a refused one alone (it must be refused on its own).
CASES = [
    # resident: the train.* settings (every engine reads them alike), and some others classed apart
    ("resident", {"train.grad_accum": 2}, DIFFERS),
    ("resident", {"train.lr": 0.05}, DIFFERS),
    ("resident", {"train.weight_decay": 0.5}, DIFFERS),
    ("resident", {"train.betas": [0.5, 0.9]}, DIFFERS),
    ("resident", {"train.eps": 0.001}, DIFFERS),
    ("resident", {"train.max_grad_norm": 0.001}, DIFFERS),
    ("resident", {"train.schedule": "constant"}, DIFFERS),
    ("resident", {"train.warmup_steps": 3}, DIFFERS),
    ("resident", {"lora.dropout": 0.5}, DIFFERS),
    ("resident", {"quant.scheme": "int4"}, DIFFERS),
    ("resident", {"precision": "fp64"}, DIFFERS),
    ("resident", {"train.log_every": 2, "train.eval_every": 1, "train.eval_batches": 1, "train.save_every": 1,
                  "train.keep_last": 1, "train.on_nonfinite": "skip", "train.nonfinite_patience": 5,
                  "train.measure_memory": True, "activations.checkpoint": "recompute"}, SAME),
    ("resident", {"train.steps": 4}, None),
    ("resident", {"engine": "slide", "activations.checkpoint": "host"}, None),  # the state carried over by name
    ("resident", {"train.batch_size": 1}, None),
    ("resident", {"train.seed": 1}, None),
    ("resident", {"data.max_length": 24}, None),
    ("slide", {"slide.working_set": "chunk"}, DIFFERS),
    ("slide", {"slide.slots": 3, "slide.moments": "disk", "slide.moments_dir": "elsewhere", "train.host_threads": 2},
     SAME),
    ("slide", {"slide.head_tile_mb": 0.01}, None),
    ("slide", {"train.master": "fp32"}, SAME),  # fp32 compute: nothing to split; checkpoints hold fp32 masters
    ("slide", {"train.moments": "8bit"}, DIFFERS),
    ("lsp", {"lsp.alpha": 0.01, "lsp.fit_iterations": 1, "lsp.fit_lr": 0.5, "lsp.schedule": "sync", "lsp.k": 1,
             "lsp.p": 1, "lsp.h": 1, "lsp.u": 1, "lsp.drift": 0.5, "lsp.check_samples": 2}, SAME),
    ("lsp", {"lsp.check_every": 1}, None),
    ("lsp", {"lsp.fit_samples": 3}, None),
    ("lsp", {"lsp.train_other": True}, None),
    # step 3 begins a sweep either way: the same chunk, at its own lr (both together would hold step 1's)
    ("chunk", {"chunk.switch_every": 2, "chunk.state": "disk", "chunk.state_dir": "elsewhere"}, SAME),
    ("chunk", {"chunk.lr_schedule": "per_sweep"}, SAME),
    ("chunk", {"chunk.lr_scale": 0.5}, DIFFERS),  # sqrt(2) -> 0.5: the resumed step's rate
    ("chunk", {"chunk.order": "random", "chunk.gradients": "host"}, None),
    ("chunk", {"chunk.n_chunks": 4}, None),
    ("roundpipe", {"roundpipe.grain": "layer", "roundpipe.memory_fraction": 0.5, "roundpipe.replan": False,
                   "roundpipe.timeout_s": 60.0}, SAME),
    ("roundpipe", {"roundpipe.workers": 3, "roundpipe.micro_batches": 2, "roundpipe.optimizer": "async",
                   "roundpipe.tail_shards": 1}, None),
]


def test_the_cases_change_every_setting_of_each_engines_section_and_of_train():
    """Every key of slide.*, lsp.*, chunk.*, roundpipe.* and train.* is changed by some case above
    (train.resume and train.overwrite decide whether there is a run to resume: test_run_folder.py)."""
    changed = {key for _, settings, _ in CASES for key in settings} | {key for key, _ in LSP_SHAPES}
    sections = ("slide.", "lsp.", "chunk.", "roundpipe.", "train.")
    wanted = {key for key in resume_settings.RULES if key.startswith(sections)} - {"train.resume", "train.overwrite"}
    assert wanted - changed == set()
    for _, settings, _ in CASES:
        refusals = [key for key in settings if resume_settings.rule(key).kind == REFUSED]
        assert not refusals or len(settings) == 1, "a refused setting is changed alone"


class Runs:
    """Each engine's two-step run, made once and copied back to its own output_dir for every case
    (run.json records that folder), and its unchanged one-step continuation's weights."""

    def __init__(self, root: Path, model: Path):
        self.root, self.model = root, model
        records = [{"prompt": f"what is {a} plus {b}?", "response": f" {a + b}"} for a in range(6) for b in range(6)]
        self.data = write_jsonl(root / "d.jsonl", records)
        self._straight: dict[str, dict] = {}

    def config(self, engine: str, *overrides: str, steps: int = 3) -> config.RunConfig:
        base = {"model": str(self.model), "data": {"path": str(self.data), "max_length": 32},
                "train": {"steps": steps, "batch_size": 2, "lr": 0.01, "measure_memory": False},
                "output_dir": str(self.folder(engine)), "device": "cpu", "engine": engine}
        return settings.load(None, [*BASE[engine], *overrides], base=base)

    def folder(self, engine: str) -> Path:
        return self.root / engine / "run"

    def fresh(self, engine: str) -> Path:
        pristine, folder = self.root / engine / "pristine", self.folder(engine)
        if not pristine.exists():
            train.fit(self.config(engine, steps=2), progress=False)
            shutil.copytree(folder, pristine)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(pristine, folder)
        return folder

    def straight(self, engine: str) -> dict:
        """The unchanged continuation's weights. Made on first call in the engine's folder, which
        it leaves holding that run: a test that reads its folder afterwards takes this first."""
        if engine not in self._straight:
            self.fresh(engine)
            run, _ = train.fit(self.config(engine), progress=False)
            self._straight[engine] = weights(run)
        return self._straight[engine]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> Runs:
    return Runs(tmp_path_factory.mktemp("resume-settings"), tiny_model_dir)


@pytest.fixture(autouse=True)
def no_plot(monkeypatch):
    """metrics.png takes most of a tiny run's time, and nothing here reads it."""
    monkeypatch.setattr(train.MetricsLog, "plot", lambda self, path: None)


def weights(run) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in run.engine.trainable_state().items()}


def snapshot(folder: Path) -> dict[str, str]:
    """Every file's hash and every folder under `folder`, but the lock (its holder's pid)."""
    return {str(p.relative_to(folder)): "folder" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.name != ".lock"}


def written(value) -> str:
    """A value as an override writes it (the refusal's way out)."""
    return value if isinstance(value, str) else json.dumps(value)


def announced(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("resuming with changed settings: ")]
    assert len(lines) == 1, out
    return lines[0]


def _override(key: str, value) -> str:
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


@pytest.mark.parametrize("engine, settings, effect", CASES, ids=[f"{e}-{'+'.join(s)}" for e, s, _ in CASES])
def test_a_changed_setting_changes_the_run_as_announced_or_is_refused_before_anything_is_written(
        runs, capsys, engine, settings, effect):
    folder = runs.fresh(engine)
    before, kept = config.flatten(json.loads((folder / "run.json").read_text())["settings"]), snapshot(folder)
    settings = {k: str(runs.root / engine / v) if k.endswith("_dir") else v for k, v in settings.items()}
    cfg = runs.config(engine, *(_override(k, v) for k, v in settings.items()))
    now = config.flatten(config.to_dict(cfg))
    assert all(before[key] != now[key] for key in settings)
    if any(resume_settings.rule(key).kind == REFUSED for key in settings):
        (key,) = settings
        with pytest.raises(UserError) as refusal:
            train.fit(cfg, progress=False)
        said = str(refusal.value)
        assert f"{key} was {written(before[key])}, now {written(now[key])}" in said, said
        assert f"resume with {key}={written(before[key])}, or start afresh with train.overwrite=true or another" \
            " output_dir" in said
        gc.collect()  # the refused run's engine lets go of anything it held in the folder
        assert snapshot(folder) == kept
        return
    run, _ = train.fit(cfg, progress=False)
    line = announced(capsys.readouterr().out)
    for key in settings:
        rule = resume_settings.rule(key)
        assert f"{key}: {before[key]!r} -> {now[key]!r}" + (f" ({rule.why})" if rule.kind == APPLIED else "") in line
    recorded = config.flatten(yaml.safe_load((folder / "config.yaml").read_text()))
    assert all(recorded[key] == now[key] for key in settings)
    if effect is not None:
        mine, straight = weights(run), runs.straight(engine)
        assert mine.keys() == straight.keys()
        equal = all(torch.equal(mine[name].to(straight[name]), straight[name]) for name in straight)
        assert equal == (effect == SAME), f"{settings}: the resumed step's weights should be {effect}"


# ---------------------------------------------------------------- lsp.r and lsp.d: applied as announced


def _losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("key, value", LSP_SHAPES)
def test_a_changed_lsp_r_or_d_fits_projectors_afresh_at_the_new_shape_and_a_resume_after_it_is_exact(
        runs, key, value):
    """Item 2 (lsp.r was announced but the checkpoint's rank-4 projectors were loaded) and item 8
    (lsp.d ended in a size mismatch): every matrix gets projectors of the new rank or size, all are
    fit at the first resumed step, and the run's next checkpoint resumes bit for bit."""
    straight = runs.straight("lsp")  # before fresh(): the first call trains in the folder
    folder = runs.fresh("lsp")
    changed = runs.config("lsp", f"{key}={value}", "train.save_every=1", "train.keep_last=5", steps=4)
    run, _ = train.fit(changed, progress=False)
    modules = run.engine.modules
    r, d = (value, 8) if key == "lsp.r" else (4, value)
    assert all(m.p_o.r == min(r, m.d) and m.d == min(d, *m.weight.shape) for m in modules)
    assert any(m.d == 16 for m in modules) or key == "lsp.r"  # some matrix is wider than the old d
    records = {r["step"]: r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}
    assert records[3]["lsp_refit"] == len(modules)  # every matrix fit at the first resumed step
    changed_weights, changed_losses = weights(run), _losses(folder)
    assert any(not torch.equal(changed_weights[n], w) for n, w in straight.items())
    # killed after step 3's checkpoint: the resume with the same settings is exact
    shutil.rmtree(folder / "checkpoints" / "step-00000004")
    again, _ = train.fit(changed, progress=False)
    assert _losses(folder) == changed_losses
    assert all(torch.equal(weights(again)[n], w) for n, w in changed_weights.items())


# ---------------------------------------------------------------- item 15: refusals that say what is true


def test_lsp_resumed_by_another_engine_is_refused_naming_the_engine_and_the_true_way_out(runs):
    """lsp holds lsp.fit_samples examples out of training, so another engine's data stream is not
    the checkpoint's: refused naming the engine, not the data, and not with train.resume=false."""
    folder = runs.fresh("lsp")
    kept = snapshot(folder)
    with pytest.raises(UserError) as refusal:
        train.fit(runs.config("lsp", "engine=resident"), progress=False)
    said = str(refusal.value)
    assert "engine was lsp, now resident" in said and "holds 4 training examples out" in said
    assert "resume with engine=lsp, or start afresh with train.overwrite=true or another output_dir" in said
    assert "train.resume=false" not in said and "lora.*" not in said
    gc.collect()
    assert snapshot(folder) == kept


def test_a_changed_data_path_is_refused_naming_the_data_and_the_true_way_out(runs):
    folder = runs.fresh("resident")
    kept = snapshot(folder)
    other = write_jsonl(runs.root / "other.jsonl", [{"prompt": f"say {a}", "response": f" {a}"} for a in range(12)])
    with pytest.raises(UserError) as refusal:
        train.fit(runs.config("resident", f"data.path={other}"), progress=False)
    said = str(refusal.value)
    assert "the training data give" in said and "data.path" in said
    assert said.endswith("or start afresh with train.overwrite=true or another output_dir.")
    assert "train.resume=false" not in said
    gc.collect()
    assert snapshot(folder) == kept


def test_a_moved_base_model_folder_resumes_and_is_announced(runs, capsys):
    """The base model's identity is its weights (run_folder), so the same weights in another folder
    resume the run (exactly: the weights after the step are the unchanged continuation's)."""
    runs.fresh("resident")
    moved = runs.root / "moved-model"
    if not moved.exists():
        shutil.copytree(runs.model, moved)
    run, _ = train.fit(runs.config("resident", f"model={moved}"), progress=False)
    assert f"model: '{runs.model}' -> '{moved}' ({resume_settings.rule('model').why})" in announced(
        capsys.readouterr().out)
    straight = runs.straight("resident")
    assert all(torch.equal(weights(run)[name], w) for name, w in straight.items())
