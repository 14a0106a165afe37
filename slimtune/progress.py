"""Progress for long work outside the training loop's steps: tokenizing a dataset (a chat record takes
1-1.5 ms on two CPU cores, so 100K records are minutes), the eval command's loss and answers, and
a large folder written, checked or read (a checkpoint, a result, a merged export: one line before). Work done
within DELAY_S shows nothing. Past that: a bar on a terminal ("bar"); on a file or a pipe
("lines", since tqdm's bar written to a file is a stream of carriage returns) a line then and at most
one every EVERY_S, the rhythm of the training loop's --no-progress lines (run/step_lines.py); "none"
shows nothing (another rank; a caller that shows its own progress). Always on stderr: stdout may hold
a table or JSON."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from typing import Callable, Literal, TextIO, TypeVar

from slimtune.units import human_bytes

DELAY_S = 2.0
EVERY_S = 30.0  # a file's or a pipe's lines: at most one this often (the training loop's too)
LARGE_FOLDER = 1 << 30  # bytes: a folder this large takes seconds to minutes to write or read, so it is said
Mode = Literal["bar", "lines", "none"]
T = TypeVar("T")


def mode_for(bar: bool, show: bool = True) -> Mode:
    """A bar where asked for and stderr is a terminal; lines elsewhere; nothing when not `show`."""
    if not show:
        return "none"
    return "bar" if bar and sys.stderr.isatty() else "lines"


def shown(items: Sequence[T], what: str, unit: str, mode: Mode, stream: TextIO | None = None,
          clock: Callable[[], float] = time.monotonic) -> Iterator[T]:
    """The items, one by one, with `what` ("tokenizing train.jsonl") shown as `mode` says while the
    caller works on them; `unit` names one ("record")."""
    stream = stream or sys.stderr
    if mode == "bar":
        from tqdm.auto import tqdm

        yield from tqdm(items, desc=what, unit=unit, delay=DELAY_S, leave=False, dynamic_ncols=True, file=stream)
        return
    if mode == "none":
        yield from items
        return
    began, said = clock(), None
    for done, item in enumerate(items):
        now = clock()
        if now - (began + DELAY_S if said is None else said + EVERY_S) >= 0:
            print(f"{what}: {done:,}/{len(items):,} {unit}s", file=stream, flush=True)
            said = now
        yield item


def large_folder(doing: str, folder, size: int | None) -> None:
    """One line on stderr before a folder of `size` bytes is written, checked or read ("writing",
    "checking", "reading"), when it is large (a checkpoint of a full fine-tune: tens of GiB, minutes at a
    disk's speed); through tqdm, so a training bar is redrawn below it."""
    if size is not None and size >= LARGE_FOLDER:
        from tqdm import tqdm

        tqdm.write(f"{doing} {folder} ({human_bytes(size)})", file=sys.stderr)
