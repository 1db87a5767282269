#!/usr/bin/env bash
# perf/run_gpu.sh once per settings variant on the same machine (a fresh server each), one table at the end:
#
#   VARIANTS="base=|fixed=adaptive_chunks=false|delay=adaptive_chunks=false codec_queue_delay_us=10000" \
#     bash perf/sweep_settings.sh
#
# VARIANTS: "name=settings|name=settings|..." (settings as run_gpu.sh's SETTINGS; empty = the defaults).
# Other knobs go to run_gpu.sh as they are (CONCURRENCY, default here 16,64; FRAMES; CKPT; DEVICE ...); the clone
# and perf_analyzer phases are off. Results in $OUT: sweep.md (the table), NAME.json (each run's loadgen.json).
# shellcheck source=perf/common.sh
source "$(dirname "$0")/common.sh"  # strict mode, $ROOT as the working directory, $RES
VARIANTS="${VARIANTS:-base=}"
export CONCURRENCY="${CONCURRENCY:-16,64}" CLONE_CONCURRENCY="" PA=0
NAMES=()
IFS='|' read -r -a ITEMS <<<"$VARIANTS"
for item in "${ITEMS[@]}"; do
  name="${item%%=*}" settings="${item#*=}"
  echo "[sweep] == $name: SETTINGS=\"$settings\""
  rm -rf "/tmp/sweep_$name"
  OUT="/tmp/sweep_$name" SETTINGS="$settings" bash perf/run_gpu.sh >"/tmp/sweep_$name.log" 2>&1 \
    || echo "[sweep] $name failed: $(tail -3 "/tmp/sweep_$name.log")"
  cp "/tmp/sweep_$name/loadgen.json" "$RES/$name.json" 2>/dev/null || true
  NAMES+=("$name:$settings")
done
"${PYTHON:-python3}" - "$RES" "${NAMES[@]}" <<'EOF'
import json, sys
from pathlib import Path

res = Path(sys.argv[1])
cols = ["variant", "settings", "c", "ok", "audio_s_per_s", "ttfa_ms_p50", "ttfa_ms_p99", "rtf_mean", "stall_fraction",
        "chunks_per_request_mean", "gpu_util_mean", "gpu_mem_peak_mib"]
lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
for arg in sys.argv[2:]:
    name, settings = arg.split(":", 1)
    f = res / f"{name}.json"
    levels = json.loads(f.read_text())["levels"] if f.is_file() else []
    for lv in levels or [{}]:
        row = {"variant": name, "settings": settings or "(defaults)", "c": lv.get("concurrency", "failed"), **lv}
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
(res / "sweep.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
