#!/usr/bin/env python3
"""The decode-attention kernel alone (`s2tts.ar.kernels.decode_attention`), on the slow AR's heads (from the
checkpoint's config): `--rows` rows of `--keys` keys each, in a paged cache of `--block`-token blocks scattered
through the pool, the keys split as the engine splits them (`ModelRunner.split_rule`), once per tiling in
`--config` (overrides of `kernels.DECODE_ATTENTION_CONFIG`; `NAME=engine`: the engine's own). `--ar fast`: the
fast AR's heads and cache instead (one block of num_codebooks + 1 positions a slot, never split). On a GPU each is
timed as a CUDA graph of 20 calls; on a CPU (`TRITON_INTERPRET=1`, a smoke test) one call is timed as it runs.

    python perf/bench_attention.py --checkpoint /tmp/s2-full --rows 1,8,64 --keys 128,512,2048 \\
        --config base= --config kvt=kv_together=1 --config st2=num_stages=2 --config w8=num_warps=8
    python perf/bench_attention.py --checkpoint /tmp/s2-full --ar fast --rows 1,64,128 --keys 2,10 \\
        --config base= --config engine=engine

Prints a markdown table: microseconds a call, the keys' and values' bytes read per second, and each tiling's
largest relative difference from the first one's output (the same function: ~1e-3 in bf16 at most).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def config(text: str) -> tuple[str, dict | None]:
    """'NAME=key=value,key=value' -> (NAME, {key: int(value)}); 'NAME=engine' -> (NAME, None): the tiling the engine
    gives these rows (`kernels.short_keys_config` for the fast AR's)."""
    name, _, rest = text.partition("=")
    if rest == "engine":
        return name, None
    return name, {k: int(v) for k, v in (kv.split("=", 1) for kv in rest.split(",") if kv)}


def timed_us(fn, device: torch.device) -> float:
    if device.type == "cuda":
        from bench_engine import graph_time_ms

        return graph_time_ms(fn, iters=30, calls=20) * 1e3
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="its config.json gives the AR's heads")
    ap.add_argument("--ar", choices=("slow", "fast"), default="slow",
                    help="whose attention: the slow AR's (paged cache, --block) or the fast AR's (its cache of "
                         "num_codebooks + 1 positions a slot; --keys up to that)")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--keys", default="128,512,2048")
    ap.add_argument("--block", type=int, default=None, help="tokens a KV block (default: setting kv_block_tokens)")
    ap.add_argument("--max-seq", type=int, default=None,
                    help="sizes the long-context split as the engine does (default: setting max_seq_len)")
    ap.add_argument("--config", action="append", default=[],
                    help="NAME=key=value,...: a tiling (keys of kernels.DECODE_ATTENTION_CONFIG: block_n, num_warps, "
                         "num_stages, kv_together); repeat; the first is the reference of the differences")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args()

    from s2tts.ar import kernels
    from s2tts.gpu import jit
    from s2tts.checkpoint_config import S2Config
    from s2tts.engine.runner import ModelRunner
    from s2tts.ar.model import Attention, KVCache
    from s2tts.settings import SCHEMA

    if not jit.available():
        raise SystemExit("bench_attention needs the triton package (on a CPU with TRITON_INTERPRET=1)")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    s2 = S2Config.from_dir(args.checkpoint)
    c = s2.text if args.ar == "slow" else s2.audio
    H, KV, D = c.n_head, c.n_local_heads, c.head_dim
    if args.ar == "slow":
        BS = args.block or SCHEMA["kv_block_tokens"].default
        max_seq = args.max_seq or SCHEMA["max_seq_len"].default
        decode_splits = ModelRunner.default_splits(max_seq)
    else:  # the fast AR's cache: one block of its num_codebooks + 1 positions a slot (FastAR.setup_caches)
        BS = max_seq = s2.num_codebooks + 1
        decode_splits = 1
    with torch.device("meta"):  # a layer's least keys a long row's split takes, as the engine reads it
        min_split = Attention(c).decode_min_split
    configs = [config(t) for t in args.config or ["base="]]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows_out = []
    for B in [int(x) for x in args.rows.split(",")]:
        for L in [int(x) for x in args.keys.split(",")]:
            if L > max_seq:
                raise SystemExit(f"--keys {L}: the {args.ar} AR's rows hold at most {max_seq} keys")
            nb = -(-L // BS)
            k = torch.randn(B * nb + 1, KV, BS, D, generator=gen).to(device, dtype)
            v = torch.randn(B * nb + 1, KV, BS, D, generator=gen).to(device, dtype)
            table = (torch.randperm(B * nb, generator=gen) + 1).reshape(B, nb).to(device, torch.int32)
            cache = KVCache(k, v, table, BS)
            q = torch.randn(B, H, D, generator=gen).to(device, dtype)
            slots = torch.arange(B, device=device)
            lens = torch.full((B,), L, device=device, dtype=torch.int64)
            splits, least = (ModelRunner.split_rule(ModelRunner, L, B, decode_splits, min_split) if args.ar == "slow"
                             else (1, min_split))  # the runner never splits the fast AR's keys
            bytes_read = 2 * B * L * KV * D * k.element_size()
            ref = None
            for name, over in configs:
                if over is None:
                    over = kernels.short_keys_config(max_seq, B) if args.ar == "fast" else {}

                def call(over=over):
                    return kernels.decode_attention(q, cache, slots, lens, splits=splits, min_split=least, config=over)

                out = call()
                ref = out if ref is None else ref
                diff = float(((out.float() - ref.float()).abs().max() / ref.float().abs().max()))
                us = timed_us(call, device)
                r = {"config": name, "rows": B, "keys": L, "splits": splits, "us": round(us, 2),
                     "tb_s": round(bytes_read / us / 1e6, 3), "max_rel_diff": round(diff, 6)}
                rows_out.append(r)
                print(json.dumps(r), flush=True)
    cols = ["config", "rows", "keys", "splits", "us", "tb_s", "max_rel_diff"]
    print(f"\n{args.ar} AR heads {H} / KV heads {KV} x {D}, blocks of {BS}, {dtype}, {device}; tilings: "
          + "; ".join(f"{n}=" + ("the engine's" if o is None
                                 else json.dumps(dict(kernels.DECODE_ATTENTION_CONFIG, **o))) for n, o in configs))
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows_out:
        print("| " + " | ".join(str(r[k]) for k in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=2))


if __name__ == "__main__":
    main()
