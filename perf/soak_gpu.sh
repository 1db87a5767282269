#!/usr/bin/env bash
# The 10-minute soak on a GPU machine, in two commands, each shorter than the soak (the server and the soak run in
# their own process sessions, so they outlive the first command on the same machine):
#
#   bash perf/soak_gpu.sh start     # env, full-size random checkpoint, server, then the soak in the background;
#                                   # stays until START_BUDGET_S (default 560 s) and copies what is there to $OUT
#   bash perf/soak_gpu.sh finish    # waits for the soak to end, stops the server, copies the results to $OUT
#
# Needs the bundle (.whl/ and .gpu/, made by scripts/make_gpu_bundle.sh; perf/README.md) on a machine without it.
# Knobs: CKPT (/tmp/s2-full), MINUTES (10), CONCURRENCY (64), FRAMES (20,200), SETTINGS ("max_batch=64
# max_seq_len=1024"), SOAK_ARGS (more perf/soak.py options), START_BUDGET_S (560).
# Results in $OUT: soak.json (everything), soak.out (its progress lines and summary), server.log, run.log.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
RES="${OUT:-perf/out}"
mkdir -p "$RES"
W=/tmp/s2tts_soak
CKPT="${CKPT:-/tmp/s2-full}"
MINUTES="${MINUTES:-10}"
CONCURRENCY="${CONCURRENCY:-64}"
FRAMES="${FRAMES:-20,200}"
SETTINGS="${SETTINGS:-max_batch=64 max_seq_len=1024}"
SOAK_ARGS="${SOAK_ARGS:-}"
START_BUDGET_S="${START_BUDGET_S:-560}"
log() { echo "[$(date '+%H:%M:%S') +${SECONDS}s] $*" | tee -a "$RES/run.log"; }
collect() {
  cp -f "$W/soak.out" "$RES/soak.out" 2>/dev/null || true
  cp -f "$W/soak.json" "$RES/soak.json" 2>/dev/null || true
  cp -f "$W/server/tritonserver.log" "$RES/server.log" 2>/dev/null || true
  cp -f "$W/server.out" "$RES/server.out" 2>/dev/null || true
}

case "${1:-}" in
start)
  rm -rf "$W" && mkdir -p "$W"
  # shellcheck disable=SC1091
  source scripts/gpu_env.sh
  set -euo pipefail
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$RES/run.log"
  git log -1 --format='commit %H %s' 2>/dev/null | tee -a "$RES/run.log" || true
  if [ ! -f "$CKPT/config.json" ]; then
    log "writing the full-size random checkpoint to $CKPT"
    python3 scripts/make_checkpoint.py "$CKPT" --size full --device cuda >>"$RES/run.log" 2>&1
  fi
  SET=()
  for kv in $SETTINGS; do SET+=(--set "$kv"); done
  log "server: ${SET[*]}"
  setsid nohup python3 -m s2tts.server --checkpoint "$CKPT" --device cuda "${SET[@]}" --workdir "$W/server" \
    --timeout 900 >"$W/server.out" 2>&1 < /dev/null &
  until grep -q "tritonserver ready" "$W/server.out" 2>/dev/null; do
    if grep -q "^error" "$W/server.out" 2>/dev/null; then cat "$W/server.out"; collect; exit 1; fi
    sleep 2
  done
  log "$(cat "$W/server.out")"
  nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$RES/run.log"
  log "soak: $MINUTES min at c=$CONCURRENCY, frames $FRAMES $SOAK_ARGS"
  # shellcheck disable=SC2086
  setsid nohup python3 perf/soak.py --minutes "$MINUTES" --concurrency "$CONCURRENCY" --frames "$FRAMES" \
    --out "$W/soak.json" $SOAK_ARGS >"$W/soak.out" 2>&1 < /dev/null &
  echo $! >"$W/soak.pid"
  while [ "$SECONDS" -lt "$START_BUDGET_S" ] && kill -0 "$(cat "$W/soak.pid")" 2>/dev/null; do sleep 5; done
  collect
  tail -3 "$W/soak.out"
  log "start: done (the soak goes on; run 'finish' next)"
  ;;
finish)
  while kill -0 "$(cat "$W/soak.pid")" 2>/dev/null; do
    [ "$SECONDS" -lt 570 ] || { log "the soak still runs after 570 s"; break; }
    sleep 5
  done
  collect
  pkill -TERM -f "s2tts.server --checkpoint" || true
  sleep 5
  collect
  tail -8 "$W/soak.out"
  ;;
*)
  echo "usage: bash perf/soak_gpu.sh start|finish" >&2
  exit 2
  ;;
esac
