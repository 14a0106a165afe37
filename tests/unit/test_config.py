"""Config: the README's example config loads as written; mistakes are refused by key; config.py
reads settings with no engine imported, and the checks that need the engines (engines.settings) say
the same sentences of a built-in engine and of one a test registers."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from slimtune import config, engines
from slimtune.config import setting
from slimtune.engines import settings
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


@pytest.mark.quick
def test_contract_config_loads(tmp_path):
    cfg = settings.load(write(tmp_path, CONTRACT))
    assert cfg.model == "path/to/hf-folder"
    assert cfg.data.format == "chat" and cfg.data.max_length == 512
    assert cfg.lora.rank == 16 and cfg.lora.alpha == 32.0 and cfg.lora.targets == "all-linear"
    assert cfg.train.lr == 2.0e-4 and cfg.train.steps == 100
    assert cfg.output_dir == "runs/demo"


@pytest.mark.quick
def test_overrides_apply_with_yaml_types(tmp_path):
    cfg = settings.load(write(tmp_path, CONTRACT), ["train.steps=7", "lora.targets=[q_proj, v_proj]", "train.lr=1e-3"])
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
        settings.load(write(tmp_path, CONTRACT), overrides)
    assert needle in str(err.value)


@pytest.mark.quick
def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(UserError, match=r"did you mean 'output_dir'"):
        settings.load(write(tmp_path, CONTRACT.replace("output_dir", "output_dri")))


@pytest.mark.quick
@pytest.mark.parametrize("key, what", [("model", "a model folder or a Hub name"), ("output_dir", "the run's folder"),
                                       ("data.path", "a data file, a folder or a Hub dataset")])
def test_an_empty_path_is_refused(tmp_path, key, what):
    """`output_dir=` wrote the run into the current folder; `data.path=` leaked a reader's IndexError."""
    with pytest.raises(UserError) as err:
        settings.load(write(tmp_path, CONTRACT), [f"{key}="])
    assert str(err.value) == f"{key} is empty; name {what}."


def test_a_bare_star_pattern_on_the_command_line_asks_for_quotes(tmp_path):
    with pytest.raises(UserError) as err:
        settings.load(write(tmp_path, CONTRACT), ["method=full", "freeze=[*embed_tokens*]"])
    assert str(err.value).startswith("override 'freeze=[*embed_tokens*]': quote each pattern, as"
                                     " freeze=\"['*embed_tokens*']\" (YAML reads a bare * as an alias")
    with pytest.raises(UserError) as err:
        settings.load(write(tmp_path, CONTRACT), ["lora.targets=*q*"])
    assert str(err.value).startswith("override 'lora.targets=*q*': quote each pattern, as lora.targets=\"['*q*']\"")
    cfg = settings.load(write(tmp_path, CONTRACT), ["method=full", "freeze=['*embed_tokens*']"])
    assert cfg.freeze == ["*embed_tokens*"]


@pytest.mark.quick
def test_a_key_given_twice_in_the_file_is_refused_with_both_lines(tmp_path):
    """YAML keeps the last of two equal keys without a word (found by a newcomer walkthrough)."""
    path = write(tmp_path, CONTRACT + "dist:\n  timeout_s: 3\n  timeout_s: 4\n")
    with pytest.raises(UserError) as err:
        settings.load(path)
    first = path.read_text().splitlines().index("  timeout_s: 3") + 1
    assert str(err.value) == f"{path} line {first + 1}: 'dist.timeout_s' is given twice (first on line {first}); keep one."
    with pytest.raises(UserError, match=r"line 11: 'train' is given twice \(first on line 9\)"):
        settings.load(write(tmp_path, CONTRACT + "train: {steps: 5}\n"))


@pytest.mark.quick
def test_a_mistyped_section_on_the_command_line_is_placed_there(tmp_path):
    """`trian.steps=3` was blamed on the YAML file: the place of a key given under the section counts."""
    with pytest.raises(UserError) as err:
        settings.load(write(tmp_path, CONTRACT), ["trian.steps=3"])
    assert str(err.value) == "unknown key 'trian' on the command line (did you mean 'train'?)."


@pytest.mark.quick
@pytest.mark.parametrize("given, meant", [("steps", "train.steps"), ("rank", "lora.rank"), ("slots", "slide.slots"),
                                          ("lr", "train.lr")])
def test_a_setting_given_without_its_section_names_the_section(tmp_path, given, meant):
    """`steps=5` named no suggestion (and `rank=8` suggested 'train', a look-alike): the section's setting
    of that name comes first (found by a newcomer walkthrough)."""
    with pytest.raises(UserError) as err:
        settings.load(write(tmp_path, CONTRACT), [f"{given}=5"])
    assert str(err.value) == f"unknown key '{given}' on the command line (did you mean '{meant}'?)."


@pytest.mark.quick
def test_missing_required_and_bad_yaml(tmp_path):
    with pytest.raises(UserError, match="missing required key 'model'"):
        settings.load(write(tmp_path, "data: x.jsonl\n"))
    with pytest.raises(UserError, match=r"run.yaml line 2: not valid YAML"):
        settings.load(write(tmp_path, "model: a\n  data: : b\n"))
    with pytest.raises(UserError, match="config file 'nope.yaml' does not exist"):
        settings.load("nope.yaml")


@pytest.mark.quick
def test_a_config_that_is_a_folder_or_a_typo_is_said_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "model: a\ndata: x.jsonl\n")  # run.yaml
    (tmp_path / "data").mkdir()
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "config.yaml").write_text("model: a\n")
    for given, said in (("data", "config file 'data' is a folder, not a YAML file."),
                        ("runs/demo", "config file 'runs/demo' is a folder, not a YAML file (a run's folder: its"
                                      " settings are in config.yaml there)."),
                        ("run.yml", "config file 'run.yml' does not exist; did you mean 'run.yaml'?")):
        with pytest.raises(UserError) as raised:
            settings.load(given)
        assert str(raised.value) == said


@pytest.mark.quick
def test_every_field_has_help():
    lines = settings.help_text()
    assert any(line.strip().startswith("train.lr") for line in lines)
    assert all(len(line.split(None, 2)) == 3 for line in lines)


@pytest.mark.quick
def test_the_help_s_columns_fit_the_longest_key_and_wrap_to_the_width_asked():
    """The key column was 22 wide and longer keys (roundpipe.memory_fraction) pushed their rows out of line; a
    terminal gets each help wrapped under its column, a pipe one whole line a key."""
    whole = settings.help_text()
    column = whole[0].index("A local Hugging Face model folder")  # model's help
    assert all(len(line) >= column and line[column - 1] == " " for line in whole)  # every help starts there
    assert all(line[column] != " " for line in whole if not line.lstrip().startswith(("(an engine)",)))
    wrapped = [part for entry in settings.help_text(width=100) for part in entry.split("\n")]
    assert len(wrapped) > len(whole) and all(len(part) <= 100 for part in wrapped)
    assert all(part.startswith(" " * column) for entry in settings.help_text(width=100) for part in entry.split("\n")[1:])


@pytest.mark.quick
def test_example_configs_load():
    from pathlib import Path

    examples = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert examples
    for path in examples:
        assert path.read_text().startswith("# slimtune train "), f"{path.name} must start with its command"
        settings.load(path)


# ---------------------------------------------------------------- a config does not depend on what was imported

ALONE = textwrap.dedent("""
    import sys
    from dataclasses import dataclass

    from slimtune import config
    from slimtune.errors import UserError

    @dataclass
    class Slots:
        slots: int = config.setting(2, "a section the caller hands in")

        def validate(self):
            pass

    contract, with_section = sys.argv[1:]
    found = config.read(contract, ["train.steps=7"])
    assert found.cfg.engine == "resident" and found.cfg.train.steps == 7 and found.cfg.sections == {}
    assert found.given[-1] == "train.steps" and found.cfg.lora.rank == 16
    try:
        config.read(with_section)
    except UserError as err:
        assert str(err).startswith("unknown key 'slide' in "), err
    else:
        raise AssertionError("an engine section nobody handed in was read")
    assert config.read(with_section, sections={"slide": Slots}).cfg.section("slide").slots == 3
    assert "slimtune.engines" not in sys.modules and "torch" not in sys.modules, sorted(sys.modules)
""")


def test_config_reads_a_file_in_a_fresh_interpreter_with_no_engine_imported(tmp_path):
    with_section = tmp_path / "slide.yaml"
    with_section.write_text(CONTRACT + "slide: {slots: 3}\n")
    proc = subprocess.run([sys.executable, "-c", ALONE, str(write(tmp_path, CONTRACT)), str(with_section)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.quick
def test_every_engine_section_is_completed_with_its_defaults_and_a_copy_shares_none():
    cfg = settings.load(None, ["engine=chunk", "method=full", "chunk.n_chunks=4"], base={"model": "m", "data": "d"})
    assert set(cfg.sections) == set(settings.sections()) and cfg.section("chunk").n_chunks == 4
    bare = config.read(None, base={"model": "m", "data": "d"}).cfg
    assert bare.sections == {} and settings.complete(bare).section("chunk") == type(cfg.section("chunk"))()
    other = dataclasses.replace(cfg, engine="resident")
    assert other.sections is not cfg.sections


@pytest.mark.quick
def test_an_unknown_engine_is_named_with_the_close_one():
    with pytest.raises(UserError) as err:
        settings.load(None, ["engine=slid"], base={"model": "m", "data": "d"})
    assert str(err.value) == f"engine must be one of {', '.join(engines.names())}; got 'slid' (did you mean 'slide'?)."
    assert {"resident", "slide"} <= set(engines.names())


@dataclasses.dataclass
class PluginConfig:
    momentum: float = setting(0.0, "engine=plugin: SGD momentum.")

    def validate(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise UserError(f"plugin.momentum must be in [0, 1), got {self.momentum}.")


def plugin_validate(cfg) -> None:
    if cfg.method != "full":
        raise UserError("engine=plugin trains every weight; set method=full.")


@pytest.fixture()
def plugin():
    engines.register(engines.EngineSpec(name="plugin", summary="an engine a test registers.", build=None,
                                        step_time=None, section=PluginConfig, validate=plugin_validate))
    yield
    engines.unregister("plugin")


def refusal(*overrides: str) -> str:
    with pytest.raises(UserError) as err:
        settings.load(None, list(overrides), base={"model": "m", "data": "d"})
    return str(err.value)


def test_an_engine_registered_in_a_test_is_read_checked_and_helped_like_a_built_in(plugin):
    cfg = settings.load(None, ["engine=plugin", "method=full", "plugin.momentum=0.5"], base={"model": "m", "data": "d"})
    assert cfg.section("plugin").momentum == 0.5 and cfg.section("slide") is not None
    assert refusal("engine=plugin") == "engine=plugin trains every weight; set method=full."
    assert refusal("engine=plugin", "method=full", "plugin.momentum=1.5") == "plugin.momentum must be in [0, 1), got 1.5."
    assert refusal("engine=plugn").endswith(", plugin; got 'plugn' (did you mean 'plugin'?).")
    assert refusal("plugin.momentm=0.5") == "unknown key 'plugin.momentm' on the command line (did you mean" \
                                            " 'plugin.momentum'?)."
    assert refusal("engine=plugin", "method=full", "quant.scheme=nf4").startswith(
        "quant.scheme=nf4 quantizes frozen weights, but method=full trains every weight, and engine=plugin trains full"
        " weights only; a 4-bit base needs method=lora, on engine ")
    lines = settings.help_text()
    assert any(line.split()[:2] == ["plugin", "(an"] and "an engine a test registers." in line for line in lines)
    assert any(line.strip().startswith("plugin.momentum") for line in lines)
    assert config.read(None, base={"model": "m", "data": "d"}).cfg.sections == {}  # config's reading never changes


def test_a_forgotten_engine_is_forgotten_by_the_settings(plugin):
    engines.unregister("plugin")
    assert refusal("plugin.momentum=0.5").startswith("unknown key 'plugin' on the command line")
    assert "plugin" not in settings.sections() and not any("plugin" in line for line in settings.help_text())


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_device_this_machine_lacks_is_one_sentence(name, monkeypatch):
    """device=cuda or cuda:N without CUDA, or cuda:N past the machine's cards (torch.cuda stood in for,
    with one card): a sentence naming the setting, not torch's assertion from deep inside the load."""
    from slimtune import assembly

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=f"device is '{name}' but no CUDA device is available; use device=auto"):
        assembly.resolve_device(name)
    # chat and eval take it as --device: the sentence spells it so
    with pytest.raises(UserError, match=f"^--device is '{name}' but no CUDA .* use --device auto or --device cpu"):
        assembly.resolve_device(name, flag=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    if name == "cuda:3":
        with pytest.raises(UserError, match="device is 'cuda:3' but this machine has 1 CUDA device"):
            assembly.resolve_device(name)
    else:
        assert assembly.resolve_device(name) == torch.device(name)


def test_precision_auto_is_bf16_on_a_card_with_bf16_of_its_own(monkeypatch):
    """auto: fp32 on the CPU and on a card that only emulates bf16 (T4, V100); bf16 on one that has it,
    and for a plan made with no card here (torch.cuda stood in for)."""
    from slimtune import assembly

    cuda = torch.device("cuda")
    assert assembly.resolve_precision("auto", torch.device("cpu")) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert assembly.resolve_precision("auto", cuda) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n or including_emulation)
        assert assembly.resolve_precision("auto", cuda) == expected
    assert assembly.resolve_precision("fp32", cuda) == "fp32"


def test_a_config_file_that_is_not_utf8_is_one_sentence_naming_its_line(tmp_path):
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"model: m\n# r\xe9glages\ndata: {path: t.jsonl}\noutput_dir: out\n")
    with pytest.raises(UserError) as caught:
        settings.load(path)
    assert str(caught.value) == f"{path} line 2: not UTF-8 text (byte 0xe9); save it as UTF-8."


def test_the_data_file_shorthand_takes_data_overrides(tmp_path):
    """`data: train.jsonl` (the shorthand for data.path) with data.max_length=32 on the command line: refused
    as "'data' is not a section" before."""
    cfg = settings.load(write(tmp_path, "model: m\ndata: train.jsonl\noutput_dir: out\n"), ["data.max_length=32"])
    assert cfg.data.path == "train.jsonl" and cfg.data.max_length == 32


def test_a_text_setting_that_yaml_reads_as_a_number_keeps_its_text(tmp_path):
    """output_dir=0755 (YAML 1.1 reads octal 493) or `output_dir: 2024` in the file: refused as "must be a
    string, got 493" before; a text setting takes the value as written."""
    cfg = settings.load(write(tmp_path, "model: m\ndata: {path: t.jsonl}\noutput_dir: 2024\n"))
    assert cfg.output_dir == "2024"
    cfg = settings.load(write(tmp_path, "model: m\ndata: {path: t.jsonl}\noutput_dir: out\n"), ["output_dir=0755"])
    assert cfg.output_dir == "0755"
    with pytest.raises(UserError, match="train.steps must be an integer"):  # a number setting is still checked
        settings.load(write(tmp_path, "model: m\ndata: {path: t.jsonl}\n"), ["train.steps=0755x"])


def test_an_empty_eval_path_is_refused_not_taken_for_none(tmp_path):
    with pytest.raises(UserError) as err:
        settings.load(write(tmp_path, CONTRACT), ["data.eval_path="])
    assert str(err.value) == "data.eval_path is empty; name one, or leave it out."
