#!/usr/bin/env python3
"""The decoder's residual units at their served shapes, on a GPU: each unit as its two channels-last convolutions
(`kernels.conv1d_nwc` twice, tiled by shape, the inner activation through memory) against one `kernels.res_unit_nwc`
in several tilings (`kernels.RES_UNIT_CONFIG` overrides; `shape`: the served choice, `kernels.res_unit_tiling`),
fp16, random weights, `--streams` x `--chunk` frames; GPU microseconds a unit (median of 20 calls queued behind a
GPU sleep, as in the pool's CUDA graphs). Each tiling's result is checked against the two convolutions'.

    python3 perf/bench_res_unit.py --streams 64 --chunk 8
    python3 perf/bench_res_unit.py --streams 1 --config shape --config block_t=32,num_warps=4
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

CONFIGS = ["shape", "", "num_warps=4", "num_stages=2", "block_t=64", "block_t=64,num_warps=4", "block_n=128"]
# (channels, output steps a frame): the decoder's last two blocks of the 44.1 kHz codec (2048 samples a frame)
UNITS = ((192, 1024), (96, 2048))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--dilation", type=int, default=3)
    ap.add_argument("--config", action="append", default=[], help=f"RES_UNIT_CONFIG overrides (default: {CONFIGS})")
    args = ap.parse_args()
    from bench_codec import timed
    from bench_engine import config_overrides

    from s2tts.codec import kernels

    configs = args.config or CONFIGS
    base = dict(kernels.RES_UNIT_CONFIG)
    dev, dt, d = "cuda", torch.float16, args.dilation
    print("| channels | rows | two convolutions us | " + " | ".join(f"[{c or 'RES_UNIT_CONFIG'}] us" for c in configs)
          + " |")
    print("|---|---|---|" + "---|" * len(configs))
    for C, steps in UNITS:
        B, T = args.streams, steps * args.chunk
        h_in = torch.randn(B, T + 6 * d, C, device=dev, dtype=dt)
        w7 = kernels.conv_weight_nwc(torch.randn(C, C, 7, device=dev, dtype=dt) / (7 * C) ** 0.5)
        w1 = kernels.conv_weight_nwc(torch.randn(C, C, 1, device=dev, dtype=dt) / C ** 0.5)
        b7, b1 = torch.randn(C, device=dev, dtype=dt), torch.randn(C, device=dev, dtype=dt)
        a2, a3 = torch.rand(C, device=dev, dtype=dt) + 0.5, torch.rand(C, device=dev, dtype=dt) + 0.5
        x, buf = torch.randn(B, T, C, device=dev, dtype=dt), torch.empty(B, T + 6, C, device=dev, dtype=dt)

        def two():
            h = kernels.conv1d_nwc(h_in, w7, d, b7, alpha=a2)
            return kernels.conv1d_nwc(h, w1, 1, b1, residual=x, alpha=a3, snake_out=buf[:, 6:], raw=True)

        with torch.inference_mode():
            want = two()
            row = [timed(two, iters=20, warmup=3, queued=True) * 1e3]
            for c in configs:
                kernels.RES_UNIT_BY_SHAPE = c == "shape"
                kernels.RES_UNIT_CONFIG.update(base, **config_overrides("" if c == "shape" else c))
                try:
                    got = kernels.res_unit_nwc(h_in, w7, d, b7, a2, w1, b1, x, a3, buf[:, 6:], raw=True)
                except Exception as e:  # e.g. a tiling that needs more shared memory than the GPU has
                    print(f"[{c}] at {C} channels: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                    row.append(float("nan"))
                    continue
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                if err > 1e-2:
                    raise SystemExit(f"res_unit_nwc [{c}] at {C} channels: relative difference {err:.3g}")
                row.append(timed(lambda: kernels.res_unit_nwc(h_in, w7, d, b7, a2, w1, b1, x, a3, buf[:, 6:], raw=True),
                                 iters=20, warmup=3, queued=True) * 1e3)
            kernels.RES_UNIT_CONFIG.update(base)
            kernels.RES_UNIT_BY_SHAPE = True
        print(f"| {C} | {B} x {T} | " + " | ".join(f"{t:.0f}" for t in row) + " |", flush=True)


if __name__ == "__main__":
    main()
