"""Local paths and Hub names: `data/train.josnl` mistyped beside data/train.jsonl is a missing file, not a Hub
dataset to ask for; a missing path is said with the nearest names; and a machine that cannot reach the Hub
hears so at once.

    a_typo_here(text)    `org/name` whose `org` is a folder here holding a name close to `name`: a mistyped
                         local path, said as missing at once instead of being looked up on the Hub (a machine
                         without a network waits out huggingface_hub's retries, about 25 s, first). Used for
                         data paths; a model name is still looked up (a folder of one Hub organisation's
                         models beside the run, meta-llama/Llama-3.1-8B, must not hide meta-llama/Llama-3.2-1B),
                         and the Hub's refusal then offers the near local names (offer)
    missing(what, path)  "<what> '<path>' does not exist", with the nearest names when a typo is likely
    offer(path)          " (did you mean 'data/train.jsonl'?)", or "" when nothing is near
    hub_unreachable()    no connection to the Hub's host opens within PROBE_TIMEOUT_S (probed at most once a
                         minute): a Hub name is then looked for in the cache alone, not asked for five times
"""

from __future__ import annotations

import difflib
import socket
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 5.0
PROBE_KEPT_S = 60.0  # a notebook that was offline a minute ago asks again
_probed: dict[str, tuple[bool, float]] = {}  # endpoint -> (unreachable, when probed)
_now = time.monotonic


def a_typo_here(text: str) -> bool:
    """A relative `first/name` whose first part is a folder here that holds a name close to `name`."""
    first, slash, rest = str(text).partition("/")
    return bool(slash and first and rest) and Path(first).is_dir() and bool(nearby(Path(text)))


def missing(what: str, path: str | Path) -> str:
    """The sentence for a path that is not there, offering the closest names of its folder."""
    near = nearby(Path(path))
    return f"{what} '{path}' does not exist" + (f"; did you mean {_names(near)}?" if near else ".")


def offer(path: str | Path) -> str:
    near = nearby(Path(path))
    return f" (did you mean {_names(near)}?)" if near else ""


def nearby(path: Path) -> list[Path]:
    """At most three names in `path`'s folder close to its own (difflib's ratio 0.75 or more)."""
    parent = path.parent
    if path.name == "" or not parent.is_dir():
        return []
    try:
        names = [entry.name for entry in parent.iterdir() if not entry.name.startswith(".") and entry.name != path.name]
    except OSError:
        return []
    return [parent / name for name in difflib.get_close_matches(path.name, names, n=3, cutoff=0.75)]


def _names(paths: list[Path]) -> str:
    return " or ".join(repr(str(p)) for p in paths)


def hub_unreachable() -> bool:
    """True when no connection to the Hub's host (huggingface_hub's endpoint: HF_ENDPOINT, huggingface.co by
    default) opens within PROBE_TIMEOUT_S, name lookup included: no network, or nothing answers. Where a
    proxy is set (the environment's, or the system's on macOS and Windows) the library's own connection
    decides, through it: False."""
    from huggingface_hub import constants

    if any(urllib.request.getproxies().get(kind) for kind in ("https", "http", "all")):
        return False
    endpoint = constants.ENDPOINT
    found = _probed.get(endpoint)
    if found is None or _now() - found[1] > PROBE_KEPT_S:
        found = _probed[endpoint] = (not _connects(endpoint), _now())
    return found[0]


def _connects(endpoint: str) -> bool:
    """A TCP connection to the endpoint's host opens within PROBE_TIMEOUT_S in all (a thread: the name's
    lookup has no timeout of its own, and each of its addresses would get one)."""
    url = urlparse(endpoint)
    address = (url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443))
    opened, ended = threading.Event(), threading.Event()

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=PROBE_TIMEOUT_S).close()
            opened.set()
        except OSError:
            pass
        finally:
            ended.set()

    threading.Thread(target=connect, daemon=True, name="slimtune-hub-probe").start()
    ended.wait(PROBE_TIMEOUT_S)
    return opened.is_set()
