#!/usr/bin/env python3
"""Quick end-to-end check of the model repository on a GPU: start tritonserver on a checkpoint, stream one
request, a few concurrent ones and a voice clone twice (the second hits the voice-prefix cache); print
TTFA / RTF per request and the server's start-up time.

    python3 perf/gpu_smoke.py --checkpoint /tmp/s2full --frames 100
"""
import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from s2tts.client import S2ProClient, TTSInput  # noqa: E402
from s2tts.server import TritonServer, parse_settings  # noqa: E402


def one(url, **kw):
    with S2ProClient(url) as c:
        t0 = time.perf_counter()
        r = c.synthesize(TTSInput(**kw))
        wall = time.perf_counter() - t0
    secs = r.audio.size / 44100
    return {"ttfa_ms": round(r.ttfa_s * 1000, 1), "rtf": round(wall / secs, 3) if secs else None, "frames": r.stats.get("frames"),
            "server_ttfa_ms": round(r.stats["ttfa_s"] * 1000, 1), "chunks": len(r.chunks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    settings = {"device": "cuda", "max_batch": "64", "max_seq_len": "1024", **parse_settings(args.set)}
    t0 = time.perf_counter()
    server = TritonServer(args.checkpoint, settings, workdir="/tmp/smoke")
    try:
        server.start(timeout=600)
        print(f"server ready in {time.perf_counter() - t0:.1f} s", flush=True)
        base = dict(max_new_tokens=args.frames, ignore_eos=True)
        one(server.grpc_url, text="Warm-up.", seed=0, **{**base, "max_new_tokens": 8})
        for i in range(3):
            print("c=1", json.dumps(one(server.grpc_url, text=f"Hello number {i}, a plain sentence to speak.", seed=i, **base)), flush=True)
        res = [None] * args.concurrency

        def run(i):
            res[i] = one(server.grpc_url, text=f"Concurrent request {i} speaking.", seed=100 + i, **base)

        th = [threading.Thread(target=run, args=(i,)) for i in range(args.concurrency)]
        t1 = time.perf_counter()
        [t.start() for t in th]
        [t.join() for t in th]
        wall = time.perf_counter() - t1
        print(f"c={args.concurrency}: wall {wall:.2f} s, audio-s/s {args.concurrency * args.frames * 2048 / 44100 / wall:.1f}, "
              f"ttfa ms {sorted(r['ttfa_ms'] for r in res)}, rtf {sorted(r['rtf'] for r in res)}", flush=True)
        t = np.arange(44100 * 10) / 44100
        ref = (0.3 * np.sin(2 * np.pi * (150 + 30 * np.sin(2 * np.pi * 0.5 * t)) * t)).astype(np.float32)
        import tritonclient.grpc as g

        cl = g.InferenceServerClient(server.grpc_url)
        w = g.InferInput("waveform", [ref.size], "FP32")
        w.set_data_from_numpy(ref)
        sr = g.InferInput("sample_rate", [1], "INT32")
        sr.set_data_from_numpy(np.array([44100], np.int32))
        te = time.perf_counter()
        codes = cl.infer("dac_encoder", [w, sr]).as_numpy("codes")
        print(f"dac_encoder 10 s reference: {1000 * (time.perf_counter() - te):.1f} ms, codes {codes.shape}", flush=True)
        for i in range(3):
            print("clone", json.dumps(one(server.grpc_url, text=f"Cloned sentence {i}.", reference_codes=codes,
                                          reference_text="A ten second reference clip of a gliding tone.", seed=i, **base)), flush=True)
    except Exception:
        print(server.log_tail(80))
        raise
    finally:
        print("\n".join(l for l in server.log_tail(400).splitlines() if "s2tts" in l or "error" in l.lower())[-3000:])
        server.stop()


if __name__ == "__main__":
    main()
