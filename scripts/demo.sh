#!/usr/bin/env bash
# Set up (first run only) and run the built-in demo: `slimtune train` with no config.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/slimtune train "$@"
