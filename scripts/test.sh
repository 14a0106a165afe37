#!/usr/bin/env bash
# Set up (first run only) and run the test suite (CPU; the GPU checks are benchmarks/run.py device_checks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/slimtune-inductor-$$"
# MKL's reproducible mode: its default kernels may split a float64 sum by the threads free at that
# moment, so two runs of threaded CPU work (roundpipe's workers) could differ in the last bits, and the
# bit-for-bit tests would fail now and then (1 in about 50 under load, 0 in 150 with this).
export MKL_CBWR="${MKL_CBWR:-COMPATIBLE}"
# Two worker processes (pytest-xdist): our machines and CI have 2 cores; SLIMTUNE_TEST_WORKERS=0 runs in one.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${SLIMTUNE_TEST_WORKERS:-2}" "$@"
