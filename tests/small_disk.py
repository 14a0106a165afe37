"""A small file system for the disk-full tests: a real tmpfs mounted for the test where this machine
lets it (root, and mount(8) works), else a fake: os.posix_fallocate raising ENOSPC, in the test's
process (`fake_full`) or in a CLI subprocess (`cli`). A test never passes without one or the other;
`SmallDisk.real` says which it ran on."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SIZE = 1 << 20  # the tmpfs: room for the tiny model's state files, so one run fits before the disk is filled

# The CLI as `python -m slimtune.cli`, with posix_fallocate failing for lack of room when `full`
# (the fake, for a machine that cannot mount a small file system).
_BOOT = """\
import errno, os, sys
if sys.argv[1] == "full":
    def _no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.posix_fallocate = _no_room
from slimtune.cli import main
sys.exit(main(sys.argv[2:]))
"""


@dataclass
class SmallDisk:
    folder: Path
    real: bool  # a mounted tmpfs of SIZE bytes; False: the fake

    def fill(self, leave: int) -> Path:
        """A user's file taking all but `leave` bytes of the tmpfs (the fake is full anyway)."""
        ballast = self.folder / "users-file.bin"
        size = max(shutil.disk_usage(self.folder).free - leave, 0) if self.real else 4096
        with open(ballast, "wb") as f:
            f.write(b"\x01" * size)
        return ballast

    def cli(self, *args: str, cwd: Path, full: bool) -> subprocess.CompletedProcess:
        """The CLI as a user runs it; with the fake, `full` makes every reservation fail."""
        mode = "full" if full and not self.real else "as-is"
        return subprocess.run([sys.executable, "-c", _BOOT, mode, *args], cwd=cwd, capture_output=True, text=True,
                              timeout=600)


@contextlib.contextmanager
def small_disk(folder: Path):
    folder.mkdir()
    if not _mount(folder):
        yield SmallDisk(folder, real=False)
        return
    try:
        yield SmallDisk(folder, real=True)
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _mount(folder: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(folder)], capture_output=True)
    return done.returncode == 0


def fake_full(monkeypatch, room: int = 0) -> None:
    """In this process: reservations fail for lack of room once they would pass `room` bytes in all."""
    taken = [0]

    def reserve(fd, offset, length):
        if taken[0] + length > room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        taken[0] += length
        os.ftruncate(fd, offset + length)
    monkeypatch.setattr(os, "posix_fallocate", reserve)
