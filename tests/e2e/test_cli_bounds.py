"""A damaged config.json, absurd sizes and other engines' settings through the command line (issue 28):
one sentence and exit 2 from every command that reads the model, a warning line for settings the run
will not read. In-process (cli.main): the same code path as the console script, without a start-up each."""

import json

import pytest

from e2e_helpers import workdir  # noqa: F401  (a fixture)
from slimtune import cli


@pytest.fixture()
def trained(workdir, monkeypatch):
    """workdir with a one-step LoRA run in out/ (export, chat and eval need one)."""
    monkeypatch.chdir(workdir)
    assert cli.main(["train", "run.yaml", "train.steps=1", "train.warmup_steps=0", "train.save_every=0",
                     "train.eval_every=0", "lora.dropout=0", "--no-progress"]) == 0
    return workdir


def _break_config(folder, **fields) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


COMMANDS = {
    "train": ["train", "run.yaml", "output_dir=again", "--no-progress"],
    "plan": ["plan", "--model", "model", "--gpu", "8GiB", "--seq", "32"],
    "chat": ["chat", "out", "--prompt", "hi", "--device", "cpu"],
    "eval": ["eval", "out", "--data", "train.jsonl", "--device", "cpu"],
    "export": ["export", "out", "--merge", "--out", "merged"],
}


def test_every_command_names_config_jsons_field(trained, capsys):
    """num_attention_heads: 0 was a ZeroDivisionError; now the same sentence from every command."""
    _break_config(trained / "model", num_attention_heads=0)
    capsys.readouterr()
    for name, argv in COMMANDS.items():
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err  # the run's commands name the base model by its resolved path
        assert err.startswith("slimtune: error: ") and err.count("\n") == 1, f"{name}: {err}"
        assert err.endswith("model/config.json: num_attention_heads must be a positive whole number, got 0.\n"), err
    assert not (trained / "again").exists() and not (trained / "merged").exists()


def test_a_million_claimed_layers_are_refused_at_once_by_train_and_plan(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    _break_config(workdir / "model", num_hidden_layers=10**6)
    says = ("slimtune: error: model folder 'model': config.json says num_hidden_layers is 1,000,000 but the weights in "
            "model.safetensors are those of 2 layers; one of them is damaged or another model's.\n")
    for argv in (COMMANDS["train"], COMMANDS["plan"]):
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == says
    assert not (workdir / "again").exists()


def test_settings_of_another_engine_are_said_once_and_a_mistyped_one_is_placed(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    with (workdir / "run.yaml").open("a") as f:
        f.write("chunk: {n_chunks: 4}\n")
    assert cli.main(["train", "run.yaml", "train.steps=1", "train.save_every=0", "train.eval_every=0",
                     "train.warmup_steps=0", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count("slimtune: warning:") == 1
    assert "slimtune: warning: chunk.n_chunks is set but engine is resident: ignored.\n" in err
    assert cli.main(["train", "run.yaml", "chunk.nchunks=4", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("slimtune: error: unknown key 'chunk.nchunks' on the command line (did you "
                                       "mean 'chunk.n_chunks'?).\n")


@pytest.mark.parametrize("size", ["0GiB", "-2GB"])
def test_a_card_size_that_is_not_positive_is_said_so_by_plan_and_train(workdir, monkeypatch, capsys, size):
    monkeypatch.chdir(workdir)
    says = (f"slimtune: error: a GPU size must be a positive number of GiB, GB, G, MiB, MB or M, such as 24GiB or "
            f"500MiB; got '{size}'.\n")
    assert cli.main(["plan", "--model", "model", f"--gpu={size}"]) == 2
    assert capsys.readouterr().err == says
    assert cli.main(["train", "run.yaml", "plan=auto", f"--gpu={size}", "--no-progress"]) == 2
    assert capsys.readouterr().err == says
    assert not (workdir / "out").exists()
