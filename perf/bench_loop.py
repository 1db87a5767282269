#!/usr/bin/env python3
"""slow_ar's serving loop with the codec in it (`EngineService(codec=...)`, codec_in_engine), no Triton: the ceiling
of what tritonserver can serve from one process, and where a pass's time goes.

    python perf/bench_loop.py --checkpoint /tmp/s2-full --make-full --streams 64 --seconds 20 --batch-steps 1,4,8

`--streams` requests are kept in flight (closed loop: a finished request is replaced at once), each generating
`--frames` frames (random weights never stop; `--frames-jitter` and `--stagger-ms` put streams out of step, as
real clients are). For each `--batch-steps` value: audio seconds delivered per second
(responses with audio, counted between the first --warm-s and the end), the pass time split into the step and the
rest (routing + codec), codec calls and chunks per call, the GPU's busy share (nvidia-smi's utilization, sampled every
0.1 s: the time a kernel ran), and the stall fraction (a request whose chunks, played from
its first one, would run dry; the same rule as perf/loadgen.py). On a CPU with the tiny checkpoint it is a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from loadgen import GpuMonitor, _stall  # noqa: E402 - the same rule as the Triton load generator
from s2tts.perf_tools import checkpoint_arguments, checkpoint_dir, exit_now, served_model_and_codec  # noqa: E402


class _Client:
    """One request's responses as a client would see them: arrival time and audio seconds of every chunk."""

    def __init__(self, sample_rate: int):
        self.sr = sample_rate
        self.arrivals: list[float] = []
        self.durations: list[float] = []
        self.done = threading.Event()
        self.done_at = 0.0
        self.error = None

    def send(self, response, final):
        kind, audio = response
        if kind == "error":
            self.error = audio
        elif audio is not None and audio.size:
            self.arrivals.append(time.monotonic())
            self.durations.append(audio.size / self.sr)
        if final:
            self.done_at = time.monotonic()
            self.done.set()

    def is_cancelled(self):
        return False

    def stalled(self) -> bool:
        return _stall(self.arrivals, self.durations)[0]


def _stall_points(clients) -> dict:
    """Where streams ran dry: {chunk index of the first late chunk: requests}."""
    out: dict[int, int] = {}
    for c in clients:
        for k in range(2, len(c.arrivals) + 1):
            if _stall(c.arrivals[:k], c.durations[:k])[0]:
                out[k - 1] = out.get(k - 1, 0) + 1
                break
    return dict(sorted(out.items()))


def run(args, model, residual, codec, fallback, prompts, sample_rate, frame_s, batch_steps, admit_every, buckets,
        prefill_tokens, uniform=None, load_frames=None, resubmit_ms=0.0, gil_load="", launch_ahead=None,
        codec_overlap=None, light_ahead=None, codec_concurrent=None, final_steps=None):
    from s2tts.codec.stream import StreamDecoder
    from s2tts.engine import Engine, EngineConfig
    from s2tts.engine.service import EngineService
    from s2tts.ar.sampling import SamplingParams

    cuda = model.s2 is not None and next(model.parameters()).device.type == "cuda"
    load_frames = args.load if load_frames is None else load_frames
    config = EngineConfig(max_batch=args.streams, max_seq_len=args.max_seq_len, kv_cache_tokens=args.kv_cache_tokens,
                          prefix_cache_mb=0, admit_every_steps=admit_every, max_prefill_tokens=prefill_tokens,
                          codec_batch_steps=batch_steps, launch_ahead=launch_ahead, codec_concurrent=codec_concurrent)
    if load_frames is not None:
        config = config.replace(load_chunk_frames=load_frames)
    eng = Engine(model, residual, config)
    decoder = StreamDecoder(codec, fallback=fallback, pool_size=2 * args.streams, buckets=buckets)
    if cuda:
        decoder.pool.warm(EngineService.codec_lengths(args.first, args.chunk, batch_steps), max_batch=args.streams)
    svc = EngineService(eng, lambda codes, reason, stats, audio: ("ok", audio), lambda e: ("error", e.wire()),
                        frame_seconds=frame_s, codec=decoder)
    if args.chunk_lag >= 0:
        svc.chunk_lag = args.chunk_lag
    if codec_overlap is not None:
        svc.codec_overlap = codec_overlap
    if light_ahead is not None:
        svc.light_ahead = light_ahead
    if final_steps is not None:
        svc.codec_final_steps = final_steps
    if uniform is not None:
        svc.chunk_options["uniform_from"] = uniform
    clients: list[_Client] = []
    lock = threading.Lock()
    n = [0]

    def submit():
        with lock:
            i = n[0]
            n[0] += 1
        c = _Client(sample_rate)
        clients.append(c)
        frames = args.frames + (int(rng.integers(-args.frames_jitter, args.frames_jitter + 1)) if args.frames_jitter else 0)
        sp = SamplingParams(seed=i, max_new_tokens=max(1, frames), ignore_end=True)
        svc.submit(f"q{i}", c, prompts[i % len(prompts)], sp, args.first, args.chunk)
        return c

    stop_load = threading.Event()
    if gil_load:  # the serving threads' Python beside the engine thread's (slow_ar's sender, the pulls)
        rate, work_ms = (float(x) for x in gil_load.split(":"))

        def busy():
            while not stop_load.wait(1.0 / rate):
                end = time.perf_counter() + work_ms / 1e3
                while time.perf_counter() < end:  # pure Python: holds the GIL, as building a response does
                    pass

        threading.Thread(target=busy, daemon=True).start()
    rng = np.random.default_rng(0)
    live, due = [], {}  # due: a finished client's slot -> when its replacement comes
    for _ in range(args.streams):  # --stagger-ms apart: streams out of step, as clients arrive
        live.append(submit())
        time.sleep(args.stagger_ms / 1e3)
    t0 = time.monotonic()
    svc.loop.every_s = 1e9  # measured here instead
    base = None  # (when, audio delivered, the loop's counters) after --warm-s: what is measured starts there
    gpu = GpuMonitor(interval=0.1) if cuda else None  # the share of time a kernel ran (nvidia-smi's utilization)
    while time.monotonic() - t0 < args.seconds:
        time.sleep(0.01)
        if base is None and time.monotonic() - t0 >= args.warm_s:
            base = (time.monotonic(), sum(sum(c.durations) for c in clients),
                    dataclasses.replace(svc.loop, tails=list(svc.loop.tails), final_waits=list(svc.loop.final_waits)))
            if gpu is not None:
                gpu.reset()
        for k, c in enumerate(live):
            if c.done.is_set():
                if k not in due:  # its replacement's delay, drawn once: --resubmit-ms +- --resubmit-jitter-ms
                    jitter = args.resubmit_jitter_ms * rng.uniform(-1.0, 1.0) if args.resubmit_jitter_ms else 0.0
                    due[k] = c.done_at + max(0.0, resubmit_ms + jitter) / 1e3
                if time.monotonic() >= due[k]:
                    del due[k]
                    live[k] = submit()
    t1 = time.monotonic()
    gpu_busy = gpu.read()["gpu_util_mean"] if gpu is not None else None
    if gpu is not None:
        gpu.close()
    stop_load.set()
    audio = sum(sum(c.durations) for c in clients)
    L, B = svc.loop, base[2]
    steps = max(1, L.steps - B.steps)
    calls = max(1, L.codec_calls - B.codec_calls)
    tails = L.tails[len(B.tails):]
    final_waits = L.final_waits[len(B.final_waits):]
    svc.shutdown()
    finished = [c for c in clients if c.done.is_set() and c.error is None and c.arrivals]
    errors = [c.error for c in clients if c.error is not None and "shutting down" not in c.error]  # not in flight at the end
    out = {"launch_ahead": svc.launch_ahead, "codec_overlap": svc.codec_overlap, "light_ahead": svc.light_ahead,
           "final_steps": svc.codec_final_steps,
           "codec_concurrent": bool(svc._streams),
           "batch_steps": batch_steps, "chunk_lag": svc.chunk_lag, "admit_every": admit_every,
           "prefill_tokens": prefill_tokens, "chunk_options": svc.chunk_options or "default",
           "passes_per_step": round(eng.runner.passes / max(1, svc.loop.steps), 2),
           "buckets": len(decoder.pool.BUCKETS),
           "streams": args.streams, "resubmit_ms": resubmit_ms, "resubmit_jitter_ms": args.resubmit_jitter_ms,
           "gil_load": gil_load or None,
           "audio_s_per_s": round((audio - base[1]) / (t1 - base[0]), 1),
           "step_ms": round(1e3 * (L.step_s - B.step_s) / steps, 2), "rest_ms": round(1e3 * (L.rest_s - B.rest_s) / steps, 2),
           # of it, the engine thread in the codec's calls (with codec_concurrent: waiting for the codec's thread)
           "codec_wait_ms": round(1e3 * (L.codec_wait_s - B.codec_wait_s) / steps, 2),
           "frames_per_step": round((L.frames - B.frames) / steps, 1), "slots_held": round((L.live - B.live) / steps, 1),
           "prompt_steps": round((L.firsts - B.firsts) / steps, 3),
           "prompt_step_ms": round(1e3 * (L.firsts_s - B.firsts_s) / max(1, L.firsts - B.firsts), 2),
           # a step's engine call: launching (host work) and waiting for frames, the prompt steps' apart, and the share
           # of those launched behind a codec call (beside it on the device)
           "launch_ms": round(1e3 * (L.launch_s - B.launch_s) / steps, 2),
           "wait_ms": round(1e3 * (L.wait_s - B.wait_s) / steps, 2),
           "prompt_launch_ms": round(1e3 * (L.firsts_launch_s - B.firsts_launch_s) / max(1, L.firsts - B.firsts), 2),
           "prompt_wait_ms": round(1e3 * (L.firsts_wait_s - B.firsts_wait_s) / max(1, L.firsts - B.firsts), 2),
           "prompt_behind_codec": round((L.firsts_early - B.firsts_early) / max(1, L.firsts - B.firsts), 3),
           "tail_ms_p50": round(1e3 * float(np.median(tails)), 1) if tails else None,
           # codec passes from a request's final item to its final response (the setting codec_final_steps)
           "final_wait_passes_p50": float(np.median(final_waits)) if final_waits else None,
           "off_cpu_ms": round(1e3 * (L.off_cpu_s - B.off_cpu_s) / steps, 2), "gpu_busy_pct": gpu_busy,
           "codec_calls_per_step": round((L.codec_calls - B.codec_calls) / steps, 3),
           "streams_per_call": round((L.codec_streams - B.codec_streams) / calls, 1),
           "requests_done": len(finished), "stall_fraction": round(sum(c.stalled() for c in finished) / max(1, len(finished)), 3),
           "stall_at_chunk": _stall_points(finished), "chunks_per_request": round(
               sum(len(c.arrivals) for c in finished) / max(1, len(finished)), 1),
           "errors": len(errors)}
    if errors:
        out["first_error"] = errors[0]
    svc = eng = decoder = None  # (freed before the cache is emptied; submit() holds svc in its closure)
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_arguments(ap)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--frames-jitter", type=int, default=0, help="each request's frames: --frames +- this (uniform)")
    ap.add_argument("--stagger-ms", type=float, default=0.0, help="between the first --streams submissions")
    ap.add_argument("--first", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warm-s", type=float, default=5.0)
    ap.add_argument("--batch-steps", default="1,4,8")
    ap.add_argument("--admit-every", default="1", help="Engine admit_every values to try (with the first --batch-steps)")
    ap.add_argument("--prefill-tokens", default="512", help="Engine max_prefill_tokens values to try (with the first "
                    "of the others)")
    ap.add_argument("--uniform-from", default="", help="comma-separated paces from which later chunks keep the "
                    "first chunk's length (Chunker(uniform_from=); 1 = never), each tried with the first "
                    "of the others")
    ap.add_argument("--load", type=int, default=None, help="Chunker(load_frames=) of every run but --load-frames' "
                    "(default: the server's, setting load_chunk_frames)")
    ap.add_argument("--load-frames", default="", help="comma-separated first-chunk lengths under load "
                    "(Chunker(load_frames=)), each tried with the first of the others")
    ap.add_argument("--buckets", default="", help="'|'-separated codec batch bucket lists to try (default: the pool's)")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--chunk-lag", type=int, default=-1, help="the chunker's lag in frames (default: the service's)")
    ap.add_argument("--torch-codec", action="store_true", help="the codec as PyTorch ops with cuDNN's heuristics "
                                                                "(before its Triton kernels and autotuning)")
    ap.add_argument("--resubmit-ms", default="0", help="comma-separated: a finished request's replacement comes this "
                    "long after its final response (a served closed loop's round trip: the final's way to the client, "
                    "the next request's way in; 0: at once), each tried with the first of the others")
    ap.add_argument("--resubmit-jitter-ms", type=float, default=0.0, help="each replacement's delay drawn "
                    "uniformly within --resubmit-ms +- this (served clients' round trips differ: arrivals spread over "
                    "the steps instead of all after a held codec call)")
    ap.add_argument("--gil-load", default="", help="comma-separated R:W: a thread runs W ms of pure Python R times a "
                    "second beside the loop (what serving adds in slow_ar's process: its sender builds a "
                    "few hundred responses a second under load, e.g. 340:0.35), each tried with the first of the "
                    "others (the first of all: none)")
    ap.add_argument("--launch-ahead", default="", help="comma-separated 1/0: the engine launches its next step "
                    "before the loop routes the last one's frames (EngineService(launch_ahead=); default: the "
                    "service's, on a GPU), each tried with the first of the others (the first of all: the default)")
    ap.add_argument("--codec-overlap", default="", help="comma-separated 1/0: with steps launched ahead, the next "
                    "one also launched during a held codec call (EngineService.codec_overlap; default on), each tried "
                    "with the first of the others")
    ap.add_argument("--light-ahead", default="", help="comma-separated 1/0: at a light load, steps launched ahead "
                    "once every request has sent audio (EngineService.light_ahead; default on), each tried with the "
                    "first of the others (e.g. --streams 1)")
    ap.add_argument("--codec-concurrent", default="", help="comma-separated 1/0: the codec's calls by a thread of "
                    "their own, on a GPU on a CUDA stream of their own beside the engine's (the setting "
                    "codec_concurrent; default on a GPU), each tried with the first of the others")
    ap.add_argument("--final-steps", default="", help="comma-separated steps: under load a finished request's last "
                    "frames decoded in a call of their own once they have waited this many steps for a held one "
                    "(the setting codec_final_steps; >= --batch-steps: always the held call), each tried with the "
                    "first of the others")
    ap.add_argument("--json")
    args = ap.parse_args()

    from s2tts.codec.loading import codec_codebook_sizes, codec_frame_seconds
    from s2tts.checkpoint_config import S2Config
    from s2tts.frontend.prompt_builder import PromptBuilder

    ck = checkpoint_dir(args)
    model, codec, fallback = served_model_and_codec(ck, args.device, tune=not args.torch_codec)
    s2 = S2Config.from_dir(ck)
    pb = PromptBuilder.from_dir(ck, s2)
    prompts = [pb.build(f"Stream number {i} says a sentence of ordinary length for the benchmark.") for i in range(16)]
    rows = []
    steps = [int(x) for x in args.batch_steps.split(",")]
    admits = [int(x) for x in args.admit_every.split(",")]
    bucket_sets = [tuple(int(b) for b in x.split(",")) for x in args.buckets.split("|")] if args.buckets else [None]
    prefills = [int(x) for x in args.prefill_tokens.split(",")]
    first = (steps[0], admits[0], bucket_sets[0], prefills[0])
    combos = [(bs, *first[1:]) for bs in steps] + [(first[0], a, *first[2:]) for a in admits[1:]] + \
        [(*first[:2], b, first[3]) for b in bucket_sets[1:]] + [(*first[:3], p) for p in prefills[1:]]
    r0 = [float(x) for x in args.resubmit_ms.split(",") if x] or [0.0]

    def go(combo, **kw):
        kw.setdefault("resubmit_ms", r0[0])
        rows.append(run(args, model, codec_codebook_sizes(ck)[1], codec, fallback, prompts, s2.sample_rate,
                        codec_frame_seconds(ck), *combo, **kw))
        print(json.dumps(rows[-1]), flush=True)

    for combo in combos:
        go(combo)
    for lf in [int(x) for x in args.load_frames.split(",") if x]:
        go(first, load_frames=lf)
    for u in [float(x) for x in args.uniform_from.split(",") if x]:
        go(first, uniform=u)
    for d in r0[1:]:
        go(first, resubmit_ms=d)
    for g in [x for x in args.gil_load.split(",") if x]:
        go(first, gil_load=g)
    for n in [int(x) for x in args.final_steps.split(",") if x]:
        go(first, final_steps=n)
    # the service's on / off choices
    for switch in ("launch_ahead", "codec_overlap", "light_ahead", "codec_concurrent"):
        for on in [x for x in getattr(args, switch).split(",") if x]:
            go(first, **{switch: on == "1"})
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    exit_now(main() or 0)
