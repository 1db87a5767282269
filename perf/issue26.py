#!/usr/bin/env python3
"""Issue 26's targets as one table: this code's run beside the issue's starting code run on the same machine.

    python3 perf/issue26.py RESULTS                 # RESULTS/final and RESULTS/base, as perf/issue26_gpu.sh writes
    python3 perf/issue26.py --final DIR [--base DIR] [--base-name 79c0cdb]

Each tree's folder holds what `perf/issue26_gpu.sh` made there (any part may be missing: its rows read "-"):

    serve/        a perf/run_gpu.sh result (c=1 and c=64 levels, a voice's first use at c=1, the server's ready time,
                  slow_ar's 10-s loop lines in summary.md)
    serve_fp8/    the same with `ar_weights=fp8`, c=1 only
    engine.json   perf/bench_engine.py --batches 1,64 --weights dtype,fp8 (the decode step as one CUDA graph)
    codec.json    perf/bench_codec.py --served-only --paths served --chunk 8 --batches 64 (one call of the held size)
    scale/        perf/scale_gpus.sh with GPUS="2" (scale.json)

A row's status is the final code's against the issue's target (`met` / `NOT met` / `not run`); the issue names an
H100, so the card (in serve/summary.md) is part of the result. Frames a step is slow_ar's busiest 10-s window of the
c=64 level (its loop line's "making N frames each"); the codec's share of a 64-frame step is one call of 64 streams x
8 frames over the 8 steps whose frames it decodes; an fp8 RTF without a served fp8 run is the engine's step alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

FRAMES = re.compile(r"last [\d.]+ s: (\d+) steps of [\d.]+ ms making ([\d.]+) frames each")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from targets import MIB_GB, levels, ready_s  # noqa: E402 - a run_gpu.sh folder's levels and ready time, read alike


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _engine(rows, weights: str, batch: int) -> dict | None:
    """Of bench_engine's rows, the one for these weights (its `weights` starts with "dtype" or "fp8") and rows a
    step: the default variant, with CUDA graphs."""
    if not isinstance(rows, list):
        return None
    return next((r for r in rows if str(r.get("weights", "")).split(" ")[0] == weights and r.get("batch") == batch
                 and r.get("variant") in (None, "", "default") and r.get("graphs", True)), None)


def measures(tree: Path) -> dict[str, float | None]:
    """The numbers of one tree's folder (see the module's doc), None where its part is missing."""
    serve = tree / "serve"
    plain = levels(serve / "loadgen.json")
    c1, c64 = plain.get(1), plain.get(64)
    first = levels(serve / "loadgen_clone_first.json").get(1)
    fp8 = levels(tree / "serve_fp8" / "loadgen.json").get(1)
    out: dict[str, float | None] = {
        "c1_ttfa_p50": c1 and c1.get("ttfa_ms_p50"), "c1_rtf": c1 and c1.get("rtf_mean"),
        "c64_audio": c64 and c64.get("audio_s_per_s"), "c64_ttfa_p99": c64 and c64.get("ttfa_ms_p99"),
        "c64_ok": c64 and c64.get("ok"), "c64_requests": c64 and c64.get("requests"),
        "c64_errors": c64 and c64.get("errors"),
        "clone_first_ttfa_p50": first and first.get("ttfa_ms_p50"),
        "fp8_rtf_served": fp8 and fp8.get("rtf_mean"),
    }
    served = [lv for lv in (c1, c64) if lv]
    out["dry"] = None if c64 is None else sum(round((lv.get("stall_fraction") or 0) * lv["ok"]) for lv in served)
    out["dry_of"] = None if c64 is None else sum(lv["ok"] for lv in served)
    peak = c64 and c64.get("gpu_mem_peak_mib")
    out["c64_mem_gb"] = peak * MIB_GB if isinstance(peak, (int, float)) else None
    summary = serve / "summary.md"
    windows = [float(m.group(2)) for m in FRAMES.finditer(summary.read_text(errors="replace"))] \
        if summary.is_file() else []
    out["frames_a_step"] = max(windows) if windows and c64 else None
    out["ready_s"] = ready_s(serve / "run.log")
    engine = _json(tree / "engine.json")
    step1, step64, fp8_1 = _engine(engine, "dtype", 1), _engine(engine, "dtype", 64), _engine(engine, "fp8", 1)
    out["step_1"] = step1 and step1.get("full_step_ms")
    out["step_64"] = step64 and step64.get("full_step_ms")
    out["fp8_step_1"] = fp8_1 and fp8_1.get("full_step_ms")
    out["fp8_rtf_engine"] = fp8_1 and fp8_1.get("stream_rtf")
    codec = _json(tree / "codec.json")
    calls = [r for r in codec if r.get("batch") == 64 and r.get("chunk_frames") == 8 and "wall_ms" in r] \
        if isinstance(codec, list) else []
    out["codec_share"] = min(r["wall_ms"] for r in calls) / 8 if calls else None
    scale = _json(tree / "scale" / "scale.json")
    two = next((r for r in scale if r.get("engines") == 2), None) if isinstance(scale, list) else None
    out["two_gpu_audio"] = two and two.get("audio_s_per_s")
    out["two_gpu_c"] = two and two.get("concurrency")
    return out


def _f(v, fmt="{:g}", unit=""):
    return "-" if v is None else fmt.format(v) + unit


def rows(final: dict, base: dict | None) -> list[tuple[str, str, str, str]]:
    """(target, the base's measure, the final's, the final's status) for each of the issue's targets."""
    base = base or {}
    out = []

    def row(target, key, ok, fmt="{:g}", unit="", text=None):
        show = text or (lambda m: _f(m.get(key), fmt, unit))
        v = final.get(key)
        status = "not run" if v is None else "met" if ok(v) else "NOT met"
        out.append((target, show(base) if base else "-", show(final), status))

    row("c=1 decode step <= 5.5 ms at one row", "step_1", lambda v: v <= 5.5, "{:.2f}", " ms")
    row("c=1 RTF <= 0.12 (served, mean)", "c1_rtf", lambda v: v <= 0.12, "{:.4f}")
    row("c=1 TTFA p50 <= 30 ms", "c1_ttfa_p50", lambda v: v <= 30, "{:.1f}", " ms")
    row("c=64 >= 300 audio-s/s (100-frame requests)", "c64_audio",
        lambda v: v >= 300 and not final.get("c64_errors"),
        text=lambda m: "-" if m.get("c64_audio") is None else
        f"{m['c64_audio']:g} ({m['c64_ok']}/{m['c64_requests']} requests)")
    row("c=64 frames a step >= 58 (slow_ar's busiest 10 s)", "frames_a_step", lambda v: v >= 58, "{:.1f}")
    row("c=64 TTFA p99 <= 400 ms", "c64_ttfa_p99", lambda v: v <= 400, "{:.1f}", " ms")
    row("no underrun at any level", "dry", lambda v: v == 0,
        text=lambda m: "-" if m.get("dry") is None else f"{m['dry']} of {m['dry_of']} ran dry")
    row("step at 64 rows <= 7.5 ms", "step_64", lambda v: v <= 7.5, "{:.2f}", " ms")
    row("codec's share of a 64-frame step <= 2.4 ms (64 x 8 frames a call / 8)", "codec_share", lambda v: v <= 2.4,
        "{:.2f}", " ms")
    fp8 = "fp8_rtf_served" if final.get("fp8_rtf_served") is not None else "fp8_rtf_engine"
    row("`ar_weights=fp8`: c=1 RTF <= 0.08" + ("" if fp8 == "fp8_rtf_served" else " (the engine's step alone)"), fp8,
        lambda v: v <= 0.08, text=lambda m: "-" if m.get(fp8) is None else
        f"{m[fp8]:.4f}" + (f" (step {m['fp8_step_1']:.2f} ms)" if m.get("fp8_step_1") is not None else ""))
    row("two GPUs of one host >= 500 audio-s/s at c=128", "two_gpu_audio", lambda v: v >= 500,
        text=lambda m: "-" if m.get("two_gpu_audio") is None else f"{m['two_gpu_audio']:g} at c={m['two_gpu_c']}")
    row("c=64 peak GPU memory <= 30 GB (all models, default KV pool)", "c64_mem_gb", lambda v: v <= 30, "{:.1f}",
        " GB")
    row("ready <= 45 s", "ready_s", lambda v: v <= 45, "{:.1f}", " s")
    row("voice clone first use <= 120 ms at c=1 (10 s reference)", "clone_first_ttfa_p50", lambda v: v <= 120,
        "{:.1f}", " ms")
    return out


def markdown(final: Path, base: Path | None, base_name: str = "main at the issue's start") -> str:
    table = rows(measures(final), measures(base) if base is not None and base.is_dir() else None)
    lines = [f"| target | {base_name} | this code | status |", "|---|---|---|---|"]
    lines += [f"| {t} | {b} | {f} | {s} |" for t, b, f, s in table]
    for name, tree in (("this code", final), (base_name, base)):  # what each ran (perf/issue26_gpu.sh's tree.txt)
        said = tree / "tree.txt" if tree is not None else None
        if said is not None and said.is_file():
            lines.append(f"\n{name}: {said.read_text().strip()}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", type=Path, help="a folder with final/ and base/ (perf/issue26_gpu.sh's OUT)")
    ap.add_argument("--final", type=Path)
    ap.add_argument("--base", type=Path)
    ap.add_argument("--base-name", default="main at the issue's start (79c0cdb)")
    args = ap.parse_args(argv)
    final = args.final or (args.results / "final" if args.results else None)
    base = args.base or (args.results / "base" if args.results else None)
    if final is None or not final.is_dir():
        print(f"{final}: no such folder: give RESULTS (with final/ and base/) or --final DIR", file=sys.stderr)
        return 2
    print(markdown(final, base, args.base_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
