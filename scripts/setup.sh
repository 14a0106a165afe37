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
# --no-compile: pip would byte-compile all ~16,000 installed modules, one core, ~35 s of a clean clone's
# set-up; Python compiles the ~3,000 a run imports when it first imports them (~10 s) and keeps them.
"$VENV/bin/python" -m pip install --quiet --no-compile torch==2.13.0
"$VENV/bin/python" -m pip install --quiet --no-compile -c constraints.txt -r requirements.txt -r requirements-dev.txt
"$VENV/bin/python" -m pip install --quiet -c constraints.txt --no-deps -e .
echo "$want" > "$stamp"
