#!/usr/bin/env bash
# Set up (first run only) and run the test suite (CPU; the GPU checks are benchmarks/run.py device_checks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/slimtune-inductor-$$"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
