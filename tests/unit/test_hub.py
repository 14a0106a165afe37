"""Hub names in (slimtune/model/hub.py): a model named `org/name` is found in a Hub cache laid out as
huggingface_hub documents it (models--org--name/refs, snapshots/<commit>/ linking into blobs/), offline,
so the library's own resolution runs; revision pinning; the refusals a user can meet (pickle-only
weights, gated, nothing cached) each one sentence with exit 2 through the CLI; a resume at another
commit refused; a plan from the cached config.json alone equal to the local folder's."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import shutil
import threading
from pathlib import Path

import pytest

from conftest import save_tiny_model, write_jsonl
from slimtune import cli
from slimtune.model import hub

NAME = "tiny-org/tiny-llama"
COMMITS = ("a" * 40, "b" * 40)


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """This test's own Hub cache, offline. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once,
    when imported: the values it read are set beside the variables a new process would read."""
    from huggingface_hub import constants

    folder = tmp_path / "hub"
    folder.mkdir()
    for name, value in (("HF_HOME", str(tmp_path / "hf-home")), ("HF_HUB_CACHE", str(folder)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def put_snapshot(cache: Path, name: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 only: tuple[str, ...] | None = None) -> Path:
    """`source`'s files (or `only` those) as the snapshot `commit` of model `name` in the cache: each file's
    bytes a blob named by its hash, the snapshot a folder of relative links to them, each ref a file
    holding the commit."""
    repo = cache / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if only is not None and path.name not in only:
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # the library writes the commit without a newline
    return snapshot


@pytest.fixture()
def here(tmp_path, tokenizer, monkeypatch) -> Path:
    """A working folder with the tiny model (model/), a small prompt_response dataset and run.yaml."""
    monkeypatch.chdir(tmp_path)
    save_tiny_model(tmp_path / "model", tokenizer)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"what is {a} plus {b}?", "response": f" {a + b}"}
                                           for a in range(5) for b in range(5)])
    (tmp_path / "run.yaml").write_text(
        f"model: {NAME}\n"
        "data: {path: train.jsonl, max_length: 32, eval_fraction: 0.0}\n"
        "lora: {rank: 4, alpha: 8}\n"
        "train: {steps: 2, batch_size: 4, lr: 1.0e-3}\n"
        "output_dir: out\n")
    return tmp_path


def train(*overrides: str) -> int:
    return cli.main(["train", "run.yaml", "--no-progress", *overrides])


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def refused(capsys, code: int, *needles: str) -> str:
    """Exit 2 and one sentence holding every needle, no traceback; returns the sentence."""
    err = capsys.readouterr().err.strip()
    assert code == 2 and all(n in err for n in needles), err
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_a_run_from_a_hub_name_trains_as_the_local_folder_does_and_records_the_commit(cache, here):
    snapshot = put_snapshot(cache, NAME, here / "model", COMMITS[0])
    assert train() == 0
    assert train("model=model", "output_dir=local") == 0
    assert losses(here / "out") == losses(here / "local")
    record = json.loads((here / "out" / "run.json").read_text())
    assert record["identity"]["model_commit"] == COMMITS[0]
    assert json.loads((here / "local" / "run.json").read_text())["identity"]["model_commit"] is None
    assert Path(record["settings"]["model"]) == snapshot  # the folder the run read, named by its commit
    assert hub.origin(record["settings"]["model"]) == (NAME, COMMITS[0])


def test_an_adapter_names_its_hub_base_by_name_and_commit_and_chat_finds_it(cache, here, capsys):
    """Other tools (PEFT, another machine's cache) can fetch org/name at a commit, not this cache's path."""
    snapshot = put_snapshot(cache, NAME, here / "model", COMMITS[0])
    assert train() == 0 and train("model=model", "output_dir=local") == 0
    named = json.loads((here / "out" / "adapter" / "adapter_config.json").read_text())
    assert (named["base_model_name_or_path"], named["revision"]) == (NAME, COMMITS[0])
    local = json.loads((here / "local" / "adapter" / "adapter_config.json").read_text())
    assert (local["base_model_name_or_path"], local["revision"]) == (str((here / "model").resolve()), None)
    capsys.readouterr()
    assert cli.main(["chat", str(here / "out" / "adapter"), "--prompt", "what is 1 plus 2?",
                     "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert str(snapshot) in capsys.readouterr().err


@pytest.mark.quick
def test_a_revision_pins_the_snapshot_a_branch_tag_or_commit_names(cache, here, tokenizer):
    put_snapshot(cache, NAME, here / "model", COMMITS[0], refs=("v1",))
    save_tiny_model(here / "newer", tokenizer, seed=1)
    put_snapshot(cache, NAME, here / "newer", COMMITS[1], refs=("main",))
    assert hub.origin(hub.folder(NAME)) == (NAME, COMMITS[1])
    assert hub.origin(hub.folder(NAME, "v1")) == (NAME, COMMITS[0])
    assert hub.origin(hub.folder(NAME, COMMITS[0])) == (NAME, COMMITS[0])


def test_a_revision_the_cache_lacks_offline_is_one_sentence(cache, here, capsys):
    put_snapshot(cache, NAME, here / "model", COMMITS[0])
    refused(capsys, train("model_revision=v2"), f"model '{NAME}' is not a local folder (none at {here / NAME}), and at"
            " revision 'v2' it is not in the Hub cache", "HF_HUB_OFFLINE")


def test_a_resume_at_another_commit_is_refused_and_goes_on_pinned_to_the_first(cache, here, tokenizer, capsys):
    put_snapshot(cache, NAME, here / "model", COMMITS[0])
    assert train() == 0
    save_tiny_model(here / "newer", tokenizer, seed=1)
    put_snapshot(cache, NAME, here / "newer", COMMITS[1], refs=("main",))  # main moved on
    capsys.readouterr()
    refused(capsys, train("train.steps=4"), f"resolves to commit {COMMITS[1]}", f"model_revision={COMMITS[0]}")
    assert train("train.steps=4", f"model_revision={COMMITS[0]}") == 0
    assert len(losses(here / "out")) == 4


def test_a_revision_beside_a_local_folder_is_refused(here, capsys):
    refused(capsys, train("model=model", "model_revision=v1"), "model_revision 'v1'", "local folder")


def test_pickle_only_weights_are_refused_unread(cache, here, capsys):
    pickled = here / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(here / "model" / name, pickled / name)
    (pickled / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    put_snapshot(cache, NAME, pickled, COMMITS[0])
    refused(capsys, train(), f"model '{NAME}'", "pytorch_model.bin", "pickle")


def test_a_cached_config_without_weights_offline_is_one_sentence(cache, here, capsys):
    put_snapshot(cache, NAME, here / "model", COMMITS[0], only=("config.json",))  # what `slimtune plan` fetched
    refused(capsys, train(), f"the cached copy of model '{NAME}'", "holds no weights", "slimtune plan")


def test_nothing_cached_offline_is_one_sentence(cache, here, capsys):
    refused(capsys, train(), f"model '{NAME}' is not a local folder (none at {here / NAME}), and it is not in the Hub"
            " cache", "HF_HUB_OFFLINE")


@pytest.fixture()
def online(here, monkeypatch):
    """serve(handler) -> endpoint: a Hub endpoint on 127.0.0.1 answering with `handler`, as HF_ENDPOINT
    names one, with an empty cache and no token (the values huggingface_hub read at import set too)."""
    from huggingface_hub import constants

    servers = []

    def serve(handler: type) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(here / "hub-cache"))
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        return endpoint

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


class _Endpoint(http.server.BaseHTTPRequestHandler):
    def answer(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Refusing(_Endpoint):
    """Every request refused, as the Hub refuses a gated model to someone without access."""

    status, code = 401, "GatedRepo"

    def do_GET(self):  # noqa: N802 - the handler's name is http.server's
        self.answer(self.status, headers={"X-Error-Code": self.code} if self.code else {})

    do_HEAD = do_GET


class _Hub(_Endpoint):
    """One model repository served at one commit as the Hub serves it: the repository's revision and file
    tree (the API), and each file's bytes with its commit and etag (resolve). `asked` lists the files
    whose bytes were asked for."""

    files: dict[str, bytes] = {}
    asked: list[str] = []

    def do_GET(self):  # noqa: N802
        path, api = self.path.split("?")[0], f"/api/models/{NAME}/"
        resolve = re.match(rf"^/{NAME}/resolve/[^/]+/(.+)$", path)
        if path.startswith(api + "revision/"):
            self.answer(200, json.dumps({"id": NAME, "sha": COMMITS[1]}).encode())
        elif path.startswith(api + "tree/"):
            tree = [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
                    for name, data in self.files.items()]
            self.answer(200, json.dumps(tree).encode())
        elif resolve and resolve.group(1) in self.files:
            data = self.files[resolve.group(1)]
            self.asked += [resolve.group(1)] if self.command == "GET" else []  # its bytes, not a HEAD
            self.answer(200, data, {"X-Repo-Commit": COMMITS[1], "ETag": f'"{hashlib.sha256(data).hexdigest()}"'})
        else:
            self.answer(404, headers={"X-Error-Code": "EntryNotFound"})

    do_HEAD = do_GET


def hub_serving(files: dict[str, bytes]) -> type:
    return type("Hub", (_Hub,), {"files": files, "asked": []})


@pytest.mark.parametrize("status,code", [(401, "GatedRepo"), (403, "GatedRepo"), (403, "")])
def test_a_gated_model_without_access_says_how_to_get_it(here, online, capsys, status, code):
    endpoint = online(type("Refusing", (_Refusing,), {"status": status, "code": code}))
    refused(capsys, train(), f"model '{NAME}' is gated or private", f"HTTP {status}", "HF_TOKEN", f"{endpoint}/{NAME}")


def test_a_fetch_takes_only_what_training_reads_and_trains_from_it(here, online):
    model = {path.name: path.read_bytes() for path in (here / "model").iterdir()}
    extra = {"consolidated.safetensors": model["model.safetensors"], "pytorch_model.bin": b"pickled",
             "README.md": b"# tiny", "onnx/model.onnx": b"onnx"}
    hub_endpoint = hub_serving({**model, **extra})
    online(hub_endpoint)
    assert train() == 0
    assert sorted(hub_endpoint.asked) == sorted(model)  # each file once; nothing else
    snapshot = here / "hub-cache" / "models--tiny-org--tiny-llama" / "snapshots" / COMMITS[1]
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(model)
    assert json.loads((here / "out" / "run.json").read_text())["identity"]["model_commit"] == COMMITS[1]


def test_pickle_only_weights_online_are_refused_before_anything_is_fetched(here, online, capsys):
    hub_endpoint = hub_serving({"config.json": (here / "model" / "config.json").read_bytes(),
                                "pytorch_model.bin": b"not to be unpickled"})
    online(hub_endpoint)
    refused(capsys, train(), "pytorch_model.bin", "never loads")
    assert hub_endpoint.asked == []


def test_plan_from_the_cached_config_alone_equals_the_local_folders(cache, here):
    """The config read through the Hub cache is the folder's, and a plan weighed on each (the real step on
    fake tensors, each estimated afresh: the estimate cache keys on the config's path too) is the same."""
    from slimtune import presets
    from slimtune.planning import planner

    put_snapshot(cache, NAME, here / "model", COMMITS[0], only=("config.json",))  # no weights: plan needs none
    configs = [presets.model_config(model) for model in (NAME, str(here / "model"))]
    settings = [{k: v for k, v in c.to_dict().items() if k != "_name_or_path"} for c in configs]
    assert settings[0] == settings[1]
    machine = planner.Machine.named("8GiB", "16GiB", "10GiB")
    base = planner.planning_config("lora", 4)
    plan = planner.applicable_plans(base, machine)[0]
    weighed = [planner.weigh(c, base, plan, machine, 1, 64) for c in configs]
    assert weighed[0] == weighed[1] and weighed[0].estimate.device_peak_bytes > 0


def test_plan_of_an_uncached_hub_model_offline_is_one_sentence(cache, capsys):
    refused(capsys, cli.main(["plan", "--model", NAME, "--gpu", "8GiB"]), f"model '{NAME}'", "HF_HUB_OFFLINE")


def test_local_paths_are_never_taken_for_hub_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_name("org/name") and hub.is_hub_name("Qwen/Qwen2.5-0.5B")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.is_hub_name("org/name")  # a folder of that name is here: it wins
    for text in ("./org/x", "/abs/path", "a/b/c", "name", "org/../x", "org/--x"):
        assert not hub.is_hub_name(text), text


def test_chat_takes_a_hub_name_and_reads_its_snapshot(cache, here, capsys):
    snapshot = put_snapshot(cache, NAME, here / "model", COMMITS[0])
    assert cli.main(["chat", NAME, "--prompt", "what is 1 plus 2?", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert f"model '{snapshot}'" in capsys.readouterr().err
