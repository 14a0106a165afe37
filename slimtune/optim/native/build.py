"""Compile a C file of this folder at first use and load it with ctypes.

The library lands in a cache folder ($XDG_CACHE_HOME/slimtune/kernels, else
~/.cache/slimtune/kernels) under a name keyed by the hash of its source, flags and compiler, so a
changed source builds anew and an unchanged one loads in a millisecond. It is written to a temporary
file and renamed into place, so two processes building at once (two test workers) each load a
whole library. Without a compiler, or when compiling fails, `load` says so once on stderr (one
line, no traceback) and returns None: the caller then takes its torch path.

Plain C, no torch headers: a build takes seconds (adamw.c: about 6 s with gcc -O3), once per source,
flags and compiler; at a terminal one line says so. ctypes releases the GIL while a loaded function
runs, so a worker thread computes beside the Python thread driving the device.

The compiler is $CC (a command: CC="zig cc" works), else cc, gcc or clang on the PATH, else the zig
that the ziglang package installs (`pip install slimtune[compiler]`: a C compiler from PyPI, for
machines without one, such as slim container images).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
# -ffp-contract=off: only the fmaf calls the source writes fuse, so its rounding is the source's.
# -fno-math-errno: sqrtf is the bare instruction, which vectorizes.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread")
COMPILE_TIMEOUT_S = 120

_said: set[str] = set()


def say_once(message: str) -> None:
    """One line on stderr, once per process: why a native kernel is not used."""
    if message not in _said:
        _said.add(message)
        print(f"slimtune: {message}", file=sys.stderr)


NO_COMPILER = "no C compiler (cc, gcc, clang, $CC, or zig from `pip install ziglang`) found"
# zig cc from the ziglang package. zig builds for this very CPU unless told otherwise; the baseline CPU
# plus the flags `isa` names, as gcc builds, keeps a library what its cache key says (a cache may be shared).
ZIG = (sys.executable, "-m", "ziglang", "cc", "-mcpu=baseline")


def compiler() -> tuple[str, ...] | None:
    """The compiler's command: $CC (split as a shell would), else cc, gcc or clang on the PATH, else
    zig cc from the ziglang package; None where there is none."""
    named = shlex.split(os.environ.get("CC", ""))
    if named:
        found = shutil.which(named[0])
        return (found, *named[1:]) if found else None
    found = next((path for c in ("cc", "gcc", "clang") if (path := shutil.which(c))), None)
    if found:
        return (found,)
    return ZIG if importlib.util.find_spec("ziglang") is not None else None


def cache_folder() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "slimtune" / "kernels"


def library_path(source: Path, cc: tuple[str, ...], isa: tuple[str, ...] = ()) -> Path:
    """Where `source`'s library lives: its stem and a hash of the source, the flags and the compiler."""
    key = hashlib.sha256(source.read_bytes() + "\0".join((*FLAGS, *isa, *cc)).encode()).hexdigest()[:16]
    return cache_folder() / f"{source.stem}-{key}.so"


def load(name: str, isa: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from `name` (a .c file in this folder) with the instruction-set flags `isa`
    (the caller checks the CPU has them), built first if the cache lacks it; None (said once) where it
    cannot be built or loaded."""
    cc = compiler()
    if cc is None:
        say_once(f"{NO_COMPILER}: the host AdamW runs on torch's tiled path (same results, slower).")
        return None
    source = HERE / name
    target = library_path(source, cc, isa)
    if not target.exists():
        if sys.stderr.isatty():  # a person waits: a build takes seconds (gcc 6 s here); logs and tests are left alone
            print(f"slimtune: building {source.name} with {_named(cc)} (once for this machine and version: a few"
                  " seconds)", file=sys.stderr)
        failure = compile_library(source, target, isa, cc)
        if failure:
            say_once(f"compiling {source.name} failed ({failure}): the host AdamW runs on torch's tiled path "
                     "(same results, slower).")
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        say_once(f"loading {target} failed ({error}): the host AdamW runs on torch's tiled path.")
        return None


def compile_library(source: Path, target: Path, isa: tuple[str, ...] = (),
                    cc: tuple[str, ...] | None = None) -> str | None:
    """source built into target with this module's flags and `isa` by `cc` (else compiler()): why it
    failed, or None. (benchmarks/cases/adamw_kernel_ab.py builds other commits' kernels with it.)"""
    cc = cc or compiler()
    if cc is None:
        return NO_COMPILER
    return _build(cc, (*FLAGS, *isa), source, target)


def _build(cc: tuple[str, ...], flags: tuple[str, ...], source: Path, target: Path) -> str | None:
    """Compile source into target atomically; the reason it failed, or None."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
        os.close(handle)
    except OSError as error:
        return f"cannot write {target.parent}: {error.strerror}"
    try:
        made = subprocess.run([*cc, *flags, str(source), "-o", temporary, "-lm"], capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        if made.returncode != 0:
            last = (made.stderr.strip().splitlines() or ["no message"])[-1]
            return f"{_named(cc)} exited with {made.returncode}: {last}"
        os.replace(temporary, target)
        return None
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _named(cc: tuple[str, ...]) -> str:
    """A compiler's command as a person reads it: gcc, or python3 -m ziglang cc."""
    return " ".join((Path(cc[0]).name, *cc[1:]))
