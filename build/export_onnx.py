#!/usr/bin/env python3
"""Export the ONNX graphs of a checkpoint and check each against PyTorch with onnxruntime (CPU).

    python build/export_onnx.py --checkpoint checkpoints/tiny --out build/onnx
    python build/export_onnx.py --checkpoint /models/s2-pro --out /models/s2-pro/engines --stream-frames 1,16,32

Writes OUT/<graph>.onnx, OUT/manifest.json (inputs, outputs, TensorRT profile shapes, decoder
state layout) and OUT/check_report.json; prints one line per check and what the TensorRT 10
operator table says about each graph. Exits 1 when a check fails. See docs/TENSORRT.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2tts.export.checks import check_exports, tensorrt_lint  # noqa: E402
from s2tts.export.driver import Profiles, export_all  # noqa: E402
from s2tts.export.onnx_graphs import GRAPHS  # noqa: E402


def _triple(text: str) -> tuple[int, int, int]:
    parts = tuple(int(p) for p in text.split(","))
    if len(parts) != 3 or not (1 <= parts[0] <= parts[1] <= parts[2]):
        raise argparse.ArgumentTypeError(f"{text!r}: give MIN,OPT,MAX with 1 <= MIN <= OPT <= MAX")
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="S2 Pro checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory (ONNX files + manifest.json)")
    ap.add_argument("--graphs", default=",".join(GRAPHS), help=f"comma-separated subset of {','.join(GRAPHS)}")
    ap.add_argument("--no-check", action="store_true", help="export only, skip the onnxruntime checks")
    ap.add_argument("--max-positions", type=int, default=32768,
                    help="frames a decoder stream may reach (RoPE table length; the encoder gets half, in its own positions)")
    for f in dataclasses.fields(Profiles):
        ap.add_argument("--" + f.name.replace("_", "-"), type=_triple, default=None, metavar="MIN,OPT,MAX",
                        help=f"TensorRT profile range (default {','.join(map(str, f.default))})")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    profiles = Profiles(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Profiles) if getattr(args, f.name)})
    out = Path(args.out)
    t0 = time.monotonic()
    try:
        export_all(args.checkpoint, out, graphs, profiles, max_positions=args.max_positions)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {len(graphs)} graphs to {out} in {time.monotonic() - t0:.1f} s")
    for g in graphs:
        problems = tensorrt_lint(out / f"{g}.onnx")
        note = " (expected: this graph is for onnxruntime only; TensorRT gets fast_ar)" if problems and g == "fast_ar_seeded" else ""
        print(f"TensorRT 10 operator table, {g}: {'no problem found' if not problems else '; '.join(problems)}{note}")
    if args.no_check:
        return 0
    checks = check_exports(out, args.checkpoint, graphs=graphs)
    for c in checks:
        print(c.line())
    report = [{"graph": c.graph, "metric": c.metric, "value": c.value, "limit": c.limit, "ok": c.ok, **c.detail} for c in checks]
    (out / "check_report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
