#!/usr/bin/env python3
"""Stream speech from the `s2pro` Triton model over gRPC into a WAV file, chunk by chunk.

    python client/s2pro_stream.py --text "Hello there." --out hello.wav
    python client/s2pro_stream.py --url localhost:8001 --text "Hi." --reference-audio me.wav \
        --reference-text "What I say in me.wav." --out hi.wav --seed 7

Prints the time to first audio (TTFA) and the real-time factor (RTF = wall time / audio time).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import soundfile as sf  # noqa: E402

from s2tts.client import AudioChunk, S2ProClient, TTSError, TTSInput  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True, help="WAV file written as chunks arrive")
    ap.add_argument("--reference-audio", help="reference clip for voice cloning")
    ap.add_argument("--reference-text", help="its transcript")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--first-chunk-frames", type=int)
    ap.add_argument("--chunk-frames", type=int)
    args = ap.parse_args(argv)

    req = TTSInput(text=args.text, seed=args.seed, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                   max_new_tokens=args.max_new_tokens, first_chunk_frames=args.first_chunk_frames,
                   chunk_frames=args.chunk_frames, reference_text=args.reference_text)
    if args.reference_audio:
        wav, sr = sf.read(args.reference_audio, dtype="float32", always_2d=True)
        req.reference_audio, req.reference_sample_rate = wav.mean(axis=1), sr
    out, ttfa, samples, sr, stats = None, None, 0, None, {}
    try:
        with S2ProClient(args.url) as client:
            for ev in client.stream(req):
                if isinstance(ev, AudioChunk):
                    if out is None:
                        sr, ttfa = ev.sample_rate, ev.t
                        out = sf.SoundFile(args.out, "w", samplerate=sr, channels=1, subtype="FLOAT")
                    out.write(ev.audio)
                    out.flush()
                    samples += ev.audio.size
                else:
                    stats, total = ev.stats, ev.t
    except TTSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if out is not None:
            out.close()
    seconds = samples / sr if sr else 0.0
    print(json.dumps({"out": args.out, "audio_seconds": round(seconds, 3), "ttfa_ms": round(ttfa * 1000, 1) if ttfa else None,
                      "rtf": round(total / seconds, 3) if seconds else None, "server_stats": stats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
