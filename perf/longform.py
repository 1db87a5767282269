#!/usr/bin/env python3
"""Long-form speech and dialogue through a running server (issue 11): one long text and one two-speaker dialogue,
each one request streamed over gRPC, with the real-time factor and GPU memory over time.

    python perf/longform.py --url 127.0.0.1:8001 --minutes 10 --turns 20 --json longform.json

1. text: unique sentences (~60 bytes) cut by the server into segments of `--chunk-length` bytes; every segment
   generates `--segment-frames` frames (`ignore_eos`: random weights never say when to stop), so the request makes
   `--minutes` of audio. Per minute of audio: the wall time it took (RTF of that minute), and whether playback from
   the first chunk would have run dry.
2. dialogue: `--turns` turns alternating `<|speaker:0|>` / `<|speaker:1|>`, two voices (synthetic references encoded
   once by dac_encoder), `--turn-frames` frames per segment.
Both: TTFA, overall RTF, longest gap between chunks, underrun, the server's stats (frames, finish reason), and GPU
memory (sum over GPUs, sampled every second) from the start to the end of the request. Prints one JSON line per
phase and writes `--json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import GpuMonitor, _stall, reference_waveform  # noqa: E402

FPS = 44100 / 2048  # frames per second of audio
WORDS = ["river", "quiet", "morning", "lantern", "harbor", "paper", "silver", "garden", "thunder", "window", "copper",
         "meadow", "violin", "station", "orchard", "glacier", "candle", "signal", "marble", "feather"]


def sentence(i: int) -> str:
    w = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(5)]
    return f"Sentence {i} tells of the {w[0]} {w[1]} near the {w[2]}, and a {w[3]} {w[4]}. "


def long_text(segments: int, chunk_length: int) -> str:
    """Enough sentences for `segments` segments of `chunk_length` bytes, as the server will cut them."""
    from s2tts.frontend.segment import batches

    n = max(1, segments * chunk_length // 60)
    while len(batches(text := "".join(sentence(i) for i in range(n)), chunk_length)) < segments:
        n += max(1, n // 20)
    while len(batches(text, chunk_length)) > segments:
        text = text[: text.rstrip().rfind(". ", 0, len(text) - 2) + 2]
    return text


def encode(url: str, x: np.ndarray, sr: int) -> np.ndarray:
    import tritonclient.grpc as g

    c = g.InferenceServerClient(url)
    a = g.InferInput("waveform", [x.size], "FP32")
    a.set_data_from_numpy(x)
    b = g.InferInput("sample_rate", [1], "INT32")
    b.set_data_from_numpy(np.array([sr], np.int32))
    codes = c.infer("dac_encoder", [a, b]).as_numpy("codes").astype(np.int32)
    c.close()
    return codes


def run(url: str, req, gpu: GpuMonitor, label: str) -> dict:
    from s2tts.client import AudioChunk, Final, S2ProClient

    arrivals, durations, mem = [], [], []
    stats, t_first = {}, None
    samples = 0
    t0 = time.perf_counter()
    last_mem = -1.0
    with S2ProClient(url) as c:
        for ev in c.stream(req, timeout=600):
            now = time.perf_counter() - t0
            if isinstance(ev, AudioChunk):
                t_first = now if t_first is None else t_first
                arrivals.append(now)
                durations.append(ev.audio.size / ev.sample_rate)
                samples += ev.audio.size
                sr = ev.sample_rate
            elif isinstance(ev, Final):
                stats = ev.stats
            if gpu.available and now - last_mem >= 1.0:
                s = gpu.sample()
                if s:
                    mem.append((round(now, 2), round(sum(s[0]))))
                last_mem = now
    wall = time.perf_counter() - t0
    audio_s = samples / sr if samples else 0.0
    # wall time per minute of audio (RTF of each minute), from chunk arrivals
    per_minute, done, k = [], 0.0, 0
    cum = np.cumsum(durations)
    for m in range(1, int(audio_s // 60) + 2):
        idx = int(np.searchsorted(cum, min(m * 60.0, audio_s) - 1e-9))
        if idx >= len(arrivals):
            break
        t_m = arrivals[idx]
        span = min(m * 60.0, audio_s) - (m - 1) * 60.0
        if span > 0:
            per_minute.append(round((t_m - done) / span, 4))
        done = t_m
    stall, gap = _stall(arrivals, durations) if arrivals else (None, None)
    return {"phase": label, "audio_s": round(audio_s, 2), "wall_s": round(wall, 2), "rtf": round(wall / max(audio_s, 1e-9), 4),
            "ttfa_ms": None if t_first is None else round(t_first * 1e3, 1), "chunks": len(arrivals),
            "max_gap_ms": None if gap is None else round(gap * 1e3, 1), "underrun": stall,
            "rtf_per_minute": per_minute, "server": stats, "gpu_mem_mib": mem,
            "gpu_mem_peak_mib": max((m for _, m in mem), default=None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--minutes", type=float, default=10.0, help="audio of the long-text request")
    ap.add_argument("--segment-frames", type=int, default=280, help="frames per segment of the long text (13 s)")
    ap.add_argument("--chunk-length", type=int, default=200)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--turn-frames", type=int, default=120)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from s2tts.client import TTSInput

    gpu = GpuMonitor(interval=1.0)
    out = []
    segments = max(1, round(args.minutes * 60 * FPS / args.segment_frames))
    text = long_text(segments, args.chunk_length)
    req = TTSInput(text=text, seed=args.seed, max_new_tokens=args.segment_frames, ignore_eos=True,
                   chunk_length=args.chunk_length)
    row = run(args.url, req, gpu, "long_text")
    row.update(text_chars=len(text), segments=segments)
    out.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "gpu_mem_mib"}), flush=True)

    if args.turns:
        voices = [("<|speaker:0|>A calm low voice reads the first part.", encode(args.url, reference_waveform(8.0, 44100, 1), 44100)),
                  ("<|speaker:1|>A brighter voice answers in the second.", encode(args.url, reference_waveform(8.0, 44100, 2) * 0.8, 44100))]
        turns = "".join(f"<|speaker:{i % 2}|>{sentence(1000 + i)}" for i in range(args.turns))
        req = TTSInput(text=turns, seed=args.seed, max_new_tokens=args.turn_frames, ignore_eos=True,
                       chunk_length=args.chunk_length, voices=voices)
        row = run(args.url, req, gpu, "dialogue")
        row.update(turns=args.turns, text_chars=len(turns))
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "gpu_mem_mib"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r["server"].get("frames") for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
