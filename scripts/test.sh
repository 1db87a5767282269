#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: real tritonserver + gateway processes on a tiny checkpoint, CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# LiveKit's Fish Audio plugin, only for its test (tests/test_fish_api.py; ~400 MB, so not in setup.sh, which the
# server's own start runs too), in an environment of its own: it needs a protobuf that tritonclient cannot use.
if ! .venv/livekit/bin/python -c "import livekit.plugins.fishaudio" 2>/dev/null; then
  echo "setup: installing LiveKit's Fish Audio plugin in .venv/livekit (its test only)"
  { .venv/bin/python -m venv .venv/livekit && .venv/livekit/bin/python -m pip install -q "livekit-plugins-fishaudio==1.8.9"; } \
    >>.venv/setup.log 2>&1 || { echo "setup: the LiveKit plugin could not be installed (see .venv/setup.log)" >&2; exit 1; }
fi
# Two test files at a time (pytest-xdist; S2TTS_TEST_WORKERS=N to change, 0 for one process): a test alone uses
# ~1.2 of 2 cores (it waits on its servers), and a server starts in ~4 s, so each worker starting its own shared
# servers costs less than the idle core did. Each file runs whole in one worker (its module fixtures shared).
exec .venv/bin/python -m pytest -q -rs --durations=25 -n "${S2TTS_TEST_WORKERS:-2}" --dist loadfile "$@"  # the 25 slowest tests, to keep the suite short
