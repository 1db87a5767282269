#!/usr/bin/env python3
"""The streaming decoder's convolutions in channels-first (NCW, as the codec runs them) against channels-last (NWC)
memory, on a GPU: each convolution of one chunk (fp16 with the codec's Triton kernels, as served) is recorded, then
timed alone with the same operands in either layout, median of 20 calls after warm-up (each queued behind a GPU sleep:
GPU time, as in a CUDA graph, not launch time), cuDNN heuristics as served.

    python3 perf/bench_conv_layout.py --checkpoint /tmp/s2-full --streams 64 --chunk 4

Prints one row per convolution shape: microseconds in NCW, in NWC (input and weight permuted in memory, the result
left as cuDNN gives it), whether the NWC result comes back channels-last (no transposition left for the next
layer), the largest difference between the two results, the sum over the call, for a dilated convolution the
time of `codec.conv1d_phases` (undilated over the interleaved phases), and for stride-1 convolutions of 16k input
channels two channels-last forms: cuDNN's conv2d on a 4-D channels_last tensor [B, C, 1, T] (`NHWC 4-D us`), and
`kernels.conv1d_nwc` (Triton, an implicit GEMM over [B, T, C]: `Triton NWC us`), each with its largest relative
difference from the NCW result.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def timed_us(fn) -> float:
    from bench_codec import timed

    return timed(fn, iters=20, warmup=3, queued=True) * 1e3


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """[A, C, W] with C the fastest-moving dimension in memory (same values, same shape)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def channels_last_forms(kind: str, x, w, rest, ref, configs: list[str]) -> dict | None:
    """For a stride-1, ungrouped conv1d with input channels in 16s (else None): microseconds and largest relative
    difference from `ref` of cuDNN's conv2d over a 4-D channels_last [B, C, 1, T] ("nhwc", "nhwc_rel") and of
    `kernels.conv1d_nwc` in its fastest of `configs` (kernels.CONV_NWC_CONFIG overrides: "tri", "tri_rel", "tri_cfg",
    that config's index). Neither counts the layout change of its operands: in a channels-last decoder they would
    already be so."""
    from bench_engine import config_overrides

    from s2tts.codec import kernels

    stride, padding, dilation, groups = [v if isinstance(v, int) else v[0] for v in (tuple(rest) + (1, 0, 1, 1)[len(rest):])[:4]]
    if kind != "conv1d" or stride != 1 or groups != 1 or padding != 0 or x.shape[1] % 16:
        return None

    def rel(y) -> float:
        return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-12))

    x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    w4 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    got = {"nhwc": timed_us(lambda: F.conv2d(x4, w4, None, 1, 0, (1, dilation))),
           "nhwc_rel": rel(F.conv2d(x4, w4, None, 1, 0, (1, dilation)).squeeze(2))}
    xt, wn = x.transpose(1, 2).contiguous(), kernels.conv_weight_nwc(w)
    base = dict(kernels.CONV_NWC_CONFIG)
    try:
        for i, cfg in enumerate(configs):
            kernels.CONV_NWC_CONFIG.update(base, **config_overrides(cfg))
            t = timed_us(lambda: kernels.conv1d_nwc(xt, wn, dilation))
            if "tri" not in got or t < got["tri"]:
                got.update(tri=t, tri_rel=rel(kernels.conv1d_nwc(xt, wn, dilation).transpose(1, 2)), tri_cfg=i)
    finally:
        kernels.CONV_NWC_CONFIG.clear()
        kernels.CONV_NWC_CONFIG.update(base)
    return got


def record_convs(codec, codes) -> list[tuple]:
    """(kind, input, weight, stride, padding and the rest of the arguments) of every convolution one decode_stream
    call runs (the codec passes them by position)."""
    seen, real = [], {"conv1d": F.conv1d, "conv_transpose1d": F.conv_transpose1d}

    def spy(kind):
        def call(x, w, b=None, *rest):
            seen.append((kind, x.detach().clone(), w, rest))
            return real[kind](x, w, b, *rest)
        return call

    from s2tts.codec import model as codec_module

    plan, codec_module._phases_pay = codec_module._phases_pay, lambda *a: False  # the codec's own form of each
    F.conv1d, F.conv_transpose1d = spy("conv1d"), spy("conv_transpose1d")
    try:
        with torch.inference_mode():
            codec.decode_stream(codes, codec.new_stream_state(codes.shape[0]))
    finally:
        F.conv1d, F.conv_transpose1d = real["conv1d"], real["conv_transpose1d"]
        codec_module._phases_pay = plan
    return seen


def chunk_parser(doc: str, chunk: int) -> argparse.ArgumentParser:
    """A codec bench's command line: --checkpoint, --streams, --chunk (frames)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=chunk)
    return ap


def random_chunk(cfg, streams: int, frames: int, device) -> torch.Tensor:
    """Codes [streams, num_codebooks, frames] of a fixed seed, on `device`."""
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.randint(0, cfg.semantic_codebook_size, (streams, 1, frames), generator=g),
                      torch.randint(0, cfg.codebook_size, (streams, cfg.n_codebooks, frames), generator=g)],
                     1).to(device)


def main():
    ap = chunk_parser(__doc__, 4)
    ap.add_argument("--nwc-config", action="append", default=[],
                    help="kernels.CONV_NWC_CONFIG overrides for the Triton NWC column, e.g. 'block_t=64,block_co=128' "
                         "(repeat: each shape keeps its fastest; default: the config as it is)")
    args = ap.parse_args()
    configs = args.nwc_config or [""]
    from s2tts.codec.loading import load_codec_from_dir
    from s2tts.codec.model import use_triton_kernels

    codec = load_codec_from_dir(args.checkpoint, "cuda", "fp16")
    codec.drop_encoding()
    use_triton_kernels(codec, channels_last=False)  # its convolutions as PyTorch calls, to be recorded
    convs = record_convs(codec, random_chunk(codec.config, args.streams, args.chunk, "cuda"))
    from s2tts.codec.model import conv1d_phases

    rows, totals = {}, [0.0, 0.0, 0]
    last = {"calls": 0, "ncw": 0.0, "nhwc": 0.0, "tri": 0.0}  # over the convolutions the channels-last forms take
    with torch.inference_mode():
        for kind, x, w, rest in convs:
            key = (kind, tuple(x.shape), tuple(w.shape), rest)
            if key not in rows:
                fn = getattr(F, kind)
                xl, wl = channels_last(x), channels_last(w)
                ncw = timed_us(lambda: fn(x, w, None, *rest))
                nwc = timed_us(lambda: fn(xl, wl, None, *rest))
                a, b = fn(x, w, None, *rest), fn(xl, wl, None, *rest)
                diff = float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-12))
                dil = rest[2][0] if kind == "conv1d" else 1
                phases, best = "", ncw  # best: what the codec runs (phases where faster)
                if dil > 1:
                    t_phases = timed_us(lambda: conv1d_phases(x, w, None, dil))
                    c = conv1d_phases(x, w, None, dil)
                    phases = f"{t_phases:.1f} ({float((a.float() - c.float()).abs().max() / a.float().abs().max()):.0e})"
                    best = min(ncw, t_phases)
                rows[key] = [ncw, nwc, b.stride(1) == 1, diff, 0, phases, best,
                             channels_last_forms(kind, x, w, rest, a, configs)]
            rows[key][4] += 1
            if rows[key][7]:
                last["calls"] += 1
                last["ncw"] += rows[key][6]
                last["nhwc"] += rows[key][7]["nhwc"]
                last["tri"] += rows[key][7]["tri"]
            totals[0] += rows[key][0]
            totals[1] += rows[key][1]
            totals[2] += 1
    print(f"\n{args.streams} streams x {args.chunk} frames, fp16, {totals[2]} convolutions a call\n")
    print("| kind | input | weight | stride, padding, dilation, groups | calls | NCW us | NWC us | NWC out channels-last "
          "| rel diff | phases us (rel diff) | NHWC 4-D us (rel diff) | Triton NWC us (rel diff) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (kind, xs, ws, rest), (ncw, nwc, cl, diff, n, phases, _, cl_forms) in rows.items():
        nhwc = tri = ""
        if cl_forms:
            nhwc = f"{cl_forms['nhwc']:.1f} ({cl_forms['nhwc_rel']:.0e})"
            tri = f"{cl_forms['tri']:.1f} ({cl_forms['tri_rel']:.0e}, config {cl_forms['tri_cfg']})"
        print(f"| {kind} | {list(xs)} | {list(ws)} | {rest} | {n} | {ncw:.1f} | {nwc:.1f} | {cl} | {diff:.1e} | {phases} "
              f"| {nhwc} | {tri} |")
    print(f"\nsum over the call: NCW {totals[0] / 1e3:.2f} ms, NWC {totals[1] / 1e3:.2f} ms")
    print(f"the {last['calls']} stride-1 convolutions a channels-last form takes: as the codec runs them (NCW, phases "
          f"where faster) {last['ncw'] / 1e3:.2f} ms, cuDNN NHWC 4-D {last['nhwc'] / 1e3:.2f} ms, Triton NWC "
          f"{last['tri'] / 1e3:.2f} ms (configs: {configs})")


if __name__ == "__main__":
    main()
