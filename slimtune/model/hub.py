"""Hub names in: a model given as `org/name` becomes a local folder, fetched into the Hugging Face cache.

    is_hub_name(text)            `org/name` that is not a local path
    folder(model, revision)      a local folder as is; a Hub name fetched (only what training reads:
                                 config, safetensors weights and their index, tokenizer and generation
                                 files) into the standard Hub cache, with huggingface_hub's own progress
                                 bars and its resume of an interrupted download; returns the snapshot folder
    resolved(cfg)                the run's settings with `model` that folder, so everything downstream
                                 (train, plan=auto, export, chat) keeps reading a folder as before
    origin(folder)               (org/name, commit) of a Hub cache snapshot folder, else None: the commit
                                 a run began from is part of its identity (run/folder.py)
    config_folder(name)          plan: only config.json fetched

The snapshot folder's name is the commit resolved (the cache's layout: models--org--name/snapshots/<commit>/),
so recording the folder records the commit. huggingface_hub owns the cache, the token (HF_TOKEN) and
offline mode (HF_HUB_OFFLINE). Each failure a user can cause is one sentence: pickle-only weights
(nothing is unpickled), a gated or private model without access, offline with nothing cached.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from slimtune import local_paths
from slimtune.errors import UserError

# `org/name`: what the Hub accepts as a repository id (letters, digits, - _ . ; no leading dot or dash).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What training, chat and export read; nothing pickled, no other format's copy of the weights.
_CONFIG = ["config.json", "generation_config.json"]
_TOKENIZER = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
              "chat_template.jinja", "chat_template.json"]
_STANDARD_WEIGHTS = ["model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json"]
_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def is_hub_name(text: str) -> bool:
    """`org/name` naming a Hub repository rather than a local path (a local path of that form wins; a
    missing one is looked up, and the refusal offers the near local names: local_paths.offer)."""
    text = str(text)
    return bool(_NAME.match(text)) and ".." not in text and "--" not in text and not Path(text).exists()


def resolved(cfg):
    """`cfg` (a RunConfig) with `model` the local folder it names: a Hub name fetched at model_revision."""
    if not is_hub_name(cfg.model):
        if cfg.model_revision is not None and origin(cfg.model) is None:  # a snapshot folder: resolved before
            raise UserError(f"model_revision '{cfg.model_revision}' is set but model '{cfg.model}' is a local folder,"
                            " not a Hub name (org/name); leave model_revision out.")
        return dataclasses.replace(cfg, model=folder(cfg.model))  # a cleaned cache's snapshot is fetched again
    return dataclasses.replace(cfg, model=folder(cfg.model, cfg.model_revision))


def folder(model: str, revision: str | None = None) -> str:
    """The local folder of `model`: itself when it is one, else the Hub name's snapshot, fetched when not
    cached. A snapshot folder that is gone (a cleaned cache) is fetched again at its commit."""
    if not is_hub_name(model):
        found = origin(model)
        return folder(*found) if found is not None and not Path(model).is_dir() else model
    from huggingface_hub import snapshot_download

    listing = _repo_files(model, revision)
    if listing is not None:
        _refuse_pickle_only(model, listing)
    try:  # the Hub not asked (offline, unreachable): the cache alone, with no retries waited out again
        snapshot = snapshot_download(model, revision=revision, allow_patterns=_patterns(listing),
                                     local_files_only=listing is None)
    except Exception as err:  # noqa: BLE001 - every fetch failure is said as one sentence, or re-raised
        raise _fetch_error(err, model, revision) from None
    if listing is None:  # offline: the cached snapshot is all there is to look at
        _refuse_cached_without_weights(model, snapshot)
    return snapshot


def origin(path: str | Path) -> tuple[str, str] | None:
    """(org/name, commit) when `path` is a model snapshot folder of a Hub cache, else None."""
    path = Path(path)
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not repo.startswith("models--") or not _COMMIT.match(path.name):
        return None
    return repo.removeprefix("models--").replace("--", "/", 1), path.name


def public_name(model: str | Path) -> tuple[str, str | None]:
    """How files other tools read (an adapter's config, a GGUF file) should name a base model: a Hub
    snapshot as (org/name, its commit), which PEFT and llama.cpp users can fetch anywhere; a local
    folder as (its absolute path, None)."""
    return origin(model) or (str(Path(model).resolve()), None)


def config_folder(name: str) -> str:
    """The snapshot folder holding `name`'s config.json, fetching that file alone (what plan reads)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        return str(Path(hf_hub_download(name, "config.json", local_files_only=_cache_only())).parent)
    except RemoteEntryNotFoundError:
        raise UserError(f"model '{name}' has no config.json on the Hub; it is not a transformers model.") from None
    except Exception as err:  # noqa: BLE001
        raise _fetch_error(err, name, None) from None


def _patterns(listing: list[str] | None) -> list[str]:
    """The files to fetch: the standard weights' names when the repository uses them (a Mistral repository
    also holds consolidated.safetensors, the same weights again), else its top-level safetensors files."""
    if listing is None or any(name in ("model.safetensors", "model.safetensors.index.json") for name in listing):
        return _CONFIG + _TOKENIZER + _STANDARD_WEIGHTS
    return _CONFIG + _TOKENIZER + [f for f in listing if f.endswith((".safetensors", ".safetensors.index.json"))]


def _repo_files(name: str, revision: str | None) -> list[str] | None:
    """The repository's top-level files, listed by the Hub before anything is fetched; None when the Hub
    cannot be asked (offline, no connection): the cache answers instead."""
    from huggingface_hub import HfApi

    if _cache_only():  # offline mode included: the library would refuse to ask
        return None
    try:
        return [f for f in HfApi().list_repo_files(name, revision=revision) if "/" not in f]
    except Exception as err:  # noqa: BLE001
        if _unreachable(err):
            return None
        raise _fetch_error(err, name, revision) from None


def _cache_only() -> bool:
    """The Hub is not to be asked: offline mode (HF_HUB_OFFLINE), or no connection to it opens here
    (local_paths.hub_unreachable: probed only when not offline)."""
    from huggingface_hub import constants

    return constants.is_offline_mode() or local_paths.hub_unreachable()


def _unreachable(err: BaseException) -> bool:
    """A connection that failed or timed out (the library's HTTP client raises its own classes)."""
    names = {cls.__name__ for cls in type(err).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "ConnectionError", "NetworkError"})


def _refuse_pickle_only(name: str, files: list[str]) -> None:
    if any(f.endswith(".safetensors") for f in files):
        return
    pickled = sorted(f for f in files if f.endswith(_PICKLED))
    if pickled:
        raise UserError(f"model '{name}' has its weights only as pickle files ({', '.join(pickled[:3])}), which"
                        " slimtune never loads (unpickling runs code); use a repository with .safetensors weights.")
    raise UserError(f"model '{name}' has no .safetensors weights on the Hub; slimtune loads safetensors only.")


def _refuse_cached_without_weights(name: str, snapshot: str) -> None:
    """Offline, a cached snapshot may be part of one: `slimtune plan` fetches config.json alone."""
    files = [p.name for p in Path(snapshot).iterdir()]
    if any(f.endswith(".safetensors") for f in files) or any(f.endswith(_PICKLED) for f in files):
        _refuse_pickle_only(name, files)
        return
    raise UserError(f"the cached copy of model '{name}' ({snapshot}) holds no weights (only part of it was fetched,"
                    " e.g. by slimtune plan) and the Hub cannot be asked; fetch it once with a connection.")


def _fetch_error(err: BaseException, name: str, revision: str | None) -> BaseException:
    """The sentence for a failed fetch of `name`; an error no user causes is handed back as it is."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hub

    page = f"{constants.ENDPOINT}/{name}"
    access = (f"accept its license at {page} while logged in, then set HF_TOKEN to an access token of that account"
              f" ({constants.ENDPOINT}/settings/tokens)")
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, hub.GatedRepoError) or (isinstance(err, hub.HfHubHTTPError) and status in (401, 403)
                                               and not isinstance(err, hub.RepositoryNotFoundError)):
        return UserError(f"model '{name}' is gated or private and the Hub refused access (HTTP {status}): {access}.")
    if isinstance(err, hub.RepositoryNotFoundError):
        return UserError(f"model '{name}' is neither a local folder{_looked_for(name)} nor a Hub model this"
                         " account can see (a private one needs HF_TOKEN set to a token with access).")
    if isinstance(err, hub.RevisionNotFoundError):
        return UserError(f"model_revision '{revision}' is not a branch, tag or commit of {name} on the Hub.")
    if isinstance(err, hub.IncompleteSnapshotError):
        return UserError(f"the cached copy of model '{name}' is incomplete and the Hub cannot be reached to finish"
                         " it; run again with a connection.")
    if isinstance(err, hub.LocalEntryNotFoundError):
        at = f" at revision '{revision}'" if revision else ""
        missing = (f"model '{name}' is not a local folder{_looked_for(name)}, and{at} it is not in the Hub"
                   f" cache ({constants.HF_HUB_CACHE})")
        if constants.is_offline_mode():
            return UserError(f"{missing} while HF_HUB_OFFLINE is set, so it cannot be fetched; fetch it once with a"
                             " connection, or unset HF_HUB_OFFLINE.")
        return UserError(f"{missing} and the Hub cannot be reached; check the connection (or HF_ENDPOINT) and run"
                         " again.")
    return err


def _looked_for(name: str) -> str:
    """The near local folders, else where a relative name was looked for as a folder (a config's
    `models/x` run from another folder, or before the step that makes it)."""
    near = local_paths.offer(name)
    return near or f" (none at {Path.cwd() / name})"
