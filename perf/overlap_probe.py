#!/usr/bin/env python3
"""Whether the AR's decode steps and the codec's held calls gain from running at the same time on one GPU (two CUDA
streams, two threads of one process) rather than one after the other, as slow_ar's loop runs them today.

    python3 perf/overlap_probe.py --checkpoint /tmp/s2-full --json overlap.json

The AR part is one captured decode step of `--rows` rows (the runner's whole step: slow AR, sampling, fast AR),
replayed and synchronized step by step as the engine's loop does; the codec part is the held call of slow_ar's
codec (`open_stream_decoder` as slow_ar makes it: `--streams` streams x `--frames` frames, numpy in and out). Each
is timed alone for `--seconds`, then both together (each on its own thread and stream) for as long. Prints one
JSON line: steps/s and calls/s alone and together, and `work_together` = steps_together / steps_alone +
calls_together / calls_alone (1.0: no gain from running them together; 2.0: neither slowed the other). With the
loop's mix (`--steps-per-call` steps per codec call) it also says what serial and overlapped passes would make:
frames per second of the AR with the codec keeping up (overlapped: while a call runs the steps go at their
together-rate, the other steps at their own). On a CPU with the tiny checkpoint a smoke test.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

from codec_start import print_json, random_chunk_jobs  # noqa: E402 - the same chunks as the codec's start measures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=8, help="frames a stream a codec call (codec_batch_steps)")
    ap.add_argument("--steps-per-call", type=float, default=8.0, help="AR steps per codec call in the loop's mix")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--ar-priority", type=int, default=0, help="the AR stream's priority (CUDA: lower is higher; -1 is "
                    "the highest PyTorch offers)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import numpy as np
    import torch

    from s2tts import settings
    from s2tts.codec.loading import codec_codebook_sizes
    from s2tts.ar.loading import load_model
    from s2tts.codec.stream import open_stream_decoder
    from s2tts.engine import Engine, EngineConfig
    from s2tts.engine.service import EngineService

    cuda = a.device.startswith("cuda")
    model = load_model(a.checkpoint, a.device, "bf16" if cuda else "fp32")
    eng = Engine(model, codec_codebook_sizes(a.checkpoint)[1], EngineConfig(max_batch=a.rows, max_seq_len=1024,
                                                                            kv_cache_tokens=a.rows * 1024))
    d = settings.SCHEMA
    lengths = EngineService.codec_lengths(d["first_chunk_frames"].default, d["chunk_frames"].default, a.frames)
    dec, _, _ = open_stream_decoder(a.checkpoint, a.device, "auto", 2 * a.streams, 600.0, lengths, a.streams,
                                    a.streams * a.frames)
    dev = eng.device
    slots = torch.arange(a.rows, device=dev)
    pos = torch.full((a.rows, 1), 200, device=dev)
    step = torch.zeros(a.rows, dtype=torch.int64, device=dev)

    ar_stream = torch.cuda.Stream(dev, priority=a.ar_priority) if cuda else None
    codec_stream = torch.cuda.Stream(dev) if cuda else None
    graph = None
    with torch.inference_mode():
        if cuda:
            with torch.cuda.stream(ar_stream):
                for _ in range(2):
                    eng.runner._decode_core(slots, pos, step)
            ar_stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=ar_stream):
                frame = eng.runner._decode_core(slots, pos, step)[0]

    def ar_step():
        with torch.inference_mode():
            if graph is not None:
                with torch.cuda.stream(ar_stream):
                    graph.replay()
                    frame.to("cpu")  # the step's frames to the host: a wait for this stream, as the loop's
            else:  # CPU (no attention kernel): the decode rows as one batch, as the runner runs them there
                r = eng.runner
                io = r._pass_io(a.rows, dev)
                io[r._SLOT], io[r._POS] = slots, pos[:, 0]
                io[r._SRC] = io[r._DST] = torch.arange(a.rows)
                r._slow_core(io, [(0, a.rows, None)])
                r._sample_core(torch.stack([slots, step, torch.ones_like(step)]))

    rng = np.random.default_rng(0)
    C = dec.C
    calls = [0]

    def codec_call():
        k = calls[0]
        calls[0] += 1
        jobs = random_chunk_jobs(rng, C, a.streams, a.frames, k == 0)
        if codec_stream is not None:
            with torch.cuda.stream(codec_stream):
                out = dec.decode_many(jobs, now=float(k))
        else:
            out = dec.decode_many(jobs, now=float(k))
        assert all(isinstance(v, np.ndarray) for v in out.values()), "a chunk failed"

    def loop(fn, stop: threading.Event, counter: list):
        while not stop.is_set():
            fn()
            counter[0] += 1

    def timed(fns) -> list[float]:
        """Run each fn in a loop on a thread of its own for --seconds -> each one's calls per second."""
        stop = threading.Event()
        counts = [[0] for _ in fns]
        threads = [threading.Thread(target=loop, args=(fn, stop, c)) for fn, c in zip(fns, counts)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        time.sleep(a.seconds)
        stop.set()
        for th in threads:
            th.join()
        el = time.perf_counter() - t
        return [c[0] / el for c in counts]

    for _ in range(3):  # warm: first calls, the codec streams opened
        ar_step()
        codec_call()
    (steps_alone,) = timed([ar_step])
    (calls_alone,) = timed([codec_call])
    steps_both, calls_both = timed([ar_step, codec_call])
    k = a.steps_per_call
    # the loop's mix: k steps then one codec call, one after the other; or the call beside the steps: while it runs
    # (its together-time) the steps go at their together-rate, the others at their own
    serial_pass = k / steps_alone + 1 / calls_alone
    during = steps_both / calls_both if calls_both else 0.0  # steps made while one call runs beside them
    overlapped_pass = (1 / calls_both + max(0.0, k - during) / steps_alone) if calls_both and during <= k else \
        k / steps_both
    rep = {"device": str(dev), "gpu": torch.cuda.get_device_name(dev) if cuda else None, "rows": a.rows,
           "streams": a.streams, "frames": a.frames,
           "step_ms_alone": round(1e3 / steps_alone, 2), "codec_call_ms_alone": round(1e3 / calls_alone, 2),
           "step_ms_together": round(1e3 / max(steps_both, 1e-9), 2),
           "codec_call_ms_together": round(1e3 / max(calls_both, 1e-9), 2),
           "work_together": round(steps_both / steps_alone + calls_both / calls_alone, 3),
           "ar_priority": a.ar_priority, "steps_per_call": k, "pass_ms_serial": round(1e3 * serial_pass, 2),
           "pass_ms_overlapped": round(1e3 * overlapped_pass, 2),
           "frames_per_s_serial": round(k * a.rows / serial_pass, 1),
           "frames_per_s_overlapped": round(k * a.rows / overlapped_pass, 1)}
    return print_json(rep, a.json)


if __name__ == "__main__":
    sys.exit(main())
