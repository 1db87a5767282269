#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: real tritonserver + gateway processes on a tiny checkpoint, CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs --durations=25 "$@"  # the 25 slowest tests, to keep the suite short
