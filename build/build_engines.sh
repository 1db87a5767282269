#!/usr/bin/env bash
# Build TensorRT engines (.plan) from the exported ONNX graphs, with the optimisation profiles
# recorded in ONNX_DIR/manifest.json. Needs TensorRT's trtexec: run it inside the NGC container
# of the Triton release that will serve the engines (an engine only loads in the TensorRT
# version and on the GPU type it was built with).
#
#   build/build_engines.sh ONNX_DIR [OUT_DIR]                       # where trtexec exists
#   build/build_engines.sh --container nvcr.io/nvidia/tritonserver:24.10-py3 ONNX_DIR [OUT_DIR]
#   build/build_engines.sh --dry-run ONNX_DIR [OUT_DIR]             # print the trtexec commands only
#
# OUT_DIR (default ONNX_DIR) receives <graph>.plan, <graph>.trtexec.log and a copy of manifest.json;
# serve it with `--set backend=tensorrt --set engine_dir=OUT_DIR` (docs/TENSORRT.md).
#
# Environment:
#   GRAPHS             graphs to build (default: "fast_ar dac_decoder_stream dac_encoder"; add dac_decoder for offline decode)
#   PRECISION_FAST_AR  trtexec precision flags for fast_ar (default: --bf16)
#   PRECISION_CODEC    trtexec precision flags for the codec graphs (default: none = fp32/TF32)
#   TRTEXEC_ARGS       extra trtexec arguments for every graph (e.g. --memPoolSize=workspace:8192)
#   TRTEXEC            path of trtexec (default: PATH, then /usr/src/tensorrt/bin/trtexec)
set -euo pipefail

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

DRY_RUN=0
CONTAINER=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --container) CONTAINER="${2:?--container needs an image}"; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    -*) echo "unknown option $1" >&2; usage 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 && $# -le 2 ]] || usage 2
ONNX_DIR="$(cd "$1" && pwd)"
OUT_DIR="${2:-$ONNX_DIR}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ -n "$CONTAINER" ]]; then
  # Re-run this script inside the container, with the graphs, the output and the script mounted.
  exec docker run --rm --gpus all \
    -e GRAPHS -e PRECISION_FAST_AR -e PRECISION_CODEC -e TRTEXEC_ARGS -e TRTEXEC \
    -v "$ONNX_DIR":/work/onnx:ro -v "$OUT_DIR":/work/engines -v "$HERE":/work/build:ro \
    "$CONTAINER" bash /work/build/build_engines.sh $([[ $DRY_RUN == 1 ]] && echo --dry-run) /work/onnx /work/engines
fi

MANIFEST="$ONNX_DIR/manifest.json"
[[ -f "$MANIFEST" ]] || { echo "error: $MANIFEST not found: run build/export_onnx.py first" >&2; exit 1; }

TRTEXEC="${TRTEXEC:-$(command -v trtexec || true)}"
[[ -z "$TRTEXEC" && -x /usr/src/tensorrt/bin/trtexec ]] && TRTEXEC=/usr/src/tensorrt/bin/trtexec
if [[ -z "$TRTEXEC" && $DRY_RUN == 0 ]]; then
  echo "error: trtexec not found (set TRTEXEC=...). It ships in nvcr.io/nvidia/tensorrt:<yy.mm>-py3;" >&2
  echo "       use the same <yy.mm> as the tritonserver container that will serve the engines." >&2
  exit 1
fi
PY="$(command -v python3 || command -v python)"

GRAPHS="${GRAPHS:-fast_ar dac_decoder_stream dac_encoder}"
for g in $GRAPHS; do
  # min/opt/max shapes of every input, as written by s2tts.export into the manifest
  read -r MIN OPT MAX < <("$PY" - "$MANIFEST" "$g" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
g = m["graphs"].get(sys.argv[2])
if g is None:
    sys.exit(f"error: graph {sys.argv[2]!r} is not in the manifest (exported: {', '.join(m['graphs'])})")
t = g["profile"]["trtexec"]
print(t["min"], t["opt"], t["max"])
PYEOF
  )
  case "$g" in
    fast_ar*) PREC="${PRECISION_FAST_AR---bf16}" ;;
    *) PREC="${PRECISION_CODEC-}" ;;
  esac
  # shellcheck disable=SC2206
  CMD=("${TRTEXEC:-trtexec}" "--onnx=$ONNX_DIR/$g.onnx" "--saveEngine=$OUT_DIR/$g.plan"
       "--minShapes=$MIN" "--optShapes=$OPT" "--maxShapes=$MAX" $PREC ${TRTEXEC_ARGS:-})
  if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' "${CMD[@]}"; echo
    continue
  fi
  echo "building $OUT_DIR/$g.plan ..."
  if ! "${CMD[@]}" > "$OUT_DIR/$g.trtexec.log" 2>&1; then
    echo "error: trtexec failed for $g; the end of $OUT_DIR/$g.trtexec.log:" >&2
    tail -n 30 "$OUT_DIR/$g.trtexec.log" >&2
    exit 1
  fi
done
if [[ $DRY_RUN == 0 && "$OUT_DIR" != "$ONNX_DIR" ]]; then
  cp "$MANIFEST" "$OUT_DIR/manifest.json"
fi
[[ $DRY_RUN == 1 ]] || echo "engines in $OUT_DIR: serve with --set backend=tensorrt --set engine_dir=$OUT_DIR"
