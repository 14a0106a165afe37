"""A mistyped local path is said as missing at once, with the nearest names; a Hub name on a machine that
cannot reach the Hub is looked for in the cache at once, without huggingface_hub's retries (about 25 s)
(slimtune/local_paths.py; found by a newcomer walkthrough: `data.path=data/train.josnl` waited 27 s and
then blamed the connection)."""

import socket

import pytest

from conftest import write_jsonl
from slimtune import cli, local_paths
from slimtune.data import repository
from slimtune.model import hub

pytestmark = pytest.mark.quick


@pytest.fixture()
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", [{"prompt": "a", "response": "b"}])
    return tmp_path


def test_a_name_under_a_folder_here_is_a_local_path_and_others_stay_hub_names(here):
    assert local_paths.under_a_local_folder("data/train.josnl")
    assert not local_paths.under_a_local_folder("yahma/alpaca-cleaned")
    assert not local_paths.under_a_local_folder("train.jsonl")  # no folder part: not a Hub name either
    assert not repository.is_hub_dataset("data/train.josnl") and repository.is_hub_dataset("yahma/alpaca-cleaned")
    assert not hub.is_hub_name("data/SmolLM2") and hub.is_hub_name("HuggingFaceTB/SmolLM2-135M")


def test_a_missing_path_offers_the_nearest_names_of_its_folder_and_only_close_ones(here):
    (here / "data" / "eval.jsonl").write_text("")
    assert local_paths.missing("data path", "data/train.josnl") == (
        "data path 'data/train.josnl' does not exist; did you mean 'data/train.jsonl'?")
    assert local_paths.missing("data path", "data/other.csv") == "data path 'data/other.csv' does not exist."
    assert local_paths.missing("model folder", "nowhere/model") == "model folder 'nowhere/model' does not exist."


def test_a_mistyped_data_path_and_model_folder_are_one_sentence_through_the_cli(here, capsys, tokenizer):
    from conftest import save_tiny_model

    save_tiny_model(here / "models" / "tiny", tokenizer)
    capsys.readouterr()  # the model's writing bars
    (here / "run.yaml").write_text("model: models/tiny\ndata: {path: data/train.jsonl}\noutput_dir: out\n")
    for override, said in (("data.path=data/train.josnl",
                            "data path 'data/train.josnl' does not exist; did you mean 'data/train.jsonl'?"),
                           ("model=models/tinny", "model folder 'models/tinny' does not exist; did you mean"
                                                  " 'models/tiny'?")):
        assert cli.main(["train", "run.yaml", override, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"slimtune: error: {said}", err
    assert not (here / "out").exists()


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed: refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_hub_is_unreachable_where_no_connection_opens_and_a_proxy_is_left_to_the_library(monkeypatch):
    for name in local_paths.PROXIES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    assert local_paths.hub_unreachable()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert not local_paths.hub_unreachable()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert not local_paths.hub_unreachable()


def test_a_hub_model_not_cached_where_the_hub_cannot_be_reached_is_said_without_retries(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    for name in local_paths.PROXIES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(Exception) as raised:
        hub.folder("some-org/some-model")
    assert "is not in the Hub cache" in str(raised.value) and "the Hub cannot be reached" in str(raised.value)
    assert "Retrying" not in capsys.readouterr().err  # nothing was asked of the Hub
