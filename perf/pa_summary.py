#!/usr/bin/env python3
"""Markdown summary of perf/run_perf_analyzer.sh's CSV files (pa_<name>_c<C>.csv).

    python perf/pa_summary.py perf/out/pa --meta perf/out/pa_inputs/meta.json [--json summary.json]

Latencies are perf_analyzer's (for the decoupled s2pro: time to the first response; slow_ar: the whole
generation, one answer). The
"work/s" column converts requests/s into the model's unit using meta.json from make_pa_inputs.py:
s2pro -> audio-s/s (frames x 2048 / 44100 per request), slow_ar -> frames/s, fast_ar -> rows/s (one row =
one frame's 9 residual codes), dac_decoder -> audio-s/s decoded.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

FPS = 44100 / 2048


def rows(directory: Path, meta: dict) -> list[dict]:
    out = []
    for f in sorted(directory.glob("pa_*_c*.csv")):
        m = re.fullmatch(r"pa_(.+)_c(\d+)\.csv", f.name)
        if not m:
            continue
        name = m.group(1)
        with f.open() as fh:
            for r in csv.DictReader(fh):
                ips = float(r["Inferences/Second"])
                d = {"run": name, "concurrency": int(r["Concurrency"]), "infer_per_s": round(ips, 3),
                     "responses_per_s": round(float(r["Response Throughput"]), 2) if r.get("Response Throughput") else None,
                     "p50_ms": round(float(r["p50 latency"]) / 1e3, 2), "p99_ms": round(float(r["p99 latency"]) / 1e3, 2),
                     "server_queue_ms": round(float(r["Server Queue"]) / 1e3, 2),
                     "server_compute_ms": round(float(r["Server Compute Infer"]) / 1e3, 2)}
                frames, dec = meta.get("frames"), meta.get("decode_frames")
                if name == "s2pro" and frames:
                    d["work_per_s"], d["work_unit"] = round(ips * frames / FPS, 2), "audio-s/s"
                elif name == "slow_ar" and frames:
                    d["work_per_s"], d["work_unit"] = round(ips * frames, 1), "frames/s"
                elif name.startswith("fast_ar_b"):
                    d["work_per_s"], d["work_unit"] = round(ips * int(name[len("fast_ar_b"):]), 1), "rows/s"
                elif name == "dac_decoder" and dec:
                    d["work_per_s"], d["work_unit"] = round(ips * dec / FPS, 2), "audio-s/s"
                out.append(d)
    order = {"s2pro": 0, "slow_ar": 1, "dac_decoder": 3}
    out.sort(key=lambda d: (order.get(d["run"], 2), d["run"], d["concurrency"]))
    return out


def markdown(rs: list[dict]) -> str:
    cols = ["run", "concurrency", "infer_per_s", "responses_per_s", "work_per_s", "work_unit", "p50_ms", "p99_ms",
            "server_queue_ms", "server_compute_ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rs:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--meta", help="meta.json written by make_pa_inputs.py")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    meta = json.loads(Path(a.meta).read_text()) if a.meta and Path(a.meta).is_file() else {}
    rs = rows(Path(a.dir), meta)
    if a.json:
        Path(a.json).write_text(json.dumps(rs, indent=1))
    print("perf_analyzer (latency of s2pro = time to first response; of slow_ar = its whole generation)\n")
    print(markdown(rs) if rs else "(no perf_analyzer results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
