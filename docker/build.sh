#!/usr/bin/env bash
# Build the image from docker/Dockerfile, sending the builder only the files it reads (not .venv or checkpoints).
#   bash docker/build.sh [--base IMAGE] [--tag TAG] [other `docker build` options]
#   --base  default: the Dockerfile's (nvcr.io/nvidia/tritonserver:24.10-py3); a plain Debian image such as
#           debian:bookworm-slim or docker/make_base.sh's s2tts-debian:bookworm builds the CPU/smaller image
#   --tag   default s2tts
# docker/wheelhouse (scripts/make_wheelhouse.py) is installed from when it holds a requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=s2tts
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) args+=(--build-arg "BASE=$2"); shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
tar -c --exclude=__pycache__ --exclude='*.pyc' pyproject.toml s2tts model_repository model_repository_trt build client \
    scripts/make_wheelhouse.py docker/Dockerfile docker/entrypoint.py docker/healthcheck.py docker/wheelhouse \
  | docker build -f docker/Dockerfile -t "$tag" "${args[@]}" -
