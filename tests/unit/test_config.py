"""Config: the README's example config loads as written; mistakes are refused by key."""

import pytest

from slimtune import config
from slimtune.errors import UserError

CONTRACT = """\
model: path/to/hf-folder
data:
  path: data/train.jsonl
  format: chat            # chat | prompt_response | text
  max_length: 512
method: lora              # lora | full
lora: {rank: 16, alpha: 32, targets: all-linear}
engine: resident
train: {steps: 100, batch_size: 4, lr: 2.0e-4}
output_dir: runs/demo
"""


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_contract_config_loads(tmp_path):
    cfg = config.load(write(tmp_path, CONTRACT))
    assert cfg.model == "path/to/hf-folder"
    assert cfg.data.format == "chat" and cfg.data.max_length == 512
    assert cfg.lora.rank == 16 and cfg.lora.alpha == 32.0 and cfg.lora.targets == "all-linear"
    assert cfg.train.lr == 2.0e-4 and cfg.train.steps == 100
    assert cfg.output_dir == "runs/demo"


def test_overrides_apply_with_yaml_types(tmp_path):
    cfg = config.load(write(tmp_path, CONTRACT), ["train.steps=7", "lora.targets=[q_proj, v_proj]", "train.lr=1e-3"])
    assert cfg.train.steps == 7
    assert cfg.lora.targets == ["q_proj", "v_proj"]
    assert cfg.train.lr == 1e-3


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.stepz=3"], "unknown key 'train.stepz'"),
        (["train.steps=abc"], "train.steps must be an integer"),
        (["train.steps=0"], "train.steps must be positive"),
        (["method=adapter"], "method must be one of lora, full"),
        (["lora.dropout=1.5"], "lora.dropout must be in [0, 1)"),
        (["data.eval_fraction=1"], "data.eval_fraction must be in [0, 1)"),
        (["train.warmup_steps=500"], "train.warmup_steps (500) exceeds train.steps (100)"),
        (["train=5"], "train on the command line must be a mapping, got int"),
        (["oops"], "override 'oops' must look like a.b=value"),
        (["method=full", "loss.mode=subset"], "loss.mode=subset needs a frozen LM head"),
        (["method=full", "quant.scheme=nf4"], "quant.scheme=nf4 quantizes frozen weights, but method=full trains every"
                                              " weight; use method=lora"),
        (["activations.checkpoint=tape"], "activations.checkpoint must be one of none, recompute, host, disk"),
        (["log.wandb=my-project"], "log.wandb must be true or false, got 'my-project'"),
        (["log.wandb_mode=cloud"], "log.wandb_mode must be one of online, offline; got 'cloud'"),
        (["log.wandb_project=team/demo"], "log.wandb_project must not contain any of / \\ # ? % :, got 'team/demo'"),
        (["log.run_name="], "log.run_name is empty; give a name or leave it out for the default."),
    ],
)
def test_mistakes_name_the_key(tmp_path, overrides, needle):
    with pytest.raises(UserError) as err:
        config.load(write(tmp_path, CONTRACT), overrides)
    assert needle in str(err.value)


def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(UserError, match=r"did you mean 'output_dir'"):
        config.load(write(tmp_path, CONTRACT.replace("output_dir", "output_dri")))


def test_missing_required_and_bad_yaml(tmp_path):
    with pytest.raises(UserError, match="missing required key 'model'"):
        config.load(write(tmp_path, "data: x.jsonl\n"))
    with pytest.raises(UserError, match=r"run.yaml line 2: not valid YAML"):
        config.load(write(tmp_path, "model: a\n  data: : b\n"))
    with pytest.raises(UserError, match="config file 'nope.yaml' does not exist"):
        config.load("nope.yaml")


def test_every_field_has_help():
    lines = config.help_text()
    assert any(line.strip().startswith("train.lr") for line in lines)
    assert all(len(line.split(None, 2)) == 3 for line in lines)


def test_example_configs_load():
    from pathlib import Path

    examples = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert examples
    for path in examples:
        assert path.read_text().startswith("# slimtune train "), f"{path.name} must start with its command"
        config.load(path)
