"""Checkpoints: atomic save, keep-last-N, exact resume; and the run's final outputs.

A checkpoint is a folder `checkpoints/step-<N>/` holding the trainable weights
(safetensors), the optimizer and scheduler state, the data stream position, and every
RNG state. It is written under a temporary name, each file fsynced, then renamed into
place, so a run killed at any instant leaves either the whole checkpoint or none.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PREFIX = "step-"
TMP_SUFFIX = ".tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


@contextmanager
def atomic_folder(final: Path):
    """Yield a temporary sibling folder; on success fsync it and rename it to `final`."""
    final = Path(final)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: Path, step: int, engine_state: dict, stream_state: dict, keep_last: int) -> Path:
    """Write checkpoint `step` under root/checkpoints atomically, then prune to keep_last."""
    folder = Path(root) / "checkpoints" / f"{PREFIX}{step:08d}"
    with atomic_folder(folder) as tmp:
        trainable = {k: v.detach().cpu().contiguous() for k, v in engine_state["trainable"].items()}
        save_file(trainable, str(tmp / "trainable.safetensors"))
        rest = {k: v for k, v in engine_state.items() if k != "trainable"}
        torch.save({"engine": rest, "rng": rng_state()}, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, "stream": stream_state}))
    prune(Path(root) / "checkpoints", keep_last)
    return folder


def prune(folder: Path, keep_last: int) -> None:
    for stale in list_checkpoints(folder)[:-keep_last]:
        shutil.rmtree(stale)


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of a killed save are ignored)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(TMP_SUFFIX)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: Path) -> Path | None:
    found = list_checkpoints(Path(root) / "checkpoints")
    return found[-1] if found else None


def load(folder: Path) -> tuple[int, dict, dict, dict]:
    """(step, engine_state, stream_state, rng) of a checkpoint folder."""
    meta = json.loads((folder / "meta.json").read_text())
    blob = torch.load(folder / "state.pt", weights_only=True)  # tensors and plain values only: no code runs
    engine_state = dict(blob["engine"], trainable=load_file(str(folder / "trainable.safetensors")))
    return meta["step"], engine_state, meta["stream"], blob["rng"]
