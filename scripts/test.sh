#!/usr/bin/env bash
# Set up (first run only) and run the test suite (CPU; the GPU checks are benchmarks/run.py device_checks).
# --quick: the inner loop's tier (tests marked quick, under 2 minutes on 2 cores): every engine steps
# once against the plain-PyTorch oracle, with the config, import-layer and cheap unit checks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/slimtune-inductor-$$"
# MKL's reproducible mode: its default kernels may split a float64 sum by the threads free at that
# moment, so two runs of threaded CPU work (roundpipe's workers) could differ in the last bits, and the
# bit-for-bit tests would fail now and then (1 in about 50 under load, 0 in 150 with this).
export MKL_CBWR="${MKL_CBWR:-COMPATIBLE}"
# One torch thread per worker process (and per CLI the tests start): the tests' tensors are tiny, and
# two workers with two threads each on two cores mostly wait on each other (tests/unit/test_lsp.py and
# test_chunk.py took 152 s of CPU with torch's default threads, 56 s with one).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then args+=(-m quick); else args+=("$arg"); fi
done
# Two worker processes (pytest-xdist): our machines and CI have 2 cores; SLIMTUNE_TEST_WORKERS=0 runs in one.
# loadgroup: tests are dealt out one at a time, except a module marked xdist_group, which one worker
# runs whole, so its module fixture (a trained run, a planned model) is built once.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${SLIMTUNE_TEST_WORKERS:-2}" --dist loadgroup "${args[@]}"
