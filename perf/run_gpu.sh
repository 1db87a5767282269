#!/usr/bin/env bash
# The whole serving benchmark on a GPU machine, in one command (from the repository root):
#
#   bash perf/run_gpu.sh
#
# 1. env       records nvidia-smi, python3, torch
# 2. setup     source scripts/gpu_env.sh if present (carried .whl/ wheels -> /tmp/site, .gpu/np numpy 1.26,
#              .gpu/tritonserver-min.tar.xz -> /tmp/s2tts_triton = S2TTS_TRITON_HOME, perf_analyzer's libraries);
#              else the same steps here (plus .gpu/libb64-0d_*.deb via dpkg -x if the server's lib/ has no libb64)
# 3. ckpt      full-size random checkpoint at $CKPT if missing (scripts/make_checkpoint.py --size full --device cuda)
# 4. server    python3 -m s2tts.server --device cuda (+ --set max_batch=$MAX_BATCH / max_seq_len=$MAX_SEQ_LEN when
#              set, + $SETTINGS)
# 5. loadgen   perf/loadgen.py over $CONCURRENCY, $FRAMES frames/request (ignore_eos), plain prompts; with $SWEEP a
#              sweep instead (loadgen --sweep: levels grown until one breaks the SLO, the peak within it in summary.md)
# 6. clone     perf/loadgen.py over $CLONE_CONCURRENCY, every request a voice clone (10 s reference, codes encoded once);
#              then over $CLONE_FIRST_CONCURRENCY, every request a voice's first use (a reference clip never sent
#              before: encoded by dac_encoder, its prefix prefilled)
# 7. determ.   with DETERMINISM=1: perf/determinism.py (seeded codes alone vs beside others, both modes)
# 8. pa        perf/make_pa_inputs.py + perf/run_perf_analyzer.sh (s2pro, slow_ar, fast_ar, dac_decoder), brief
# 9. targets   perf/targets.py: the serving targets filled in from this run (targets.md, and in summary.md)
#
# Knobs (environment):      default
#   OUT                     perf/out                 where the results go
#   CKPT                    /tmp/s2-full             checkpoint directory (written if it has no config.json)
#   MAX_BATCH, MAX_SEQ_LEN  "", ""                   model repository settings max_batch, max_seq_len; "" = the
#                                                    server's own defaults (s2tts/settings.py: no --set passed)
#   SETTINGS                ""                       more settings, "key=value key=value" (e.g. "chunk_frames=25 fast_ar=bls")
#   CONCURRENCY             1,4,16,64                loadgen levels; "" skips the phase (unless SWEEP is set)
#   SWEEP                   ""                       START[:STEP[:MAX]] (e.g. 64:32:512): the plain loadgen phase
#                                                    as a sweep instead of $CONCURRENCY (loadgen --sweep): levels
#                                                    START, START+STEP, ... until one breaks the SLO; the peak
#                                                    within the SLO and the level that broke it in summary.md
#   SLO_TTFA_P99_MS         "" (loadgen's default)   the sweep's TTFA p99 limit (loadgen --slo-ttfa-p99-ms)
#   FRAMES                  100                      frames per request (100 = 4.64 s of audio)
#   CLONE_CONCURRENCY       1,16                     clone levels; "" skips the phase
#   LIVE_CONCURRENCY        ""                       perf/live_load.py levels (text sessions fed at an LLM's pace,
#                                                    LIVE_ARGS for its options); "" skips the phase
#   CLONE_FIRST_CONCURRENCY 1 ("" without clone levels)  first-use clone levels (loadgen --clone-mode audio
#                                                    --fresh-references); "" skips the phase
#   SERVER_CPUS, CLIENT_CPUS ""                      CPU lists (taskset -c) for the server's processes and for the
#                                                    load generators (e.g. 0-11 and 12-15: whether the client's
#                                                    threads on the same host slow the engine's); "" = any CPU
#   LOADGEN_ARGS            ""                       extra loadgen options for both phases (e.g. "--requests-per-level
#                                                    64:384": a long c=64 level, the others their default)
#   DETERMINISM             0                        1 runs perf/determinism.py (16 requests, the server's
#                                                    max_batch, 4 alone)
#   CPU_USE                 1                        1: perf/cpu_use.py samples /proc during the plain loadgen
#                                                    phase: CPU cores taken by tritonserver, each model's stub and
#                                                    the load generator (a table in summary.md)
#   PROFILE                 0                        1: every model process samples its threads' stacks
#                                                    (S2TTS_PROFILE_DIR, s2tts/serving/profiler.py): summaries in summary.md,
#                                                    flame-graph input in details.tar.gz (details/profile/)
#   PA                      1                        0 skips perf_analyzer
#   PA_CONCURRENCY          "1 16"                   perf_analyzer levels
#   PA_FRAMES               50                       frames per s2pro/slow_ar request in perf_analyzer
#   PA_REQUESTS             (per model)              requests per perf_analyzer run (run_perf_analyzer.sh -n)
#   GRPC_PORT, HTTP_PORT, METRICS_PORT  8001, 8000, 8002
#   SERVER_TIMEOUT          900                      seconds to wait for the server to be ready
#   LEVEL_TIMEOUT           120                      loadgen: no new request starts after this long in a level
#   BUDGET_S                570                      soft time limit of the whole run, in seconds: the clone and
#                                                    perf_analyzer phases are skipped when less than 90 s of it is left
#   DEVICE                  cuda                     server device (cpu: a smoke test of this script with a tiny CKPT;
#                                                    a list, e.g. cuda:0,cuda:1: one engine per GPU, perf/scale_gpus.sh)
#   CKPT_SIZE               full                     size of a checkpoint written at $CKPT (tiny|full)
#   USE_CARRIED             1                        0: ignore the bundle in .whl/ and .gpu/ (use what $PYTHON has)
#   PYTHON                  python3
#   STOP_NOW                0                        1: at the end, kill the server and its models at once instead of
#                                                    letting them unload (~5 s on a CPU); for the tests' CPU runs,
#                                                    which read nothing written after the results
#
# Results in $OUT (few files, so that all of them are easy to copy back from a remote machine):
#   summary.md            the tables: loadgen (plain, clone), perf_analyzer, the targets; slow_ar's loop log lines
#   targets.md            the serving targets, measured by this run (perf/targets.py)
#   determinism.jsonl     with DETERMINISM=1: perf/determinism.py's lines (one per mode)
#   loadgen.json          loadgen_clone.json      per level numbers + per request records
#   loadgen_clone_first.json                      the same for the first use of a voice
#   live.json             with LIVE_CONCURRENCY: perf/live_load.py per level numbers + per session records
#   run.log               everything printed, with timestamps and each phase's time
#   tritonserver.log      the server's log
#   model_stats.json      Triton's statistics of every model at the end of the run (/v2/models/stats)
#   details.tar.gz        perf_analyzer CSV/logs, its input meta, environment info, rendered settings
# shellcheck source=perf/common.sh
source "$(dirname "$0")/common.sh"  # strict mode, $ROOT as the working directory, $RES
WORK="${WORK:-/tmp/s2tts_perf}"
rm -rf "$WORK"
mkdir -p "$WORK/details"
CKPT="${CKPT:-/tmp/s2-full}"
MAX_BATCH="${MAX_BATCH:-}"
MAX_SEQ_LEN="${MAX_SEQ_LEN:-}"
SETTINGS="${SETTINGS:-}"
CONCURRENCY="${CONCURRENCY-1,4,16,64}"
SWEEP="${SWEEP:-}"
SLO_TTFA_P99_MS="${SLO_TTFA_P99_MS:-}"
FRAMES="${FRAMES:-100}"
CLONE_CONCURRENCY="${CLONE_CONCURRENCY-1,16}"
CLONE_FIRST_CONCURRENCY="${CLONE_FIRST_CONCURRENCY-${CLONE_CONCURRENCY:+1}}"
LOADGEN_ARGS="${LOADGEN_ARGS:-}"
SERVER_CPUS="${SERVER_CPUS:-}" CLIENT_CPUS="${CLIENT_CPUS:-}"
ON_SERVER_CPUS=() ON_CLIENT_CPUS=()
[ -n "$SERVER_CPUS" ] && ON_SERVER_CPUS=(taskset -c "$SERVER_CPUS")
[ -n "$CLIENT_CPUS" ] && ON_CLIENT_CPUS=(taskset -c "$CLIENT_CPUS")
PA="${PA:-1}"
DETERMINISM="${DETERMINISM:-0}"
PROFILE="${PROFILE:-0}"
CPU_USE="${CPU_USE:-1}"
PA_CONCURRENCY="${PA_CONCURRENCY:-1 16}"
PA_FRAMES="${PA_FRAMES:-50}"
SERVER_TIMEOUT="${SERVER_TIMEOUT:-900}"
LEVEL_TIMEOUT="${LEVEL_TIMEOUT:-120}"
BUDGET_S="${BUDGET_S:-570}"
DEVICE="${DEVICE:-cuda}"
CKPT_SIZE="${CKPT_SIZE:-full}"
USE_CARRIED="${USE_CARRIED:-1}"
PY="${PYTHON:-python3}"
GRPC_PORT="${GRPC_PORT:-8001}" HTTP_PORT="${HTTP_PORT:-8000}" METRICS_PORT="${METRICS_PORT:-8002}"
PA_REQUESTS="${PA_REQUESTS:-}"
STOP_NOW="${STOP_NOW:-0}"

exec > >(tee -a "$RES/run.log") 2>&1
T_START=$SECONDS
PHASE="" T_PHASE=$SECONDS
ts() { date '+%Y-%m-%d %H:%M:%S'; }
log() { echo "[$(ts) +$((SECONDS - T_START))s] $*"; }
phase() {
  [ -n "$PHASE" ] && log "== $PHASE done in $((SECONDS - T_PHASE)) s"
  PHASE="$1" T_PHASE=$SECONDS
  [ -n "$PHASE" ] && log "== $PHASE"
  return 0
}
time_left() { [ $((BUDGET_S - (SECONDS - T_START))) -ge 90 ] || { log "skipping $1: only $((BUDGET_S - (SECONDS - T_START))) s of BUDGET_S=$BUDGET_S left"; echo "## $1: skipped (time budget)" >>"$RES/summary.md"; return 1; }; }

SERVER_PID=""
finish() {
  local rc=$?
  set +e
  if [ $rc -ne 0 ]; then log "!! FAILED in phase '$PHASE' (exit $rc) after $((SECONDS - T_PHASE)) s"; fi
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    if [ "$STOP_NOW" = 1 ]; then  # tritonserver is s2tts.server's child, in a process group of its own with its models
      for p in $(pgrep -P "$SERVER_PID" 2>/dev/null); do kill -KILL -- "-$p" 2>/dev/null; done
    fi
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null
  fi
  [ -f "$WORK/server/tritonserver.log" ] && cp "$WORK/server/tritonserver.log" "$RES/tritonserver.log"
  [ -f "$WORK/server.out" ] && cp "$WORK/server.out" "$WORK/details/server.out"
  if [ $rc -ne 0 ] && [ -f "$RES/tritonserver.log" ]; then
    log "last lines of the server log ($RES/tritonserver.log):"; tail -40 "$RES/tritonserver.log"
  fi
  tar -czf "$RES/details.tar.gz" -C "$WORK" details 2>/dev/null
  log "== total $((SECONDS - T_START)) s; results in $RES: $(cd "$RES" && ls | tr '\n' ' ')"
  exit $rc
}
trap finish EXIT

# ------------------------------------------------------------------------------------------------ 1. env
phase env
log "host $(hostname), repo $ROOT, results $RES, work $WORK"
{ nvidia-smi || true; } | tee "$WORK/details/nvidia-smi.txt"
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' \
  | tee "$WORK/details/python.txt"
{ git log -1 --format='commit %H %s' 2>/dev/null; git diff --quiet HEAD 2>/dev/null || echo " + uncommitted changes to: $(git diff --name-only HEAD 2>/dev/null | tr '\n' ' ')"; } | tr -d '\n' | tee "$WORK/details/commit.txt" || true
git status --short 2>/dev/null >"$WORK/details/git-status.txt" || true

# ------------------------------------------------------------------------------------------------ 2. carried software
# scripts/gpu_env.sh (when present) is the project's own setup of the GPU machine; otherwise the same steps here:
# wheels -> /tmp/site, numpy 1.26 (.gpu/np: the 24.10 python backend stub mis-reads BYTES tensors under numpy 2)
# -> /tmp/np1 ahead of everything, tritonserver -> /tmp/s2tts_triton, perf_analyzer's libcudart.so.12 / libb64.so.0d
# from the tritonserver's lib/ (or .gpu/libb64-0d_*.deb, the nvidia-cuda-runtime-cu12 wheel) -> /tmp/pa_libs.
phase setup
PA_LIBS=""
if [ "$USE_CARRIED" != 1 ]; then
  log "USE_CARRIED=$USE_CARRIED: using what $PY has"
elif [ -f scripts/gpu_env.sh ] && compgen -G ".whl/*.whl" >/dev/null; then
  log "source scripts/gpu_env.sh"
  # shellcheck disable=SC1091
  source scripts/gpu_env.sh
  set -euo pipefail  # gpu_env.sh ends with set +e
else
  if compgen -G ".whl/*.whl" >/dev/null; then
    # a libcudart.so.12 wheel stays off PYTHONPATH: torch's CUDA-library preloading scans sys.path for it
    WHEELS=() CU12=()
    for w in .whl/*.whl; do case $(basename "$w") in nvidia_cuda_runtime_cu12-*) CU12+=("$w") ;; *) WHEELS+=("$w") ;; esac; done
    PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
    [ ${#WHEELS[@]} -gt 0 ] && "${PIP[@]}" --target /tmp/site "${WHEELS[@]}"
    [ ${#CU12[@]} -gt 0 ] && "${PIP[@]}" --target /tmp/site_cu12 "${CU12[@]}"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="/tmp/site/bin:$PATH"
    log "installed ${#WHEELS[@]} wheels into /tmp/site (${WHEELS[*]##*/}), ${#CU12[@]} into /tmp/site_cu12"
  fi
  if compgen -G ".gpu/np/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/np1 .gpu/np/*.whl
    export PYTHONPATH="/tmp/np1:${PYTHONPATH:-}"  # inherited by tritonserver's python stubs
  fi
  if [ -f .gpu/tritonserver-min.tar.xz ]; then
    [ -x /tmp/s2tts_triton/bin/tritonserver ] || tar -xJf .gpu/tritonserver-min.tar.xz -C /tmp
    export S2TTS_TRITON_HOME=/tmp/s2tts_triton
  fi
  mkdir -p /tmp/pa_libs
  if [ -d /tmp/s2tts_triton/lib ]; then
    for f in /tmp/s2tts_triton/lib/libcudart-*.so.12*; do [ -e "$f" ] && ln -sf "$f" /tmp/pa_libs/libcudart.so.12; done
    for f in /tmp/s2tts_triton/lib/libb64-*.so.0d; do [ -e "$f" ] && ln -sf "$f" /tmp/pa_libs/libb64.so.0d; done
  fi
  if [ ! -e /tmp/pa_libs/libb64.so.0d ] && compgen -G ".gpu/libb64-0d_*.deb" >/dev/null; then
    mkdir -p /tmp/b64 && dpkg -x .gpu/libb64-0d_*.deb /tmp/b64
    ln -sf "$(find /tmp/b64 -name 'libb64.so.0d*' | head -1)" /tmp/pa_libs/libb64.so.0d
  fi
  if [ ! -e /tmp/pa_libs/libcudart.so.12 ] && [ -e /tmp/site_cu12/nvidia/cuda_runtime/lib/libcudart.so.12 ]; then
    ln -sf /tmp/site_cu12/nvidia/cuda_runtime/lib/libcudart.so.12 /tmp/pa_libs/libcudart.so.12
  fi
  PA_LIBS=/tmp/pa_libs
fi
export PYTHONUNBUFFERED=1
[ -x /tmp/site/bin/perf_analyzer ] && export PERF_ANALYZER=/tmp/site/bin/perf_analyzer
log "S2TTS_TRITON_HOME=${S2TTS_TRITON_HOME:-(unset)} PERF_ANALYZER=${PERF_ANALYZER:-(search)} PYTHONPATH=${PYTHONPATH:-}"
"$PY" -c 'import numpy, tritonclient.grpc, s2tts; print("client side ok: numpy", numpy.__version__)'

# ------------------------------------------------------------------------------------------------ 3. ckpt
phase checkpoint
if [ -f "$CKPT/config.json" ]; then
  log "checkpoint $CKPT exists"
else
  "$PY" scripts/make_checkpoint.py "$CKPT" --size "$CKPT_SIZE" --device "${DEVICE%%,*}"
fi
du -sh "$CKPT" || true

# ------------------------------------------------------------------------------------------------ 4. server
phase server
SET_ARGS=()
[ -n "$MAX_BATCH" ] && SET_ARGS+=(--set "max_batch=$MAX_BATCH")
[ -n "$MAX_SEQ_LEN" ] && SET_ARGS+=(--set "max_seq_len=$MAX_SEQ_LEN")
for kv in $SETTINGS; do SET_ARGS+=(--set "$kv"); done
if [ "$PROFILE" = 1 ]; then export S2TTS_PROFILE_DIR="$WORK/details/profile"; fi
log "settings: device=$DEVICE ${SET_ARGS[*]}"
[ -n "$SERVER_CPUS$CLIENT_CPUS" ] && log "CPUs: the server on ${SERVER_CPUS:-any}, the load generators on ${CLIENT_CPUS:-any}"
echo "device=$DEVICE ${SET_ARGS[*]}" >"$WORK/details/settings.txt"
"${ON_SERVER_CPUS[@]}" "$PY" -m s2tts.server --checkpoint "$CKPT" --device "$DEVICE" "${SET_ARGS[@]}" --http-port $HTTP_PORT --grpc-port $GRPC_PORT \
  --metrics-port $METRICS_PORT --workdir "$WORK/server" --timeout "$SERVER_TIMEOUT" >"$WORK/server.out" 2>&1 &
SERVER_PID=$!
until grep -q "tritonserver ready" "$WORK/server.out" 2>/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    log "the server exited before it was ready:"; cat "$WORK/server.out"; exit 1
  fi
  if [ $((SECONDS - T_PHASE)) -gt $((SERVER_TIMEOUT + 30)) ]; then log "server not ready after $SERVER_TIMEOUT s"; exit 1; fi
  sleep 0.5
done
cat "$WORK/server.out"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv 2>/dev/null | tee "$WORK/details/gpu-mem-after-load.txt" || true

# ------------------------------------------------------------------------------------------------ 5./6. loadgen
{
  echo "# S2 Pro serving benchmark"
  echo
  echo "- $(cat "$WORK/details/python.txt")"
  echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "- checkpoint $CKPT (random weights); settings: device=$DEVICE ${SET_ARGS[*]}"
  echo "- $(cat "$WORK/details/commit.txt" 2>/dev/null)"
  echo
} >"$RES/summary.md"

LG_FAIL=0
if [ -n "$SWEEP$CONCURRENCY" ]; then
  phase loadgen
  LEVEL_ARGS=(--concurrency "$CONCURRENCY") TITLE="plain prompts"
  if [ -n "$SWEEP" ]; then
    LEVEL_ARGS=(--sweep "$SWEEP" ${SLO_TTFA_P99_MS:+--slo-ttfa-p99-ms "$SLO_TTFA_P99_MS"})
    TITLE="plain prompts, a sweep of levels $SWEEP"
  fi
  CPU_PID=
  if [ "$CPU_USE" = 1 ]; then
    "$PY" perf/cpu_use.py --json "$WORK/details/cpu.json" --markdown "$WORK/cpu.md" >/dev/null 2>&1 &
    CPU_PID=$!
  fi
  # shellcheck disable=SC2086
  "${ON_CLIENT_CPUS[@]}" "$PY" perf/loadgen.py --url "127.0.0.1:$GRPC_PORT" "${LEVEL_ARGS[@]}" --frames "$FRAMES" --level-timeout "$LEVEL_TIMEOUT" \
    --json "$RES/loadgen.json" --markdown "$WORK/loadgen.md" $LOADGEN_ARGS || LG_FAIL=1
  [ -n "$CPU_PID" ] && { kill -INT "$CPU_PID" 2>/dev/null; wait "$CPU_PID" || true; }
  { echo "## loadgen, $TITLE"; echo; cat "$WORK/loadgen.md" 2>/dev/null || echo "(failed)"; echo
    if [ -s "$WORK/cpu.md" ]; then echo "### CPU use during these levels (perf/cpu_use.py)"; echo; cat "$WORK/cpu.md"; echo; fi
  } >>"$RES/summary.md"
fi
if [ -n "$CLONE_CONCURRENCY" ] && time_left loadgen-clone; then
  phase loadgen-clone
  # shellcheck disable=SC2086
  "${ON_CLIENT_CPUS[@]}" "$PY" perf/loadgen.py --url "127.0.0.1:$GRPC_PORT" --concurrency "$CLONE_CONCURRENCY" --frames "$FRAMES" \
    --clone-fraction 1 --clone-mode codes --warmup 1 --level-timeout "$LEVEL_TIMEOUT" \
    --json "$RES/loadgen_clone.json" --markdown "$WORK/loadgen_clone.md" $LOADGEN_ARGS || LG_FAIL=1
  { echo "## loadgen, voice clone (10 s reference, codes encoded once by dac_encoder)"; echo
    cat "$WORK/loadgen_clone.md" 2>/dev/null || echo "(failed)"; echo; } >>"$RES/summary.md"
fi
if [ -n "${LIVE_CONCURRENCY:-}" ] && time_left live; then
  phase live
  "${ON_CLIENT_CPUS[@]}" "$PY" perf/live_load.py --url "127.0.0.1:$GRPC_PORT" --concurrency "$LIVE_CONCURRENCY" --json "$RES/live.json" \
    ${LIVE_ARGS:-} >"$WORK/live.md" || LG_FAIL=1
  { echo "## live sessions: text fed at an LLM's pace (perf/live_load.py ${LIVE_ARGS:-})"; echo
    cat "$WORK/live.md" 2>/dev/null || echo "(failed)"; echo; } >>"$RES/summary.md"
fi
if [ -n "$CLONE_FIRST_CONCURRENCY" ] && time_left loadgen-clone-first; then
  phase loadgen-clone-first
  # shellcheck disable=SC2086
  "${ON_CLIENT_CPUS[@]}" "$PY" perf/loadgen.py --url "127.0.0.1:$GRPC_PORT" --concurrency "$CLONE_FIRST_CONCURRENCY" --frames "$FRAMES" \
    --clone-fraction 1 --clone-mode audio --fresh-references --warmup 1 --level-timeout "$LEVEL_TIMEOUT" \
    --json "$RES/loadgen_clone_first.json" --markdown "$WORK/loadgen_clone_first.md" $LOADGEN_ARGS || LG_FAIL=1
  { echo "## loadgen, first use of a voice (a 10 s reference never sent before, encoded and prefilled each time)"; echo
    cat "$WORK/loadgen_clone_first.md" 2>/dev/null || echo "(failed)"; echo; } >>"$RES/summary.md"
fi

# ------------------------------------------------------------------------------------------------ 7. determinism
if [ "$DETERMINISM" = 1 ] && time_left determinism; then
  phase determinism
  # the server's max_batch: as given, else as the launcher sizes it (s2tts.sizing), else the schema's
  DET_BATCH="${MAX_BATCH:-$("$PY" -c 'import sys; from s2tts.settings import SCHEMA; from s2tts.sizing import with_gpu_sizes
print(with_gpu_sizes({"checkpoint": sys.argv[1], "device": sys.argv[2]})[0].get("max_batch") or SCHEMA["max_batch"].default)' "$CKPT" "$DEVICE")}"
  "$PY" perf/determinism.py --checkpoint "$CKPT" --device "${DEVICE%%,*}" --requests 16 --max-batch "$DET_BATCH" \
    --alone 4 >"$RES/determinism.jsonl" 2>"$WORK/details/determinism.err" \
    || log "the determinism run failed (details.tar.gz: details/determinism.err)"
  { echo "## determinism (perf/determinism.py)"; echo; sed 's/^/    /' "$RES/determinism.jsonl"; echo; } >>"$RES/summary.md"
fi

# ------------------------------------------------------------------------------------------------ 8. perf_analyzer
if [ "$PA" = 1 ] && time_left perf_analyzer; then
  phase perf_analyzer
  "$PY" perf/make_pa_inputs.py --checkpoint "$CKPT" --out "$WORK/details/pa_inputs" --frames "$PA_FRAMES" >/dev/null
  if LD_LIBRARY_PATH="${PA_LIBS:+$PA_LIBS:}${LD_LIBRARY_PATH:-}" PYTHON="$PY" bash perf/run_perf_analyzer.sh \
       -u "127.0.0.1:$GRPC_PORT" -i "$WORK/details/pa_inputs" -o "$WORK/details/pa" -c "$PA_CONCURRENCY" -t 240 -b "1 64" ${PA_REQUESTS:+-n "$PA_REQUESTS"}; then
    :
  else
    log "some perf_analyzer runs failed (see details.tar.gz: details/pa/*.log)"
  fi
  # keep the tarball small: the input files of the full-size checkpoint are large and reproducible
  find "$WORK/details/pa_inputs" -name '*.json' ! -name meta.json -delete
  { echo "## perf_analyzer"; echo; cat "$WORK/details/pa/pa_summary.md" 2>/dev/null || echo "(no results)"; echo; } >>"$RES/summary.md"
fi
phase ""

# slow_ar's own account of its loop (codec_in_engine: every 10 s under load, a step's time and the codec's)
if grep -q "routing and decoding" "$WORK/server/tritonserver.log" 2>/dev/null; then
  { echo "## slow_ar's loop, from its log"; echo
    grep -oE "slow_ar: (last|sender, last) .*" "$WORK/server/tritonserver.log" | sed 's/^/- /'; echo; } >>"$RES/summary.md"
fi
# s2pro's calls out of its process (BLS calls to slow_ar / the codec, responses sent to the client), every 10 s
if grep -q "s2pro, last" "$WORK/server/tritonserver.log" 2>/dev/null; then
  { echo "## s2pro's calls, from its log"; echo; grep -oE "s2pro, last .*" "$WORK/server/tritonserver.log" | sed 's/^/- /'; echo; } >>"$RES/summary.md"
fi

# where the model processes' threads spent the run (PROFILE=1): the server is still up, the files are 10 s old at most
if [ "$PROFILE" = 1 ]; then
  sleep 11
  { echo "## thread stacks sampled in the model processes (PROFILE=1)"; echo
    for f in "$WORK"/details/profile/*.txt; do [ -f "$f" ] && { echo '```'; head -32 "$f"; echo '```'; echo; }; done
  } >>"$RES/summary.md"
fi

# Triton's own statistics of every model (requests, executions, queue and compute times), the server still up
"$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())' \
  "http://127.0.0.1:$HTTP_PORT/v2/models/stats" >"$RES/model_stats.json" 2>/dev/null || log "no model statistics"

# ------------------------------------------------------------------------------------------------ 9. targets
"$PY" perf/targets.py "$RES" >"$RES/targets.md" || true
{ echo "## the serving targets, this run"; echo; cat "$RES/targets.md"; echo; } >>"$RES/summary.md"

echo
cat "$RES/summary.md"
[ $LG_FAIL -eq 0 ] || { log "a loadgen phase failed"; exit 1; }
