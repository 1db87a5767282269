#!/usr/bin/env bash
# What the served path loses against the engine loop alone, split, on one machine in one call (issue 25):
#
#   bash perf/served_gap.sh
#
# 1. served   perf/run_gpu.sh at c=$C ($REQUESTS requests, default settings), CPUs as the OS places them
# 2. pinned   the same with the server on CPUs 0..N-5 and the load generator on the last 4 (SERVER_CPUS /
#             CLIENT_CPUS): whether the client's threads on the same host lengthen the engine's pass ($PIN=0 skips)
# 3. loop     perf/bench_loop.py with $LOOP_ARGS: the loop alone at once, with a served closed loop's round trip
#             (--resubmit-ms), with Python beside it in its process (--gil-load)
# One table (gap.md, printed): audio-s/s, and for each run its steady state: a pass's step and codec-and-routing
# time, frames and slots a step, the share of steps ending a prompt (their step time against the others', and each
# kind's engine call split into launching and waiting for frames, with the share of prompt steps launched behind a
# codec call), a request's last frame to its final response. For a served run the steady state is slow_ar's 10 s loop line that made
# the most frames a step (its level must last more than 10 s: REQUESTS >= 12 C or so).
#
# Knobs: OUT (perf/out), CKPT (/tmp/s2-full), C (64), REQUESTS (768), PIN (1), SERVED (1; 0: the loop alone), LOOP_ARGS ("--streams $C --seconds 20
# --batch-steps 8 --resubmit-ms 0,90 --gil-load 340:0.35"), PYTHON, and run_gpu.sh's own (DEVICE, SETTINGS ...).
# shellcheck source=perf/common.sh
source "$(dirname "$0")/common.sh"  # strict mode, $ROOT as the working directory, $RES
C="${C:-64}" REQUESTS="${REQUESTS:-768}" PIN="${PIN:-1}" PY="${PYTHON:-python3}"
export CKPT="${CKPT:-/tmp/s2-full}"
LOOP_ARGS="${LOOP_ARGS:---streams $C --seconds 20 --batch-steps 8 --resubmit-ms 0,90 --gil-load 340:0.35}"
export CONCURRENCY="$C" CLONE_CONCURRENCY="" CLONE_FIRST_CONCURRENCY="" PA=0 LEVEL_TIMEOUT="${LEVEL_TIMEOUT:-60}"
export LOADGEN_ARGS="--requests-per-level $C:$REQUESTS"
RUNS=()
[ "${SERVED:-1}" = 1 ] && RUNS+=(served)
if [ "${SERVED:-1}" = 1 ] && [ "$PIN" = 1 ]; then
  n=$(nproc)
  [ "$n" -ge 8 ] || { echo "[served_gap] $n CPUs: too few to pin; PIN=0 skips the pinned run" >&2; exit 2; }
  RUNS+=(pinned)
fi
for run in "${RUNS[@]+"${RUNS[@]}"}"; do
  pin=()
  [ "$run" = pinned ] && pin=(SERVER_CPUS="0-$((n - 5))" CLIENT_CPUS="$((n - 4))-$((n - 1))")
  echo "[served_gap] == $run ${pin[*]}"
  rm -rf "$RES/$run"
  env "${pin[@]}" OUT="$RES/$run" bash perf/run_gpu.sh >"$RES/$run.log" 2>&1 || echo "[served_gap] $run failed: $(tail -3 "$RES/$run.log")"
done
echo "[served_gap] == loop: $LOOP_ARGS"
# shellcheck disable=SC2086
"$PY" perf/bench_loop.py --checkpoint "$CKPT" --device "${DEVICE:-cuda}" $LOOP_ARGS --json "$RES/loop.json" \
  >"$RES/loop.log" 2>&1 || echo "[served_gap] loop failed: $(tail -3 "$RES/loop.log")"
"$PY" perf/gap_table.py "$RES" "${RUNS[@]+"${RUNS[@]}"}"
