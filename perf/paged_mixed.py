#!/usr/bin/env python3
"""The paged KV cache on one GPU (engine level, no Triton), full-size random weights.

1. Step time at 64 short streams, slot layout (`kv_block_tokens=0`, one block of max_seq_len per request, the
   cache of before) against paged blocks, at the same max_seq_len.
2. Mixed load: 64 short streams plus `--long` streams with `--long-tokens` tokens of context, together, on a paged
   pool sized for what they hold: peak GPU memory (this process: weights, KV pool, activations, CUDA graphs) and
   the decode-step time with everything live.

    python perf/paged_mixed.py --checkpoint /tmp/s2-full --make-full --json /tmp/paged.json

Random weights never choose to stop: every request generates exactly its frames.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from s2tts.perf_tools import checkpoint_arguments, checkpoint_dir  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steady_steps(eng, reqs, window):
    """Submit `reqs` and step until `window` decode steps ran with every request live (then cancel them all)
    -> (median time of those steps in ms, steps timed)."""
    for rid, p, sp in reqs:
        eng.submit(rid, p, sp)
    times = []
    while eng.has_work():
        c = eng.counts()
        all_live = c["waiting"] == 0 and c["live"] == len(reqs)
        _sync(eng.device)
        t = time.perf_counter()
        outs = eng.step()
        _sync(eng.device)
        dt = time.perf_counter() - t
        if all_live and len(times) < window and len(outs) == len(reqs) and all(o.codes.shape[0] == 1 for o in outs):
            times.append(dt)
            if len(times) == window:
                for rid, _, _ in reqs:
                    eng.cancel(rid)
    times.sort()
    return (times[len(times) // 2] * 1e3 if times else None), len(times)


def release(model) -> None:
    """Free an engine's KV pool and CUDA graphs before the next one is made (the model holds the pool and its owner)."""
    import gc

    model.engine_owner = None
    for stack in (model.slow.stack, model.fast.stack):
        stack.k_pool = stack.v_pool = stack.blocks = None
        for layer in stack.layers:
            layer.attention.cache = None
    gc.collect()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_arguments(ap)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=20000)
    ap.add_argument("--frames", type=int, default=300, help="frames each request may generate")
    ap.add_argument("--window", type=int, default=60, help="decode steps timed with everything live")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--max-seq", type=int, default=1024, help="max_seq_len of the step-time comparison")
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--splits", default="auto,1", help="decode_splits values for the mixed load (auto: the engine's rule)")
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda:  # the memory figures read 0 on a CPU
        for name in ("empty_cache", "reset_peak_memory_stats"):
            setattr(torch.cuda, name, lambda *a, **k: None)
        for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved"):
            setattr(torch.cuda, name, lambda *a, **k: 0)
        torch.cuda.mem_get_info = lambda *a, **k: (0, 0)
        torch.cuda.get_device_name = lambda *a, **k: "cpu"

    from s2tts.codec.loading import codec_codebook_sizes
    from s2tts.ar.loading import load_model
    from s2tts.engine import Engine, EngineConfig
    from s2tts.engine.prompt import Prompt
    from s2tts.frontend.prompt import PromptBuilder
    from s2tts.ar.sampling import SamplingParams

    ck = checkpoint_dir(args)
    model = load_model(ck, args.device, "bf16" if cuda else "fp32")
    s2 = model.s2
    c = s2.text
    weights_gib = torch.cuda.memory_allocated() / 2**30
    print(f"loaded: {weights_gib:.2f} GiB of weights", flush=True)
    residual = codec_codebook_sizes(ck)[1]
    pb = PromptBuilder.from_dir(ck, s2)
    shorts = [pb.build(f"Short stream number {i}, a sentence of ordinary length to speak aloud.") for i in range(args.short)]
    gen = torch.Generator().manual_seed(0)
    longs = []
    for i in range(args.long):  # a long context: text tokens (the content does not change the cost)
        n = args.long_tokens
        longs.append(Prompt(torch.randint(0, s2.semantic_start_id, (n,), generator=gen), torch.zeros(n, s2.num_codebooks, dtype=torch.long),
                            torch.zeros(n, dtype=torch.bool)))

    def params(i):
        return SamplingParams(seed=i, max_new_tokens=args.frames, ignore_end=True)

    short_reqs = [(f"s{i}", p, params(i)) for i, p in enumerate(shorts)]
    rows = {"weights_gib": round(weights_gib, 2), "device": torch.cuda.get_device_name()}

    # 1. slot layout vs paged blocks, 64 short streams, same max_seq_len (and paged with 16 decode splits: its cost)
    for name, block, splits in (("slot", 0, None), ("paged", args.block, None), ("paged_splits16", args.block, 16)):
        release(model)
        torch.cuda.reset_peak_memory_stats()
        eng = Engine(model, residual, EngineConfig(max_batch=args.short, max_seq_len=args.max_seq,
                                                   max_prefill_tokens=args.prefill_tokens, kv_block_tokens=block, decode_splits=splits))
        print(f"{name}: engine ready ({eng.kv_capacity_tokens} KV tokens)", flush=True)
        step_ms, n = steady_steps(eng, short_reqs, args.window)
        rows[f"{name}_step_ms"] = round(step_ms, 3)
        rows[f"{name}_steps_timed"] = n
        rows[f"{name}_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        rows[f"{name}_kv_pool_gib"] = round(eng.blocks.capacity * eng.block_bytes / 2**30, 2)
        rows["kv_bytes_per_token"] = eng.block_bytes // eng.blocks.block_size
        print(json.dumps(rows), flush=True)
        del eng
    rows["paged_vs_slot_step"] = round(rows["paged_step_ms"] / rows["slot_step_ms"], 4)

    # 2. mixed load on a pool sized for what the requests hold (plus 5%)
    short_tokens = max(len(p) for p in shorts) + args.frames
    long_tokens = args.long_tokens + args.frames
    pool = int((args.short * short_tokens + args.long * long_tokens) * 1.05)
    max_seq = min(c.max_seq_len, long_tokens + 64)
    mixed = [(f"l{i}", p, params(1000 + i)) for i, p in enumerate(longs)] + short_reqs
    for splits in args.splits.split(","):
        release(model)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        eng = Engine(model, residual, EngineConfig(max_batch=args.short + args.long, max_seq_len=max_seq,
                                                   max_prefill_tokens=args.prefill_tokens, kv_block_tokens=args.block, kv_cache_tokens=max(pool, max_seq), decode_splits=None if splits == "auto" else int(splits)))
        init_s = time.perf_counter() - t0
        print(f"mixed: engine ready ({eng.kv_capacity_tokens} KV tokens, {init_s:.1f} s)", flush=True)
        t0 = time.perf_counter()
        step_ms, n = steady_steps(eng, mixed, args.window)
        free, total = torch.cuda.mem_get_info()
        tag = f"mixed_splits{eng.runner.decode_splits}"
        rows.update({
            "mixed_streams": len(mixed), "mixed_kv_pool_tokens": eng.kv_capacity_tokens,
            "mixed_kv_pool_gib": round(eng.blocks.capacity * eng.block_bytes / 2**30, 2),
            f"{tag}_step_ms": round(step_ms, 3) if step_ms else None, f"{tag}_steps_timed": n,
            f"{tag}_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            f"{tag}_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            f"{tag}_device_used_gib": round((total - free) / 2**30, 2),
            f"{tag}_preemptions": eng.preemptions, f"{tag}_init_s": round(init_s, 1),
            f"{tag}_run_s": round(time.perf_counter() - t0, 1),
        })
        print(json.dumps(rows), flush=True)
        del eng
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
