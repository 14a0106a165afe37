"""Run one benchmark case and write its result with the environment it ran in.

    python benchmarks/run.py CASE [--quick]   # -> benchmarks/results/<case>_<device>_<YYYY-MM-DD>.json
    python benchmarks/run.py --list

A case is benchmarks/cases/<case>.py with `run(quick: bool) -> dict`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES, RESULTS = HERE / "cases", HERE / "results"


def cases() -> list[str]:
    return sorted(p.stem for p in CASES.glob("*.py") if not p.stem.startswith("_"))


def load_case(name: str):
    if str(CASES) not in sys.path:  # cases share helpers (benchmarks/cases/_*.py)
        sys.path.insert(0, str(CASES))
    path = CASES / f"{name}.py"
    if not path.is_file():
        sys.exit(f"unknown case '{name}'; known: {', '.join(cases()) or 'none'}.")
    spec = importlib.util.spec_from_file_location(f"benchmark_case_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def git_commit() -> str | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except ImportError:  # peft on a lent machine may be missing or built for another transformers
        return None


def environment(device: str, date: str) -> dict:
    import torch
    import transformers

    return {
        "date": date,
        "device": device,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": _version("peft"),
        "native_compiler": native_compiler(),
        "git_commit": git_commit(),
    }


def native_compiler() -> str | None:
    """The compiler the native kernels are built with here and its version line (the 8-bit loop's speed
    depends on it), or None where there is none."""
    from slimtune.optim.native import build

    cc = build.compiler()
    if cc is None:
        return None
    try:
        said = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        said = ""
    return " ".join(cc) + (f": {said.splitlines()[0]}" if said.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a benchmark case and save its JSON result.")
    parser.add_argument("case", nargs="?", help="a case in benchmarks/cases/")
    parser.add_argument("--quick", action="store_true", help="a few steps only: a smoke run, not a result")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.list or not args.case:
        print("\n".join(cases()))
        return 0
    case = load_case(args.case)
    date, device = datetime.date.today().isoformat(), device_name()
    result = {"case": args.case, "quick": args.quick, "environment": environment(device, date)}
    result.update(case.run(quick=args.quick))
    RESULTS.mkdir(exist_ok=True)
    suffix = "_quick" if args.quick else ""
    path = RESULTS / f"{args.case}_{device}_{date}{suffix}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
