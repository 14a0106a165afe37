"""The resume's table of settings (resume_settings.py): every built-in setting is classed once, a
refusal names the setting, both values and the true way out, and a checkpoint of other trained
tensors is refused naming what differs (issue 28, items 2, 8 and 15)."""

import copy

import pytest
import torch

from conftest import engine_config
from slimtune import config, engines
from slimtune.engines import settings
from slimtune.run import resume_settings
from slimtune.config import DataConfig, RunConfig, TrainConfig
from slimtune.store.checkpoint import check_resumable
from slimtune.errors import UserError
from slimtune.run.resume_settings import APPLIED, REFUSED, SAFE


def built_in_keys() -> set[str]:
    """Every key of the flattened settings, engine sections of slimtune's own engines included (an
    engine a test registers and forgets to unregister is left out)."""
    cfg = settings.complete(RunConfig(model="m", data=DataConfig(path="d")))
    foreign = {name for name in engines.names() if not engines.get(name).module.startswith("slimtune.")}
    return {key for key in config.flatten(config.to_dict(cfg)) if key.partition(".")[0] not in foreign}


def test_every_built_in_setting_is_classed_once_and_the_table_names_no_other():
    keys = built_in_keys()
    assert keys - resume_settings.RULES.keys() == set(), "settings with no resume class: add them to RULES"
    assert resume_settings.RULES.keys() - keys == set(), "RULES names settings that no longer exist"
    for key, rule in resume_settings.RULES.items():
        assert rule.kind in (SAFE, APPLIED, REFUSED), key
        assert bool(rule.why) == (rule.kind != SAFE), f"{key}: an applied or refused setting says why, a safe one not"


def test_lsp_r_and_d_follow_their_class_and_a_setting_no_rule_names_is_refused():
    assert resume_settings.rule("lsp.r").kind == resume_settings.rule("lsp.d").kind == APPLIED
    assert resume_settings.rule("toy.momentum").kind == REFUSED  # an engine registered outside slimtune


def test_a_refused_change_is_one_sentence_with_both_values_and_the_way_out():
    before = config.to_dict(engine_config(engine="lsp", method="full"))
    now = copy.deepcopy(before)
    now["lsp"]["train_other"], now["train"]["steps"] = True, 200
    cfg = settings.load(None, base={**now, "model": "m", "data": {"path": "d"}})
    found = resume_settings.changes(before, cfg)
    assert {c.key for c in found} == {"lsp.train_other", "train.steps", "model", "data.path"}
    with pytest.raises(UserError) as refusal:
        resume_settings.refuse([c for c in found if c.key not in ("model", "data.path")], "out")
    said = str(refusal.value)
    assert "lsp.train_other was false, now true" in said
    assert "resume with lsp.train_other=false, or start afresh with train.overwrite=true or another output_dir" in said
    assert "train.resume=false" not in said and "train.steps" not in said


def test_a_change_in_a_section_the_run_does_not_read_is_not_weighed():
    """chunk.n_chunks is refused under engine=chunk, and nothing under engine=resident."""
    before = config.to_dict(engine_config(engine="resident"))
    cfg = engine_config(engine="resident")
    cfg.section("chunk").n_chunks = 4
    (change,) = resume_settings.changes(before, cfg)
    assert change.key == "chunk.n_chunks" and not change.weighed
    resume_settings.refuse([change], "out")  # nothing to refuse
    chunked = config.to_dict(engine_config(engine="chunk", method="full"))
    cfg = engine_config(engine="chunk", method="full")
    cfg.section("chunk").n_chunks = 4
    with pytest.raises(UserError, match="chunk.n_chunks was 8, now 4"):
        resume_settings.refuse(resume_settings.changes(chunked, cfg), "out")


def test_an_applied_change_is_announced_with_its_effect():
    before = config.to_dict(engine_config(engine="lsp", method="full"))
    cfg = engine_config(engine="lsp", method="full")
    cfg.section("lsp").r = 2
    (change,) = resume_settings.changes(before, cfg)
    assert change.text() == f"lsp.r: 4 -> 2 ({resume_settings.rule('lsp.r').why})"
    assert "fit at the next step" in change.text()


# ---------------------------------------------------------------- item 15: what a refusal names


def _state(engine: str, names: list[str]):
    from slimtune.store.checkpoint import EngineState

    return EngineState(engine=engine, step=1, trainable={n: torch.zeros(1) for n in names}, exp_avg={}, exp_avg_sq={},
                       adam_steps={})


def test_an_auto_setting_that_resolves_otherwise_is_a_change_under_its_rule_and_a_record_without_it_none():
    before = config.to_dict(engine_config(engine="slide", method="full"))
    cfg = engine_config(engine="slide", method="full")
    assert cfg.precision == "auto"
    then, now = {"device": "cuda", "precision": "bf16"}, {"device": "cpu", "precision": "fp32"}
    device, precision = resume_settings.changes(before, cfg, then, now)
    assert precision.text() == ("precision: 'auto' (bf16 at the last start) -> 'auto' (fp32 now)"
                                f" ({resume_settings.rule('precision').why})")
    assert device.text() == "device: 'auto' (cuda at the last start) -> 'auto' (cpu now)"  # safe: no effect said
    assert resume_settings.changes(before, cfg, now, now) == []
    assert resume_settings.changes(before, cfg, None, now) == []  # run.json from before "resolved" was kept
    cfg.precision = "fp32"  # a changed setting is said once, as the setting's own change
    found = {c.key: c.text() for c in resume_settings.changes(before, cfg, then, now)}
    assert list(found) == ["precision", "device"] and found["precision"].startswith("precision: 'auto' -> 'fp32' (")


def test_a_checkpoint_of_other_tensors_names_the_engine_or_lsp_train_other_and_the_true_way_out():
    linears, others = ["model.layers.0.mlp.up_proj.weight"], ["model.embed_tokens.weight"]
    with pytest.raises(UserError) as by_engine:  # an lsp checkpoint resumed by engine resident
        check_resumable(_state("lsp", linears), linears + others, "resident")
    with pytest.raises(UserError) as by_setting:  # lsp.train_other changed (a folder without run.json)
        check_resumable(_state("lsp", linears), linears + others, "lsp", decided_by="lsp.train_other")
    assert "written by engine lsp" in str(by_engine.value) and "engine=lsp" in str(by_engine.value)
    assert "lsp.train_other differ(s)" in str(by_setting.value)
    for said in (str(by_engine.value), str(by_setting.value)):
        assert "train.overwrite=true or another output_dir" in said
        assert "train.resume=false" not in said and "lora.*" not in said


def test_a_changed_data_stream_names_its_setting_and_the_true_way_out():
    from slimtune.data.dataset import BatchStream, Example

    examples = [Example([1, 2, 3, 4], [-100, 2, 3, 4]) for _ in range(8)]
    saved = BatchStream(examples, 2, 8, False, 0, 0).state_dict()
    cases = {"train.batch_size was 2, now 4; resume with train.batch_size=2": BatchStream(examples, 4, 8, False, 0, 0),
             "the training data give 6 examples where the checkpoint's gave 8 (the data at data.path":
                 BatchStream(examples[:6], 2, 8, False, 0, 0)}
    for want, stream in cases.items():
        with pytest.raises(UserError) as refusal:
            stream.load_state_dict(saved)
        assert want in str(refusal.value), str(refusal.value)
        assert str(refusal.value).endswith("or start afresh with train.overwrite=true or another output_dir.")
        assert "train.resume=false" not in str(refusal.value)


def test_a_train_config_default_change_is_seen():
    """changes() compares flattened values: a list setting (train.betas) counts too."""
    before = config.to_dict(engine_config())
    cfg = engine_config(train=TrainConfig(betas=[0.8, 0.99]))
    assert [(c.key, c.rule.kind) for c in resume_settings.changes(before, cfg)] == [("train.betas", SAFE)]
