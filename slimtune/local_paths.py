"""Local paths and Hub names: `data/train.jsonl` mistyped is a missing file, not a Hub repository to ask
for; and a machine that cannot reach the Hub hears so at once.

    under_a_local_folder(text)   `org/name` whose `org` is a folder here: a local path, so a missing one is
                                 said as missing at once instead of being looked up on the Hub (a machine
                                 without a network waits out huggingface_hub's retries, about 25 s, first)
    missing(what, path)          "<what> '<path>' does not exist", with the nearest names beside it when a
                                 typo is likely ("did you mean 'data/train.jsonl'?")
    hub_unreachable()            no connection to the Hub's host opens (probed once a process, 5 s at most):
                                 a Hub name is then looked for in the cache alone, not asked for five times

A Hub organisation that is also a folder in the working directory is read as that folder: run from
another directory, or give the dataset as a folder of your own.
"""

from __future__ import annotations

import difflib
import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
PROBE_TIMEOUT_S = 5.0


def under_a_local_folder(text: str) -> bool:
    """A relative `first/rest` whose first part is a folder in the working directory."""
    first, slash, _ = str(text).partition("/")
    return bool(slash) and bool(first) and Path(first).is_dir()


def missing(what: str, path: str | Path) -> str:
    """The sentence for a path that is not there, offering the closest names in the nearest folder that
    exists (at most three)."""
    path = Path(path)
    near = _closest(path)
    offer = f"; did you mean {' or '.join(repr(str(p)) for p in near)}?" if near else "."
    return f"{what} '{path}' does not exist{offer}"


def _closest(path: Path) -> list[Path]:
    parent = path.parent
    if not parent.is_dir() or path.name == "":
        return []
    try:
        names = [entry.name for entry in parent.iterdir() if not entry.name.startswith(".")]
    except OSError:
        return []
    return [parent / name for name in difflib.get_close_matches(path.name, names, n=3, cutoff=0.75)]


def hub_unreachable() -> bool:
    """True when no connection to the Hub's host (HF_ENDPOINT's, huggingface.co by default) opens within
    PROBE_TIMEOUT_S: no network (the name does not resolve), or nothing answers. With a proxy set in the
    environment the library's own connection decides (a direct probe would go around the proxy): False."""
    if any(os.environ.get(name) for name in PROXIES):
        return False
    return _unreachable(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")


@functools.cache
def _unreachable(endpoint: str) -> bool:
    """Probed once a process and endpoint."""
    url = urlparse(endpoint)
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=PROBE_TIMEOUT_S).close()
    except OSError:
        return True
    return False
