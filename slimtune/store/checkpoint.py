"""Checkpoints: atomic save, keep-last-N, exact resume.

A checkpoint is a folder `checkpoints/step-<N>/`:
  trainable.safetensors  the trained weights by parameter name
  moments.safetensors    AdamW's moments by parameter name (`exp_avg/<name>`, `exp_avg_sq/<name>`)
  state.pt               the engine's name, AdamW's step count per parameter, engine extras, every RNG
  meta.json              format, step, engine, the data stream's position, each file's size and CRC-32
State sharded across ranks (dist.strategy=fsdp: DTensors) is written by every rank at once with
torch.distributed.checkpoint into `sharded/` in place of the two safetensors files, keyed the same
way (`trainable/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>`); rank 0 writes the rest. It loads
into whatever the resuming engine holds (whole tensors or shards): DCP reshards. The training loop
resumes a run only on the world size that wrote it, since the data position means those steps
(data.BatchStream's fingerprint); another engine, or an export, may read it on any.
Under data parallelism without sharding every rank holds the same state and rank 0 alone writes.
Every engine writes this one format (`EngineState`): the optimizer state is kept by parameter name,
not in an engine's own layout, so a checkpoint resumes under another engine (plan=auto on another
card), or ends in one sentence. The folder is written under a temporary name, each file fsynced,
then renamed into place, so a run killed at any instant leaves either the whole checkpoint or none.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from slimtune.dist.ranks import SINGLE, Dist
from slimtune import progress
from slimtune.errors import UserError
from slimtune.units import human_bytes

PREFIX = "step-"
TMP_SUFFIX = ".tmp"
FORMAT = 2  # meta.json "format"; checkpoints without one kept engine-specific optimizer state
SHARDED = "sharded"  # the folder torch.distributed.checkpoint writes sharded state into


@dataclass
class EngineState:
    """Everything exact resume needs from an engine, the same for every engine."""

    engine: str  # the engine that wrote it
    step: int  # optimizer steps taken: the learning-rate schedule's position
    trainable: dict[str, torch.Tensor]  # the trained weights by parameter name
    exp_avg: dict[str, torch.Tensor]  # AdamW's moments by parameter name
    exp_avg_sq: dict[str, torch.Tensor]
    adam_steps: dict[str, float]  # AdamW's step count by parameter name (its bias correction)
    extra: dict = field(default_factory=dict)  # engine-specific state (tensors and plain values only)


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


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask alone must set one to
    read it, which another thread's new file could catch)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _modes_as_umask_gives(folder: Path) -> None:
    """Every file of `folder` readable as any file this process makes: safetensors 0.8 writes through a
    temporary file of mode 0600 and renames it (safetensors/safetensors#782), so a model or adapter it
    wrote was readable by its owner alone (another user, a container's, could not load it) while the
    files beside it were not."""
    mode, me = 0o666 & ~_umask(), os.geteuid() if hasattr(os, "geteuid") else None
    for path in folder.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        found = path.stat()
        if found.st_mode & 0o777 == mode or (me is not None and found.st_uid != me):
            continue  # already so, or another node's rank wrote it (a shared filesystem): its mode is its own
        try:
            os.chmod(path, mode)
        except PermissionError:
            pass  # a file this process may not change: left as it was written


@contextmanager
def atomic_folder(final: Path, replaceable=lambda folder: False, needed: int | None = None):
    """Yield a temporary sibling folder; on success fsync it and rename it to `final`.

    An existing `final`, or a temporary folder a killed write left, is removed only when
    `replaceable(folder)` says slimtune wrote it: else one sentence and nothing is removed. A full
    disk or a folder this user may not write ends in one sentence as well (`needed`: the bytes the
    folder takes, where the caller knows), with the temporary folder removed and `final` as it was."""
    final = Path(final)
    if final.is_symlink():  # write where the link points: the link itself is the user's
        final = final.resolve()
    tmp = final.with_name(final.name + TMP_SUFFIX)
    for folder in (final, tmp):
        if folder.exists() and not replaceable(folder):
            raise UserError(f"'{folder}' holds files slimtune did not write, so slimtune leaves it as it is; write"
                            " to another folder, or move it away first.")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        progress.large_folder("writing", final, needed)
        yield tmp
        _modes_as_umask_gives(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        sentence = write_failure(err, final, needed)
        if sentence is None:
            raise
        raise UserError(sentence) from None


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def write_failure(err: BaseException, final: Path, needed: int | None = None) -> str | None:
    """One sentence for a write that failed for want of space or permission, else None."""
    cause = _os_error_behind(err)
    if cause is None:
        return None
    if cause.errno in NO_SPACE:
        need = f"it needs about {human_bytes(needed)}, " if needed else ""
        return (f"no space left on the device to write '{final}' ({need}{human_bytes(_free_bytes(final))} free);"
                " nothing was kept of it and what was written before is intact: free some space and run the same"
                " command again.")
    if cause.errno in NOT_WRITABLE:
        where = cause.filename or final.parent
        return (f"cannot write '{final}': {cause.strerror} ('{where}'); nothing was kept of it: make the folder"
                " writable or write to another one.")
    return None


def _os_error_behind(err: BaseException) -> OSError | None:
    """The operating system's error behind `err`: itself, the one it was raised from or while
    handling (torch's writer wraps it in a RuntimeError), or the one safetensors names in its text."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        named = re.search(r"\(os error (\d+)\)", str(err))
        if named:
            code = int(named.group(1))
            return OSError(code, os.strerror(code))
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def process_rng_state() -> dict:
    """Every generator the loop draws from (Python's, torch's, each CUDA device's): what resume
    restores; and the current device's apart ("cuda_own": under torchrun, the rank's own card)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_own"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_process_rng_state(state: dict) -> None:
    """Rank 0 writes the state; every rank of a job draws alike (one seed, the same ops), so rank r's
    own card takes rank 0's own card's state, not rank 0's copy of card r's (which it never used)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # The cards this machine has (a run saved on 8 may resume on 1: set_rng_state_all would index past them).
        for index, card_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(card_state, index)
        if "cuda_own" in state:
            torch.cuda.set_rng_state(state["cuda_own"], torch.cuda.current_device())


def _host(tensors: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def save(root: Path, step: int, state: EngineState, stream_state: dict, keep_last: int, dist: Dist = SINGLE) -> Path:
    """Write checkpoint `step` under root/checkpoints atomically, then prune to keep_last. Every rank
    calls it under data parallelism: rank 0 writes, and with sharded state every rank writes its shards."""
    folder = Path(root) / "checkpoints" / f"{PREFIX}{step:08d}"
    sharded = is_sharded(state)
    if not dist.is_main and not sharded:
        return folder
    # A step folder under the run's own checkpoints/ is the run's: a damaged one passed over on resume is rewritten.
    writing = atomic_folder(folder, replaceable=lambda _: True, needed=_bytes_of(state)) if dist.is_main else \
        _made_by_rank0(folder)
    with writing as tmp:
        if sharded:
            _save_sharded(state, tmp, dist)
        else:
            save_file(_host(state.trainable), str(tmp / "trainable.safetensors"))
            save_file({**_host(state.exp_avg, "exp_avg/"), **_host(state.exp_avg_sq, "exp_avg_sq/")},
                      str(tmp / "moments.safetensors"))
        if dist.is_main:
            with open(tmp / "state.pt", "wb") as handle:  # a full disk then raises an OSError torch's own file hides
                torch.save({"engine": state.engine, "step": state.step, "adam_steps": state.adam_steps,
                            "extra": state.extra, "rng": process_rng_state()}, handle)
            files = file_sums(tmp)
            (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step, "engine": state.engine,
                                                       "stream": stream_state, "files": files, "sharded": sharded}))
    if dist.is_main:
        prune(Path(root) / "checkpoints", keep_last)
    return folder


def _bytes_of(state: EngineState) -> int:
    """What the checkpoint's tensors take on disk (this rank's share when sharded)."""
    tensors = [*state.trainable.values(), *state.exp_avg.values(), *state.exp_avg_sq.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def is_sharded(state: EngineState) -> bool:
    from slimtune.dist import sharding

    return any(sharding.is_sharded(t) for t in state.trainable.values())


def _flat_state(state: EngineState) -> dict[str, torch.Tensor]:
    return {**{f"trainable/{k}": v for k, v in state.trainable.items()},
            **{f"exp_avg/{k}": v for k, v in state.exp_avg.items()},
            **{f"exp_avg_sq/{k}": v for k, v in state.exp_avg_sq.items()}}


def _save_sharded(state: EngineState, tmp: Path, dist: Dist) -> None:
    import torch.distributed.checkpoint as dcp

    dist.barrier("the checkpoint's folder")  # rank 0 made it
    dist.collective(lambda: dcp.save(_flat_state(state), checkpoint_id=tmp / SHARDED), "the sharded checkpoint")


@contextmanager
def _made_by_rank0(folder: Path):
    """A rank other than 0 writes its shards into the temporary folder rank 0 made and renames."""
    yield folder.with_name(folder.name + TMP_SUFFIX)


def prune(folder: Path, keep_last: int) -> None:
    for stale in list_checkpoints(folder)[:-keep_last]:
        shutil.rmtree(stale)


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of a killed save are ignored)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and _is_checkpoint_name(p.name)]
    return sorted(found, key=step_of)


def _is_checkpoint_name(name: str) -> bool:
    """step-<digits> alone: a killed save's temporary folder, or a user's copy (step-00000004.bak,
    "step-00000004 copy"), is not one of the run's checkpoints."""
    return name.startswith(PREFIX) and name[len(PREFIX):].isascii() and name[len(PREFIX):].isdigit()


def step_of(folder: Path) -> int:
    """The step a checkpoint folder holds, from its name."""
    return int(folder.name[len(PREFIX):])


def latest(root: Path) -> Path | None:
    found = list_checkpoints(Path(root) / "checkpoints")
    return found[-1] if found else None


def latest_intact(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint whose files are whole, and a sentence for each newer one that is not."""
    damaged = []
    for folder in reversed(list_checkpoints(Path(root) / "checkpoints")):
        reason = damage(folder)
        if reason is None:
            return folder, damaged
        damaged.append(f"checkpoint '{folder}' is damaged ({reason})")
    return None, damaged


def damage(folder: Path) -> str | None:
    """Why a checkpoint cannot be trusted (a file missing, cut short or changed since it was
    written: sizes and CRC-32s are in meta.json), or None when it is whole."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return "meta.json is missing or torn"
    if meta.get("format") != FORMAT:
        return None  # load() names an older format in a sentence of its own
    if "files" not in meta:
        return "meta.json lists no files"
    return files_damage(folder, meta["files"])


def written_bytes(folder: Path) -> int:
    """The bytes of a checkpoint's files as meta.json lists them (0 where it lists none)."""
    try:
        files = json.loads((folder / "meta.json").read_text()).get("files") or {}
    except (OSError, ValueError):
        return 0
    return sum(want["bytes"] for want in files.values())


def file_sums(folder: Path, leave_out: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each file under `folder` (its path there, / between parts) -> its size and CRC-32."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in leave_out]
    return {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "crc32": file_crc32(p)} for p in paths}


def files_damage(folder: Path, files: dict[str, dict]) -> str | None:
    """The first file of `files` (file_sums as written) that is missing, cut short or changed, or None."""
    progress.large_folder("checking", folder, sum(want["bytes"] for want in files.values()))
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if file_crc32(path) != want["crc32"]:
            return f"{name} has changed since it was written (CRC-32)"
    return None


def file_crc32(path: Path) -> int:
    """CRC-32 of a file, read in 16 MiB pieces: it tells damage, not tampering, at several GB/s."""
    crc = 0
    with open(path, "rb") as handle:
        while piece := handle.read(16 << 20):
            crc = zlib.crc32(piece, crc)
    return crc


def load(folder: Path, template=None) -> tuple[int, EngineState, dict, dict]:
    """(step, engine state, stream state, rng) of a checkpoint folder. A sharded checkpoint is read
    into `template()`'s tensors (the resuming engine's state_dict: DCP reshards into them)."""
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"checkpoint '{folder}' is in an older format than this slimtune reads; resume it with the"
                        " slimtune that wrote it, or start afresh with train.overwrite=true or another output_dir.")
    blob = torch.load(folder / "state.pt", weights_only=True)  # tensors and plain values only: no code runs
    if meta.get("sharded"):
        trainable, exp_avg, exp_avg_sq = _load_sharded(folder, template)
    else:
        moments = load_file(str(folder / "moments.safetensors"))
        trainable = load_file(str(folder / "trainable.safetensors"))
        exp_avg = {k.removeprefix("exp_avg/"): v for k, v in moments.items() if k.startswith("exp_avg/")}
        exp_avg_sq = {k.removeprefix("exp_avg_sq/"): v for k, v in moments.items() if k.startswith("exp_avg_sq/")}
    state = EngineState(engine=blob["engine"], step=blob["step"], trainable=trainable, exp_avg=exp_avg,
                        exp_avg_sq=exp_avg_sq, adam_steps=blob["adam_steps"], extra=blob["extra"])
    return meta["step"], state, meta["stream"], blob["rng"]


def _load_sharded(folder: Path, template) -> tuple[dict, dict, dict]:
    """The sharded state, read into the resuming engine's own tensors; the names it saved must be
    the ones that engine trains (else check_resumable's sentence, from the caller)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder / SHARDED))
    saved = set(reader.read_metadata().state_dict_metadata)
    mine = template()
    names = {k.removeprefix("trainable/") for k in saved if k.startswith("trainable/")}
    if names != set(mine.trainable):
        stub = {name: torch.empty(0) for name in names}
        return stub, {}, {}  # the engine names the mismatch
    wanted = {k: v for k, v in _flat_state(mine).items() if k in saved}
    dcp.load(wanted, storage_reader=reader)
    return tuple({k.removeprefix(prefix): v for k, v in wanted.items() if k.startswith(prefix)}
                 for prefix in ("trainable/", "exp_avg/", "exp_avg_sq/"))


def check_resumable(state: EngineState, names: list[str], engine: str,
                    decided_by: str = "the method, lora.* or freeze settings") -> None:
    """One sentence when a checkpoint trained other tensors than this run trains: nothing could be
    resumed exactly. It names what differs: the engine that wrote the checkpoint, or, under the same
    engine, `decided_by`: what decides which tensors this engine trains (a training run has already
    refused another method, adapter or freeze patterns, run_folder's identity: lsp names lsp.train_other)."""
    mine, theirs = set(names), set(state.trainable)
    if mine == theirs:
        return
    only = sorted(theirs - mine) or sorted(mine - theirs)
    side = "the checkpoint has" if theirs - mine else "this run trains"
    lacks = f"{side} {len(only)} trained tensor(s) the other lacks, e.g. '{only[0]}'"
    afresh = "or start afresh with train.overwrite=true or another output_dir."
    if state.engine != engine:
        raise UserError(f"the checkpoint was written by engine {state.engine} and trained other tensors than this run"
                        f" (engine {engine}) does ({lacks}); resume with the engine and settings it was written with"
                        f" (engine={state.engine}), {afresh}")
    raise UserError(f"the checkpoint trained other tensors than this run does ({lacks}): {decided_by} differ(s) from"
                    f" the checkpoint's; resume with the settings it was written with, {afresh}")


def copy_named(targets: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    """Copy source[name] into targets[name] for every name (dtype and device converted on the way)."""
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(source[name])
