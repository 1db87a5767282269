#!/usr/bin/env bash
# Set everything up, start tritonserver + the OpenAI-compatible gateway, answer a demo request,
# print the URL and serve until Ctrl-C. Without --checkpoint a tiny random checkpoint is used.
#   bash scripts/run.sh [--checkpoint DIR] [--device cuda] [--set max_batch=64] [--once]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m s2tts.launch "$@"
