"""Hub datasets in (slimtune/data/repository.py): a folder laid out as a Hub dataset repository (data/
parquet shards, a README.md whose YAML names two configs and their splits) read through datasets'
repository path, and the same dataset by name (`org/sums`) from datasets' offline cache, each giving
exactly the examples the same records give from a local .jsonl; the eval split a second split; a wrong
split or subset, a split of a single file and an uncached name offline each one sentence."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from conftest import write_jsonl
from slimtune.config import DataConfig
from slimtune.data.dataset import load_splits
from slimtune.errors import UserError

SUMS = [{"prompt": f"what is {a} plus {b}?", "response": f" {a + b}"} for a in range(6) for b in range(6)]
TRAIN, TEST = SUMS[:30], SUMS[30:]
QA = [{"question": f"name {n}?", "answer": f" {n}"} for n in range(8)]
README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
- config_name: qa
  data_files:
  - split: train
    path: qa/train-*.parquet
---
# sums
Sums of two digits, and a few questions.
"""


def write_repository(folder: Path) -> Path:
    """The dataset as a Hub repository holds it: train in two parquet shards, test in one, a second config."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for sub, split, rows, shards in (("data", "train", TRAIN, 2), ("data", "test", TEST, 1), ("qa", "train", QA, 1)):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        for k in range(shards):
            part = rows[k * len(rows) // shards:(k + 1) * len(rows) // shards]
            pq.write_table(pa.Table.from_pylist(part), folder / sub / f"{split}-{k:05d}-of-{shards:05d}.parquet")
    (folder / "README.md").write_text(README)
    return folder


@pytest.fixture()
def offline(tmp_path, monkeypatch) -> Path:
    """Empty Hub and datasets caches of this test, offline. datasets and huggingface_hub read these
    variables once, when imported: the values they read are set beside the variables."""
    import datasets
    from huggingface_hub import constants

    cache = tmp_path / "datasets-cache"
    for name, value in (("HF_HOME", str(tmp_path / "hf-home")), ("HF_DATASETS_CACHE", str(cache)),
                        ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return cache


def cache_as_a_first_load_leaves_it(repository: Path, cache: Path, name: str) -> None:
    """What loading `name` with a connection leaves in the datasets cache (each config prepared as arrow
    files under org___name/<config>/<version>/<hash>/), made from the same repository read locally."""
    import datasets

    for config in ("default", "qa"):
        datasets.load_dataset(str(repository), config, cache_dir=str(cache))
    org, dataset = name.split("/")
    (cache / repository.name).rename(cache / f"{org}___{dataset}")


def examples(tokenizer, **data):
    splits = load_splits(DataConfig(**{"max_length": 32, **data}), tokenizer, seed=0)
    return splits.train, splits.eval


def as_local_files(tmp_path: Path, tokenizer, **fields):
    """The plain way: the same records from .jsonl files, evaluation from a second file."""
    train = write_jsonl(tmp_path / "train.jsonl", fields.pop("train"))
    held = write_jsonl(tmp_path / "eval.jsonl", fields.pop("eval"))
    return examples(tokenizer, path=str(train), eval_path=str(held), **fields)


@pytest.mark.quick
def test_a_folder_laid_out_as_a_hub_repository_reads_its_splits_and_subsets(tmp_path, tokenizer):
    repository = write_repository(tmp_path / "sums")
    expected = as_local_files(tmp_path, tokenizer, train=TRAIN, eval=TEST)
    assert examples(tokenizer, path=str(repository), eval_split="test") == expected
    assert examples(tokenizer, path=str(repository), split="test", eval_split="train") == expected[::-1]
    qa_train, _ = examples(tokenizer, path=str(repository), subset="qa", prompt_field="question",
                           response_field="answer", eval_fraction=0.0)
    plain, _ = as_local_files(tmp_path, tokenizer, train=QA, eval=QA[:1], prompt_field="question",
                              response_field="answer")
    assert qa_train == plain


def test_a_hub_dataset_by_name_reads_from_the_datasets_cache_offline(tmp_path, tokenizer, offline):
    cache_as_a_first_load_leaves_it(write_repository(tmp_path / "sums"), offline, "org/sums")
    shutil.rmtree(tmp_path / "sums")  # nothing local: only the cache answers
    expected = as_local_files(tmp_path, tokenizer, train=TRAIN, eval=TEST)
    assert examples(tokenizer, path="org/sums", eval_split="test") == expected
    qa_train, _ = examples(tokenizer, path="org/sums", subset="qa", prompt_field="question",
                           response_field="answer", eval_fraction=0.0)
    assert qa_train == as_local_files(tmp_path, tokenizer, train=QA, eval=QA[:1], prompt_field="question",
                                      response_field="answer")[0]


def refusal(tokenizer, **data) -> str:
    with pytest.raises(UserError) as caught:
        examples(tokenizer, **data)
    return str(caught.value)


def test_a_wrong_split_or_subset_names_the_setting_and_the_choices(tmp_path, tokenizer, offline):
    repository = write_repository(tmp_path / "sums")
    said = refusal(tokenizer, path=str(repository), eval_split="validation")
    assert said == f"data.eval_split 'validation' is not a split of data.path '{repository}'; it has: train, test."
    said = refusal(tokenizer, path=str(repository), subset="nope")
    assert said == f"data.subset 'nope' is not a subset of data.path '{repository}'; it has: default, qa."
    file = write_jsonl(tmp_path / "t.jsonl", TRAIN)
    assert "data.split names a split or subset of a Hub dataset or a dataset folder, but data.path" in refusal(
        tokenizer, path=str(file), split="train")


def test_an_uncached_hub_dataset_offline_is_one_sentence(tokenizer, offline):
    said = refusal(tokenizer, path="org/absent")
    assert said.startswith("data.path 'org/absent' is not in the datasets cache") and "HF_HUB_OFFLINE" in said
    assert "does not exist" in refusal(tokenizer, path="data/missing.jsonl")  # a file's name is never fetched


def test_a_run_trains_on_a_hub_dataset_by_name_and_evaluates_on_its_second_split(tmp_path, tokenizer, offline,
                                                                                monkeypatch, capsys):
    from conftest import save_tiny_model
    from slimtune import cli

    cache_as_a_first_load_leaves_it(write_repository(tmp_path / "sums"), offline, "org/sums")
    save_tiny_model(tmp_path / "model", tokenizer)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--no-progress", "model=model", "data.path=org/sums", "data.eval_split=test",
                     "data.max_length=32", "train.steps=2", "train.batch_size=4", "lora.rank=4", "output_dir=out"]) == 0
    assert "30 train / 6 eval examples" in capsys.readouterr().out


def test_where_the_hub_cannot_be_reached_a_cached_dataset_is_read_at_once(tmp_path, tokenizer, monkeypatch, capsys):
    """HF_HUB_OFFLINE unset and no connection: datasets in this process would ask the Hub, five retries over
    about 25 s, before reading its cache. A process of its own started offline reads it instead, so this
    process never calls datasets for it; an uncached name is one sentence that does not blame HF_HUB_OFFLINE."""
    from huggingface_hub import constants

    from slimtune import local_paths
    from slimtune.data import repository

    cache = tmp_path / "datasets-cache"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))  # the reader's process reads these
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cache_as_a_first_load_leaves_it(write_repository(tmp_path / "sums"), cache, "org/sums")
    shutil.rmtree(tmp_path / "sums")
    monkeypatch.setattr(local_paths, "hub_unreachable", lambda: True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as huggingface_hub read it (the variable unset)

    def asked_here(*args):
        raise AssertionError("datasets was asked in this process")

    monkeypatch.setattr(repository, "_load_by_name", asked_here)
    expected = as_local_files(tmp_path, tokenizer, train=TRAIN, eval=TEST)
    assert examples(tokenizer, path="org/sums", eval_split="test") == expected
    assert "slimtune: the Hub cannot be reached from here: data.path 'org/sums' is read from the datasets cache" in \
        capsys.readouterr().err
    with monkeypatch.context() as rank_1:  # under torchrun every rank reads it, and rank 0 alone says so
        rank_1.setenv("WORLD_SIZE", "2")
        rank_1.setenv("RANK", "1")
        assert examples(tokenizer, path="org/sums", eval_split="test") == expected
        assert "cannot be reached" not in capsys.readouterr().err
    said = refusal(tokenizer, path="org/absent")
    assert said == (f"data.path 'org/absent' is not in the datasets cache ({cache}) and the Hub cannot be reached from"
                    " here; check the connection, or fetch it once where there is one.")


@pytest.mark.parametrize("reader, said", [
    ("echo 'MemoryError: the reader ran out' >&2; exit 1", "MemoryError: the reader ran out"),
    ('printf "\\200\\004" > "$4"; exit 0', "exit code 0"),  # a torn answer (args: -m MODULE ASKED ANSWER)
    ("exit 0", "exit code 0"),  # no answer at all
], ids=["dies", "torn", "silent"])
def test_a_cache_reader_that_fails_is_one_sentence(tmp_path, tokenizer, monkeypatch, reader, said):
    from slimtune.data import repository

    monkeypatch.setattr(repository, "_hub_unreachable", lambda: True)
    script = tmp_path / "reader"
    script.write_text(f"#!/bin/sh\n{reader}\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))
    assert refusal(tokenizer, path="org/sums") == f"data.path 'org/sums' could not be read from the datasets cache ({said})."


@pytest.mark.parametrize("status", [401, 403])
def test_a_gated_hub_dataset_without_access_says_how_to_get_it(tmp_path, tokenizer, monkeypatch, status):
    """A Hub endpoint on 127.0.0.1 refusing as the Hub refuses a gated dataset to someone without access."""
    import http.server
    import threading

    import datasets
    from huggingface_hub import constants

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name is http.server's
            self.send_response(status)
            self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for module, name, value in ((constants, "ENDPOINT", endpoint), (constants, "HF_HUB_OFFLINE", False),
                                (constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache")),
                                (constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"),
                                (datasets.config, "HF_ENDPOINT", endpoint), (datasets.config, "HF_HUB_OFFLINE", False),
                                (datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")):
        monkeypatch.setattr(module, name, value)
    try:
        said = refusal(tokenizer, path="org/gated")
    finally:
        server.shutdown()
        server.server_close()
    assert said.startswith(f"data.path 'org/gated' is a gated dataset: accept its terms at {endpoint}/datasets/org/gated")
    assert "HF_TOKEN" in said


def eval_cases(tokenizer, run_data: dict, path: str, overrides: list[str] = ()) -> list[str]:
    """The references `slimtune eval --data path` answers, the run having trained with `run_data`."""
    from pathlib import Path as P

    from slimtune.serve import evaluate, inference

    source = inference.Source(P("run"), "lora run", P("model"), data={"max_length": 32, **run_data})
    prepared = evaluate.prepare(evaluate.data_config(source, path, None, list(overrides)), tokenizer, 4)
    assert len(prepared.cases) == prepared.examples  # every record scored is answered, and no other
    return [reference for _, reference in prepared.cases]


def test_eval_answers_the_split_and_subset_it_scores(tmp_path, tokenizer):
    """slimtune eval on a dataset with splits and subsets: the answers are of the records the loss is of,
    the split and subset named, not the default split of the default subset."""
    repository = str(write_repository(tmp_path / "sums"))
    assert eval_cases(tokenizer, {}, repository, ["data.split=test"]) == [r["response"] for r in TEST]
    qa = ["data.subset=qa", "data.prompt_field=question", "data.response_field=answer"]
    assert eval_cases(tokenizer, {}, repository, qa) == [r["answer"] for r in QA]
    # A run that trained on the repository's train split and evaluated on its test split, scored on test
    # (the run's subset kept: the same dataset), and on a file of its own (no split carried to a file).
    run = {"path": repository, "split": "train", "eval_split": "test"}
    assert eval_cases(tokenizer, run, repository, ["data.split=test"]) == [r["response"] for r in TEST]
    file = write_jsonl(tmp_path / "held.jsonl", TEST[:4])
    assert eval_cases(tokenizer, {**run, "subset": "default"}, str(file)) == [r["response"] for r in TEST[:4]]
