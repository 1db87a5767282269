#!/usr/bin/env bash
# Create .venv and install the project with everything the server, gateway and tests need.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first: the CPU wheel where one is on disk (dev machines, CI), else whatever pip finds.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
python -m pip install -q -e ".[server,gateway,export,test]"
# perf_analyzer (inside the tritonclient wheel) loads libcudart.so.12 and libb64.so.0d even for gRPC runs.
python -m pip install -q nvidia-cuda-runtime-cu12
if ! ldconfig -p | grep -q libb64.so.0d; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libb64-0d) >/dev/null 2>&1 || echo "warning: could not install libb64-0d; perf_analyzer will not run" >&2
  else
    echo "warning: libb64-0d is missing (sudo apt-get install libb64-0d); perf_analyzer will not run" >&2
  fi
fi
# The reference DAC of fish-speech 0.1.0, only for the codec parity test.
if ! python -c "import fish_speech" 2>/dev/null; then
  python -m pip install -q --no-deps fish-speech==0.1.0 descript-audio-codec descript-audiotools
  python -m pip install -q -r tests/requirements-parity.txt
fi
echo "setup done: $(python -c 'import torch, sys; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")')"
