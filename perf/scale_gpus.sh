#!/usr/bin/env bash
# Scaling over several GPUs of one host: perf/run_gpu.sh once per layout, one engine per GPU
# (`device=cuda:0,...,cuda:N-1`, each engine's codec beside it; s2tts/layout.py), at C_PER_GPU x N streams.
#
#   bash perf/scale_gpus.sh                  # GPUS="1 2 4" (those the host has), 64 streams per GPU
#
# On a machine that cannot install packages, with the bundle of scripts/make_gpu_bundle.sh (.whl/, .gpu/) there.
#
# Knobs (environment):   default
#   GPUS                 "1 2 4"        engine counts to run (counts above the host's GPUs are skipped)
#   C_PER_GPU            64             concurrent streams per engine
#   FRAMES               100            frames per request (ignore_eos)
#   MAX_BATCH            64             KV slots per engine
#   SETTINGS             ""             more settings for every run
#   DEVICE_TYPE          cuda           cpu: a smoke test with a tiny CKPT (device=cpu,cpu,...)
#   PROCS_PER_GPU        2              from two engines up, load generator processes per engine (loadgen --procs,
#                                       unless LOADGEN_ARGS has it): one Python client process tops out near one core,
#                                       and its own receiving then delays what it measures
#   CKPT                 /tmp/s2-full   written once (full-size random) if missing
#   OUT                  perf/out       results: scale.md (the table), scale.json, gN.tar.gz (run_gpu.sh's files)
# run_gpu.sh's own knobs (SERVER_CPUS, STOP_NOW, ...) pass through to every run.
# Every run also passes max_concurrent_requests = 2 x its streams (s2pro's admission limit is for the whole server).
# shellcheck source=perf/common.sh
source "$(dirname "$0")/common.sh"  # strict mode, $ROOT as the working directory, $RES
GPUS="${GPUS:-1 2 4}"
export MAX_BATCH="${MAX_BATCH:-64}"  # run_gpu.sh's own default is the server's
C_PER_GPU="${C_PER_GPU:-64}"
DEVICE_TYPE="${DEVICE_TYPE:-cuda}"
PY="${PYTHON:-python3}"
if [ "$DEVICE_TYPE" = cuda ]; then
  HAVE=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
else
  HAVE=1024
fi
echo "[scale_gpus] host has $HAVE GPU(s); layouts: $GPUS; $C_PER_GPU streams per engine"
RUNS=()
for n in $GPUS; do
  if [ "$n" -gt "$HAVE" ]; then echo "[scale_gpus] skipping $n engines: only $HAVE GPU(s)"; continue; fi
  devs=""
  for ((i = 0; i < n; i++)); do
    if [ "$DEVICE_TYPE" = cuda ]; then d="cuda:$i"; else d=cpu; fi
    devs="${devs:+$devs,}$d"
  done
  c=$((C_PER_GPU * n))
  echo "[scale_gpus] == $n engine(s): device=$devs, c=$c"
  rm -rf "$RES/g$n" && mkdir -p "$RES/g$n"
  rc=0
  la="${LOADGEN_ARGS:-}"
  if [ "$n" -gt 1 ] && [[ "$la" != *--procs* ]]; then la="$la --procs $((${PROCS_PER_GPU:-2} * n))"; fi
  LOADGEN_ARGS="$la" OUT="$RES/g$n" DEVICE="$devs" CONCURRENCY="$c" CLONE_CONCURRENCY="" PA=0 \
    SETTINGS="max_concurrent_requests=$((2 * c)) ${SETTINGS:-}" bash perf/run_gpu.sh >"$RES/g$n.log" 2>&1 || rc=$?
  tail -5 "$RES/g$n.log"
  [ $rc -eq 0 ] || echo "[scale_gpus] the $n-engine run failed (exit $rc): see g$n.tar.gz"
  mv "$RES/g$n.log" "$RES/g$n/"
  RUNS+=("$n")
done
"$PY" - "$RES" "${RUNS[@]}" <<'EOF'
import json, sys
from pathlib import Path

res, runs = Path(sys.argv[1]), [int(n) for n in sys.argv[2:]]
rows, base = [], None
for n in runs:
    f = res / f"g{n}" / "loadgen.json"
    if not f.is_file():
        rows.append({"engines": n, "error": "no loadgen.json (the run failed)"})
        continue
    lv = json.loads(f.read_text())["levels"][-1]
    row = {"engines": n, "concurrency": lv["concurrency"], "ok": lv["ok"], "requests": lv["requests"],
           "audio_s_per_s": lv["audio_s_per_s"], "ttfa_ms_p50": lv["ttfa_ms_p50"], "ttfa_ms_p99": lv["ttfa_ms_p99"],
           "rtf_mean": lv["rtf_mean"], "stall_fraction": lv["stall_fraction"], "gpu_mem_peak_mib": lv.get("gpu_mem_peak_mib")}
    if n == 1:
        base = row["audio_s_per_s"]
    row["efficiency"] = round(row["audio_s_per_s"] / (n * base), 3) if base else None
    rows.append(row)
(res / "scale.json").write_text(json.dumps(rows, indent=1))
cols = ["engines", "concurrency", "ok", "audio_s_per_s", "efficiency", "ttfa_ms_p50", "ttfa_ms_p99", "rtf_mean",
        "stall_fraction", "gpu_mem_peak_mib"]
lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
lines += ["| " + " | ".join(str(r.get(c, r.get("error", ""))) for c in cols) + " |" for r in rows]
(res / "scale.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
for n in "${RUNS[@]}"; do  # few files to copy back: one tarball per layout
  tar -czf "$RES/g$n.tar.gz" -C "$RES" "g$n" && rm -rf "${RES:?}/g$n"
done
