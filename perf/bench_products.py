#!/usr/bin/env python3
"""The AR's matrix products alone, at a decode step's row counts: each form the model can run them in, timed on the
GPU at every weight shape of S2 Pro's layers, and the step's sum of them (36 slow layers once, 4 fast layers for
each of the 9 codebooks).

    python perf/bench_products.py --rows 1,16,32,64,128 --json products.json

Forms: `cublas` (F.linear in bf16), `kernel` (`ar.kernels.linear`, the row-invariant split-K kernel, in its
default tiling and in each `--tiling`), `small` (`ar.kernels.gemv_small`, at up to its rows, in its tiling and
each `--small-tiling`), and with `--fp8` the FP8 weights' forms: `fp8_kernel` (the same kernel, weight widened in
registers, in its tiling and in each `--fp8-tiling`), `fp8_small` (`gemv_small` with
FP8 weights), `fp8_cublas` (`kernels.fp8_matmul`: the activations quantized too, then cuBLAS's FP8 product) and
`fp8_mm` (that product alone, the activations quantized beforehand: what quantizing them inside the kernel before
would leave). Each timing is a CUDA graph of one product over each of
`--copies` weight copies in turn (their bytes many times the L2, so every call reads its weight from memory);
median of the replays, per product. Prints one table: microseconds a product, and the weight's bytes over that
time (TB/s); the last rows sum a step's products per form, with the best form per shape and row count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from s2tts.perf_tools import exit_now, graph_time_ms  # noqa: E402

from s2tts.random_checkpoint import CODEBOOKS, SIZES  # noqa: E402

_SLOW, _FAST = SIZES["full"]["text"], SIZES["full"]["audio"]  # the full-size checkpoint's layers (both ARs alike)
SHAPES = {  # name: [N, K] of one layer's weight
    "wqkv": ((_SLOW["n_head"] + 2 * _SLOW["n_local_heads"]) * _SLOW["head_dim"], _SLOW["dim"]),
    "wo": (_SLOW["dim"], _SLOW["n_head"] * _SLOW["head_dim"]),
    "w13": (2 * _SLOW["intermediate_size"], _SLOW["dim"]),
    "w2": (_SLOW["dim"], _SLOW["intermediate_size"]),
}
# each shape's products in a decode step: the slow AR's layers once, the fast AR's once for each residual codebook
PER_STEP = _SLOW["n_layer"] + _FAST["n_layer"] * (CODEBOOKS - 1)


def tiling(text: str) -> tuple[str, dict]:
    """'NAME=key=value,...' -> (NAME, overrides of kernels.GEMV_CONFIG)."""
    name, _, rest = text.partition("=")
    return name, {k: int(v) for k, v in (kv.split("=", 1) for kv in rest.split(",") if kv)}


def time_us(fn, iters: int) -> float:
    """Median microseconds of one replay of a CUDA graph of `fn` (`fn` runs its products over every copy once)."""
    return graph_time_ms(fn, iters) * 1e3


def copy_tbps(gib: float = 2.0) -> float:
    """A device-to-device copy's bandwidth (bytes read + written a second, TB/s): the memory's ceiling here."""
    n = int(gib * 2**30) // 2
    a, b = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_(), torch.empty(n, dtype=torch.bfloat16,
                                                                                   device="cuda")
    us = time_us(lambda: b.copy_(a), 50)
    return 2 * a.numel() * 2 / us / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,64,128")
    ap.add_argument("--copies", type=int, default=6, help="weight copies a graph cycles through")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--tiling", action="append", default=[],
                    help="NAME=key=value,...: the kernel also with kernels.GEMV_CONFIG's keys overridden (programs, "
                         "block_n, block_k, num_warps, num_stages, max_block_m, swap); repeat for more")
    ap.add_argument("--small-tiling", action="append", default=[],
                    help="NAME=key=value,...: gemv_small also with kernels.GEMV_SMALL_CONFIG's keys overridden "
                         "(block_n, block_k, num_warps, num_stages), bf16 and (with --fp8) FP8 weights; repeat for more")
    ap.add_argument("--fp8-tiling", action="append", default=[],
                    help="NAME=key=value,...: the FP8 kernel also with GEMV_FP8_CONFIG's keys overridden at every row "
                         "count (as --tiling); repeat for more")
    ap.add_argument("--fp8", action="store_true", help="also the FP8 weights' forms")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from s2tts.ar import kernels

    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    base, small_base = dict(kernels.GEMV_CONFIG), dict(kernels.GEMV_SMALL_CONFIG)
    fp8_base = dict(kernels.GEMV_FP8_CONFIG)
    tilings = [("kernel", {})] + [tiling(t) for t in args.tiling]
    smalls = [("small", {})] + [(f"small:{n}", o) for n, o in map(tiling, args.small_tiling)]
    fp8_tilings = [(f"fp8_kernel:{n}", o) for n, o in map(tiling, args.fp8_tiling)]
    results = []
    for shape, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(args.copies)]
        w8 = [kernels.quantize_fp8(w) for w in ws] if args.fp8 else []
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            forms = {"cublas": lambda: [F.linear(x, w) for w in ws],
                     "cublaslt": lambda: _blas("cublaslt", lambda: [F.linear(x, w) for w in ws])}
            for name, over in tilings:
                forms[name] = lambda over=over: _with(kernels.GEMV_CONFIG, base, over,
                                                      lambda: [kernels.linear(x, w, max_rows=1 << 30) for w in ws])
            for name, over in smalls if M <= kernels.GEMV_SMALL_ROWS else []:
                forms[name] = lambda over=over: _with(kernels.GEMV_SMALL_CONFIG, small_base, over,
                                                      lambda: [kernels.gemv_small(x, w) for w in ws])
                if args.fp8:
                    forms["fp8_" + name] = lambda over=over: _with(
                        kernels.GEMV_SMALL_CONFIG, small_base, over, lambda: [kernels.gemv_small(x, q, scale=s)
                                                                              for q, s in w8])
            if args.fp8:
                forms["fp8_kernel"] = lambda: [kernels.linear(x, q, scale=s) for q, s in w8]
                for name, over in fp8_tilings:
                    forms[name] = lambda over=over: _with(kernels.GEMV_FP8_CONFIG, fp8_base, over,
                                                          lambda: [kernels.linear(x, q, scale=s) for q, s in w8])
                forms["fp8_cublas"] = lambda: [kernels.fp8_matmul(x, q, s) for q, s in w8]
                if kernels.fp8_matmul_available(x.device):
                    x8, xs = kernels.quantize_rows_fp8(x, -(-M // 16) * 16)
                    forms["fp8_mm"] = lambda x8=x8, xs=xs: [torch._scaled_mm(x8, q.t(), scale_a=xs,
                                                                              scale_b=s[None, :],
                                                                              out_dtype=torch.bfloat16)[:M]
                                                            for q, s in w8]
            ref = F.linear(x.float(), ws[0].float())
            for form, fn in forms.items():
                try:
                    out = fn()[0].float()
                    err = float((out - ref).norm() / ref.norm())
                    us = time_us(fn, args.iters) / args.copies
                except Exception as e:  # noqa: BLE001 - a tiling that does not fit (shared memory): noted, skipped
                    print(json.dumps({"shape": shape, "rows": M, "form": form, "error": str(e)[:200]}), flush=True)
                    continue
                wbytes = N * K * (1 if form.startswith("fp8") else 2)
                r = {"shape": shape, "N": N, "K": K, "rows": M, "form": form, "us": round(us, 2),
                     "tbps": round(wbytes / us / 1e6, 3), "rel_err": round(err, 5)}
                results.append(r)
                print(json.dumps(r), flush=True)
        del ws, w8
        torch.cuda.empty_cache()
    ceiling = copy_tbps()  # last, with the clocks up: timed first, on an idle GPU, it reads low
    _table(results, rows, ceiling)
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_tbps": ceiling, "results": results}, indent=2))
    return 0


def _blas(library: str, fn):
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return fn()
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _with(config: dict, base: dict, over: dict, fn):
    config.clear()
    config.update(base, **over)
    try:
        return fn()
    finally:
        config.clear()
        config.update(base)


def _table(results: list[dict], rows: list[int], ceiling: float) -> None:
    forms = list(dict.fromkeys(r["form"] for r in results))
    at = {(r["shape"], r["rows"], r["form"]): r for r in results}
    print(f"\ncopy ceiling {ceiling:.2f} TB/s; us a product (TB/s of its weight)\n")
    print("| shape | rows | " + " | ".join(forms) + " |\n|" + "---|" * (len(forms) + 2))
    for shape in SHAPES:
        for M in rows:
            cells = [f"{at[(shape, M, f)]['us']:.1f} ({at[(shape, M, f)]['tbps']:.2f})" if (shape, M, f) in at
                     else "" for f in forms]
            print(f"| {shape} | {M} | " + " | ".join(cells) + " |")
    print("\nA step's products (ms): each form alone, and the best form of each shape")
    print("| rows | " + " | ".join(forms) + " | best of bf16 forms | best of all |\n|" + "---|" * (len(forms) + 3))
    bf16 = [f for f in forms if not f.startswith("fp8")]
    for M in rows:
        cells = [step_ms(results, M, [f]) for f in forms] + [step_ms(results, M, bf16), step_ms(results, M, forms)]
        print(f"| {M} | " + " | ".join("" if v is None else f"{v:.2f}" for v in cells) + " |")


def step_ms(results: list[dict], rows: int, forms: list[str]) -> float | None:
    """A decode step's products at `rows` rows, ms: each shape's PER_STEP products in the fastest of `forms` timed for
    it; None when some shape has none of them timed."""
    per = [[r["us"] for r in results if r["shape"] == s and r["rows"] == rows and r["form"] in forms] for s in SHAPES]
    return sum(min(p) for p in per) * PER_STEP / 1e3 if all(per) else None


if __name__ == "__main__":
    rc = main()
    exit_now(rc)
