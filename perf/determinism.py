#!/usr/bin/env python3
"""Do seeded requests give the same codes alone and beside others? And what does `batch_invariant` cost?

    python perf/determinism.py                                   # tiny checkpoint, CPU, bf16
    python perf/determinism.py --checkpoint /tmp/s2-full --make-full --device cuda --requests 64 --max-batch 64

For each mode (default, batch_invariant) it runs `--requests` seeded requests through one engine, one
joining every `--every` steps (so they join batches already running and, half of them cloning one voice,
hit the prefix cache), then each request alone in a fresh engine, and counts the requests whose codes
changed. It also times the decode step with one live request and with a full batch (the cost of
running every step at `max_batch` rows). Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="default: a tiny checkpoint written to a temporary directory")
    ap.add_argument("--make-full", action="store_true", help="write a full-size random checkpoint there if missing")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--every", type=int, default=3, help="steps between arrivals in the side-by-side run")
    ap.add_argument("--alone", type=int, default=None, help="check only the first N requests alone (default all)")
    args = ap.parse_args()

    from s2tts.codec.loading import codec_codebook_sizes
    from s2tts.ar.loading import load_model
    from s2tts.engine import Engine, EngineConfig
    from s2tts.frontend.prompt_builder import PromptBuilder
    from s2tts.ar.sampling import SamplingParams
    from s2tts.random_checkpoint import write_checkpoint

    if args.checkpoint is None:
        ck = write_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "tiny", seed=0)
    else:
        ck = Path(args.checkpoint)
        if args.make_full and not (ck / "config.json").is_file():
            write_checkpoint(ck, "full", seed=0, device=args.device)
    model = load_model(ck, args.device, args.dtype)
    residual = codec_codebook_sizes(ck)[1]
    builder = PromptBuilder.from_dir(ck)
    C = model.s2.num_codebooks
    ref = torch.randint(0, min(residual, 1024), (C, 100), generator=torch.Generator().manual_seed(5))
    prompts = [builder.build(f"Sentence number {i} with {'some ' * (i % 9)}words.", ref if i % 2 else None,
                             "The reference transcript." if i % 2 else None) for i in range(args.requests)]

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def new_engine(invariant: bool) -> Engine:
        # one live Engine per model: a new one takes over the model's KV cache (the last one's graphs read it)
        return Engine(model, residual, EngineConfig(max_batch=args.max_batch, max_seq_len=1024, prefix_cache_mb=256,
                                                    batch_invariant=invariant))

    def run(invariant: bool, ids: list[int], every: int, eng=None):
        eng = eng or new_engine(invariant)
        out, pending, done, k = {i: [] for i in ids}, list(ids), set(), 0
        while len(done) < len(ids):
            if pending and k % every == 0:
                i = pending.pop(0)
                eng.submit(str(i), prompts[i], SamplingParams(seed=1000 + i, max_new_tokens=args.frames, ignore_end=True))
            k += 1
            for o in eng.step():
                out[int(o.request_id)].append(o.codes)
                done |= {int(o.request_id)} if o.finished else set()
        return {i: np.concatenate(v) for i, v in out.items()}, eng

    def step_ms(eng, n: int) -> float:
        """Median decode-step time with n live requests (after their prefill)."""
        for i in range(n):
            eng.submit(f"t{i}", prompts[i % len(prompts)], SamplingParams(seed=i, max_new_tokens=10**6, ignore_end=True))
        while eng.counts()["waiting"] or eng.counts()["prefilling"]:
            eng.step()  # every prompt prefilled (max_prefill_tokens a step)
        times = []
        for _ in range(30):
            sync()
            t = time.perf_counter()
            eng.step()
            sync()
            times.append((time.perf_counter() - t) * 1e3)
        for i in range(n):
            eng.cancel(f"t{i}")
        eng.step()
        return float(np.median(times))

    for invariant in (False, True):
        t0 = time.perf_counter()
        together, eng = run(invariant, list(range(args.requests)), args.every)
        check = list(range(args.requests if args.alone is None else args.alone))
        changed = [i for i in check if not np.array_equal(together[i], run(invariant, [i], 1)[0][i])]
        row = {"mode": "batch_invariant" if invariant else "default", "device": args.device, "dtype": args.dtype,
               "max_batch": args.max_batch, "requests": args.requests, "checked_alone": len(check),
               "changed": len(changed), "changed_ids": changed, "prefix_cache_hits": eng.prefix_cache.hits,
               "step_ms_1": round(step_ms(timing := new_engine(invariant), 1), 3),
               f"step_ms_{args.max_batch}": round(step_ms(timing, args.max_batch), 3),
               "graphs": sorted(eng.graphs), "wall_s": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
