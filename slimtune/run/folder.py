"""A run's folder (output_dir), kept safe for the run's life: what is checked before anything is
loaded or written, what a run records of itself, what resume verifies, and one run at a time.

    inspect(cfg)   before the model or data load; writes nothing. The settings' folders can be
                   written; no live run holds the folder; a folder that holds a run is resumed only
                   with train.resume and only by the same run (its identity: the base model's
                   fingerprint, the method, the adapter's shape and targets, the freeze patterns),
                   and is replaced only with train.overwrite. The result's folder (adapter/ or
                   model/) is not the base model or the data and is absent, empty or slimtune's
                   (results.check_target). Each refusal is one sentence.
    claim()        after the run is built, before its first write: makes the folder, takes the lock
                   (flock: released when the process dies, so a kill -9 leaves no stale lock),
                   removes an overwritten run (never a user's adapter/, model/ or merged/ it did not
                   write) and the scratch folders of killed runs, and records run.json for a new run.
    settled(cfg)   after resume: the settings that changed since the run's last start are said
                   once and recorded (steps, cadences and the like may change; identity may not),
                   with what device=auto and precision=auto resolved to on this machine (a resume
                   elsewhere may resolve them otherwise: resume_settings says so).
    finished(step) the result (adapter/ or model/) holds step `step`: export compares it with the
                   newest checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import struct
import time
from pathlib import Path

from slimtune.store import checkpoint, results
from slimtune import engines
from slimtune.device import runtime
from slimtune.step.block_stores import SCRATCH_KIND as BLOCKS
from slimtune.config import RunConfig, to_dict
from slimtune.errors import UserError
from slimtune.model import hub
from slimtune.model.stack import read_config
from slimtune.optim.host_adam import SCRATCH_KIND as MOMENTS

RECORD = "run.json"
CONFIG = "config.yaml"  # the run's resolved settings, written at each start
LOCK = ".lock"
# What a run writes in its folder: train.overwrite removes these and nothing else.
RUN_FILES = (RECORD, CONFIG, "metrics.jsonl", "metrics.png", "trackers.json", "checkpoints", "adapter", "model",
             "merged", "tensorboard", "activations", "moments")
SAMPLES = 16  # model fingerprint: bytes sampled from this many places of each weights file
SAMPLE_BYTES = 4096


class RunFolder:
    def __init__(self, cfg: RunConfig):
        self.cfg, self.root = cfg, Path(cfg.output_dir)
        self.lock = None  # the open, flock'd lock file while this run holds the folder
        self.record: dict | None = None  # run.json as found (None: the folder holds no run)

    # ------------------------------------------------------------ before anything loads

    def inspect(self) -> None:
        check_writable(self.root, "output_dir")
        for setting, folder in _scratch_roots(self.cfg).items():
            check_writable(folder, setting)
        if self.root.is_dir():
            self._lock()
            self.record = self._read_record()
            self._refuse_a_users_config()
            if self._holds_run() and not self.cfg.train.overwrite:
                if not self.cfg.train.resume:
                    raise UserError(
                        f"output_dir '{self.root}' holds a run and train.resume=false would start another over it;"
                        " set train.overwrite=true to remove the old run first, or use another output_dir.")
                if self.record is not None:
                    self._check_identity()
        self._check_result_folder()

    def _refuse_a_users_config(self) -> None:
        """A config.yaml in a folder that holds no run is the user's (often the very config being run):
        the run would replace it with its resolved settings, which chat, eval and export read there."""
        config_file = self.root / CONFIG
        if config_file.exists() and not self._holds_run():
            raise UserError(f"output_dir '{self.root}' holds {CONFIG}, which no run there wrote; a run writes its "
                            f"resolved settings to {config_file} (chat, eval and export read them), so keep your "
                            "config outside output_dir, or use another output_dir.")

    def _check_result_folder(self) -> None:
        """The result's folder (adapter/ or model/ in output_dir) is not the base model, the data or a
        folder of the user's; and train.overwrite would remove none of those."""
        kept = _kept(self.cfg)
        name = result_name(self.cfg)
        results.check_target(self.root / name, name, f"the result folder '{self.root / name}' of output_dir"
                             f" '{self.root}'", kept, "use another output_dir", recorded=self._recorded(name))
        if not self.cfg.train.overwrite:
            return
        for entry in RUN_FILES:
            if (self.root / entry).exists() and self._ours(self.root / entry):  # what claim would remove
                results.check_kept(self.root / entry, f"train.overwrite=true would remove '{self.root / entry}', which",
                                   kept, "use another output_dir")

    def _recorded(self, name: str) -> bool:
        """The run's record names `name` as its result: slimtune wrote it (a run from before manifests)."""
        result = (self.record or {}).get("result")
        return isinstance(result, dict) and result.get("path") == name

    def _ours(self, path: Path) -> bool:
        """A result folder (adapter/, model/, merged/) in output_dir that train.overwrite may remove."""
        if path.name not in results.KINDS or not path.is_dir():
            return True
        return self._recorded(path.name) or results.written_by_slimtune(path, path.name) or not any(path.iterdir())

    def _holds_run(self) -> bool:
        return self.record is not None or bool(checkpoint.list_checkpoints(self.root / "checkpoints"))

    def _read_record(self) -> dict | None:
        path = self.root / RECORD
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"{path} is damaged ({err}); restore it, or start afresh with train.overwrite=true.") from None

    def _check_identity(self) -> None:
        read_config(self.cfg.model)  # a model folder that is not there is named as such, not as another model
        before, now = self.record["identity"], identity(self.cfg)
        changed = [key for key in now if before.get(key) != now[key]]
        if "method" in changed:  # the adapter and freeze settings follow the method: naming it is enough
            changed = ["model", "method"] if "model" in changed else ["method"]
        if "model_commit" in changed and "model" in changed:  # another commit's weights: the commit says it
            changed.remove("model")
        if not changed:
            return
        what = "; ".join(_describe_change(key, before.get(key), now[key]) for key in changed)
        raise UserError(
            f"output_dir '{self.root}' holds a run this one cannot continue: {what}. Resume it with the settings it "
            "began with, or start afresh with train.overwrite=true or another output_dir.")

    # ------------------------------------------------------------ before the first write

    def claim(self, cfg: RunConfig, resolved: dict[str, str]) -> None:
        """`cfg`: the run as built (plan=auto may have chosen its engine and options); `resolved`: what
        its auto settings resolved to here (device, precision)."""
        self.cfg = cfg
        for setting, folder in _scratch_roots(cfg).items():
            check_writable(folder, setting)
        _make_folder(self.root, "output_dir")
        self._lock()
        if self.cfg.train.overwrite:
            for name in RUN_FILES:
                path = self.root / name
                if not self._ours(path):  # a user's folder of that name: not the old run's to remove
                    continue
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            self.record = None
        for setting, folder in _scratch_roots(self.cfg).items():
            for kind in (BLOCKS, MOMENTS):
                runtime.remove_orphans(folder, kind)
        if self.record is None:
            self.record = {"format": 1, "identity": identity(self.cfg), "settings": to_dict(self.cfg),
                           "resolved": resolved, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "result": None}
            self._write_record()

    def settled(self, cfg: RunConfig, resolved: dict[str, str]) -> list[str]:
        """The settings that changed since the run's last start ("key: old -> new"), recorded now with
        what the auto ones resolved to (`resolved`)."""
        before, now = _flat(self.record.get("settings", {})), _flat(to_dict(cfg))
        changed = [f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in now if before.get(k) != now[k]]
        self.record["settings"], self.record["resolved"] = to_dict(cfg), resolved
        self._write_record()
        return changed

    def withdraw(self) -> None:
        """Forget a run that ends before its first checkpoint (a tracker could not start, a step failed,
        a stop): without run.json the folder holds no run, so a retry may change any setting. A run with
        checkpoints, or with a result, stays recorded."""
        if self.record is not None and not self.record.get("result") and \
                not checkpoint.list_checkpoints(self.root / "checkpoints"):
            (self.root / CONFIG).unlink(missing_ok=True)  # the run's (a folder without a run keeps the user's)
            (self.root / RECORD).unlink(missing_ok=True)
            self.record = None

    def finished(self, step: int, result: Path) -> None:
        self.record["result"] = {"step": step, "path": result.name}
        self._write_record()

    def _write_record(self) -> None:
        checkpoint.atomic_write_text(self.root / RECORD, json.dumps(self.record, indent=2) + "\n")

    # ------------------------------------------------------------ one run at a time

    def _lock(self) -> None:
        if self.lock is not None:
            return
        handle = open(self.root / LOCK, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise UserError(f"output_dir '{self.root}' is in use by another run ({holder}); wait for it to end,"
                            " or use another output_dir.") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}")
        handle.flush()
        self.lock = handle

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # closing the file drops the flock
            self.lock = None

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------- identity


def identity(cfg: RunConfig) -> dict:
    """What a run's checkpoints mean only together with: the base model's weights (and, for a Hub model,
    the commit they were fetched at), and which tensors train (method, the adapter's shape and targets,
    or the freeze patterns). A record from before model_commit was kept reads as None, as a local model."""
    lora = cfg.method == "lora"
    hub_origin = hub.origin(cfg.model)  # a Hub model: the commit its snapshot holds
    return {"model": model_fingerprint(Path(cfg.model)), "model_commit": hub_origin[1] if hub_origin else None,
            "method": cfg.method,
            "lora.rank": cfg.lora.rank if lora else None, "lora.alpha": cfg.lora.alpha if lora else None,
            "lora.targets": cfg.lora.targets if lora else None, "freeze": None if lora else cfg.freeze}


def model_fingerprint(folder: Path) -> str:
    """A hash of a model folder's config.json and, for every *.safetensors file, its size, its header
    (names, shapes, dtypes, offsets) and bytes sampled across its data: another model of the same
    shape differs in the samples. Reads a few hundred KiB whatever the model's size."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("config.json")) + sorted(folder.glob("*.safetensors")):
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(struct.pack("<Q", size))
            if path.suffix != ".safetensors":
                digest.update(handle.read())
                continue
            for offset in sorted({0, *(size * k // SAMPLES for k in range(SAMPLES)), max(size - SAMPLE_BYTES, 0)}):
                handle.seek(offset)
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def _describe_change(key: str, before, now) -> str:
    if key == "model":
        return "the base model's weights differ from those it began with"
    if key == "model_commit":
        if before is None:
            return f"the base model is now the Hub's commit {now}, where the run began from a local folder"
        return (f"the Hub model resolves to commit {now or '(a local folder)'} where the run began from commit"
                f" {before} (resume it with model_revision={before})")
    return f"{key} was {before!r}, now {now!r}"


def _flat(settings: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


# ---------------------------------------------------------------- folders the run writes


def _scratch_roots(cfg: RunConfig) -> dict[str, Path]:
    """Setting -> folder of every place the run keeps scratch files: block inputs on disk, and what
    the engine names (e.g. slide's memory-mapped moments)."""
    roots = {}
    if cfg.activations.checkpoint == "disk":
        roots["activations.disk_dir"] = Path(cfg.activations.disk_dir or Path(cfg.output_dir) / "activations")
    for setting, folder in engines.get(cfg.engine).scratch(cfg).items():
        roots[setting] = Path(folder)
    return roots


def check_writable(folder: Path, setting: str, replaced: bool = False) -> None:
    """`folder` is, or can be made as, a folder this process may write; one sentence if not.
    `replaced`: an existing `folder` is replaced whole, so the folder holding it is written too."""
    probe = folder
    try:
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
    except OSError as err:  # a name longer than the file system takes, say
        raise UserError(f"{setting} '{folder}' cannot be a folder: {err.strerror or err}.") from None
    if not probe.is_dir():
        raise UserError(f"{setting} '{folder}' cannot be a folder: '{probe}' is a file.")
    for place in [probe, probe.parent] if replaced and probe == folder else [probe]:
        if not os.access(place, os.W_OK | os.X_OK):
            raise UserError(f"{setting} '{folder}' is not writable ('{place}' does not let this user write).")


def _make_folder(root: Path, setting: str) -> None:
    """`root` and the missing folders above it, or none of them: a name the file system cannot take, or
    a place writable by its permissions yet not for folders (/proc), is one sentence and leaves nothing."""
    made = []
    try:
        for folder in reversed([root, *root.parents]):
            if folder.is_dir():
                continue
            try:
                folder.mkdir()
            except FileExistsError:  # made meanwhile by another process
                continue
            made.append(folder)
    except OSError as err:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise UserError(f"{setting} '{root}' cannot be made: {err.strerror or err}.") from None


def result_name(cfg: RunConfig) -> str:
    """The result's folder in output_dir: the adapter (LoRA) or the whole model."""
    return "adapter" if cfg.method == "lora" else "model"


def _kept(cfg: RunConfig) -> list[results.Kept]:
    """What a run reads and must never write over: the base model and the data."""
    return results.existing({"the base model's folder": cfg.model, "the training data (data.path)":
                             cfg.data.path, "the evaluation data (data.eval_path)": cfg.data.eval_path})
