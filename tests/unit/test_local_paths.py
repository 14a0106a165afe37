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


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed: refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def endpoint(monkeypatch):
    """set(url): huggingface_hub's endpoint for this test, no proxy, and no probe remembered from another."""
    from huggingface_hub import constants

    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(local_paths, "_probed", {})
    return lambda url: monkeypatch.setattr(constants, "ENDPOINT", url)


def test_a_typo_beside_a_local_file_is_a_local_path_and_hub_names_stay_hub_names(here):
    (here / "meta-llama" / "Llama-3.1-8B").mkdir(parents=True)
    assert local_paths.a_typo_here("data/train.josnl")
    assert not local_paths.a_typo_here("data/other.csv")  # nothing near: a name to look up
    assert not local_paths.a_typo_here("yahma/alpaca-cleaned") and not local_paths.a_typo_here("train.jsonl")
    assert not repository.is_hub_dataset("data/train.josnl") and repository.is_hub_dataset("yahma/alpaca-cleaned")
    # One Hub organisation's model beside the run does not hide the organisation's others.
    assert hub.is_hub_name("meta-llama/Llama-3.2-1B") and not hub.is_hub_name("meta-llama/Llama-3.1-8B")


def test_a_missing_path_offers_the_nearest_names_of_its_folder_and_only_close_ones(here):
    (here / "data" / "eval.jsonl").write_text("")
    assert local_paths.missing("data path", "data/train.josnl") == (
        "data path 'data/train.josnl' does not exist; did you mean 'data/train.jsonl'?")
    assert local_paths.missing("data path", "data/other.csv") == "data path 'data/other.csv' does not exist."
    assert local_paths.missing("model folder", "nowhere/model") == "model folder 'nowhere/model' does not exist."
    assert local_paths.offer("data/train.jsnl") == " (did you mean 'data/train.jsonl'?)"
    assert local_paths.offer("data/zzz") == ""


def test_a_mistyped_data_path_and_model_folder_are_one_sentence_through_the_cli(here, capsys, tokenizer, endpoint):
    from conftest import save_tiny_model

    endpoint(f"http://127.0.0.1:{closed_port()}")  # a model name is looked up: here the Hub cannot be reached
    save_tiny_model(here / "models" / "tiny", tokenizer)
    capsys.readouterr()  # the model's writing bars
    (here / "run.yaml").write_text("model: models/tiny\ndata: {path: data/train.jsonl}\noutput_dir: out\n")
    assert cli.main(["train", "run.yaml", "data.path=data/train.josnl", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "slimtune: error: data path 'data/train.josnl' does not exist; did you mean 'data/train.jsonl'?"
    assert cli.main(["train", "run.yaml", "model=models/tinny", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("slimtune: error: model 'models/tinny' is not a local folder (did you mean"
                          " 'models/tiny'?), and it is not in the Hub cache") and "cannot be reached" in err, err
    assert "Retrying" not in err and "\n" not in err
    assert not (here / "out").exists()


def test_the_hub_is_unreachable_where_no_connection_opens_and_a_proxy_is_left_to_the_library(monkeypatch, endpoint):
    endpoint(f"http://127.0.0.1:{closed_port()}")
    assert local_paths.hub_unreachable()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        endpoint(f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert not local_paths.hub_unreachable()
    endpoint(f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert not local_paths.hub_unreachable()


def test_a_probe_is_remembered_a_minute_then_asked_again(monkeypatch, endpoint):
    endpoint(f"http://127.0.0.1:{closed_port()}")
    asked, clock = [], [1000.0]
    monkeypatch.setattr(local_paths, "_connects", lambda url: asked.append(url) or False)
    monkeypatch.setattr(local_paths, "_now", lambda: clock[0])
    assert local_paths.hub_unreachable() and local_paths.hub_unreachable()
    clock[0] += local_paths.PROBE_KEPT_S + 1
    assert local_paths.hub_unreachable()
    assert len(asked) == 2


def test_a_hub_model_not_cached_where_the_hub_cannot_be_reached_is_said_without_retries(tmp_path, monkeypatch, capsys,
                                                                                         endpoint):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    endpoint(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(Exception) as raised:
        hub.folder("some-org/some-model")
    assert "is not in the Hub cache" in str(raised.value) and "the Hub cannot be reached" in str(raised.value)
    assert "Retrying" not in capsys.readouterr().err  # nothing was asked of the Hub
