#!/usr/bin/env bash
# Set up (first run only) and run the test suite (CPU; the GPU checks are benchmarks/run.py device_checks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/slimtune-inductor-$$"
# Two worker processes (pytest-xdist): our machines and CI have 2 cores; SLIMTUNE_TEST_WORKERS=0 runs in one.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${SLIMTUNE_TEST_WORKERS:-2}" "$@"
