"""Offline synthesis: text (+ optional reference WAV and transcript) -> a WAV file.

    python -m s2tts.cli --checkpoint checkpoints/tiny --text "Hello." --out hello.wav
    python -m s2tts.cli --checkpoint checkpoints/s2-pro --text "Hi." --reference-audio me.wav \\
        --reference-text "What I say in me.wav." --out hi.wav --seed 7
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .ar.sampling import SamplingParams
from .pipeline import S2Pipeline
from .settings import SCHEMA


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="s2tts-synthesize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="S2 Pro checkpoint directory (config.json, safetensors, codec.pth)")
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True, help="output WAV path")
    ap.add_argument("--reference-audio", help="reference clip for voice cloning (any format soundfile reads)")
    ap.add_argument("--reference-text", help="transcript of the reference clip")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=1024, help="frames at most, per text segment")
    ap.add_argument("--chunk-length", type=int, default=SCHEMA["chunk_length"].default,
                    help="UTF-8 bytes of text per segment: a longer text or a dialogue is spoken segment after segment")
    ap.add_argument("--ignore-eos", action="store_true", help="generate max_new_tokens frames per segment (benchmarks)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, or auto")
    ap.add_argument("--dtype", default="bf16", help="AR weights: bf16 (default), fp16 or fp32")
    ap.add_argument("--codec-dtype", default="fp32", help="DAC codec: fp32 (default), bf16 or fp16")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import soundfile as sf


    if bool(args.reference_audio) != bool(args.reference_text):
        print("error: --reference-audio and --reference-text go together (the clip and its transcript)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed,
                                ignore_end=args.ignore_eos).validate()
        t0 = time.perf_counter()
        pipe = S2Pipeline(args.checkpoint, args.device, args.dtype, args.codec_dtype)
        load_s = time.perf_counter() - t0
        ref_codes = None
        if args.reference_audio:
            wav, sr = sf.read(args.reference_audio, dtype="float32", always_2d=True)
            ref_codes = pipe.encode_reference(wav, sr)
        t1 = time.perf_counter()
        out = pipe.synthesize(args.text, params, ref_codes, args.reference_text, chunk_length=args.chunk_length)
        gen_s = time.perf_counter() - t1
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sf.write(args.out, out.audio, out.sample_rate, subtype="FLOAT")
    seconds = len(out.audio) / out.sample_rate
    print(json.dumps({"out": args.out, "frames": int(out.codes.shape[1]), "audio_seconds": round(seconds, 3),
                      "finish_reason": out.finish_reason, "load_s": round(load_s, 2), "synthesis_s": round(gen_s, 3),
                      "rtf": round(gen_s / seconds, 3) if seconds else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
