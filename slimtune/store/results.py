"""The folders slimtune writes as results (a run's adapter/ or model/, a merged export): the mark that
says slimtune wrote one, the rule for replacing one, and the check that one is whole when it loads.

    MANIFEST          slimtune-result.json inside every result folder: its kind and each file's size
                      and CRC-32 (as a checkpoint's meta.json records them). PEFT and transformers
                      load the folder as they would without it.
    writing(...)      the folder written under a temporary name, its manifest last, then renamed into
                      place (checkpoint.atomic_folder); an existing folder is replaced only when
                      slimtune wrote it as a result of the same kind and nothing else is in it.
    check_target(...) before anything loads: the folder is not, does not hold and does not lie inside
                      a folder slimtune must keep (the base model, the run's own files, the data); it
                      is absent, empty or slimtune's own. Otherwise one sentence, and nothing written.
    verify(...)       on load: every file the manifest lists is whole. A folder without a manifest (a
                      PEFT adapter from elsewhere, an older run) loads as it is.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from slimtune.store import checkpoint
from slimtune.errors import UserError

MANIFEST = "slimtune-result.json"
KINDS = ("adapter", "model", "merged")  # a LoRA run's result, a full run's, `slimtune export --merge`'s


@dataclass(frozen=True)
class Kept:
    """A path a result folder must not be, hold, or (unless `inside_ok`) lie inside."""

    path: Path
    what: str  # e.g. "the base model's folder"
    inside_ok: bool = False


@contextmanager
def writing(folder: Path, kind: str, needed: int | None = None, recorded: bool = False):
    """Yield a temporary folder to fill; it becomes `folder`, with its manifest, when the block ends.
    `recorded`: the run's own record names `folder` as its result (a run from before manifests)."""
    def replaceable(found: Path) -> bool:
        if found.name.endswith(checkpoint.TMP_SUFFIX):  # a write of ours that a kill cut short
            return _manifest(found) is not None or _is_empty(found)
        return recorded or written_by_slimtune(found, kind) or _is_empty(found)

    with checkpoint.atomic_folder(folder, replaceable, needed) as tmp:
        _write_manifest(tmp, kind, None)  # marks the temporary folder as slimtune's from the start
        yield tmp
        _write_manifest(tmp, kind, checkpoint.file_sums(tmp, leave_out=(MANIFEST,)))


def _write_manifest(folder: Path, kind: str, files: dict | None) -> None:
    """`files` None: the folder is still being written."""
    text = json.dumps({"written_by": "slimtune", "kind": kind, "files": files}, indent=1)
    (folder / MANIFEST).write_text(text + "\n")


def _manifest(folder: Path) -> dict | None:
    try:
        found = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _is_empty(folder: Path) -> bool:
    return folder.is_dir() and not any(folder.iterdir())


def written_by_slimtune(folder: Path, kind: str) -> bool:
    """Whether `folder` is a `kind` result slimtune wrote with nothing added since (files it wrote
    may be damaged or missing: it is still slimtune's to replace)."""
    manifest = _manifest(folder)
    if manifest is None or manifest.get("kind") != kind or not isinstance(manifest.get("files"), dict):
        return False
    return not _foreign_files(folder, manifest["files"])


def _foreign_files(folder: Path, listed: dict) -> list[str]:
    """Files under `folder` that its manifest does not list."""
    present = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()]
    return [name for name in present if name != MANIFEST and name not in listed]


# ---------------------------------------------------------------- before anything loads


def check_target(folder: Path, kind: str, label: str, kept: list[Kept], advice: str, recorded: bool = False) -> None:
    """Refuse, in one sentence starting with `label` and ending with `advice`, a result folder that
    would replace what slimtune must keep or did not write. Paths are compared resolved (symlinks
    followed, relative paths made absolute)."""
    check_kept(folder, label, kept, advice)
    target = Path(folder).resolve()
    if not target.exists():
        return
    if not target.is_dir():
        raise UserError(f"{label} is a file, which slimtune does not replace; {advice}.")
    if recorded or written_by_slimtune(target, kind) or _is_empty(target):
        return
    manifest = _manifest(target)
    if manifest is not None and manifest.get("kind") != kind:
        raise UserError(f"{label} holds {_a(manifest.get('kind'))} slimtune wrote, which {_a(kind)} does not replace;"
                        f" {advice}.")
    listed = manifest.get("files") if manifest is not None and isinstance(manifest.get("files"), dict) else {}
    foreign = _foreign_files(target, listed) or sorted(p.name for p in target.iterdir())
    more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
    raise UserError(f"{label} holds files slimtune did not write ({foreign[0]}{more}), and slimtune replaces only a"
                    f" folder it wrote; {advice}.")


def check_kept(path: Path, label: str, kept: list[Kept], advice: str) -> None:
    """Refuse a path to write or remove that is, holds or lies inside one that slimtune must keep."""
    target = Path(path).resolve()
    for keep in kept:
        place = keep.path.resolve()
        relation = ("is" if target == place else "holds" if place.is_relative_to(target)
                    else "lies inside" if target.is_relative_to(place) and not keep.inside_ok else None)
        if relation:
            raise UserError(f"{label} {relation} {keep.what} ('{keep.path}'): slimtune never writes over it;"
                            f" {advice}.")


def _a(kind) -> str:
    return {"adapter": "an adapter", "model": "a model", "merged": "a merged model"}.get(kind, f"a {kind!r} result")


def existing(paths: dict[str, Path | str | None]) -> list[Kept]:
    """Kept entries for those of `paths` (what -> path) that exist."""
    return [Kept(Path(path), what) for what, path in paths.items() if path and Path(path).exists()]


# ---------------------------------------------------------------- on load


def verify(folder: Path, what: str) -> None:
    """One sentence naming the file when a result folder slimtune wrote is no longer whole; a folder
    without a manifest is taken as it is."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        return
    manifest = _manifest(folder)
    files = manifest.get("files") if manifest is not None else None
    if not isinstance(files, dict):
        raise UserError(f"{what} '{folder}' is damaged ({MANIFEST} is torn or was never finished); write it again.")
    reason = checkpoint.files_damage(folder, files)
    if reason is not None:
        raise UserError(f"{what} '{folder}' is damaged: {reason} (its {MANIFEST} has each file's size and CRC-32);"
                        " restore the file or write the folder again.")


def run_config(path: Path) -> dict:
    """A run's config.yaml (`path`), or one sentence: unreadable, not YAML, or not a slimtune run's."""
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(f"{path} is not readable YAML ({str(err).splitlines()[0]}).") from None
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise UserError(f"{path} is not a slimtune run's config (it names no `model`).")
    return cfg


def trained_path(run_dir: Path, cfg: dict, value: str) -> Path | None:
    """`value`, a path the run recorded, as it exists now: as written (absolute, or from here), or
    from the folder the training ran in (the run folder less output_dir's parts). None: neither, or
    no path at all (data.chat_template may be the template's text, longer than a file name may be)."""
    path = Path(value)
    candidates = [path]
    out = Path(str(cfg.get("output_dir", "")))
    root = run_dir.resolve()
    if not path.is_absolute() and not out.is_absolute() and out.parts and ".." not in out.parts:
        n = len(out.parts)
        if root.parts[-n:] == out.parts:
            candidates.insert(0, Path(*root.parts[:-n]) / path)
    return next((c for c in candidates if _exists(c)), None)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long for the file system, a NUL in it: no such path
        return False
