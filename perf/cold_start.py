#!/usr/bin/env python3
"""Where a cold start's time goes: slow_ar's engine (the AR's weights, the in-engine codec, the KV pool, the CUDA
graphs) built in this process exactly as the served model builds it (`engine.build.serve_engine` on the settings a
rendered repository gives slow_ar), with Triton's kernel cache in a fresh folder (every kernel compiled: a fresh
machine's start) unless --cache names one, and every Triton compile recorded: which kernel, how long, in which
part of the start.

    python3 perf/cold_start.py --checkpoint /tmp/s2-full --json cold.json
    python3 perf/cold_start.py --checkpoint /tmp/s2-full --set max_batch=64 --cache /tmp/tcache   # twice: warm

Prints the start's parts (the server's own "ready in" figures), the compiles by part and the kernels that took
longest. --variant MODULE.NAME=VALUE sets a module attribute first (a kernel table, say) to see what it changes.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class CompileLog:
    """Every Triton compile of this process: (kernel, seconds, the part of the start it fell in)."""

    def __init__(self):
        self.records: list[tuple[str, float, str]] = []
        self.part = "before the codec"
        self.lock = threading.Lock()

    def within(self, fn, part: str):
        """fn, its compiles counted in this part of the current one ("captures" -> `part`)."""
        def call(*a, **k):
            outer, self.part = self.part, self.part.replace("captures", part)
            try:
                return fn(*a, **k)
            finally:
                self.part = outer
        return call

    def wrap(self, compile_fn):
        def compile(src, *args, **kwargs):
            t = time.perf_counter()
            try:
                return compile_fn(src, *args, **kwargs)
            finally:
                name = getattr(getattr(src, "fn", None), "__name__", None) or type(src).__name__
                with self.lock:
                    self.records.append((name, time.perf_counter() - t, self.part))
        return compile

    def summary(self, top: int) -> dict:
        parts, kernels = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
        for name, s, part in self.records:
            parts[part][0] += 1
            parts[part][1] += s
            kernels[name][0] += 1
            kernels[name][1] += s
        slow = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
        return {"compiles": len(self.records), "compile_s": round(sum(r[1] for r in self.records), 2),
                "by_part": {p: {"compiles": n, "compile_s": round(s, 2)} for p, (n, s) in parts.items()},
                "kernels": {k: {"compiles": n, "compile_s": round(s, 2)} for k, (n, s) in slow}}


def set_variant(text: str) -> None:
    """'s2tts.codec.kernels.CONV_NWC_BY_SHAPE=False' -> that module attribute set (a literal value)."""
    target, eq, value = text.partition("=")
    module, dot, name = target.rpartition(".")
    if not (eq and dot):
        raise SystemExit(f"--variant {text!r}: give MODULE.NAME=VALUE, e.g. s2tts.codec.kernels.CONV_NWC_BY_SHAPE=False")
    setattr(importlib.import_module(module), name, ast.literal_eval(value))


def slow_ar_values(checkpoint: str, device: str, given: dict[str, str]):
    """The settings slow_ar reads, from a repository rendered as the server renders it (sizes from the GPU)."""
    from s2tts import settings as schema
    from s2tts.repository import render_model_repository
    from s2tts.sizing import with_gpu_sizes

    sets, line = with_gpu_sizes({"checkpoint": checkpoint, "device": device, **given})
    if line:
        print(line)
    repo = render_model_repository(Path(tempfile.mkdtemp(prefix="s2tts-cold-")) / "repo", sets)
    from google.protobuf import json_format
    from s2tts.repository import parse_model_config

    cfg = json_format.MessageToDict(parse_model_config(repo / "slow_ar" / "config.pbtxt"),
                                    preserving_proto_field_name=True)
    return schema.model_values(cfg, "slow_ar")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a server setting (as --set)")
    ap.add_argument("--cache", help="Triton's kernel cache folder (default: a new one, so every kernel compiles)")
    ap.add_argument("--variant", action="append", default=[], metavar="MODULE.NAME=VALUE")
    ap.add_argument("--top", type=int, default=12, help="kernels listed, the longest compiling first")
    ap.add_argument("--json")
    args = ap.parse_args()

    os.environ["TRITON_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="s2tts-triton-cache-")
    started = time.perf_counter()
    import triton.compiler  # a JITFunction takes `compile` from here at its first launch

    compiles = CompileLog()
    triton.compiler.compile = compiles.wrap(triton.compiler.compile)
    from s2tts.engine import build
    from s2tts.gpu import jit
    from s2tts.perf_tools import exit_now

    for v in args.variant:
        set_variant(v)
    jit.compile_ahead = compiles.within(jit.compile_ahead, "side by side")  # the warm-ups', apart from the captures'
    if hasattr(jit, "compile_only"):  # (absent from older trees, which this tool can measure too)
        jit.compile_only = compiles.within(jit.compile_only, "compiles alone")
    engine_codec = build._engine_codec

    def codec(*a, **k):
        compiles.part = "codec: captures"
        try:
            return engine_codec(*a, **k)
        finally:
            compiles.part = "engine: captures"

    build._engine_codec = codec
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("s2tts").addHandler(Keep())
    logging.getLogger("s2tts").setLevel(logging.INFO)
    v = slow_ar_values(args.checkpoint, args.device, dict(s.split("=", 1) for s in args.set))
    imports_s = time.perf_counter() - started
    t = time.perf_counter()
    service = build.serve_engine(v, lambda *a, **k: None, lambda e: None, "slow_ar")
    ready_s = time.perf_counter() - t
    runner = service.engine.runner
    out = {"imports_and_render_s": round(imports_s, 2), "ready_s": round(ready_s, 2),
           "engine_warm_s": {k: round(s, 2) for k, s in runner.warm_s.items()},
           "codec_making_s": {k: round(s, 2) for k, (s, _) in (service.codec.making if service.codec else {}).items()},
           "graphs": len(runner.graphs) + len(runner.sample_graphs), "cache": os.environ["TRITON_CACHE_DIR"],
           "variants": args.variant, "settings": args.set, **compiles.summary(args.top),
           "log": [s for s in lines if "ready in" in s or "codec in the engine" in s]}
    print(f"ready in {ready_s:.1f} s (imports and settings {imports_s:.1f} s); engine {out['engine_warm_s']}; codec "
          f"{out['codec_making_s']}")
    print(f"{out['compiles']} Triton compiles, {out['compile_s']:.1f} s of compiling (summed over threads)")
    print("| part | compiles | compile s |\n|---|---|---|")
    for part, d in out["by_part"].items():
        print(f"| {part} | {d['compiles']} | {d['compile_s']:.1f} |")
    print("| kernel | compiles | compile s |\n|---|---|---|")
    for name, d in out["kernels"].items():
        print(f"| {name} | {d['compiles']} | {d['compile_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    exit_now(0)


if __name__ == "__main__":
    sys.exit(main())
