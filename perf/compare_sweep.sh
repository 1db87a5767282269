#!/usr/bin/env bash
# The sweep for the peak within the SLO, this tree's server beside another commit's, on one GPU machine, one after
# the other, both driven by this tree's perf/loadgen.py (the same client, ramp and SLO for both servers):
#
#   rm -rf baseline && mkdir baseline && git archive <commit> | tar -x -C baseline     # on the development machine
#   BASE_REV=<commit> BASE_SETTINGS="--set max_batch=256 --set max_concurrent_requests=512" bash perf/compare_sweep.sh
#
# From the repository root, with .whl/ and .gpu/ carried (scripts/make_gpu_bundle.sh) and baseline/ beside them. Each
# server starts cold (its own Triton cache) on the checkpoint at $CKPT (written when missing), serves the sweep, and
# is stopped before the next starts. Results under $OUT: sweep_final.md / .json, sweep_base.md / .json, each server's
# output and its work folder (work_<tree>/tritonserver.log); the two tables are printed last.
#
# Knobs (environment):    default
#   OUT                   perf/out/compare_sweep
#   CKPT                  /tmp/s2-full
#   BASE_DIR              baseline
#   BASE_REV              (required unless TREES=final)  the commit baseline/ holds, for the record
#   BASE_SETTINGS         ""          the base server's --set options (its own defaults otherwise)
#   FINAL_SETTINGS        ""          this tree's server's --set options
#   SWEEP                 64:32:256   loadgen --sweep
#   REQUESTS              512         requests a level
#   LOADGEN_ARGS          "--level-timeout 40 --procs 4 --timeout 120"
#   TREES                 "final base"
#   USE_CARRIED           1           0: never source scripts/gpu_env.sh (a machine with the packages installed)
#   DEVICE                cuda        the servers' --device (cpu with a tiny CKPT: a check of this script)
#   GRPC_PORT, HTTP_PORT, METRICS_PORT  8001, 8000, 8002
set -u
cd "$(dirname "$0")/.."
here="$PWD"
OUT="${OUT:-perf/out/compare_sweep}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
CKPT="${CKPT:-/tmp/s2-full}"
BASE_DIR="${BASE_DIR:-baseline}"
TREES="${TREES:-final base}"
export PYTHONUNBUFFERED=1
GRPC_PORT="${GRPC_PORT:-8001}" HTTP_PORT="${HTTP_PORT:-8000}" METRICS_PORT="${METRICS_PORT:-8002}"
PORTS="--grpc-port $GRPC_PORT --http-port $HTTP_PORT --metrics-port $METRICS_PORT"
L="--url 127.0.0.1:$GRPC_PORT --sweep ${SWEEP:-64:32:256} --requests-per-level ${REQUESTS:-512} ${LOADGEN_ARGS:---level-timeout 40 --procs 4 --timeout 120}"
log() { echo "[$(date +%H:%M:%S)] $*"; }

# shellcheck disable=SC1091
carried() { [ "${USE_CARRIED:-1}" = 1 ] && [ -f scripts/gpu_env.sh ] && [ -d .whl ]; }
carried && source scripts/gpu_env.sh > "$OUT/env.log" 2>&1
PY="${PYTHON:-python3}"
[ -f "$CKPT/config.json" ] || "$PY" scripts/make_checkpoint.py "$CKPT" --size full --device cuda > "$OUT/ckpt.log" 2>&1
case " $TREES " in *" base "*)
  if [ ! -d "$BASE_DIR/s2tts" ] || [ -z "${BASE_REV:-}" ]; then
    echo "the base tree needs $BASE_DIR/ (git archive <commit> | tar -x -C $BASE_DIR) and BASE_REV=<that commit>;" \
         "or run with TREES=final" >&2
    exit 2
  fi
  for d in .whl .gpu; do [ -e "$d" ] && ln -sfn "$here/$d" "$BASE_DIR/$d"; done
  echo "$BASE_DIR/ = git archive $BASE_REV" > "$OUT/base_tree.txt";;
esac
git log -1 --format='commit %h %s' > "$OUT/final_tree.txt" 2>/dev/null

for tree in $TREES; do
  dir=.; settings="${FINAL_SETTINGS:-}"
  [ "$tree" = base ] && { dir="$BASE_DIR"; settings="${BASE_SETTINGS:-}"; }
  t0=$SECONDS
  # shellcheck disable=SC2086
  ( cd "$dir" && { carried && source scripts/gpu_env.sh > "$OUT/env_$tree.log" 2>&1; } ;
    export GIT_CEILING_DIRECTORIES="$here"
    TRITON_CACHE_DIR="$(mktemp -d)" exec "$PY" -m s2tts.server --checkpoint "$CKPT" --device "${DEVICE:-cuda}" \
      --workdir "$OUT/work_$tree" $PORTS $settings ) > "$OUT/server_$tree.out" 2>&1 &
  server=$!
  until grep -q "tritonserver ready" "$OUT/server_$tree.out" 2>/dev/null; do
    kill -0 "$server" 2>/dev/null || { log "$tree: the server exited before it was ready"; cat "$OUT/server_$tree.out"; break; }
    sleep 1
  done
  log "$tree: $(grep -h 'ready in' "$OUT/server_$tree.out")"
  # shellcheck disable=SC2086
  "$PY" perf/loadgen.py $L --json "$OUT/sweep_$tree.json" --markdown "$OUT/sweep_$tree.md" > "$OUT/sweep_$tree.log" 2>&1
  log "$tree: sweep done in $((SECONDS - t0)) s"
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null  # (s2tts.server stops tritonserver and its models)
done
for tree in $TREES; do
  echo "== $tree ($(cat "$OUT/${tree}_tree.txt" 2>/dev/null))"
  grep -E '^\| (c|[0-9]+) \|' "$OUT/sweep_$tree.md" 2>/dev/null
done
exit 0
