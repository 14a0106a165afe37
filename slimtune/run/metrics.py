"""Run metrics: metrics.jsonl (one object per logged step), TensorBoard when installed, W&B and
MLflow when log.wandb / log.mlflow turn them on, a PNG plot of loss and device memory, and the
layout of the final summary table.

The trackers (W&B, MLflow) get what TensorBoard gets, each record's numbers by step, and the
resolved settings once at start. They start before metrics.jsonl is touched: one that cannot start
ends the run with one sentence before it trains. trackers.json in the run folder names their runs,
so a resumed run goes on in the same W&B and MLflow runs, at the same step numbers.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Protocol

import yaml

from slimtune.store.checkpoint import atomic_write_text
from slimtune.config import LogConfig, RunConfig, flatten, to_dict
from slimtune.errors import UserError

TRACKERS_FILE = "trackers.json"
PARAM_CHARS = 500  # what every MLflow server takes as a param value (newer ones 6000); config.yaml holds them whole
RESUMED = "resumed."  # MLflow: the tag of a setting a resume changed, its param being the value it began with


class RankLog:
    """The log of a rank other than 0 under data parallelism: rank 0 writes the step's figures,
    summed over ranks; this one keeps nothing."""

    def __init__(self):
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        del record

    def close(self, failed: bool = False) -> None:
        del failed

    def plot(self, path: Path) -> None:
        del path


class MetricsLog:
    def __init__(self, output_dir: Path, resume_step: int = 0, cfg: RunConfig | None = None):
        """`cfg`: the run's resolved settings; its log.* section turns the trackers on (None: none)."""
        self._trackers = open_trackers(cfg, Path(output_dir), resume_step) if cfg is not None else []
        self.path = Path(output_dir) / "metrics.jsonl"
        try:
            self.records = self._kept_records(resume_step)
            # A resumed run drops what the killed run logged after its last checkpoint.
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
            self._handle = open(self.path, "a")
            self._tensorboard = _tensorboard_writer(Path(output_dir) / "tensorboard", resume_step)
        except BaseException:
            for tracker in self._trackers:
                _close_quietly(tracker, failed=True)
            raise

    def _kept_records(self, resume_step: int) -> list[dict]:
        """What the run logged up to its checkpoint; a line torn by a kill (or damaged) ends what is kept."""
        if resume_step == 0 or not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                break
            records.append(record)
        return [r for r in records if r["step"] <= resume_step]

    def log(self, record: dict) -> None:
        self.records.append(record)
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, record["step"])
        self._track(record)

    def _track(self, record: dict) -> None:
        """A tracker that fails mid-run is said once and left out: metrics.jsonl keeps every step."""
        numbers = scalars(record)
        for tracker in list(self._trackers):
            try:
                tracker.log(record["step"], numbers)
            except Exception as err:  # a server gone away must not end hours of training
                self._trackers.remove(tracker)
                print(f"{tracker.setting}: {tracker.title} refused step {record['step']} ({_one_line(err)}); it gets"
                      " no more of this run, metrics.jsonl keeps every step.", file=sys.stderr)
                _close_quietly(tracker, failed=True)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ends on an error; the trackers mark their runs failed. A second close does nothing."""
        self._handle.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            _close_quietly(tracker, failed)

    def plot(self, path: Path) -> Path | None:
        """Loss (train and eval) and device peak bytes against step, as a PNG."""
        train = [r for r in self.records if "loss" in r]
        if not train:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        top.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
        evals = [r for r in self.records if "eval_loss" in r]
        if evals:
            top.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
        top.set_ylabel("loss")
        top.legend()
        measured = [r for r in train if r["device_peak_bytes"] is not None]
        bottom.plot([r["step"] for r in measured], [r["device_peak_bytes"] / 2**20 for r in measured])
        bottom.set_ylabel("device peak (MiB, measured)")
        bottom.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _tensorboard_writer(folder: Path, resume_step: int):
    """A resumed run hides what the killed one logged after its checkpoint (purge_step), as
    metrics.jsonl drops it: TensorBoard would draw those steps twice. A run started over (no
    checkpoint: an attempt stopped before its first) hides all of that attempt's steps the same way."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(folder), purge_step=resume_step + 1)


# ---------------------------------------------------------------- trackers: W&B and MLflow


class Tracker(Protocol):
    setting: str  # the setting that turns it on, as the user names it: "log.wandb"
    title: str
    record: dict  # what trackers.json keeps of its run, to go on with it on resume

    def log(self, step: int, numbers: dict[str, float]) -> None: ...

    def close(self, failed: bool) -> None: ...


# setting -> (module, the pip command that installs it). Full mlflow: its default store (sqlite) and `mlflow ui`;
# mlflow-skinny, the client alone, is enough for a tracking server (and is what the tests use).
PACKAGES = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow")}


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers by name, as TensorBoard gets them (step is the axis, not a number)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


def check_trackers(log: LogConfig) -> None:
    """Every tracker log.* turns on can be imported; one sentence naming the setting and the pip command if not."""
    for setting, (module, pip) in PACKAGES.items():
        if not getattr(log, setting):
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            missing = isinstance(err, ModuleNotFoundError) and err.name == module
            state = "is not installed" if missing else f"does not import ({_one_line(err)})"
            raise UserError(f"log.{setting}=true needs the {module} package, which {state}; install it with"
                            f" `{pip}`, or set log.{setting}=false.") from None


def open_trackers(cfg: RunConfig, output_dir: Path, resume_step: int) -> list[Tracker]:
    """The trackers cfg.log turns on, started: on resume (resume_step > 0) they go on with the runs
    trackers.json names, a fresh run starts new ones. One that cannot start is a UserError, and the
    ones already started are closed as failed."""
    log = cfg.log
    known = _tracker_runs(output_dir) if resume_step else {}
    if not (log.wandb or log.mlflow):
        if not resume_step:
            (output_dir / TRACKERS_FILE).unlink(missing_ok=True)  # names an overwritten run's trackers
        return []
    check_trackers(log)
    settings, name = to_dict(cfg), log.run_name or output_dir.resolve().name
    started: list[Tracker] = []
    try:
        if log.wandb:
            started.append(WandbTracker.start(log, name, settings, known.get("wandb"), resume_step, output_dir))
        if log.mlflow:
            started.append(MlflowTracker.start(log, name, settings, known.get("mlflow"), resume_step))
    except BaseException:
        for tracker in started:
            _close_quietly(tracker, failed=True)
        raise
    known.update((t.setting.removeprefix("log."), t.record) for t in started)  # a tracker now off keeps its run
    atomic_write_text(output_dir / TRACKERS_FILE, json.dumps(known, indent=2) + "\n")
    return started


def _tracker_runs(output_dir: Path) -> dict:
    try:
        found = json.loads((output_dir / TRACKERS_FILE).read_text())
    except (OSError, ValueError):
        return {}  # none yet, or damaged: the trackers start new runs
    return found if isinstance(found, dict) else {}


class WandbTracker:
    setting, title = "log.wandb", "W&B"

    def __init__(self, run, record: dict, after: int):
        self.run, self.record, self.after = run, record, after

    @classmethod
    def start(cls, log: LogConfig, name: str, settings: dict, known: dict | None, resume_step: int,
              output_dir: Path) -> WandbTracker:
        """W&B's local files (its wandb/ folder) go in the run's folder, not the current one, unless WANDB_DIR
        says where; an offline run's folder is named for `wandb sync`."""
        import wandb

        project = log.wandb_project or os.environ.get("WANDB_PROJECT") or "slimtune"
        same = resume_step and isinstance(known, dict) and known.get("project") == project and known.get("id")
        run_id = known["id"] if same else secrets.token_hex(4)
        mode = {"mode": log.wandb_mode} if log.wandb_mode else {}  # unset: WANDB_MODE, else online
        run = None
        try:
            run = wandb.init(project=project, name=name, id=run_id, resume="allow",
                             dir=os.environ.get("WANDB_DIR") or str(output_dir), **mode)
            run.config.update(flatten(settings), allow_val_change=True)  # a resumed run may change some
        except Exception as err:
            if run is not None:
                _close_quietly(cls(run, {}, 0), failed=True)
            raise UserError(f"log.wandb: W&B could not start run {run_id!r} in project {project!r}"
                            f" ({_one_line(err)}); log in with `wandb login`, or set log.wandb_mode=offline and"
                            " `wandb sync` its folder later.") from None
        if run.settings.mode == "offline":
            print(f"slimtune: W&B runs offline in '{run.settings.sync_dir}'; `wandb sync` that folder to upload it.",
                  file=sys.stderr)
        # Online, a resumed run knows its last step: steps a killed run logged after its checkpoint stay.
        return cls(run, {"id": run_id, "project": project}, max(resume_step, run.step - 1))

    def log(self, step: int, numbers: dict[str, float]) -> None:
        if step > self.after:
            self.run.log(numbers, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    setting, title = "log.mlflow", "MLflow"

    def __init__(self, client, run_id: str, record: dict, after: int):
        self.client, self.run_id, self.record, self.after = client, run_id, record, after

    @classmethod
    def start(cls, log: LogConfig, name: str, settings: dict, known: dict | None, resume_step: int) -> MlflowTracker:
        from mlflow.tracking import MlflowClient

        experiment = log.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "slimtune"
        uri = log.mlflow_tracking_uri
        where, run_id = f"'{uri}'" if uri else "MLflow's default tracking URI", None
        try:
            client = MlflowClient(tracking_uri=uri)  # unset: MLFLOW_TRACKING_URI, else MLflow's default
            where = f"'{client.tracking_uri}'"
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(experiment)
            record = {"tracking_uri": str(client.tracking_uri), "experiment_id": experiment_id}
            run = _mlflow_run_to_continue(client, known, record) if resume_step else None
            if run is None:
                run = client.create_run(experiment_id, run_name=name)
            else:
                client.update_run(run.info.run_id, status="RUNNING")
            run_id = run.info.run_id
            _mlflow_settings(client, run, settings)
            after = max([resume_step] + [m.step for key in run.data.metrics
                                         for m in client.get_metric_history(run_id, key)])
        except Exception as err:
            if run_id is not None:
                _close_quietly(cls(client, run_id, {}, 0), failed=True)
            raise UserError(f"log.mlflow: MLflow could not start a run in experiment {experiment!r} at {where}"
                            f" ({_one_line(err)}); check log.mlflow_tracking_uri, or set log.mlflow=false.") from None
        return cls(client, run_id, {**record, "run_id": run_id}, after)

    def log(self, step: int, numbers: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if step > self.after:
            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in numbers.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _mlflow_run_to_continue(client, known: dict | None, record: dict):
    """The run trackers.json names, when it is in this store and experiment and still there."""
    if not isinstance(known, dict) or any(known.get(k) != v for k, v in record.items()) or not known.get("run_id"):
        return None
    try:
        run = client.get_run(known["run_id"])
    except Exception:  # deleted from the store: a new run
        return None
    return run if run.info.lifecycle_stage == "active" else None


def _mlflow_settings(client, run, settings: dict) -> None:
    """The settings as params (dotted keys, values cut to PARAM_CHARS) and whole as config.yaml.
    Params cannot change once logged (MLflow refuses a new value), so a resumed run adds the new
    ones, and a setting the resume changed (train.steps) keeps the param it began with and gets the
    tag RESUMED + key with the value the run now has (tags can change: a later resume updates it);
    its config.yaml is the newest."""
    from mlflow.entities import Param, RunTag

    have, tags = run.data.params, run.data.tags
    texts = {k: (v if isinstance(v, str) else json.dumps(v))[:PARAM_CHARS] for k, v in flatten(settings).items()}
    params = [Param(k, text) for k, text in texts.items() if k not in have]
    changed = [RunTag(RESUMED + k, text) for k, text in texts.items()
               if k in have and (have[k] != text or RESUMED + k in tags)]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params, and 100 tags, a call
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    for i in range(0, len(changed), 100):
        client.log_batch(run.info.run_id, tags=changed[i:i + 100])
    client.log_text(run.info.run_id, yaml.safe_dump(settings, sort_keys=False), "config.yaml")


def _close_quietly(tracker: Tracker, failed: bool) -> None:
    """Closing never raises: the run's result is written after the log closes."""
    try:
        tracker.close(failed)
    except Exception as err:
        print(f"{tracker.setting}: closing the {tracker.title} run failed ({_one_line(err)}).", file=sys.stderr)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
