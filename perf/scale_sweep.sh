#!/usr/bin/env bash
# The peak within the SLO for each way of laying the service over one host's GPUs: this tree's server started in
# each layout in turn (cold, its own Triton cache), swept by perf/loadgen.py with the one-GPU sweep's SLO
# (perf/compare_sweep.sh does each), then one table: each layout's peak, its concurrency, TTFA and underruns, and
# its peak over the one-GPU layout's (the first listed).
#
#   bash perf/scale_sweep.sh          # one GPU; two engines, one a GPU; one engine with its codec on the second GPU
#
# From the repository root, with .whl/ and .gpu/ carried on a machine that cannot install packages. A layout that
# needs more GPUs than the host has is skipped.
#
# Knobs (environment):    default
#   LAYOUTS               "one=cuda:0@64:32:512 two=cuda:0,cuda:1@128:64:1024 split=cuda:0/cuda:1@64:32:512"
#                         NAME=DEVICES[/CODEC_DEVICE]@SWEEP each: `device` (an engine a device), the codec's device
#                         when not beside its engine (`codec_device`), and the levels (loadgen --sweep)
#   SETTINGS              ""          more --set options for every layout's server
#   REQUESTS, LOADGEN_ARGS            as perf/compare_sweep.sh's (requests a level, the load generator's options)
#   CKPT                  /tmp/s2-full
#   OUT                   perf/out/scale_sweep   results: scale_sweep.md / .json, each layout's compare_sweep folder
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-perf/out/scale_sweep}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
LAYOUTS="${LAYOUTS:-one=cuda:0@64:32:512 two=cuda:0,cuda:1@128:64:1024 split=cuda:0/cuda:1@64:32:512}"
PY="${PYTHON:-python3}"
log() { echo "[$(date +%H:%M:%S)] $*"; }
have=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
: > "$OUT/layouts.txt"
for spec in $LAYOUTS; do
  name=${spec%%=*}; rest=${spec#*=}; sweep=${rest#*@}; devs=${rest%@*}
  codec=""; [[ "$devs" == */* ]] && { codec=${devs#*/}; devs=${devs%/*}; }
  need=$(echo "$devs,$codec" | tr ',' '\n' | grep -o 'cuda:[0-9]*' | sort -u | wc -l)
  if [ "$need" -gt "$have" ] && [[ "$devs$codec" == *cuda* ]]; then
    log "$name: skipped, it needs $need GPUs and the host has $have"; continue
  fi
  set_codec=""; [ -n "$codec" ] && set_codec="--set codec_device=$codec"
  log "$name: device=$devs${codec:+ codec_device=$codec}, levels $sweep"
  OUT="$OUT/$name" TREES=final DEVICE="$devs" SWEEP="$sweep" FINAL_SETTINGS="$set_codec ${SETTINGS:-}" \
    bash perf/compare_sweep.sh > "$OUT/$name.log" 2>&1
  grep -h "ready in" "$OUT/$name.log" | sed "s/^/  /"
  echo "$name $devs $codec" >> "$OUT/layouts.txt"
done
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows, base = [], None
for line in (out / "layouts.txt").read_text().splitlines():
    name, devs, *codec = line.split()
    f = out / name / "sweep_final.json"
    sw = json.loads(f.read_text()).get("sweep") if f.is_file() else None
    peak, broken = (sw or {}).get("peak"), (sw or {}).get("broken")
    row = {"layout": name, "device": devs, "codec_device": codec[0] if codec else "beside each engine",
           "peak_audio_s_per_s": peak and peak["audio_s_per_s"], "steady": peak and peak["audio_s_per_s_steady"],
           "concurrency": peak and peak["concurrency"], "ttfa_ms_p99": peak and peak["ttfa_ms_p99"],
           "underruns": peak and peak["underruns"],
           "first_over": broken and f"c={broken['concurrency']}: " + "; ".join(broken["reasons"].values()),
           "error": None if sw else "no sweep (see its log)"}
    base = base if base is not None else row["peak_audio_s_per_s"]
    row["over_first"] = round(row["peak_audio_s_per_s"] / base, 3) if base and row["peak_audio_s_per_s"] else None
    rows.append(row)
(out / "scale_sweep.json").write_text(json.dumps(rows, indent=1))
cols = ["layout", "device", "codec_device", "peak_audio_s_per_s", "steady", "concurrency", "ttfa_ms_p99", "underruns",
        "over_first", "first_over"]
lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
lines += ["| " + " | ".join(str(r[c] if r[c] is not None else (r["error"] or "-")) for c in cols) + " |" for r in rows]
(out / "scale_sweep.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
