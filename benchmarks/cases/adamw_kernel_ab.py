"""The native host AdamW's loop at several commits, timed against each other (issue 30, item 7: the
8-bit loop is compute-bound, so changes to it are judged by its arithmetic's speed).

    python benchmarks/run.py adamw_kernel_ab                                   # d565b0c against HEAD
    SLIMTUNE_AB_REVS="d565b0c 61cad2a HEAD" python benchmarks/run.py adamw_kernel_ab
    SLIMTUNE_AB_REVS="HEAD WORKTREE" python benchmarks/run.py adamw_kernel_ab  # an edit not yet committed
    SLIMTUNE_AB_REVS="HEAD HEAD@zig" python benchmarks/run.py adamw_kernel_ab  # gcc against zig cc (ziglang)
    SLIMTUNE_AB_LAYOUT=split python benchmarks/run.py adamw_kernel_ab          # the fp32-moment default layout

Each revision's slimtune/optim/native/adamw.c (read with `git show`; WORKTREE names the working
tree's file) is built as the library is (native/build.py's compiler, flags and instruction sets; a
revision ending in @zig by build.ZIG, zig cc from the ziglang package, the fallback where no compiler
is found) into a temporary folder and loaded beside the others; the revisions must share the working tree's Run and
Hyper structs (true since 89539c8). Before anything is timed, each build takes two steps on copies of
the same tensors as the working tree's library and must leave the same bits in every output, or the
case stops: only exact kernels are compared.

The timing is host_adam_bandwidth's split_8bit layout (bf16 weight + residual, bf16 gradient, 8-bit
m and v; on the VBMI path where the machine runs it, else the portable loops), or the layout
SLIMTUNE_AB_LAYOUT names (split: fp32 m and v; split_accum: the same with an fp32 gradient, as
train.grad_accum > 1 leaves it), one thread: runs of 2^14 numbers (in the L1 and L2), 2^20 (four sets of them: mostly the
L3) and 2^25 (in memory, the size host_adam_bandwidth's ratio is taken at), each in four allocations
at different offsets (where the tensors fall moves the loop by a few percent), the builds alternated
round by round, the best call of each. The loop is called through ctypes, so a figure includes the
call (about 0.06 ns a number at 2^14, nothing at 2^20).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

REVS_ENV = "SLIMTUNE_AB_REVS"
LAYOUT_ENV = "SLIMTUNE_AB_LAYOUT"
LAYOUTS = ("split_8bit", "split", "split_accum")
DEFAULT_REVS = ("d565b0c", "HEAD")  # the loop before its chains were staged (fb06106), and now
ROOT = Path(__file__).resolve().parents[2]  # the checkout
KERNEL = "slimtune/optim/native/adamw.c"
WORKTREE = "WORKTREE"  # a revision name: the working tree's kernel, edits included
ZIG_SUFFIX = "@zig"  # after a revision: built by zig cc (build.ZIG) instead of this machine's compiler
SIZES = (1 << 14, 1 << 20, 1 << 25)
ALLOCATIONS = 4
CALLS = {1 << 14: 1024, 1 << 20: 40, 1 << 25: 3}  # best of this many calls a round
ROUNDS = 3
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
STEP = 5.0


def run(quick: bool) -> dict:
    from slimtune.optim.native import adamw

    if adamw.library() is None:
        return {"skipped": "the native host AdamW does not build or load here"}
    layout = os.environ.get(LAYOUT_ENV, LAYOUTS[0])
    if layout not in LAYOUTS:
        raise SystemExit(f"{LAYOUT_ENV}={layout!r} is not a layout this case times; it times {', '.join(LAYOUTS)}.")
    path = ("vbmi" if adamw.fast_path() else "portable") if layout == "split_8bit" else "fp32 moments"
    torch.set_num_threads(1)
    revs = os.environ.get(REVS_ENV, " ".join(DEFAULT_REVS)).split()
    commits = [_commit(rev) for rev in revs]
    with tempfile.TemporaryDirectory(prefix="adamw-ab-") as folder:
        libraries = [_built(rev, Path(folder) / f"{index}") for index, rev in enumerate(revs)]
        for rev, lib in zip(revs, libraries):
            _check_exact(rev, lib, adamw.library(), layout)
        rounds, scale = (1, 16) if quick else (ROUNDS, 1)
        sizes = {n: _time(libraries, n, rounds, max(4, CALLS[n] // scale), layout) for n in SIZES}
    result = {"revs": revs, "commits": commits, "layout": layout, "path": path, "isa": list(adamw.isa() or ()),
              "rounds": rounds, "allocations": ALLOCATIONS, "ns_per_number": {str(n): found for n, found in sizes.items()}}
    _summarize(result)
    return result


def _git(*args: str) -> str:
    """git's output, or the case stops with git's own sentence (a revision this clone lacks, say)."""
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"git {' '.join(args)} failed: {last}")
    return done.stdout.strip()


def _split(rev: str) -> tuple[str, bool]:
    """A revision without its @zig suffix, and whether it had one."""
    name = rev.removesuffix(ZIG_SUFFIX)
    return name, name != rev


def _commit(rev: str) -> str:
    name, zig = _split(rev)
    commit = WORKTREE.lower() if name == WORKTREE else _git("rev-parse", "--short", name)
    return commit + (ZIG_SUFFIX if zig else "")


def _built(rev: str, folder: Path) -> ctypes.CDLL:
    """rev's kernel built as the library is (by zig cc for a rev@zig), loaded."""
    from slimtune.optim.native import adamw, build

    name, zig = _split(rev)
    folder.mkdir()
    source = folder / "adamw.c"
    source.write_text((ROOT / KERNEL).read_text() if name == WORKTREE else _git("show", f"{name}:{KERNEL}") + "\n")
    target = folder / "adamw.so"
    failure = build.compile_library(source, target, adamw.isa(), build.ZIG if zig else None)
    if failure:
        raise SystemExit(f"{rev}'s {KERNEL} did not build: {failure}")
    lib = ctypes.CDLL(str(target))
    lib.slimtune_adamw.argtypes = [ctypes.POINTER(adamw.Run), ctypes.POINTER(adamw.Hyper)]
    return lib


def _layout(n: int, layout: str) -> tuple:
    """Fresh tensors of the layout for n numbers (HostAdam's, as host_adam_bandwidth makes them) with a
    gradient in place, and their Run."""
    import host_adam_bandwidth as bandwidth
    from slimtune.optim.native import adamw

    adam = bandwidth.host_adam(layout, n, None)
    tensors = bandwidth.native_tensors(adam)
    tensors["grad"].copy_(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3)
    return adam, tensors, adamw.run_of(n, tensors, 1, False)


def _constants():
    from slimtune.optim import tiled_adamw
    from slimtune.optim.native import adamw

    hyper = tiled_adamw.Hyper(HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"])
    return adamw.constants(hyper, STEP, 1.0)


def _check_exact(rev: str, lib: ctypes.CDLL, reference: ctypes.CDLL, layout: str) -> None:
    """Two steps of rev's build and of the working tree's library on equal tensors: the same bits,
    every output (weights, residuals, codes, absmax)."""
    from slimtune.optim.native import adamw

    n = 1 << 14
    _, tensors, _ = _layout(n, layout)
    outputs = []
    for kernel in (lib, reference):
        mine = {role: t.clone() for role, t in tensors.items()}
        run = adamw.run_of(n, mine, 1, False)
        for _ in range(2):
            kernel.slimtune_adamw(ctypes.byref(run), ctypes.byref(_constants()))
        outputs.append(mine)
    differing = [role for role in tensors  # bit patterns: -0.0 is not 0.0 here
                 if not torch.equal(outputs[0][role].view(torch.uint8), outputs[1][role].view(torch.uint8))]
    if differing:
        raise SystemExit(f"{rev}'s kernel leaves other bits than the working tree's in {', '.join(differing)}: "
                         "only exact kernels are compared.")


def _time(libraries: list, n: int, rounds: int, calls: int, layout: str) -> list[dict]:
    """Per build: the best ns a number of each allocation, and the best of all."""
    held, layouts = [], []
    for index in range(ALLOCATIONS):
        held.append(torch.empty(4096 * (index + 1) + 64 * index, dtype=torch.uint8))  # shifts what follows
        layouts.append(_layout(n, layout))
    constants = _constants()
    best = [[float("inf")] * ALLOCATIONS for _ in libraries]
    for _ in range(rounds):
        for a, (_, _, run) in enumerate(layouts):
            for b, lib in enumerate(libraries):
                call, args = lib.slimtune_adamw, (ctypes.byref(run), ctypes.byref(constants))
                for _ in range(calls):
                    began = time.perf_counter()
                    call(*args)
                    best[b][a] = min(best[b][a], time.perf_counter() - began)
    return [{"allocations": [round(s / n * 1e9, 4) for s in row], "best": round(min(row) / n * 1e9, 4)}
            for row in best]


def _summarize(result: dict) -> None:
    for n, found in result["ns_per_number"].items():
        print(f"{int(n)} numbers:")
        for rev, commit, row in zip(result["revs"], result["commits"], found):
            spread = " ".join(f"{x:.3f}" for x in row["allocations"])
            print(f"  {rev:>10} ({commit}) best {row['best']:.3f} ns a number; by allocation {spread}")
