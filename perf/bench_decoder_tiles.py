#!/usr/bin/env python3
"""The channels-last decoder's convolutions in several tilings, on a GPU: every `kernels.conv1d_nwc` call of one
chunk (fp16, `--streams` x `--chunk` frames, as the served codec makes it: the transposed convolutions in their
two-tap form, each epilogue as the decoder asks for it) is recorded with its operands, then timed alone in each
tiling (`kernels.CONV_NWC_CONFIG` overrides; `shape`: the served choice by shape, `kernels.conv_nwc_tiling`),
median of 20 calls queued behind a GPU sleep (GPU time, as in the pool's CUDA graphs).

    python3 perf/bench_decoder_tiles.py --checkpoint /tmp/s2-full --streams 64 --chunk 8
    python3 perf/bench_decoder_tiles.py --checkpoint /tmp/s2-full --streams 1 --chunk 8 --config '' \
        --config block_t=32,block_co=32 --config block_t=64,block_co=32

Prints one row per call: its rows (batch x output steps), taps and dilation, channels in -> out, its epilogue (b:
bias, r: residual, s: Snake returned, S: Snake into the next input buffer, +raw: the sum kept too), microseconds
in each tiling; then the sums: each tiling over every call, and each call's fastest (what a table of tilings by
shape would give). `--device cpu` (under TRITON_INTERPRET=1, tiny checkpoints) checks the script only: its times
are the interpreter's.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

CONFIGS = ["shape", "", "block_co=64", "block_t=64", "block_t=64,block_co=64", "block_co=64,num_warps=8",
           "num_stages=4", "block_ci=64", "block_t=32,block_co=32"]


def record_calls(codec, codes) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of every kernels.conv1d_nwc call of one decode_stream (their tensors stay alive with them)."""
    from s2tts.codec import kernels

    calls, real = [], kernels.conv1d_nwc

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    kernels.conv1d_nwc = spy
    try:
        with torch.inference_mode():
            codec.decode_stream(codes, codec.new_stream_state(codes.shape[0]))
    finally:
        kernels.conv1d_nwc = real
    return calls


def geometry(args: tuple, kwargs: dict) -> tuple:
    """(x, weight, dilation, taps, output steps) of a recorded call."""
    x, weight = args[0], args[1]
    dilation = args[2] if len(args) > 2 else kwargs.get("dilation", 1)
    taps = weight.shape[0] // x.shape[-1]
    return x, weight, dilation, taps, x.shape[1] - (taps - 1) * dilation


def describe(args: tuple, kwargs: dict) -> tuple[str, str, str, str]:
    """(rows, taps and dilation, channels, epilogue) of a recorded call."""
    x, weight, dilation, taps, t_out = geometry(args, kwargs)
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    epi = ("b" if bias is not None else "") + ("r" if kwargs.get("residual") is not None else "")
    if kwargs.get("alpha") is not None:
        epi += "S" if kwargs.get("snake_out") is not None else "s"
        epi += "+raw" if kwargs.get("raw") else ""
    return f"{x.shape[0]} x {t_out}", f"k{taps} d{dilation}", f"{x.shape[-1]} -> {weight.shape[1]}", epi or "-"


def call_flops(args: tuple, kwargs: dict) -> float:
    """Multiply-adds x 2 of a recorded call: rows x taps x channels in x channels out."""
    x, weight, _, _, t_out = geometry(args, kwargs)
    return 2.0 * x.shape[0] * t_out * weight.shape[0] * weight.shape[1]


def main():
    from bench_conv_layout import chunk_parser, random_chunk

    ap = chunk_parser(__doc__, 8)
    ap.add_argument("--config", action="append", default=[],
                    help="kernels.CONV_NWC_CONFIG overrides, e.g. 'block_t=64,block_co=64' (repeat; '' is "
                         f"CONV_NWC_CONFIG itself, 'shape' the served choice by shape; default: {CONFIGS})")
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script under TRITON_INTERPRET=1")
    args = ap.parse_args()
    from bench_engine import config_overrides

    from s2tts.codec import kernels
    from s2tts.codec.loading import load_codec_from_dir
    from s2tts.codec.model import use_triton_kernels

    cuda = args.device.startswith("cuda")
    if cuda:
        from bench_codec import timed

        def timed_us(fn):
            return timed(fn, iters=20, warmup=3, queued=True) * 1e3
    else:
        def timed_us(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6

    codec = load_codec_from_dir(args.checkpoint, args.device, "fp16" if cuda else "fp32").drop_encoding()
    use_triton_kernels(codec)
    if not codec.decoder.channels_last:
        raise SystemExit("the decoder did not turn channels-last: nothing to time")
    calls = record_calls(codec, random_chunk(codec.config, args.streams, args.chunk, args.device))
    configs = args.config or CONFIGS
    base = dict(kernels.CONV_NWC_CONFIG)
    times = []  # [call][config] us
    with torch.inference_mode():
        for a, kw in calls:
            row = []
            for c in configs:
                kernels.CONV_NWC_BY_SHAPE = c == "shape"
                kernels.CONV_NWC_CONFIG.update(base, **config_overrides("" if c == "shape" else c))
                row.append(timed_us(lambda: kernels.conv1d_nwc(*a, **kw)))
            kernels.CONV_NWC_CONFIG.update(base)
            kernels.CONV_NWC_BY_SHAPE = True
            times.append(row)
    print(f"\n{args.streams} streams x {args.chunk} frames, {next(codec.parameters()).dtype}, {len(calls)} convolutions "
          f"a call; tilings: " + ", ".join(f"[{i}] {c or 'CONV_NWC_CONFIG'}" for i, c in enumerate(configs)) + "\n")
    print("| rows | taps | channels | epilogue | " + " | ".join(f"[{i}] us" for i in range(len(configs)))
          + " | fastest | GFLOP | TFLOP/s [0] / fastest |")
    print("|---|---|---|---|" + "---|" * (len(configs) + 3))
    flops = [call_flops(a, kw) for a, kw in calls]
    for (a, kw), row, f in zip(calls, times, flops):
        best = min(range(len(configs)), key=row.__getitem__)
        print("| " + " | ".join(describe(a, kw)) + " | " + " | ".join(f"{t:.0f}" for t in row) + f" | [{best}] | "
              f"{f / 1e9:.1f} | {f / row[0] / 1e6:.0f} / {f / row[best] / 1e6:.0f} |")
    sums = [sum(r[i] for r in times) for i in range(len(configs))]
    print("\nsums, ms: " + ", ".join(f"[{i}] {s / 1e3:.2f}" for i, s in enumerate(sums))
          + f"; each call's fastest {sum(min(r) for r in times) / 1e3:.2f}; {sum(flops) / 1e12:.2f} TFLOP a call, "
          f"{sum(flops) / sums[0] / 1e6:.0f} TFLOP/s in [0]")


if __name__ == "__main__":
    main()
