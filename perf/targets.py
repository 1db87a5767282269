#!/usr/bin/env python3
"""The serving targets, filled in from one `perf/run_gpu.sh` result directory: one markdown table.

    python3 perf/targets.py perf/out            # loadgen.json, loadgen_clone.json, run.log, determinism.jsonl there

Each row: the target, what the run measured, and `met` / `NOT met` / `not run` (the level or phase was not in
the run). A voice's first use is `loadgen_clone_first.json`: run_gpu.sh's phase of audio clones whose every reference
clip is new to the server (`loadgen.py --clone-mode audio --fresh-references`: encoded by dac_encoder, its prefix
prefilled). run_gpu.sh writes the table to targets.md and appends it to summary.md; `DETERMINISM=1` adds the
determinism phase (`perf/determinism.py`). The numbers are the run's own: the card, the settings and the commit are in
summary.md beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PEAK_TARGET = 800  # audio-s/s at the highest concurrency a sweep finds within its SLO


def loadgen_result(path: Path) -> dict:
    """A loadgen JSON ({} when the phase did not run)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def levels(result: dict) -> dict[int, dict]:
    """A loadgen result's levels by concurrency."""
    return {lv["concurrency"]: lv for lv in result.get("levels", [])}


def _status(ok: bool | None) -> str:
    return "not run" if ok is None else "met" if ok else "NOT met"


def ready_s(run_log: Path) -> float | None:
    if not run_log.is_file():
        return None
    m = re.findall(r"tritonserver ready in ([\d.]+) s", run_log.read_text(errors="replace"))
    return float(m[-1]) if m else None


def _determinism(path: Path) -> dict[str, dict]:
    """determinism.py's JSON lines by mode ("default", "batch_invariant")."""
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("{"):
                row = json.loads(line)
                out[row.get("mode", "?")] = row
    return out


def rows(res: Path) -> list[tuple[str, str, str]]:
    run = loadgen_result(res / "loadgen.json")
    plain, clone = levels(run), levels(loadgen_result(res / "loadgen_clone.json"))
    first_use = levels(loadgen_result(res / "loadgen_clone_first.json"))  # every reference new to the server (see the doc)
    out = []

    def level_row(target, c, text, ok, levels=plain):
        lv = levels.get(c)
        out.append((target, text(lv) if lv else "-", _status(ok(lv) if lv else None)))

    def ttfa_p50(limit_ms):
        return lambda lv: lv["ttfa_ms_p50"] is not None and lv["ttfa_ms_p50"] <= limit_ms

    sweep = run.get("sweep")
    if sweep is None:
        out.append((f"peak within the SLO >= {PEAK_TARGET} audio-s/s (a sweep)", "-", _status(None)))
    else:
        pk, br = sweep.get("peak"), sweep.get("broken")
        why = f"; first over the SLO: c={br['concurrency']}" if br else ""
        text = (f"{pk['audio_s_per_s']} audio-s/s at c={pk['concurrency']}, TTFA p99 {pk['ttfa_ms_p99']} ms{why}"
                if pk else f"no level within the SLO{why}")
        out.append((f"peak within the SLO >= {PEAK_TARGET} audio-s/s (a sweep)", text,
                    _status(pk is not None and pk["audio_s_per_s"] >= PEAK_TARGET)))
    level_row("c=64 throughput >= 450 audio-s/s", 64, lambda lv: f"{lv['audio_s_per_s']} audio-s/s over "
              f"{lv['ok']}/{lv['requests']} requests", lambda lv: lv["audio_s_per_s"] >= 450 and lv["errors"] == 0)
    level_row("c=64 TTFA p99 <= 1 s", 64, lambda lv: f"{lv['ttfa_ms_p99']} ms (p50 {lv['ttfa_ms_p50']})",
              lambda lv: lv["ttfa_ms_p99"] is not None and lv["ttfa_ms_p99"] <= 1000)
    if plain:
        stalls = {c: lv.get("stall_fraction") for c, lv in sorted(plain.items())}
        dry = {c: round((s or 0) * plain[c]["ok"]) for c, s in stalls.items()}
        out.append(("no underrun at every level up to c=64",
                    ", ".join(f"c={c}: {dry[c]} of {plain[c]['ok']}" for c in stalls),
                    _status(all(not s for s in stalls.values()) if 64 in plain else None)))
    else:
        out.append(("no underrun at every level up to c=64", "-", _status(None)))
    p50 = lambda lv: f"{lv['ttfa_ms_p50']} ms"  # noqa: E731
    level_row("c=1 TTFA p50 <= 15 ms", 1, p50, ttfa_p50(15))
    level_row("c=1 RTF <= 0.09", 1, lambda lv: f"{lv['rtf_mean']} (mean; p50 {lv['rtf_p50']})",
              lambda lv: lv["rtf_mean"] is not None and lv["rtf_mean"] <= 0.09)
    level_row("voice clone c=1, voice seen: TTFA p50 <= 50 ms", 1, p50, ttfa_p50(50), clone)
    level_row("voice clone c=1, first use of a 10 s reference: TTFA p50 <= 150 ms", 1, p50, ttfa_p50(150), first_use)
    ready = ready_s(res / "run.log")
    out.append(("server ready <= 30 s", "-" if ready is None else f"{ready:g} s", _status(None if ready is None
                                                                                         else ready <= 30)))
    level_row("first wave of 16: no stream waits on a first use (c=16 first traffic after c=1)", 16,
              lambda lv: f"TTFA p50 {lv['ttfa_ms_p50']} / p99 {lv['ttfa_ms_p99']} ms, stalls {lv['stall_fraction']}",
              lambda lv: not lv.get("stall_fraction") and lv["errors"] == 0)
    det = _determinism(res / "determinism.jsonl").get("batch_invariant")
    if det is None:
        out.append(("seeded determinism (bf16, alone vs beside others), batch_invariant=true", "-", _status(None)))
    else:
        full = det.get("step_ms_{}".format(det["max_batch"]))
        out.append(("seeded determinism (bf16, alone vs beside others), batch_invariant=true",
                    f"{det['changed']} of {det['checked_alone']} changed beside {det['requests'] - 1} others (step "
                    f"{det['step_ms_1']} ms at 1 live, {full} at {det['max_batch']})", _status(det["changed"] == 0)))
    return out


def markdown(res: Path) -> str:
    lines = ["| target | measured | status |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {s} |" for t, m, s in rows(res)]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a perf/run_gpu.sh result directory")
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        print(f"{args.results} is not a directory: give the OUT of a perf/run_gpu.sh run", file=sys.stderr)
        return 2
    print(markdown(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
