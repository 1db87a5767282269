#!/usr/bin/env python3
"""Where a cold start's time goes: slow_ar's engine (the AR's weights, the in-engine codec, the KV pool, the CUDA
graphs) built in this process exactly as the served model builds it (`engine.build.serve_engine` on the settings a
rendered repository gives slow_ar), with Triton's kernel cache in a fresh folder (every kernel compiled: a fresh
machine's start) unless --cache names one, and every Triton compile recorded: which kernel, how long, in which
part of the start (those compiled in worker processes, `gpu.compile_workers`, also as "<part> in workers": from
the request to the answer).

    python3 perf/cold_start.py --checkpoint /tmp/s2-full --json cold.json
    python3 perf/cold_start.py --checkpoint /tmp/s2-full --set max_batch=64 --cache /tmp/tcache   # twice: warm

Prints the start's parts (the server's own "ready in" figures), the compiles by part (and how many ran at once) and
the kernels that took longest; --stacks also where the main thread spent each part. --variant MODULE.NAME=VALUE
sets a module attribute first (a kernel table, a switch) to see what it changes.
"""

from __future__ import annotations

import argparse
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
    """Every Triton compile of this process: (kernel, seconds, the part of the start it fell in, its start on
    `time.perf_counter`)."""

    def __init__(self):
        self.records: list[tuple[str, float, str, float]] = []
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

    def add(self, src, started: float, part: str) -> None:
        """A compile of `src` from `started` until now, in `part`."""
        name = getattr(getattr(src, "fn", None), "__name__", None) or type(src).__name__
        with self.lock:
            self.records.append((name, time.perf_counter() - started, part, started))

    def workers(self, compile_fn):
        """`CompileWorkers.compile` recorded as a compile in a worker (its part + " in workers"), from its request
        to its answer."""
        def compile(workers, src, *args, **kwargs):
            t = time.perf_counter()
            done = compile_fn(workers, src, *args, **kwargs)
            if done:
                self.add(src, t, self.part + " in workers")
            return done
        return compile

    def wrap(self, compile_fn):
        def compile(src, *args, **kwargs):
            t = time.perf_counter()
            try:
                return compile_fn(src, *args, **kwargs)
            finally:
                self.add(src, t, self.part)
        return compile

    @staticmethod
    def busy_s(spans: list[tuple[float, float]]) -> float:
        """The time within which at least one of the (start, end) spans ran."""
        busy, reach = 0.0, float("-inf")
        for a, b in sorted(spans):
            busy += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        return busy

    def summary(self, top: int) -> dict:
        """Compiles and their summed seconds by part and by kernel; each part's `busy_s` (the wall time in which a
        compile of it ran) and `threads` (summed over busy: how many compiled at once on average)."""
        parts, kernels = defaultdict(lambda: [0, 0.0, []]), defaultdict(lambda: [0, 0.0])
        for name, s, part, t in self.records:
            parts[part][0] += 1
            parts[part][1] += s
            parts[part][2].append((t, t + s))
            kernels[name][0] += 1
            kernels[name][1] += s
        slow = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]

        def part(n, s, spans):
            busy = self.busy_s(spans)
            return {"compiles": n, "compile_s": round(s, 2), "busy_s": round(busy, 2),
                    "threads": round(s / busy, 2) if busy else 0.0}
        return {"compiles": len(self.records), "compile_s": round(sum(r[1] for r in self.records), 2),
                "by_part": {p: part(*v) for p, v in parts.items()},
                "kernels": {k: {"compiles": n, "compile_s": round(s, 2)} for k, (n, s) in slow}}


class Stacks:
    """Where the main thread is, sampled every `interval` s by part of the start (`CompileLog.part`): its innermost
    frame and the innermost frame of this package's code above it."""

    def __init__(self, log: CompileLog, interval: float = 0.005):
        self.log, self.interval, self.main = log, interval, threading.main_thread().ident
        self.counts: dict[str, dict[tuple[str, str], int]] = defaultdict(lambda: defaultdict(int))
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(self.interval):
            f = sys._current_frames().get(self.main)
            if f is None:
                continue
            inner, ours = f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}", "-"
            while f is not None:
                if f"{os.sep}s2tts{os.sep}" in f.f_code.co_filename:
                    ours = f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}:{f.f_lineno}"
                    break
                f = f.f_back
            self.counts[self.log.part][(inner, ours)] += 1

    def stop(self, top: int) -> dict:
        """-> {part: [[seconds, innermost frame, this package's frame], ...]}, the most seconds first."""
        self.done.set()
        self.thread.join()
        return {part: [[round(n * self.interval, 2), *k] for k, n in sorted(c.items(), key=lambda kv: -kv[1])[:top]]
                for part, c in self.counts.items()}


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
    ap.add_argument("--stacks", action="store_true", help="sample where the main thread is, by part of the start")
    ap.add_argument("--json")
    args = ap.parse_args()

    os.environ["TRITON_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="s2tts-triton-cache-")
    started = time.perf_counter()
    import triton.compiler  # a JITFunction takes `compile` from here at its first launch

    compiles = CompileLog()
    triton.compiler.compile = compiles.wrap(triton.compiler.compile)
    from s2tts.engine import build
    from s2tts.gpu import jit
    from s2tts import perf_tools

    set_variant = getattr(perf_tools, "set_variant", None)  # (absent from older trees: no --variant there)
    if args.variant and set_variant is None:
        raise SystemExit("--variant: this tree's s2tts.perf_tools has no set_variant")

    for v in args.variant:
        set_variant(v)
    if hasattr(jit, "compile_ahead"):  # (older trees: warm-ups run side by side)
        jit.compile_ahead = compiles.within(jit.compile_ahead, "side by side")  # apart from the captures'
    if hasattr(jit, "compile_only"):  # (absent from older trees, which this tool can measure too)
        jit.compile_only = compiles.within(jit.compile_only, "compiles alone")
    if hasattr(jit, "compile_workers"):
        from s2tts.gpu.compile_workers import CompileWorkers

        CompileWorkers.compile = compiles.workers(CompileWorkers.compile)
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
    stacks = Stacks(compiles) if args.stacks else None
    t = time.perf_counter()
    service = build.serve_engine(v, lambda *a, **k: None, lambda e: None, "slow_ar")
    ready_s = time.perf_counter() - t
    where = stacks.stop(args.top) if stacks else {}
    runner = service.engine.runner
    out = {"imports_and_render_s": round(imports_s, 2), "ready_s": round(ready_s, 2),
           "engine_warm_s": {k: round(s, 2) for k, s in runner.warm_s.items()},
           "codec_making_s": {k: round(s, 2) for k, (s, _) in (service.codec.making if service.codec else {}).items()},
           "graphs": len(runner.graphs) + len(runner.sample_graphs), "cache": os.environ["TRITON_CACHE_DIR"],
           "variants": args.variant, "settings": args.set, **compiles.summary(args.top),
           "log": [s for s in lines if "ready in" in s or "codec in the engine" in s], "stacks": where}
    print(f"ready in {ready_s:.1f} s (imports and settings {imports_s:.1f} s); engine {out['engine_warm_s']}; codec "
          f"{out['codec_making_s']}")
    print(f"{out['compiles']} Triton compiles, {out['compile_s']:.1f} s of compiling (summed over threads)")
    print("| part | compiles | compile s | wall s compiling | at once |\n|---|---|---|---|---|")
    for part, d in out["by_part"].items():
        print(f"| {part} | {d['compiles']} | {d['compile_s']:.1f} | {d['busy_s']:.1f} | {d['threads']:.1f} |")
    print("| kernel | compiles | compile s |\n|---|---|---|")
    for name, d in out["kernels"].items():
        print(f"| {name} | {d['compiles']} | {d['compile_s']:.1f} |")
    for part, rows in where.items():
        print(f"| {part}: main thread's s | innermost frame | this package's frame |\n|---|---|---|")
        for sec, inner, ours in rows:
            print(f"| {sec:.2f} | {inner} | {ours} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    perf_tools.exit_now(0)


if __name__ == "__main__":
    sys.exit(main())
