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
# pip byte-compiles what it installs (~35 s of one core). Not --no-compile: these machines set
# PYTHONDONTWRITEBYTECODE=1, so what Python compiles on import is never kept, and every process the
# suite starts compiled torch and transformers again (import 3.9 s instead of 2.0 s; the suite took
# 9 CPU-minutes more).
"$VENV/bin/python" -m pip install --quiet torch==2.13.0
"$VENV/bin/python" -m pip install --quiet -c constraints.txt -r requirements.txt -r requirements-dev.txt
"$VENV/bin/python" -m pip install --quiet -c constraints.txt --no-deps -e .
echo "$want" > "$stamp"
