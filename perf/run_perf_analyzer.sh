#!/usr/bin/env bash
# Run Triton's perf_analyzer (the one in the tritonclient==2.51.0 wheel) against the project's models.
#
#   perf/run_perf_analyzer.sh -u 127.0.0.1:8001 -i perf/out/pa_inputs -o perf/out/pa [-m "s2pro slow_ar fast_ar dac_decoder"]
#                             [-c "1 4 16"] [-n REQUESTS] [-t SECONDS] [-b "1 8 64"]
#
#   -u  Triton gRPC address                      (default 127.0.0.1:8001)
#   -i  input-data directory from perf/make_pa_inputs.py (required)
#   -o  output directory: pa_<model>[_b<B>]_c<C>.csv / .log (+ .profile.json with PA_PROFILE=1), pa_summary.md
#   -m  models to run                            (default "s2pro slow_ar fast_ar dac_decoder")
#   -c  concurrency levels                       (default per model: streaming "1 4 16", fast_ar "1 4", dac_decoder "1 4 16")
#   -n  requests per (model, concurrency) run    (default: streaming max(2c, 8), fast_ar / dac_decoder max(50c, 100))
#   -t  timeout of one perf_analyzer run, s      (default 300)
#   -b  fast_ar row counts (files fast_ar_b<B>.json must exist) (default: every fast_ar_b*.json in -i)
#
# s2pro is decoupled: it runs with --streaming, and perf_analyzer's latency is the time to the FIRST response
# (its own words: "Detected decoupled model, using the first response for measuring latency"); "Response
# Throughput" in the CSV counts responses/s (one per audio chunk). slow_ar is request-response and the inputs
# carry no request_id, so each request is answered once with its whole generation: latency = all its frames.
# Each run uses --request-count (a fixed number of requests, no stabilisation loop), so it is bounded; before the
# first run of each input file, PA_WARMUP (default 2) unmeasured requests. PA_PROFILE=1 adds --profile-export-file
# for the streaming models (per-response timestamps; large: it holds every output tensor).
# A failing run is logged and the script goes on; it exits 1 if any run failed.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
URL=127.0.0.1:8001 INPUTS="" OUTDIR="" MODELS="s2pro slow_ar fast_ar dac_decoder" CONC="" NREQ="" TMO=300 BATCHES=""
while getopts "u:i:o:m:c:n:t:b:h" opt; do
  case $opt in
    u) URL=$OPTARG ;; i) INPUTS=$OPTARG ;; o) OUTDIR=$OPTARG ;; m) MODELS=$OPTARG ;; c) CONC=$OPTARG ;;
    n) NREQ=$OPTARG ;; t) TMO=$OPTARG ;; b) BATCHES=$OPTARG ;;
    h|*) sed -n '2,25p' "$0"; exit 2 ;;
  esac
done
[ -n "$INPUTS" ] && [ -d "$INPUTS" ] || { echo "run_perf_analyzer: -i INPUTS_DIR (from perf/make_pa_inputs.py) is required" >&2; exit 2; }
OUTDIR=${OUTDIR:-$INPUTS/../pa}
mkdir -p "$OUTDIR"

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# perf_analyzer's binary and the library path it needs (libcudart.so.12 from nvidia-cuda-runtime-cu12; libb64.so.0d)
PA=${PERF_ANALYZER:-$(cd "$ROOT" && "$PYTHON" -c 'from s2tts.perf_tools import perf_analyzer_path as p; print(p() or "")')}
[ -n "$PA" ] && [ -x "$PA" ] || { echo "run_perf_analyzer: no perf_analyzer (install tritonclient==2.51.0 or set PERF_ANALYZER)" >&2; exit 2; }
export LD_LIBRARY_PATH="$(cd "$ROOT" && "$PYTHON" -c 'from s2tts.perf_tools import perf_analyzer_env as e; print(e().get("LD_LIBRARY_PATH", ""))')"

ts() { date +%H:%M:%S; }
failed=0
declare -A WARM=()
run_one() {  # name model input_json concurrency requests [extra args...]
  local name=$1 model=$2 data=$3 c=$4 n=$5; shift 5
  local base="$OUTDIR/pa_${name}_c${c}"
  if [ -z "${WARM[$name]:-}" ] && [ "${PA_WARMUP:-2}" -gt 0 ]; then  # first use of these shapes: not measured
    WARM[$name]=1
    timeout "$TMO" "$PA" -m "$model" -u "$URL" -i grpc --input-data "$data" --concurrency-range 1:1 \
      --request-count "${PA_WARMUP:-2}" "$@" >"$OUTDIR/pa_${name}.warmup.log" 2>&1 || true
  fi
  local t0=$SECONDS
  echo "[$(ts)] perf_analyzer $name: concurrency $c, $n requests" >&2
  timeout "$TMO" "$PA" -m "$model" -u "$URL" -i grpc --input-data "$data" --concurrency-range "$c:$c" \
      --request-count "$n" -f "$base.csv" "$@" >"$base.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    failed=1
    echo "[$(ts)]   FAILED (rc $rc after $((SECONDS - t0)) s); last lines of $base.log:" >&2
    tail -5 "$base.log" | sed 's/^/    /' >&2
  else
    echo "[$(ts)]   done in $((SECONDS - t0)) s" >&2
  fi
}

levels() {  # model -> its concurrency levels
  if [ -n "$CONC" ]; then echo "$CONC"; return; fi
  case $1 in fast_ar) echo "1 4" ;; *) echo "1 4 16" ;; esac
}
count() {  # streaming|unary c -> requests
  if [ -n "$NREQ" ]; then echo "$NREQ"; return; fi
  if [ "$1" = streaming ]; then echo $(( 2 * $2 > 8 ? 2 * $2 : 8 )); else echo $(( 50 * $2 > 100 ? 50 * $2 : 100 )); fi
}

for model in $MODELS; do
  case $model in
    s2pro|slow_ar)
      [ -f "$INPUTS/$model.json" ] || { echo "no $INPUTS/$model.json" >&2; failed=1; continue; }
      for c in $(levels "$model"); do
        prof=(); [ "${PA_PROFILE:-0}" = 1 ] && prof=(--profile-export-file "$OUTDIR/pa_${model}_c${c}.profile.json")
        stream=(); [ "$model" = s2pro ] && stream=(--streaming)  # slow_ar: request-response, one whole answer
        run_one "$model" "$model" "$INPUTS/$model.json" "$c" "$(count streaming "$c")" "${stream[@]}" "${prof[@]}"
      done ;;
    fast_ar)
      if [ -n "$BATCHES" ]; then files=""; for b in $BATCHES; do files="$files $INPUTS/fast_ar_b$b.json"; done
      else files=$(ls "$INPUTS"/fast_ar_b*.json 2>/dev/null | sort -V); fi
      [ -n "$files" ] || { echo "no fast_ar_b*.json in $INPUTS" >&2; failed=1; continue; }
      for f in $files; do
        b=$(basename "$f" .json); b=${b#fast_ar_b}
        for c in $(levels fast_ar); do run_one "fast_ar_b$b" fast_ar "$f" "$c" "$(count unary "$c")"; done
      done ;;
    dac_decoder)
      [ -f "$INPUTS/dac_decoder.json" ] || { echo "no $INPUTS/dac_decoder.json" >&2; failed=1; continue; }
      for c in $(levels dac_decoder); do run_one dac_decoder dac_decoder "$INPUTS/dac_decoder.json" "$c" "$(count unary "$c")" -b 1; done ;;
    *) echo "run_perf_analyzer: unknown model $model" >&2; failed=1 ;;
  esac
done

(cd "$ROOT" && "$PYTHON" perf/pa_summary.py "$OUTDIR" --meta "$INPUTS/meta.json" >"$OUTDIR/pa_summary.md") || failed=1
cat "$OUTDIR/pa_summary.md"
exit $failed
