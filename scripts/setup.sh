#!/usr/bin/env bash
# Create .venv and install the project with everything the server, gateway and tests need.
# A second run only checks: the inputs of the last install are stamped in .venv. Usage: bash scripts/setup.sh
# pip's own output goes to .venv/setup.log (shown when a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=.venv/setup.log
say() { echo "setup: $*"; }
run() {  # one step; its output goes to the log, and the log's end is shown if it fails
  if ! "$@" >>"$LOG" 2>&1; then
    echo "setup: this step failed: $*" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}
stamp() { cat pyproject.toml tests/requirements-parity.txt scripts/setup.sh | sha256sum | cut -c1-16; }
done_line() { echo "setup done: $(.venv/bin/python -c 'import torch, sys; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")')"; }

if [ -x .venv/bin/python ] && [ "$(cat .venv/.setup-stamp 2>/dev/null)" = "$(stamp)" ] \
    && .venv/bin/python -c "import s2tts, torch, fastapi, tritonclient.grpc, pytriton" 2>/dev/null; then
  say "up to date (.venv), nothing to install"
  done_line
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
: >"$LOG"
. .venv/bin/activate
run python -m pip install -q --upgrade pip
# torch first: the CPU wheel where one is on disk (dev machines, CI), else whatever pip finds.
if ! python -c "import torch" 2>/dev/null; then
  say "installing torch (the largest download)"
  run sh -c 'python -m pip install -q "torch==2.13.0" || python -m pip install -q torch'
fi
say "installing the project with its server, gateway, export and test dependencies (tritonserver included; about a minute the first time)"
run python -m pip install -q -e ".[server,gateway,export,test]"
# perf_analyzer (inside the tritonclient wheel) loads libcudart.so.12 and libb64.so.0d even for gRPC runs.
run python -m pip install -q nvidia-cuda-runtime-cu12
if ! ldconfig -p | grep -q libb64.so.0d; then
  if [ "$(id -u)" = 0 ]; then
    say "installing libb64-0d (Debian package) for perf_analyzer"
    (apt-get update -qq && apt-get install -y -qq libb64-0d) >>"$LOG" 2>&1 || echo "warning: could not install libb64-0d; perf_analyzer will not run" >&2
  else
    echo "warning: libb64-0d is missing (sudo apt-get install libb64-0d); perf_analyzer will not run" >&2
  fi
fi
# The reference DAC of fish-speech 0.1.0, only for the codec parity test. It is installed without its own
# dependencies (their pins would replace torch and protobuf), so pip's consistency report about them is expected:
# it stays in the log.
if ! python -c "import fish_speech" 2>/dev/null; then
  say "installing the reference codec for the parity test (fish-speech 0.1.0, test only)"
  run python -m pip install -q --no-deps fish-speech==0.1.0 descript-audio-codec descript-audiotools
  run python -m pip install -q -r tests/requirements-parity.txt
fi
stamp >.venv/.setup-stamp
done_line
