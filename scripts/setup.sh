#!/usr/bin/env bash
# Creates .venv with pinned torch (CPU wheel on our machines) and slimtune installed
# editable. Idempotent: a second run with nothing changed takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SLIMTUNE_VENV:-.venv}
stamp="$VENV/.slimtune-setup"
want=$(cat requirements.txt requirements-dev.txt constraints.txt pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# Installed --no-compile, then byte-compiled below on every core at once: pip compiles file by file on
# one core (~35 s of the set-up). The compiled files must be written here, not left to the first import:
# these machines set PYTHONDONTWRITEBYTECODE=1, so what Python compiles on import is never kept and every
# process the suite starts would compile torch and transformers again (import 3.9 s instead of 2.0 s;
# the suite took 9 CPU-minutes more).
"$VENV/bin/python" -m pip install --quiet --no-compile torch==2.13.0
"$VENV/bin/python" -m pip install --quiet --no-compile -c constraints.txt -r requirements.txt -r requirements-dev.txt
"$VENV/bin/python" -m pip install --quiet --no-compile -c constraints.txt --no-deps -e .
# site-packages as pip would have compiled it, and slimtune's own modules and the tests' helpers, which
# every CLI and torchrun rank a test starts imports (~0.2 s of compiling each time otherwise). Exit 1 is
# expected: torch ships a file in Python 3.12's syntax (torch/testing/_internal/py312_intrinsics.py),
# which pip's compiling skips the same way.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" -m compileall -q -q -j 0 "$site" slimtune tests || true
echo "$want" > "$stamp"
