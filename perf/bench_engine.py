#!/usr/bin/env python3
"""Engine-level speed of S2 Pro on one GPU (no Triton): decode-step time per batch size,
eager PyTorch against CUDA graphs + the Triton decode-attention kernel, with a profile
of the slow AR, the fast AR and the rest of the step.

    python perf/bench_engine.py --checkpoint /tmp/s2-full --make-full --batches 1,8,64 --frames 100

Random weights never choose to stop: every request generates exactly --frames frames.
Prints a markdown table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from s2tts.perf_tools import exit_now, graph_time_ms  # noqa: E402

FPS = 44100 / 2048  # frames per second of audio


def config_overrides(text: str) -> dict:
    """'block_n=128,num_warps=8' -> {"block_n": 128, "num_warps": 8}: kernel tiling overrides given on a command line."""
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def run_engine(model, residual, batch, frames, graphs: bool, max_seq: int, prompts, dependent_launch=None,
               splits: int | None = None):
    """`splits`: the decode-attention kernel's programs a row (a power of two; None: the engine's choice); see
    `attention_split` for the rest of that split."""
    from s2tts.engine import Engine, EngineConfig
    from s2tts.ar.sampling import SamplingParams

    t0 = time.perf_counter()
    eng = Engine(model, residual, EngineConfig(max_batch=batch, max_seq_len=max_seq, cuda_graphs=graphs,
                                               decode_kernel=graphs, dependent_launch=dependent_launch, decode_splits=splits))
    init_s = time.perf_counter() - t0
    for i in range(batch):
        eng.submit(f"r{i}", prompts[i % len(prompts)], SamplingParams(seed=i, max_new_tokens=frames, ignore_end=True))
    torch.cuda.synchronize()
    t_first = time.perf_counter()
    while eng.counts()["waiting"] or eng.counts()["prefilling"]:
        eng.step()  # prefill of all requests (+ their first frame), max_prefill_tokens a step
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t_first
    steps, first = [], []
    while eng.has_work():
        t = time.perf_counter()
        first += [o.codes for o in eng.step() if o.request_id == "r0" and o.codes is not None]
        steps.append(time.perf_counter() - t)
    steps.sort()
    med = steps[len(steps) // 2]
    return {"batch": batch, "graphs": graphs, "init_s": round(init_s, 2), "prefill_ms": round(prefill_s * 1e3, 1),
            "step_ms_p50": round(med * 1e3, 3), "step_ms_p90": round(steps[int(len(steps) * 0.9)] * 1e3, 3),
            "frames_per_s": round(batch / med, 1), "stream_rtf": round(med * FPS, 4),
            "audio_s_per_s": round(batch / med / FPS, 1),
            "r0_codes": hashlib.sha1(b"".join(c.tobytes() for c in first)).hexdigest()[:10],
            "dependent_launch": eng.runner.dependent_launch}, eng


@contextlib.contextmanager
def attention_split(model, split_from: int | None = None, min_split: int | None = None):
    """Within it, engines (their captured graphs, their steps, the pieces timed after them) split a row's keys in the
    decode-attention kernel from `split_from` keys of the longest row (ModelRunner.SPLIT_FROM, at least 1) in parts
    of at least `min_split` keys (each attention's decode_min_split); None leaves either as it is."""
    from s2tts.engine.runner import ModelRunner

    layers = [m for m in model.modules() if hasattr(m, "decode_min_split")]
    before = ModelRunner.SPLIT_FROM, [m.decode_min_split for m in layers]
    if split_from is not None:
        ModelRunner.SPLIT_FROM = split_from
    for m in layers:
        m.decode_min_split = m.decode_min_split if min_split is None else min_split
    try:
        yield
    finally:
        ModelRunner.SPLIT_FROM = before[0]
        for m, v in zip(layers, before[1]):
            m.decode_min_split = v


def profile(eng, batch):
    """Graph-timed pieces of one decode step at this batch size (slots 0..batch-1 after a run)."""
    model = eng.model
    dev = eng.device
    slots = torch.arange(batch, device=dev)
    pos = torch.full((batch, 1), 200, device=dev)
    step = torch.zeros(batch, dtype=torch.int64, device=dev)
    x = torch.randn(batch, 1, model.s2.text.dim, device=dev, dtype=eng.dtype)
    hidden = torch.randn(batch, model.s2.text.dim, device=dev, dtype=eng.dtype)
    code0 = torch.zeros(batch, dtype=torch.int64, device=dev)
    t, p, k, sd = eng.runner.temperature[slots], eng.runner.top_p[slots], eng.runner.top_k[slots], eng.runner.seed[slots]
    with eng.runner._launch_mode(batch):  # the pieces launched as the engine's passes launch them
        return {
            "slow_ar_ms": round(graph_time_ms(lambda: model.slow(x, pos, slots)), 3),
            "fast_ar_ms": round(graph_time_ms(lambda: eng.runner.fast_ar(hidden, code0, t, p, k, sd, step)), 3),
            "full_step_ms": round(graph_time_ms(lambda: eng.runner._decode_core(slots, pos, step)), 3),
        }


def check_parity(ck, prompts, steps=6):
    """Teacher-forced logits of prefill + `steps` decode steps, against a float32 reference:
    bf16 plain PyTorch and bf16 with the fused Triton kernels (relative error, argmax agreement)."""
    from s2tts.ar.loading import load_model
    from s2tts.ar.model import use_triton_kernels

    p = prompts[0]
    s2 = None
    results = {}
    for name, dtype, fused in (("fp32", "fp32", False), ("bf16", "bf16", False), ("bf16_fused", "bf16", True)):
        model = load_model(ck, "cuda", dtype)
        s2 = model.s2
        use_triton_kernels(model, fused)
        for layer in model.slow.layers:
            layer.attention.decode_kernel = fused
        model.slow.stack.setup_caches(2, 256, next(model.parameters()).dtype, "cuda")
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 1000, (steps, s2.num_codebooks), generator=gen)
        tokens = torch.cat([p.tokens, codes[:, 0] + s2.semantic_start_id]).cuda()
        allc = torch.cat([p.codes, codes]).cuda()
        sem = torch.cat([p.semantic, torch.ones(steps, dtype=torch.bool)]).cuda()
        T = len(p)
        slots = torch.tensor([1], device="cuda")
        out = []
        with torch.inference_mode():
            x = model.embed(tokens[None], allc[None], sem[None])
            pos = torch.arange(T + steps, device="cuda")[None]
            _, lg = model.slow(x[:, :T], pos[:, :T], slots, kv_len_max=T)
            out.append(lg[0, -1].float())
            for i in range(T, T + steps):
                _, lg = model.slow(x[:, i:i + 1], pos[:, i:i + 1], slots, kv_len_max=i + 1)
                out.append(lg[0, -1].float())
        results[name] = torch.stack(out)
        del model
        torch.cuda.empty_cache()
    ref = results["fp32"]
    rep = {}
    for name in ("bf16", "bf16_fused"):
        err = ((results[name] - ref).norm(dim=-1) / ref.norm(dim=-1))
        rep[name] = {"rel_err_prefill": round(float(err[0]), 5), "rel_err_decode_max": round(float(err[1:].max()), 5),
                     "argmax_agree": round(float((results[name].argmax(-1) == ref.argmax(-1)).float().mean()), 3)}
    return rep


def kernel_profile(eng, batch, path):
    """CUDA kernel time by kernel name for one decode step (eager launch of the captured function)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    dev = eng.device
    slots = torch.arange(batch, device=dev)
    pos = torch.full((batch, 1), 200, device=dev)
    step = torch.zeros(batch, dtype=torch.int64, device=dev)
    with torch.inference_mode():
        for _ in range(3):
            eng.runner._decode_core(slots, pos, step)
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.runner._decode_core(slots, pos, step)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(table)
    n = sum(e.count for e in prof.key_averages())
    return n, table


def variant(text: str) -> tuple[str, dict]:
    """'NAME=key=value,key=value' -> (NAME, {key: value})."""
    name, _, rest = text.partition("=")
    return name, dict(kv.split("=", 1) for kv in rest.split(",") if kv)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--make-full", action="store_true", help="write a full-size random checkpoint there first if missing")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--eager", action="store_true", help="also time the eager baseline")
    ap.add_argument("--parity", action="store_true", help="first compare fused kernels against plain PyTorch")
    ap.add_argument("--kernel-profile", help="directory for per-kernel CUDA time tables")
    ap.add_argument("--weights", default="dtype",
                    help="comma-separated load_model weights forms to time in turn: dtype (bf16), fp8 (ar_weights=fp8)")
    ap.add_argument("--fp8-config", action="append", default=[],
                    help="the FP8 kernel's tiling for the fp8 runs: kernels.GEMV_FP8_CONFIG with these overrides, e.g. "
                         "'swap=1,block_n=128' (repeat: one set of fp8 rows each; without it, the server's)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=key=value,...: run every batch once per variant, in one process (keys: pdl=0|1, "
                         "small_rows=N for kernels.GEMV_SMALL_ROWS, small_block_n, small_block_k, small_num_warps, "
                         "small_num_stages; the attention's split of a row's keys: splits=N (a power of two), "
                         "split_from=N keys, min_split=N keys, few_rows=N for ModelRunner.FEW_ROWS (0: no split "
                         "for few rows), blas=cublas|cublaslt (torch.backends.cuda.preferred_blas_library: the "
                         "library of the products PyTorch runs), short_keys=0|1 (kernels.SHORT_KEYS: the fast "
                         "AR's attention in short tiles), attention_<key>=N for kernels.DECODE_ATTENTION_CONFIG's "
                         "keys (block_n, num_warps, num_stages, kv_together), swiglu=0|1 (kernels.SWIGLU_IN_PRODUCT: "
                         "the SwiGLU in gemv_small's last step), sort16=0|1 (kernels.SORT_KEY16: bf16 logits sorted "
                         "as 32-bit keys), rope_attend=0|1 (kernels.ROPE_ATTEND_SHORT: the fast AR's q/k norm, "
                         "RoPE, cache write and attention in one kernel))")
    ap.add_argument("--json")
    args = ap.parse_args()

    from s2tts.ar import kernels
    from s2tts.codec.loading import codec_codebook_sizes
    from s2tts.ar.loading import load_model
    from s2tts.frontend.prompt_builder import PromptBuilder

    ck = Path(args.checkpoint)
    if args.make_full and not (ck / "config.json").is_file():
        from s2tts.random_checkpoint import write_checkpoint

        t = time.perf_counter()
        write_checkpoint(ck, "full", seed=0, device="cuda")
        print(f"wrote full-size checkpoint in {time.perf_counter() - t:.1f} s", flush=True)
    residual = codec_codebook_sizes(ck)[1]
    rows = []
    fp8_base = dict(kernels.GEMV_FP8_CONFIG)
    runs = [(w, c) for w in args.weights.split(",") for c in ((args.fp8_config or [""]) if w == "fp8" else [""])]
    for weights, cfg in runs:
        kernels.GEMV_FP8_CONFIG.clear()
        kernels.GEMV_FP8_CONFIG.update(fp8_base, **config_overrides(cfg))
        t = time.perf_counter()
        model = load_model(ck, "cuda", "bf16", weights=weights)
        torch.cuda.synchronize()
        print(f"{weights}: loaded in {time.perf_counter() - t:.1f} s; weights "
              f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
        pb = PromptBuilder.from_dir(ck, model.s2)
        prompts = [pb.build(f"This is benchmark prompt number {i}, with a few more words to make it realistic.")
                   for i in range(16)]
        if args.parity:
            print("parity (fused kernels vs plain PyTorch):", json.dumps(check_parity(ck, prompts)), flush=True)
            model = load_model(ck, "cuda", "bf16", weights=weights)
        from s2tts.engine.runner import ModelRunner

        small = (kernels.GEMV_SMALL_ROWS, dict(kernels.GEMV_SMALL_CONFIG))
        few_rows = ModelRunner.FEW_ROWS
        blas = torch.backends.cuda.preferred_blas_library()
        switches = {"short_keys": "SHORT_KEYS", "swiglu": "SWIGLU_IN_PRODUCT", "sort16": "SORT_KEY16",
                    "rope_attend": "ROPE_ATTEND_SHORT"}  # variant key: kernels.NAME
        switched = {key: getattr(kernels, name) for key, name in switches.items()}
        attention = dict(kernels.DECODE_ATTENTION_CONFIG)
        for b, (vname, vset), graphs in [(b, v, g) for b in [int(x) for x in args.batches.split(",")]
                                         for v in [variant(v) for v in args.variant or ["default="]]
                                         for g in ([False, True] if args.eager else [True])]:
                kernels.GEMV_SMALL_ROWS = int(vset.get("small_rows", small[0]))
                kernels.GEMV_SMALL_CONFIG.update(small[1], **{k[6:]: int(v) for k, v in vset.items()
                                                              if k.startswith("small_") and k != "small_rows"})
                pdl = None if "pdl" not in vset else bool(int(vset["pdl"]))
                ModelRunner.FEW_ROWS = int(vset.get("few_rows", few_rows))
                torch.backends.cuda.preferred_blas_library(vset.get("blas", blas))
                for key, name in switches.items():
                    setattr(kernels, name, bool(int(vset.get(key, switched[key]))))
                kernels.DECODE_ATTENTION_CONFIG.update(attention, **{k[10:]: int(v) for k, v in vset.items()
                                                                     if k.startswith("attention_")})
                torch.cuda.reset_peak_memory_stats()
                split = {k: int(vset[k]) if k in vset else None for k in ("splits", "split_from", "min_split")}
                with attention_split(model, split["split_from"], split["min_split"]):
                    r, eng = run_engine(model, residual, b, args.frames, graphs, args.max_seq, prompts, pdl,
                                        split["splits"])
                    r["variant"] = vname
                    r["weights"] = weights + (f" ({cfg})" if cfg else "")
                    r["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                    if graphs:
                        with torch.inference_mode():
                            r.update(profile(eng, b))
                        if args.kernel_profile:
                            tag = vname + "_" + weights + cfg.replace(",", "_").replace("=", "")
                            n, table = kernel_profile(eng, b, Path(args.kernel_profile) / f"kernels_{tag}_b{b}.txt")
                            r["kernels_per_step"] = n
                            print(table, flush=True)
                rows.append(r)
                print(json.dumps(r), flush=True)
                del eng
                torch.cuda.empty_cache()
        del model
        gc.collect()  # the model and its last engine reference each other (Model.engine_owner)
        torch.cuda.empty_cache()
    cols = ["variant", "weights", "batch", "graphs", "step_ms_p50", "step_ms_p90", "frames_per_s", "audio_s_per_s", "stream_rtf", "slow_ar_ms",
            "fast_ar_ms", "full_step_ms", "prefill_ms", "init_s", "peak_gib", "dependent_launch", "r0_codes"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
    exit_now(0)
