"""log.wandb and log.mlflow: what the trackers are sent (metrics.jsonl's numbers by step, the resolved
settings once), read back from W&B's offline run files and a file-based MLflow store; resume goes on
in the same runs; off by default; a missing package or a tracker that cannot start is one sentence,
before anything is written."""

import json
import struct
import sys
from pathlib import Path

import pytest
import yaml

from slimtune import config, train
from slimtune.engines import settings as run_settings
from slimtune.run import metrics
from slimtune.errors import UserError
from slimtune.run.metrics import MetricsLog
from test_train import small_run

RECORDS = [{"step": s, "loss": 1.0 / s, "lr": 0.1 * s, "tokens": 10 + s, "device_peak_bytes": None,
            "note": "text is not a scalar"} for s in (1, 2, 3)]


def settings(tmp_path, *overrides):
    base = {"model": "m", "data": {"path": "d.jsonl"}, "output_dir": str(tmp_path / "out")}
    return run_settings.load(None, list(overrides), base=base)


def opened(tmp_path, cfg, resume_step=0):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return MetricsLog(out, resume_step, cfg)


# ---------------------------------------------------------------- TensorBoard


def tensorboard_steps(folder: Path) -> list[int]:
    """The steps of every `loss` event TensorBoard shows for the folder, a purge applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.step for e in events.Scalars("loss")]


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    """A run killed after step 3 and resumed from its checkpoint of step 2 logs 3 again: the writer
    purges what came after the checkpoint, as metrics.jsonl drops it (steps 3 were drawn twice)."""
    pytest.importorskip("tensorboard")
    cfg = settings(tmp_path)
    log = opened(tmp_path, cfg)
    for record in RECORDS:
        log.log(record)
    log.close(failed=True)
    log = opened(tmp_path, cfg, resume_step=2)
    log.log({"step": 3, "loss": 0.3})
    log.log({"step": 4, "loss": 0.25})
    log.close()
    assert tensorboard_steps(tmp_path / "out" / "tensorboard") == [1, 2, 3, 4]


def test_tensorboard_after_a_start_over_shows_only_the_new_attempt(tmp_path):
    """An attempt stopped before its first checkpoint (a Ctrl-C, a non-finite loss) is started over:
    its steps were drawn beside the retry's (1, 2, 3 then 1 .. 4), as metrics.jsonl does not."""
    pytest.importorskip("tensorboard")
    cfg = settings(tmp_path)
    log = opened(tmp_path, cfg)
    for record in RECORDS:
        log.log({**record, "loss": 9.0})
    log.close(failed=True)
    log = opened(tmp_path, cfg)
    for record in RECORDS:
        log.log(record)
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    shown = events.Scalars("loss")
    assert [e.step for e in shown] == [1, 2, 3]
    assert [e.value for e in shown] == pytest.approx([r["loss"] for r in RECORDS])  # the retry's (fp32), not 9.0


# ---------------------------------------------------------------- W&B offline run files


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    """W&B offline, writing under tmp_path; wandb reads its environment once per process, so its
    singleton is torn down around each test."""
    wandb = pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": tmp_path, "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
           "WANDB_CONFIG_DIR": tmp_path / "wandb-config", "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
           "WANDB_DATA_DIR": tmp_path / "wandb-data"}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    wandb.teardown()
    yield tmp_path / "wandb"
    wandb.teardown()


def wandb_records(path):
    """The protobuf records of a .wandb file: W&B's header, then LevelDB's log format (32 KiB blocks
    of chunks: crc32, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4). wandb ships no Python reader."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(folder):
    """Each offline run folder, oldest first: its run id, config, history {step: {key: value}} and exit code."""
    import wandb

    wandb.teardown()  # finish() leaves the writing to wandb's service; its shutdown flushes the files
    runs = []
    for path in sorted(folder.glob("offline-run-*/run-*.wandb")):
        run = {"config": {}, "history": {}, "exit": None}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["name"], run["project"] = record.run.run_id, record.run.display_name, record.run.project
            elif kind == "config":
                run["config"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                      for i in record.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                run["history"][record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "exit":
                run["exit"] = record.exit.exit_code
        runs.append(run)
    return runs


def test_wandb_offline_gets_the_scalars_by_step_and_the_settings_and_a_resume_goes_on(tmp_path, wandb_dir):
    cfg = settings(tmp_path, "log.wandb=true", "log.wandb_project=demo")
    log = opened(tmp_path, cfg)
    for record in RECORDS:
        log.log(record)
    log.close()
    (first,) = wandb_runs(wandb_dir)
    assert (first["name"], first["project"], first["exit"]) == ("out", "demo", 0)
    assert first["history"] == {r["step"]: {"loss": r["loss"], "lr": r["lr"], "tokens": r["tokens"]} for r in RECORDS}
    assert {k: first["config"][k] for k in config.flatten(config.to_dict(cfg))} == config.flatten(config.to_dict(cfg))
    assert first["config"]["log.wandb_project"] == "demo" and first["config"]["train.betas"] == [0.9, 0.999]

    # killed after step 3, resumed from the checkpoint of step 2: the same run id, only the new steps
    log = opened(tmp_path, cfg, resume_step=2)
    log.log({"step": 3, "loss": 0.3})
    log.log({"step": 4, "loss": 0.25})
    log.close(failed=True)
    _, resumed = wandb_runs(wandb_dir)
    assert resumed["id"] == first["id"] and resumed["exit"] == 1
    assert resumed["history"] == {3: {"loss": 0.3}, 4: {"loss": 0.25}}


def test_wandb_s_files_go_in_the_run_s_folder_and_an_offline_run_is_named(tmp_path, wandb_dir, monkeypatch, capsys):
    """Without WANDB_DIR, wandb/ went into the current folder, unsaid (found by a newcomer walkthrough)."""
    monkeypatch.delenv("WANDB_DIR")
    monkeypatch.chdir(tmp_path)
    log = opened(tmp_path, settings(tmp_path, "log.wandb=true"))
    log.close()
    (run,) = (tmp_path / "out" / "wandb").glob("offline-run-*")
    assert not (tmp_path / "wandb").exists()
    assert f"slimtune: W&B runs offline in '{run}'; `wandb sync` that folder to upload it." in capsys.readouterr().err


# ---------------------------------------------------------------- MLflow with a file store


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return f"file:{tmp_path / 'mlruns'}"


def mlflow_run(uri, run_id, tmp_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics}
    config_yaml = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_dir))).read_text()
    return run, history, yaml.safe_load(config_yaml)


def mlflow_run_id(tmp_path):
    return json.loads((tmp_path / "out" / metrics.TRACKERS_FILE).read_text())["mlflow"]["run_id"]


def test_mlflow_file_store_gets_the_scalars_by_step_and_the_settings_and_a_resume_goes_on(tmp_path, mlflow_uri):
    template = "{{ messages }}" * 50  # 700 characters: MLflow's params take 500, config.yaml all
    cfg = settings(tmp_path, "log.mlflow=true", f"log.mlflow_tracking_uri={mlflow_uri}",
                   "log.mlflow_experiment=demo", "log.run_name=first", f"data.chat_template={template}")
    log = opened(tmp_path, cfg)
    for record in RECORDS:
        log.log(record)
    log.close()
    run_id = mlflow_run_id(tmp_path)
    run, history, whole = mlflow_run(mlflow_uri, run_id, tmp_path)
    assert (run.info.run_name, run.info.status) == ("first", "FINISHED")
    assert history == {"loss": [(r["step"], r["loss"]) for r in RECORDS], "lr": [(r["step"], r["lr"]) for r in RECORDS],
                       "tokens": [(r["step"], float(r["tokens"])) for r in RECORDS]}
    flat = config.flatten(config.to_dict(cfg))
    assert run.data.params.keys() == flat.keys()
    assert run.data.params["train.lr"] == "0.0002" and run.data.params["log.mlflow"] == "true"
    assert run.data.params["data.chat_template"] == template[:500]
    assert whole == config.to_dict(cfg) and whole["data"]["chat_template"] == template

    # resumed from step 2 with more steps: the same run; step 3 (logged before the kill) is not sent twice
    longer = settings(tmp_path, "log.mlflow=true", f"log.mlflow_tracking_uri={mlflow_uri}",
                      "log.mlflow_experiment=demo", "train.steps=200")
    log = opened(tmp_path, longer, resume_step=2)
    log.log({"step": 3, "loss": 0.3})
    log.log({"step": 4, "loss": 0.25})
    log.close(failed=True)
    run, history, whole = mlflow_run(mlflow_uri, run_id, tmp_path)
    assert run.info.status == "FAILED"
    assert history["loss"] == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25)]
    assert run.data.params["train.steps"] == "100" and whole["train"]["steps"] == 200  # params are write-once
    # what the resume changed is tagged with the value the run now has (the first start's name and template)
    resumed = {k: v for k, v in run.data.tags.items() if k.startswith("resumed.")}
    assert resumed == {"resumed.train.steps": "200", "resumed.log.run_name": "null",
                       "resumed.data.chat_template": "null"}

    # a fresh start in the folder (train.overwrite, or no checkpoint yet) is a new run
    opened(tmp_path, cfg).close()
    assert mlflow_run_id(tmp_path) != run_id


# ---------------------------------------------------------------- through a real run


def test_a_training_run_sends_both_what_metrics_jsonl_holds_and_its_resume_goes_on(
        tmp_path, tiny_model_dir, wandb_dir, mlflow_uri):
    overrides = {"log.wandb": "true", "log.mlflow": "true", "log.mlflow_tracking_uri": mlflow_uri,
                 "train.measure_memory": "false"}
    train.fit(small_run(tmp_path, tiny_model_dir, **overrides), progress=False)
    train.fit(small_run(tmp_path, tiny_model_dir, **overrides, **{"train.steps": 3}), progress=False)
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3]
    numbers = [metrics.scalars(r) for r in logged]

    first, resumed = wandb_runs(wandb_dir)
    assert first["id"] == resumed["id"] and first["exit"] == resumed["exit"] == 0
    assert {**first["history"], **resumed["history"]} == {r["step"]: n for r, n in zip(logged, numbers)}
    assert first["config"]["output_dir"] == str(tmp_path / "out") and resumed["config"]["train.steps"] == 3

    run, history, _ = mlflow_run(mlflow_uri, mlflow_run_id(tmp_path), tmp_path)
    assert run.info.status == "FINISHED" and run.data.params["model"] == str(tiny_model_dir)
    assert history["loss"] == [(r["step"], r["loss"]) for r in logged]
    assert history.keys() == {key for n in numbers for key in n}


# ---------------------------------------------------------------- off, absent, failing


def test_off_by_default_no_tracker_is_imported_or_started(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of either would fail
    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = settings(tmp_path)
    assert not cfg.log.wandb and not cfg.log.mlflow
    log = opened(tmp_path, cfg)
    log.log(RECORDS[0])
    log.close()
    assert log._trackers == [] and not (tmp_path / "out" / metrics.TRACKERS_FILE).exists()


@pytest.mark.parametrize("setting, module, pip", [("wandb", "wandb", "pip install wandb"),
                                                  ("mlflow", "mlflow", "pip install mlflow")])
def test_a_missing_package_is_one_sentence_before_anything_is_written(tmp_path, monkeypatch, setting, module, pip):
    monkeypatch.setitem(sys.modules, module, None)
    cfg = settings(tmp_path, f"log.{setting}=true")
    with pytest.raises(UserError) as err:
        opened(tmp_path, cfg)
    assert str(err.value) == (f"log.{setting}=true needs the {module} package, which is not installed; install it"
                              f" with `{pip}`, or set log.{setting}=false.")
    assert list((tmp_path / "out").iterdir()) == []


def test_training_refuses_a_missing_package_before_the_model_loads(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setattr(train, "build", lambda cfg: pytest.fail("the model loaded before the refusal"))
    with pytest.raises(UserError, match=r"^log\.mlflow=true needs the mlflow package, which is not installed"):
        train.fit(small_run(tmp_path, tiny_model_dir, **{"log.mlflow": "true"}), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_tracker_that_cannot_start_ends_the_run_before_it_writes(tmp_path, wandb_dir, mlflow_uri):
    """W&B started, then MLflow could not: the W&B run is closed as failed and metrics.jsonl is not begun."""
    cfg = settings(tmp_path, "log.wandb=true", "log.mlflow=true", "log.mlflow_tracking_uri=nope://there")
    with pytest.raises(UserError) as err:
        opened(tmp_path, cfg)
    assert str(err.value).startswith("log.mlflow: MLflow could not start a run in experiment 'slimtune' at"
                                     " 'nope://there' (")
    assert str(err.value).endswith("; check log.mlflow_tracking_uri, or set log.mlflow=false.")
    assert list((tmp_path / "out").iterdir()) == []
    (started,) = wandb_runs(wandb_dir)
    assert started["exit"] == 1 and started["history"] == {}


def test_a_resume_that_changes_a_setting_again_updates_its_mlflow_tag(tmp_path, mlflow_uri):
    """Params cannot change once logged: the tag resumed.KEY follows each start's value instead."""
    def start(resume_step, *overrides):
        opened(tmp_path, settings(tmp_path, "log.mlflow=true", f"log.mlflow_tracking_uri={mlflow_uri}", *overrides),
               resume_step).close()

    start(0, "train.steps=100")
    for steps in (200, 300, 100):
        start(2, f"train.steps={steps}")
        run, _, whole = mlflow_run(mlflow_uri, mlflow_run_id(tmp_path), tmp_path)
        assert run.data.params["train.steps"] == "100" and whole["train"]["steps"] == steps
        tagged = {k: v for k, v in run.data.tags.items() if k.startswith("resumed.")}
        assert tagged == {"resumed.train.steps": str(steps)}


def test_a_tracker_that_cannot_start_leaves_no_run_recorded_so_a_retry_may_change_settings(
        tmp_path, tiny_model_dir, mlflow_uri):
    broken = {"log.mlflow": "true", "log.mlflow_tracking_uri": "nope://there", "train.measure_memory": "false"}
    with pytest.raises(UserError, match=r"^log\.mlflow: MLflow could not start a run"):
        train.fit(small_run(tmp_path, tiny_model_dir, **broken), progress=False)
    assert not (tmp_path / "out" / "run.json").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()
    # the retry fixes the tracker and changes what a recorded run could not (lora.rank: the run's identity)
    train.fit(small_run(tmp_path, tiny_model_dir, **{"lora.rank": 8, "train.measure_memory": "false"}), progress=False)
    assert json.loads((tmp_path / "out" / "run.json").read_text())["identity"]["lora.rank"] == 8


def test_a_tracker_failing_mid_run_is_said_once_and_training_goes_on(tmp_path, capsys):
    class Flaky:
        setting, title, record = "log.flaky", "Flaky", {}
        closed = None

        def __init__(self):
            self.steps = []

        def log(self, step, numbers):
            self.steps.append(step)
            if step == 2:
                raise ConnectionError("server went away")

        def close(self, failed):
            Flaky.closed = failed

    log = opened(tmp_path, settings(tmp_path))
    log._trackers.append(flaky := Flaky())
    for record in RECORDS:
        log.log(record)
    log.close()
    assert flaky.steps == [1, 2] and Flaky.closed is True
    assert len(log.records) == 3 and len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 3
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["log.flaky: Flaky refused step 2 (server went away); it gets no more of this run, metrics.jsonl"
                    " keeps every step."]
