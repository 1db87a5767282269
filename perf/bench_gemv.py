#!/usr/bin/env python3
"""The decode step's matrix products at a few rows: cuBLAS (F.linear) against `s2tts.ar.kernels.linear` (the GEMV
kernel), and up to `GEMV_SMALL_ROWS` rows `kernels.gemv_small` (the decode step's products at one or two streams;
timed without dependent launch: alone it has no predecessor to overlap), on S2 Pro's weight shapes, bf16, each timed
as a CUDA graph of 20 calls; and the kernel with the weight in
FP8 (`kernels.quantize_fp8`: e4m3, a scale per output row; `fp8_rel_err` is against the bf16 weight's exact product),
and cuBLAS's FP8 x FP8 product (`w8a8_cublas`: the activations in FP8 as well).

    python perf/bench_gemv.py --rows 1,2,4,8,16
    python perf/bench_gemv.py --rows 64,32,16 --partials

`--partials`: for the weights whose products end in a residual sum and its norm (wo, w2) and for wqkv, the kernel's
split-K pass alone, each split's float32 partial sums written and not added (what a product costs when the next
kernel, the norm, adds the partials itself instead of a separate sum kernel), over a sweep of tilings (columns a
program, K a step, splits), against cuBLAS: the best four per shape, with the partials' size that the next kernel
would then read.

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
                    help="kernels.GEMV_CONFIG (and GEMV_FP8_CONFIG) overrides, e.g. 'block_n=32,num_warps=8' (repeat: one table row set each)")
    ap.add_argument("--json")
    ap.add_argument("--partials", action="store_true", help="the split-K pass alone (partial sums not added) against "
                    "cuBLAS, over tilings: see the module's doc")
    args = ap.parse_args()
    from s2tts.ar import kernels

    if args.partials:
        rows = partials(kernels, [int(r) for r in args.rows.split(",")])
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return

    torch.manual_seed(0)
    rows = []
    from bench_engine import config_overrides

    bases = [(c, dict(c)) for c in (kernels.GEMV_CONFIG, kernels.GEMV_FP8_CONFIG)]
    for cfg in args.config or [""]:
        for c, base in bases:  # the same overrides for the bf16 and the FP8 kernel
            c.clear()
            c.update(base, **config_overrides(cfg))
        rows += bench(kernels, args, cfg)
    cols = ["config", "weight", "rows", "cublas_us", "kernel_us", "small_us", "small_rel_err", "cublas_tb_s", "kernel_tb_s", "kernel_rel_err",
            "cublas_rel_err", "row_invariant", "fp8_us", "fp8_tb_s", "fp8_rel_err", "w8a8_cublas_us", "w8a8_rel_err"]
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
            small = M <= kernels.GEMV_SMALL_ROWS
            t_small = round(timed_us(lambda: kernels.gemv_small(x[:M], nxt())), 1) if small else ""
            ref = torch.nn.functional.linear(x[:M].float(), ws[0].float())
            got = kernels.linear(x[:M], ws[0], max_rows=M).float()
            err = rel(got, ref)
            cub = rel(torch.nn.functional.linear(x[:M], ws[0]), ref)
            alone = kernels.linear(x[:1], ws[0])
            beside = kernels.linear(x[:M], ws[0], max_rows=M)[:1]
            w8s = [kernels.quantize_fp8(w) for w in ws]
            j = [0]

            def nxt8():
                j[0] = (j[0] + 1) % len(w8s)
                return w8s[j[0]]

            def fp8_call():
                w8, scale = nxt8()
                return kernels.linear(x[:M], w8, scale=scale)

            t_fp8 = timed_us(fp8_call)
            got8 = kernels.linear(x[:M], w8s[0][0], scale=w8s[0][1]).float()
            err8 = rel(got8, ref)
            t_w8a8, err_w8a8 = scaled_mm(x, M, w8s, ref)
            gb = N * K * 2 / 1e9
            rows.append({"config": cfg or "default", "weight": name, "N": N, "K": K, "rows": M, "plan": kernels.gemv_plan(N, K),
                         "cublas_us": round(t_cublas, 1), "kernel_us": round(t_kernel, 1),
                         "cublas_tb_s": round(gb / t_cublas * 1e3, 2), "kernel_tb_s": round(gb / t_kernel * 1e3, 2),
                         "small_us": t_small,
                         "small_rel_err": f"{rel(kernels.gemv_small(x[:M], ws[0]), ref):.1e}" if small else "",
                         "kernel_rel_err": f"{err:.1e}", "cublas_rel_err": f"{cub:.1e}",
                         "row_invariant": bool(torch.equal(alone, beside)),
                         "fp8_us": round(t_fp8, 1), "fp8_tb_s": round(gb / 2 / t_fp8 * 1e3, 2),
                         "fp8_rel_err": f"{err8:.1e}", "w8a8_cublas_us": t_w8a8, "w8a8_rel_err": err_w8a8})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def partials(kernels, row_counts: list[int]) -> list[dict]:
    """See the module's doc (`--partials`): one line per weight and row count, and a dict each."""
    import itertools

    out = []
    for name in ("wo", "w2", "wqkv"):
        N, K = SHAPES[name]
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(4)]
        i = [0]

        def nxt():
            i[0] = (i[0] + 1) % len(ws)
            return ws[i[0]]

        for M in row_counts:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x.float(), ws[0].float())
            t_cublas = timed_us(lambda: torch.nn.functional.linear(x, nxt()))
            bm = max(16, 1 << (M - 1).bit_length())
            tried = []
            for bn, bk, split in itertools.product((32, 64), (64, 128), (2, 4, 8)):
                k_per = -(-K // (split * bk)) * bk
                if k_per * (split - 1) >= K:  # a split with nothing to add
                    continue
                y = torch.empty(M, N, dtype=x.dtype, device="cuda")
                p = torch.empty(split, M, N, dtype=torch.float32, device="cuda")

                def call(w=None):
                    kernels._gemv_kernel[(-(-M // bm), -(-N // bn), split)](
                        x, nxt() if w is None else w, y, y, p, M, N, K, k_per, x.stride(0), K, N, BLOCK_M=bm,
                        BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, IEEE=False, SCALED=False, SWAP=False, num_warps=4,
                        num_stages=4, PDL=False)

                t = timed_us(call)
                call(ws[0])
                tried.append({"us": round(t, 1), "block_n": bn, "block_k": bk, "split": split,
                              "rel_err": f"{rel(p.sum(0), ref):.0e}", "partials_mb": round(split * M * N * 4 / 1e6, 2)})
            tried.sort(key=lambda r: r["us"])
            out.append({"weight": name, "rows": M, "cublas_us": round(t_cublas, 1), "best": tried[:4]})
            print(f"{name} {M} rows: cuBLAS {t_cublas:.1f} us; partials alone, best: " + "; ".join(
                f"{r['us']} us (block_n {r['block_n']}, block_k {r['block_k']}, split {r['split']}: "
                f"{r['partials_mb']} MB of partials, error {r['rel_err']})" for r in tried[:4]), flush=True)
    return out


def rel(got, ref) -> float:
    return float((got.float() - ref).norm() / ref.norm())


def scaled_mm(x, M, w8s, ref) -> tuple[float | str, str]:
    """cuBLAS's FP8 product (`torch._scaled_mm`, activations quantized too, a scale per row of each; at least 16
    rows) -> (microseconds a call, relative error against the bf16 weight's exact product); the activations'
    quantization is not timed."""
    from s2tts.ar.kernels import FP8_MAX

    m = max(M, 16)
    xs = x[:m].float().abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    x8 = (x[:m].float() / xs).to(torch.float8_e4m3fn)
    i = [0]

    def call():
        i[0] = (i[0] + 1) % len(w8s)
        w8, s = w8s[i[0]]
        return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=s[None, :], out_dtype=torch.bfloat16)

    try:
        t = round(timed_us(call), 1)
        got = torch._scaled_mm(x8, w8s[0][0].t(), scale_a=xs, scale_b=w8s[0][1][None, :], out_dtype=torch.bfloat16)
    except (RuntimeError, AttributeError) as e:  # no FP8 tensor cores, or a torch without rowwise scales
        return f"n/a ({str(e)[:40]})", ""
    return t, f"{rel(got[:M], ref):.1e}"


if __name__ == "__main__":
    main()
