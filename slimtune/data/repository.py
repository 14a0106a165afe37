"""Datasets as people name them: a Hub dataset (`data.path: org/name`), a local folder laid out as a Hub
dataset repository (data files, and a README.md whose YAML names its configs and splits), or a folder
`save_to_disk` wrote. Records only: dataset.py maps their fields and checks them as it does a file's.

    is_hub_dataset(path)   `org/name` that is no local path and no data file's name
    is_saved(folder)       a folder `save_to_disk` wrote (its own marker files)
    load(where)            the records of one split (of one subset) of a Hub name or a folder
    load_saved(where)      the records of a save_to_disk folder (a split of a DatasetDict)

A Hub dataset goes through datasets.load_dataset into the user's datasets cache (HF_DATASETS_CACHE), where
a second run, or one offline (HF_HUB_OFFLINE=1, or no connection to the Hub: _load_from_cache), finds it;
the library shows its download bars. A local
folder is read as load_dataset reads a Hub repository (the same configs and splits from the README's
YAML), into a throwaway cache. Every failure a user can cause is one sentence naming the setting.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimtune import local_paths
from slimtune.errors import UserError

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# `org/name` as the Hub takes a repository id (model/hub.py, a layer above data, reads model names alike).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes beside the arrow files


@dataclass(frozen=True)
class Where:
    """One split of one dataset, and the settings that named it (for the sentences)."""

    path: str
    subset: str | None
    split: str | None
    path_setting: str = "data.path"
    split_setting: str = "data.split"


def is_hub_dataset(path: str) -> bool:
    """A Hub name: `data/train.jsonl` that is missing stays a missing file, not a dataset to fetch, and so
    does `data/train.josnl` beside data/train.jsonl (local_paths.a_typo_here)."""
    text = str(path)
    return (bool(_NAME.match(text)) and ".." not in text and "--" not in text and not Path(text).exists()
            and not text.lower().endswith(DATA_SUFFIXES) and not local_paths.a_typo_here(text))


def is_saved(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _SAVED_MARKERS)


@contextlib.contextmanager
def quiet_datasets(progress: bool = False):
    """datasets with its logging silenced (a failed load logs an error before raising; we raise our own
    sentence instead), and its progress bars only when `progress` (a download worth watching)."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.enable_progress_bars() if progress else datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    logger = datasets.utils.logging.get_logger("datasets")
    level = logger.level
    logger.setLevel(100)
    try:
        yield datasets
    finally:
        logger.setLevel(level)
        datasets.enable_progress_bars() if shown else datasets.disable_progress_bars()


def cause(err: BaseException) -> str:
    """The informative first line of a reader's error (datasets wraps the one that says what happened)."""
    text = str(err.__cause__ or err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load(where: Where) -> list[Any]:
    """The records of `where`: a Hub dataset through the datasets cache, a folder through a throwaway one."""
    split = where.split or "train"
    if not Path(where.path).exists():  # a Hub name (read_records checked)
        if _hub_unreachable():
            return _load_from_cache(where, split)
        with quiet_datasets(progress=True) as datasets:
            try:
                return _load_by_name(datasets, where.path, where.subset, split)
            except Exception as err:  # noqa: BLE001 - every reader failure is said as one sentence
                raise _error(err, where, split) from None
    refuse_mixed_formats(where)
    with quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="slimtune-data-") as cache:
        try:
            ds = datasets.load_dataset(where.path, where.subset, split=split, cache_dir=cache, keep_in_memory=True)
            return ds.to_list()
        except Exception as err:  # noqa: BLE001
            raise _error(err, where, split, folder=True) from None


def _hub_unreachable() -> bool:
    """No connection to the Hub opens from here (local_paths.hub_unreachable), and HF_HUB_OFFLINE is unset."""
    from huggingface_hub import constants

    return not constants.is_offline_mode() and local_paths.hub_unreachable()


def _load_from_cache(where: Where, split: str) -> list[Any]:
    """`where` read from the datasets cache alone, on a machine that cannot reach the Hub. In this process
    datasets would ask the Hub first, five retries over about 25 s (huggingface_hub reads HF_HUB_OFFLINE,
    its only cache-only switch, once, when imported), so a process of its own started with HF_HUB_OFFLINE=1
    reads it (1-3 s) and hands back the records or the sentence (_answer_from_cache) through a file.
    Under torchrun each rank reads it; rank 0 says so."""
    from slimtune.dist.ranks import env_rank

    if env_rank() == 0:
        print(f"slimtune: the Hub cannot be reached from here: {where.path_setting} '{where.path}' is read from"
              " the datasets cache", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="slimtune-data-") as folder:
        asked, answer = Path(folder) / "asked.pickle", Path(folder) / "answer.pickle"
        with asked.open("wb") as handle:
            pickle.dump((where, split), handle)
        done = subprocess.run([sys.executable, "-m", "slimtune.data.repository", str(asked), str(answer)],
                              env=_reader_environment(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, errors="replace")
        try:
            with answer.open("rb") as handle:
                read, value = pickle.load(handle) if done.returncode == 0 else (None, None)
        except (OSError, EOFError, pickle.UnpicklingError):
            read = None
        if read is None:  # the reader itself failed (killed, out of memory, a full disk): its last words
            last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            raise UserError(f"{where.path_setting} '{where.path}' could not be read from the datasets cache ({last}).")
    if not read:
        raise UserError(value)
    return value


def _reader_environment() -> dict[str, str]:
    """This process's environment, offline, and with slimtune importable wherever it was imported from."""
    root = str(Path(__file__).resolve().parents[2])
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(paths)}


def _answer_from_cache(asked: Path, answer: Path) -> None:
    """_load_from_cache's reader, in its own process under HF_HUB_OFFLINE=1: (True, records) or (False,
    the sentence) into `answer`, whole or not at all (written beside it, then renamed)."""
    with asked.open("rb") as handle:
        where, split = pickle.load(handle)
    with quiet_datasets() as datasets:
        try:
            found = (True, _load_by_name(datasets, where.path, where.subset, split))
        except Exception as err:  # noqa: BLE001 - every reader failure is said as one sentence
            found = (False, str(_error(err, where, split, unreachable=True)))
    partial = answer.with_suffix(".partial")
    with partial.open("wb") as handle:
        pickle.dump(found, handle, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(partial, answer)


# A data file's format by its extension, as datasets infers a folder's builder.
_FORMATS = {".jsonl": "JSON", ".json": "JSON", ".csv": "CSV", ".tsv": "CSV", ".parquet": "Parquet", ".txt": "text",
            ".arrow": "Arrow"}


def refuse_mixed_formats(where: Where) -> None:
    """A folder of data files in several formats, without a README.md naming which files are which: datasets
    reads the most common format alone and drops the others' records without a word, so it is said."""
    folder = Path(where.path)
    if (folder / "README.md").is_file():
        return
    kinds: dict[str, str] = {}
    for file in sorted(folder.rglob("*")):
        kind = _FORMATS.get(file.suffix.lower())
        hidden = any(part.startswith((".", "_")) for part in file.relative_to(folder).parts)  # as datasets skips them
        if kind is not None and file.is_file() and not hidden:
            kinds.setdefault(kind, file.relative_to(folder).as_posix())
    if len(kinds) > 1:
        found = ", ".join(f"{name} ({kind})" for kind, name in kinds.items())
        raise UserError(f"{where.path_setting} '{where.path}' holds data files in several formats ({found}); datasets"
                        " would read one format and drop the others: keep one format in the folder, or name a file.")


def refuse_splits_of_a_file(where: Where) -> None:
    """A single file has no subsets or splits: naming one is a mistake, said rather than ignored."""
    if where.subset or where.split:
        named = where.split_setting if where.split else "data.subset"
        raise UserError(f"{named} names a split or subset of a Hub dataset or a dataset folder, but {where.path_setting}"
                        f" '{where.path}' is a single file.")


def load_saved(where: Where) -> list[Any]:
    """The records of a folder save_to_disk wrote: its one dataset, or a split of its DatasetDict (train,
    or the only one, when data.split is unset)."""
    label = where.path
    with quiet_datasets() as datasets:
        try:
            ds = datasets.load_from_disk(label, keep_in_memory=True)
        except Exception as err:  # noqa: BLE001
            raise UserError(f"data folder '{label}' is not a save_to_disk dataset ({cause(err)}).") from None
    if where.subset:
        raise UserError(f"data.subset '{where.subset}' names a subset, but data folder '{label}' is one saved dataset.")
    if not isinstance(ds, datasets.DatasetDict):
        if where.split:
            raise UserError(f"{where.split_setting} '{where.split}' names a split, but data folder '{label}' is one"
                            " saved dataset without splits.")
        return ds.to_list()
    if where.split:
        if where.split not in ds:
            raise UserError(f"{where.split_setting} '{where.split}' is not a split of data folder '{label}'; it has:"
                            f" {', '.join(ds)}.")
        return ds[where.split].to_list()
    if "train" not in ds and len(ds) != 1:
        raise UserError(f"data folder '{label}' holds splits {list(ds)} and none is named 'train'; name one with"
                        " data.split.")
    return (ds["train"] if "train" in ds else next(iter(ds.values()))).to_list()


def _load_by_name(datasets, name: str, subset: str | None, split: str) -> list[Any]:
    """A Hub dataset's split. Offline, datasets finds a dataset with several subsets in its cache but cannot
    tell which one the Hub calls the default; the subset named `default` is the one it would take online."""
    try:
        return datasets.load_dataset(name, subset, split=split).to_list()
    except ValueError as err:
        if subset is not None or "multiple" not in str(err) or "default" not in _listed(str(err)).split(", "):
            raise
    return datasets.load_dataset(name, "default", split=split).to_list()


def _error(err: BaseException, where: Where, split: str, folder: bool = False, unreachable: bool = False) -> UserError:
    """One sentence for a failed load_dataset, naming the setting at fault. `unreachable`: read offline
    because the Hub cannot be reached (_load_from_cache), not because the user set HF_HUB_OFFLINE."""
    import datasets

    what, text = f"{where.path_setting} '{where.path}'", str(err)
    choices = _listed(text)
    if "Unknown split" in text:
        return UserError(f"{where.split_setting} '{split}' is not a split of {what}{_subset(where)}; it has: {choices}.")
    if "BuilderConfig" in text and "not found" in text:
        return UserError(f"data.subset '{where.subset}' is not a subset of {what}; it has: {choices}.")
    if "Config name is missing" in text or "multiple" in text and "configurations in the cache" in text:
        return UserError(f"{what} has several subsets ({choices}); name one with data.subset.")
    if folder:
        return UserError(f"data folder '{where.path}' is neither a save_to_disk dataset nor a folder of data files"
                         f" ({cause(err)}).")
    hub_site = datasets.config.HF_ENDPOINT
    if isinstance(err, datasets.exceptions.DatasetNotFoundError):
        if "gated" in text:
            return UserError(f"{what} is a gated dataset: accept its terms at {hub_site}/datasets/{where.path} while"
                             f" logged in, then set HF_TOKEN to an access token of that account"
                             f" ({hub_site}/settings/tokens).")
        return UserError(f"{what} is neither a local file or folder nor a Hub dataset this account can see (a private"
                         " one needs HF_TOKEN set to a token with access).")
    if isinstance(err, ConnectionError):
        if unreachable:
            return UserError(f"{what} is not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}) and the Hub"
                             " cannot be reached from here; check the connection, or fetch it once where there is one.")
        if datasets.config.HF_HUB_OFFLINE:
            return UserError(f"{what} is not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}) and"
                             " HF_HUB_OFFLINE is set, so it cannot be fetched; fetch it once with a connection, or"
                             " unset HF_HUB_OFFLINE.")
        return UserError(f"{what} is not in the datasets cache and the Hub cannot be reached ({cause(err)}); check the"
                         " connection and run again.")
    return UserError(f"{what} could not be read as a Hub dataset ({cause(err)}).")


def _subset(where: Where) -> str:
    return f" (subset '{where.subset}')" if where.subset else ""


def _listed(text: str) -> str:
    """The names a datasets message lists as ['a', 'b'], as a, b."""
    found = re.search(r"\[([^\]]*)\]", text)
    if found:
        return ", ".join(re.findall(r"'([^']*)'", found.group(1)))
    found = re.search(r"in the cache: (.*)$", text.splitlines()[0] if text else "")  # "... in the cache: a, b"
    return found.group(1).rstrip(".") if found else "(none listed)"


if __name__ == "__main__":  # _load_from_cache's reader: python -m slimtune.data.repository ASKED ANSWER
    _answer_from_cache(Path(sys.argv[1]), Path(sys.argv[2]))
