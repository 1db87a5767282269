#!/usr/bin/env python3
"""What the in-engine codec's start costs, and what its held call then takes: the stream decoder made as slow_ar
makes it (`open_stream_decoder`: fp16 with the fp32 fallback on a GPU, 2 x max_batch stream slots, the chunk
lengths of the default settings, at most max_batch x codec_batch_steps frames a call) with an empty Triton cache,
so every kernel it needs is compiled as on a fresh machine.

    python3 perf/codec_start.py --checkpoint /tmp/s2-full --json start.json

Prints one JSON line: seconds to make it (and each part's, as slow_ar's log line), the Triton kernels compiled
(entries in the fresh cache), and the wall milliseconds of a held call (`--streams` streams x `--frames` frames,
numpy in and out, as the engine's loop calls it; median of `--calls` after a first call). On a CPU (tiny checkpoint)
a smoke test: no kernel is compiled there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def print_json(rep: dict, path: str | None) -> int:
    """Print the report as one JSON line, also into `path` if given -> 0 (the exit status)."""
    line = json.dumps(rep)
    print(line)
    if path:
        Path(path).write_text(line + "\n")
    return 0


def random_chunk_jobs(rng, C: int, streams: int, frames: int, start: bool) -> list:
    """`StreamDecoder.decode_many`'s jobs for one chunk of `frames` random codes on each of `streams` streams
    (`s0`, `s1` ...; code 0 below 64, the others below 32: within the tiny checkpoint's codebooks too)."""
    import numpy as np

    return [(k, f"s{k}", np.concatenate([rng.integers(0, 64, (frames, 1)), rng.integers(0, 32, (frames, C - 1))], axis=1),
             start, False) for k in range(streams)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=8, help="frames a stream a call (codec_batch_steps)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache  # before triton is imported: every kernel compiles here
    import numpy as np
    import torch

    from s2tts import settings
    from s2tts.codec.stream import open_stream_decoder
    from s2tts.engine.service import EngineService

    d = settings.SCHEMA
    K = d["codec_batch_steps"].default
    lengths = EngineService.codec_lengths(d["first_chunk_frames"].default, d["chunk_frames"].default, K)
    t0 = time.monotonic()
    dec, dtype, graphs = open_stream_decoder(a.checkpoint, a.device, "auto", 2 * a.max_batch, 600.0, lengths,
                                             a.max_batch, a.max_batch * K)
    made_s = time.monotonic() - t0
    compiled = sum(1 for p in Path(cache).rglob("*.json") if not p.name.startswith("__grp__"))
    rng = np.random.default_rng(0)
    C = dec.C
    ms = []
    for call in range(a.calls + 1):
        jobs = random_chunk_jobs(rng, C, a.streams, a.frames, call == 0)
        t = time.perf_counter()
        out = dec.decode_many(jobs, now=float(call))
        ms.append(1e3 * (time.perf_counter() - t))
        assert all(isinstance(v, np.ndarray) and np.isfinite(v).all() for v in out.values()), "a chunk failed"
    rep = {"device": str(dec.device), "gpu": torch.cuda.get_device_name(dec.device) if dec.device.type == "cuda" else None,
           "dtype": dtype, "lengths": lengths, "graphs": graphs, "made_s": round(made_s, 2),
           "parts_s": {k: round(s, 2) for k, (s, _) in dec.making.items()}, "kernels_compiled": compiled,
           "streams": a.streams, "frames": a.frames, "call_ms_median": round(float(np.median(ms[1:])), 2),
           "first_call_ms": round(ms[0], 2)}
    return print_json(rep, a.json)


if __name__ == "__main__":
    sys.exit(main())
