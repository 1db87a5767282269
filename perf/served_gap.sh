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
# time, frames and slots a step, the share of steps ending a prompt (their step time against the others'), a
# request's last frame to its final response. For a served run the steady state is slow_ar's 10 s loop line that made
# the most frames a step (its level must last more than 10 s: REQUESTS >= 12 C or so).
#
# Knobs: OUT (perf/out), CKPT (/tmp/s2-full), C (64), REQUESTS (768), PIN (1), LOOP_ARGS ("--streams $C --seconds 20
# --batch-steps 8 --resubmit-ms 0,90 --gil-load 340:0.35"), PYTHON, and run_gpu.sh's own (DEVICE, SETTINGS ...).
# shellcheck source=perf/common.sh
source "$(dirname "$0")/common.sh"  # strict mode, $ROOT as the working directory, $RES
C="${C:-64}" REQUESTS="${REQUESTS:-768}" PIN="${PIN:-1}" PY="${PYTHON:-python3}"
export CKPT="${CKPT:-/tmp/s2-full}"
LOOP_ARGS="${LOOP_ARGS:---streams $C --seconds 20 --batch-steps 8 --resubmit-ms 0,90 --gil-load 340:0.35}"
export CONCURRENCY="$C" CLONE_CONCURRENCY="" CLONE_FIRST_CONCURRENCY="" PA=0 LEVEL_TIMEOUT="${LEVEL_TIMEOUT:-60}"
export LOADGEN_ARGS="--requests-per-level $C:$REQUESTS"
RUNS=(served)
served_env=()
if [ "$PIN" = 1 ]; then
  n=$(nproc)
  [ "$n" -ge 8 ] || { echo "[served_gap] $n CPUs: too few to pin; PIN=0 skips the pinned run" >&2; exit 2; }
  RUNS+=(pinned)
fi
for run in "${RUNS[@]}"; do
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
"$PY" - "$RES" "${RUNS[@]}" <<'EOF'
import json, re, sys
from pathlib import Path

res, runs = Path(sys.argv[1]), sys.argv[2:]
LINE = re.compile(r"(\d+) steps of ([\d.]+) ms making ([\d.]+) frames each, then ([\d.]+) ms a step .*? slots held "
                  r"([\d.]+), requests waiting ([\d.]+) a step; (\d+)% of the steps with prompt rows ending \(([\d.]+) "
                  r"ms, the others ([\d.]+)\); last frame to final response (?:([\d.]+) ms p50|-)")
head = ("| run | audio-s/s | pass ms (step + codec and routing) | frames a step | slots held | steps ending a prompt "
        "(their step ms / the others') | last frame -> final p50 ms |\n|---|---|---|---|---|---|---|")
rows = [head]
for run in runs:
    lg = res / run / "loadgen.json"
    level = json.loads(lg.read_text())["levels"][0] if lg.is_file() else {}
    text = (res / run / "summary.md").read_text(errors="replace") if (res / run / "summary.md").is_file() else ""
    lines = [m.groups() for m in LINE.finditer(text)]
    if not lines:
        rows.append(f"| {run} | {level.get('audio_s_per_s', '-')} | (no loop line over 10 s) | | | | |")
        continue
    _, step, frames, rest, held, _, pct, pms, oms, tail = max(lines, key=lambda g: float(g[2]))
    rows.append(f"| {run} | {level.get('audio_s_per_s', '-')} | {float(step) + float(rest):.2f} ({step} + {rest}) | "
                f"{frames} | {held} | {pct}% ({pms} / {oms}) | {tail or '-'} |")
loop = json.loads((res / "loop.json").read_text()) if (res / "loop.json").is_file() else []
for r in loop:
    what = "loop" + (f", resubmit {r['resubmit_ms']:g} ms" if r.get("resubmit_ms") else "") + \
        (f", Python beside {r['gil_load']}" if r.get("gil_load") else "")
    p = r["prompt_steps"]
    others = (r["step_ms"] - p * r["prompt_step_ms"]) / (1 - p) if p < 1 else 0.0
    rows.append(f"| {what} | {r['audio_s_per_s']} | {r['step_ms'] + r['rest_ms']:.2f} ({r['step_ms']} + {r['rest_ms']}) | "
                f"{r['frames_per_step']} | {r['slots_held']} | {100 * p:.0f}% ({r['prompt_step_ms']} / {others:.2f}) | "
                f"{r['tail_ms_p50'] if r['tail_ms_p50'] is not None else '-'} |")
out = "\n".join(rows)
(res / "gap.md").write_text(out + "\n")
print(out)
EOF
