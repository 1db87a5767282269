#!/usr/bin/env python3
"""The decode step's matrix products at a few rows: cuBLAS (F.linear) against `s2tts.kernels.linear` (the GEMV
kernel), on S2 Pro's weight shapes, bf16, each timed as a CUDA graph of 20 calls.

    python perf/bench_gemv.py --rows 1,2,4,8,16

Prints a markdown table: microseconds a call, weight-streaming bandwidth (weight bytes / time), the kernel's
largest relative difference from F.linear, and whether a row's result is the same alone and beside 15 others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {  # name: (N, K) of the weight, from the full S2 Pro config (both ARs' layers are 2560 wide)
    "wqkv": (6144, 2560), "wo": (2560, 4096), "w13": (19456, 2560), "w2": (2560, 9728),
    "slow head": (4097, 2560), "fast head": (4096, 2560),
}


def timed_us(fn) -> float:
    """Microseconds a call, 20 calls captured in one CUDA graph."""
    from bench_engine import graph_time_ms

    return graph_time_ms(fn, iters=30, calls=20) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--config", action="append", default=[],
                    help="kernels.GEMV_CONFIG overrides, e.g. 'block_n=32,num_warps=8' (repeat: one table row set each)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from s2tts import kernels

    torch.manual_seed(0)
    rows = []
    base = dict(kernels.GEMV_CONFIG)
    for cfg in args.config or [""]:
        kernels.GEMV_CONFIG.clear()
        kernels.GEMV_CONFIG.update(base, **{k: int(v) for k, v in (kv.split("=") for kv in cfg.split(",") if kv)})
        rows += bench(kernels, args, cfg)
    cols = ["config", "weight", "rows", "cublas_us", "kernel_us", "cublas_tb_s", "kernel_tb_s", "kernel_rel_err",
            "cublas_rel_err", "row_invariant"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def bench(kernels, args, cfg: str) -> list[dict]:
    rows = []
    for name, (N, K) in SHAPES.items():
        # several copies of the weight, used in turn, so that no call finds it in L2
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(4)]
        for M in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(max(M, 16), K, device="cuda", dtype=torch.bfloat16)
            i = [0]

            def nxt():
                i[0] = (i[0] + 1) % len(ws)
                return ws[i[0]]

            t_cublas = timed_us(lambda: torch.nn.functional.linear(x[:M], nxt()))
            t_kernel = timed_us(lambda: kernels.linear(x[:M], nxt(), max_rows=M))
            ref = torch.nn.functional.linear(x[:M].float(), ws[0].float())
            got = kernels.linear(x[:M], ws[0], max_rows=M).float()
            err = float((got - ref).norm() / ref.norm())
            cub = float((torch.nn.functional.linear(x[:M], ws[0]).float() - ref).norm() / ref.norm())
            alone = kernels.linear(x[:1], ws[0])
            beside = kernels.linear(x[:M], ws[0], max_rows=M)[:1]
            gb = N * K * 2 / 1e9
            rows.append({"config": cfg or "default", "weight": name, "N": N, "K": K, "rows": M, "plan": kernels.gemv_plan(N, K),
                         "cublas_us": round(t_cublas, 1), "kernel_us": round(t_kernel, 1),
                         "cublas_tb_s": round(gb / t_cublas * 1e3, 2), "kernel_tb_s": round(gb / t_kernel * 1e3, 2),
                         "kernel_rel_err": f"{err:.1e}", "cublas_rel_err": f"{cub:.1e}",
                         "row_invariant": bool(torch.equal(alone, beside))})
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
