#!/usr/bin/env python3
"""The codec's calls made by a thread of their own on a CUDA stream of their own (the setting `codec_concurrent`)
give the same codes and audio as on the engine's: `--requests` seeded requests served at once by slow_ar's loop
with the codec in it (no Triton), once each way, every request's codes compared exactly (`batch_invariant` engine: a
row's codes do not depend on its neighbours) and its audio to within `--atol` (the codec batches streams as they
come: its fp16 kernels may tile a batch of another size differently).

    python3 perf/stream_check.py --checkpoint /tmp/s2-full          (GPU; exit 1 on a difference)
    python3 perf/stream_check.py --checkpoint /tmp/tinyck --device cpu   (the codec's thread, no streams there)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from s2tts.perf_tools import checkpoint_arguments, checkpoint_dir, served_model_and_codec  # noqa: E402


class _Collect:
    def __init__(self):
        self.codes, self.audio, self.error = [], [], None
        self.done = threading.Event()

    def send(self, response, final):
        kind, codes, audio = response
        if kind == "error":
            self.error = codes
        else:
            self.codes.append(codes)
            if audio is not None:
                self.audio.append(audio)
        if final:
            self.done.set()

    def is_cancelled(self):
        return False


def serve(model, ckpt, codec, fallback, prompts, args, on: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    from s2tts.codec.loading import codec_codebook_sizes, codec_frame_seconds
    from s2tts.codec.stream import StreamDecoder
    from s2tts.engine import Engine, EngineConfig
    from s2tts.engine.service import EngineService
    from s2tts.ar.sampling import SamplingParams

    config = EngineConfig(max_batch=args.requests, max_seq_len=1024, prefix_cache_mb=0,
                          batch_invariant=args.batch_invariant, codec_concurrent=on)
    eng = Engine(model, codec_codebook_sizes(ckpt)[1], config)
    decoder = StreamDecoder(codec, fallback=fallback, pool_size=2 * args.requests)
    if eng.device.type == "cuda":
        decoder.pool.warm(EngineService.codec_lengths(2, 16, 1), max_batch=args.requests)
    svc = EngineService(eng, lambda codes, reason, stats, audio: ("ok", codes, audio),
                        lambda e: ("error", e.wire(), None), frame_seconds=codec_frame_seconds(ckpt), codec=decoder)
    clients = [_Collect() for _ in range(args.requests)]
    try:
        for i, c in enumerate(clients):
            sp = SamplingParams(seed=100 + i, max_new_tokens=args.frames + 7 * i, ignore_end=True)
            svc.submit(f"r{i}", c, prompts[i % len(prompts)], sp, 2, 16)
        for c in clients:
            if not c.done.wait(args.wait_s):
                faulthandler.dump_traceback(all_threads=True)  # where the service's threads are
                raise SystemExit(f"codec_concurrent={on}: a request did not finish in {args.wait_s} s")
    finally:
        svc.shutdown()
    used, worker = bool(svc._streams), svc._codec_worker is not None
    if used != (on and eng.device.type == "cuda") or worker != on:
        raise SystemExit(f"codec_concurrent={on}: streams of their own {'used' if used else 'not used'}, the codec's "
                         f"thread {'used' if worker else 'not used'}")
    out = []
    for c in clients:
        if c.error is not None:
            raise SystemExit(f"a request failed: {c.error}")
        out.append((np.concatenate(c.codes), np.concatenate(c.audio)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_arguments(ap)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--frames", type=int, default=80)
    ap.add_argument("--atol", type=float, default=2e-3)
    ap.add_argument("--batch-invariant", type=int, default=1, help="0: the engine as served (a row's codes may then "
                    "depend on its neighbours: only the audio's length and finiteness are checked)")
    ap.add_argument("--wait-s", type=float, default=120.0, help="for each request (then the threads' stacks are printed)")
    args = ap.parse_args()

    from s2tts.checkpoint_config import S2Config
    from s2tts.frontend.prompt import PromptBuilder

    ck = checkpoint_dir(args)
    model, codec, fallback = served_model_and_codec(ck, args.device)
    pb = PromptBuilder.from_dir(ck, S2Config.from_dir(ck))
    prompts = [pb.build(f"Request {i} checks the codec's own stream.") for i in range(4)]
    side = serve(model, ck, codec, fallback, prompts, args, True)
    same = serve(model, ck, codec, fallback, prompts, args, False)
    rows, bad = [], 0
    for i, ((c1, a1), (c0, a0)) in enumerate(zip(side, same)):
        codes_equal = c1.shape == c0.shape and bool((c1 == c0).all())
        err = float(np.abs(a1 - a0).max()) if a1.shape == a0.shape else None
        alike = codes_equal and err is not None and err <= args.atol
        ok = bool((alike or not args.batch_invariant) and a1.shape == a0.shape and np.isfinite(a1).all() and a1.std() > 0)
        bad += not ok
        rows.append({"request": i, "frames": int(c1.shape[0]), "codes_equal": codes_equal, "audio_max_abs_diff": err,
                     "audio_rms": round(float(np.sqrt((a1 ** 2).mean())), 4), "ok": ok})
        print(json.dumps(rows[-1]), flush=True)
    print(f"codec on its own stream against the engine's: {len(rows) - bad} of {len(rows)} requests alike")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
