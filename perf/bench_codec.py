#!/usr/bin/env python3
"""DAC codec speed on a GPU: streaming decode of one chunk per stream for a batch of streams, whole-clip
encode; fp32 (TF32 off / on, cuDNN autotuning on) against fp16 and bf16, with the output difference to exact
fp32. For fp16 (the GPU default) it also times what dac_decoder runs: the chunk plus the finite check of its audio
and state that sends an overflowing chunk to the fp32 fallback (`StreamDecoder._decode`, host copy included),
against the same without the check.

    python3 perf/bench_codec.py --checkpoint /tmp/s2full --chunk 16 --batches 1,8,32,64
    python3 perf/bench_codec.py --checkpoint /tmp/s2full --served-only     # dac_decoder's paths alone

`--served-only` times what dac_decoder runs per call (fp16 with the fp32 fallback, `StreamDecoder.decode_many`:
numpy in, numpy out) for a batch of streams each sending its next chunk: wall and CPU milliseconds per call with
each stream's own state (no pool), with the slot pool run eagerly, with the pool's CUDA graphs,
the same with the codec's Triton kernels (`pool_graphs_kernels`; `..._ncw`: with the decoder channels-first),
and what the servers open (`--paths`); `--profile DIR` writes kernel and
operator tables of one chunk, as PyTorch ops and with the kernels. Modes ending in `_kernels` use the kernels too.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from s2tts.perf_tools import exit_now, set_variant  # noqa: E402


def timed(fn, iters=10, warmup=2, queued=False):
    """Median milliseconds of `iters` calls after `warmup`. `queued`: each call queued behind a GPU sleep first, so
    that the time is the GPU's alone (as in a CUDA graph), not that of launching it."""
    from s2tts.gpu.timing import gpu_time_ms

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = [gpu_time_ms(fn, queued=queued) for _ in range(iters)]
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--json")
    ap.add_argument("--served-only", action="store_true")
    ap.add_argument("--modes", default="fp32,tf32,fp16,fp16_kernels,bf16",
                    help="precisions to compare (fp32 first: the reference); `_kernels`: the codec's Triton kernels; "
                         "`fp32_kernels_ieee`: their float32 products exact (kernels.FP32_CONV_PRECISION), not tf32x3")
    ap.add_argument("--device", default="cuda", help="--served-only: cpu is a smoke test of this script")
    ap.add_argument("--paths", default="own_state,pool_eager,pool_graphs,pool_graphs_kernels,served",
                    help="--served-only: which of dac_decoder's paths to time (`_kernels`: the codec's Triton kernels; "
                         "`_one_tiling`: every convolution in kernels.CONV_NWC_CONFIG's tiling, not by its shape; "
                         "`_unfused`: each residual unit as its two convolutions, not `kernels.res_unit_nwc`; "
                         "`served`: what the servers open, `codec.stream.open_stream_decoder`)")
    ap.add_argument("--profile", help="--served-only: directory for kernel and operator tables of one fp16 chunk at "
                                      "the largest batch, as PyTorch ops and with the codec's Triton kernels")
    ap.add_argument("--no-phases", action="store_true",
                    help="run every dilated convolution as one (never as its phases, `codec.conv1d_phases`)")
    ap.add_argument("--variant", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a module attribute set first (a kernel table, a switch), as perf/cold_start.py's")
    args = ap.parse_args()
    for v in args.variant:
        set_variant(v)
    if args.no_phases:
        from s2tts.codec import model as codec_module

        codec_module._phases_pay = lambda *a: False
    if args.served_only:
        return bench_served(args)
    from s2tts.codec import kernels
    from s2tts.codec.loading import load_codec_from_dir
    from s2tts.codec.model import use_triton_kernels
    from s2tts.codec.stream import StreamDecoder

    torch.backends.cudnn.benchmark = True
    rows = []
    gen = torch.Generator().manual_seed(0)
    batches = [int(x) for x in args.batches.split(",")]
    all_codes, wav = {}, torch.randn(1, 1, 44100 * 10, generator=gen) * 0.1  # the same inputs for every mode
    for mode in args.modes.split(","):
        torch.backends.cudnn.allow_tf32 = mode == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
        codec = load_codec_from_dir(args.checkpoint, "cuda", mode.split("_")[0] if mode != "tf32" else "fp32")
        use_triton_kernels(codec, "_kernels" in mode)
        kernels.FP32_CONV_PRECISION = "ieee" if mode.endswith("_ieee") else "tf32x3"
        cfg = codec.config
        for b in batches:
            if b not in all_codes:
                all_codes[b] = torch.cat([torch.randint(0, cfg.semantic_codebook_size, (b, 1, 40), generator=gen),
                                          torch.randint(0, cfg.codebook_size, (b, 9, 40), generator=gen)], 1)
            codes = all_codes[b].cuda()
            with torch.inference_mode():
                # a warm state (after 24 frames), then time one chunk
                _, st = codec.decode_stream(codes[..., :24], codec.new_stream_state(b))
                ms = timed(lambda: codec.decode_stream(codes[..., 24:24 + args.chunk], st))
                out = codec.decode_stream(codes[..., 24:24 + args.chunk], st)[0].float()
            audio_s = b * args.chunk * 2048 / 44100
            rows.append({"mode": mode, "batch": b, "chunk_frames": args.chunk, "ms": round(ms, 2),
                         "audio_s_per_s": round(audio_s / (ms / 1000), 1), "_out": out.cpu()})
            if mode.startswith("fp16"):
                chunk = codes[..., 24:24 + args.chunk]
                with torch.inference_mode():
                    served = {check: timed(lambda: StreamDecoder._decode(codec, chunk, [st], check=check))
                              for check in (False, True)}
                rows[-1].update({"served_ms_no_check": round(served[False], 2), "served_ms_checked": round(served[True], 2)})
        with torch.inference_mode():
            w = wav.cuda().to(next(codec.parameters()).dtype)
            enc = codec.encode(w).cpu()
            rows.append({"mode": mode, "encode_10s_ms": round(timed(lambda: codec.encode(w), 5), 1), "_codes": enc})
        del codec
        torch.cuda.empty_cache()
    ref = {r["batch"]: r["_out"] for r in rows if r.get("mode") == "fp32" and "_out" in r}
    ref_codes = next(r["_codes"] for r in rows if r.get("mode") == "fp32" and "_codes" in r)
    for r in rows:
        if "_out" in r:
            o = r.pop("_out")
            r["rel_err_vs_fp32"] = round(float((o - ref[r["batch"]]).norm() / ref[r["batch"]].norm()), 5)
        if "_codes" in r:
            r["encode_codes_equal_fp32"] = round(float((r.pop("_codes") == ref_codes).float().mean()), 4)
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def bench_served(args):
    import time

    import numpy as np

    from s2tts.codec import kernels
    from s2tts.codec.loading import load_codec_from_dir
    from s2tts.codec.model import use_triton_kernels
    from s2tts.codec.stream import StreamDecoder, open_stream_decoder

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    codec = load_codec_from_dir(args.checkpoint, dev, "fp16" if dev.startswith("cuda") else "fp32")
    fallback = load_codec_from_dir(args.checkpoint, dev, "fp32")
    cfg = codec.config
    gen = np.random.default_rng(0)
    n = args.chunk
    rows = []
    paths = {"own_state": (0, False, False), "pool_eager": (256, False, False), "pool_graphs": (256, True, False),
             "pool_graphs_kernels": (256, True, True), "pool_graphs_kernels_ncw": (256, True, "ncw"),
             "pool_graphs_kernels_one_tiling": (256, True, True), "pool_graphs_kernels_unfused": (256, True, True),
             "served": None}
    max_batch = max(int(b) for b in args.batches.split(","))
    unit_channels = kernels.RES_UNIT_MAX_CHANNELS
    if args.profile:
        profile_decode(codec, cfg, max_batch, n, Path(args.profile))
    for label in args.paths.split(","):
        t0 = time.perf_counter()
        kernels.CONV_NWC_BY_SHAPE = label != "pool_graphs_kernels_one_tiling"  # CONV_NWC_CONFIG's for every call
        kernels.RES_UNIT_MAX_CHANNELS = 0 if label == "pool_graphs_kernels_unfused" else unit_channels
        if paths[label] is None:  # what dac_decoder / slow_ar open: the Triton kernels, pool, graphs
            dec, _, made = open_stream_decoder(args.checkpoint, dev, "auto", 256, 600.0, [4, 8, n], max_batch)
            pool = 256
        else:
            pool, graphs, fused = paths[label]
            for c in (codec, fallback):  # "ncw": the kernels with the decoder channels-first
                use_triton_kernels(c, bool(fused), channels_last=fused != "ncw")
            dec = StreamDecoder(codec, fallback=fallback, pool_size=pool, graphs=graphs)
            made = dec.pool.warm([4, 8, n], max_batch=max_batch) if pool else 0
        if pool:
            from s2tts.codec import model as codec_module

            rows.append({"path": label, "warm_s": round(time.perf_counter() - t0, 2), "graphs": made,
                         "pool_mib": round(dec.pool.bytes / 2**20),
                         "as_phases": sorted(f"{list(k[0])} d{k[2]}" for k, v in codec_module._PHASE_PLAN.items() if v)})
        for b in (int(x) for x in args.batches.split(",")):
            sids = [f"{label}-{b}-{i}" for i in range(b)]

            def chunk():
                return np.concatenate([gen.integers(0, cfg.semantic_codebook_size, (n, 1)),
                                       gen.integers(0, cfg.codebook_size, (n, cfg.n_codebooks))], 1)

            dec.decode_many([(i, s, chunk(), True, False) for i, s in enumerate(sids)], now=0.0)
            walls, cpus = [], []
            for k in range(12):
                jobs = [(i, s, chunk(), False, False) for i, s in enumerate(sids)]
                sync()
                w, c = time.perf_counter(), time.process_time()
                out = dec.decode_many(jobs, now=1.0 + k)
                walls.append((time.perf_counter() - w) * 1e3)
                cpus.append((time.process_time() - c) * 1e3)
                assert all(isinstance(a, np.ndarray) and a.size == n * 2048 for a in out.values()), out
            dec.decode_many([(i, s, np.zeros((0, cfg.n_codebooks + 1), np.int64), False, True) for i, s in enumerate(sids)],
                            now=99.0)
            wall, cpu = float(np.median(walls[2:])), float(np.median(cpus[2:]))
            rows.append({"path": label, "batch": b, "chunk_frames": n, "wall_ms": round(wall, 2), "cpu_ms": round(cpu, 2),
                         "audio_s_per_s": round(b * n * 2048 / 44100 / (wall / 1e3), 1)})
        del dec
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def profile_decode(codec, cfg, batch: int, n: int, out: Path) -> None:
    """CUDA kernel time by kernel name, and by operator, for one streaming chunk (eager, cuDNN's heuristics as in
    serving), PyTorch ops then the codec's Triton kernels."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    from s2tts.codec.model import use_triton_kernels

    out.mkdir(parents=True, exist_ok=True)
    codes = torch.cat([torch.randint(0, cfg.semantic_codebook_size, (batch, 1, n)),
                       torch.randint(0, cfg.codebook_size, (batch, cfg.n_codebooks, n))], 1).cuda()
    for fused in (False, "ncw", True):
        use_triton_kernels(codec, bool(fused), channels_last=fused != "ncw")
        with torch.inference_mode():
            st = codec.new_stream_state(batch)
            for _ in range(3):
                codec.decode_stream(codes, st)
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                codec.decode_stream(codes, st)
                torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as by_op:
                codec.decode_stream(codes, st)
                torch.cuda.synchronize()
        avg = prof.key_averages()
        attr = next(a for a in ("self_device_time_total", "self_cuda_time_total") if hasattr(avg[0], a))
        total = sum(getattr(e, attr) for e in avg) / 1e3
        table = avg.table(sort_by=attr, row_limit=30)
        ops = by_op.key_averages().table(sort_by="cuda_time_total", row_limit=40)  # aten ops with their kernels' time
        name = f"codec_b{batch}_n{n}_{ {False: 'torch', 'ncw': 'kernels_ncw', True: 'kernels'}[fused]}.txt"
        (out / name).write_text(table + "\n\nBy operator (CUDA total includes the kernels it launched):\n" + ops)
        print(f"{name}: {sum(e.count for e in avg)} kernels, {total:.1f} ms of kernel time", flush=True)
    use_triton_kernels(codec, False)


if __name__ == "__main__":
    main()
    exit_now(0)
