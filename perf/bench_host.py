#!/usr/bin/env python3
"""The serving loop's host work alone: `EngineService` over an engine and a codec that do nothing, so that every
second it spends is the loop's own Python (routing, chunking, the codec's plan, hand-outs, the sender thread).

    python perf/bench_host.py --streams 64,128 --seconds 5 --json host.json

Each level keeps `--streams` requests live (a finished one is replaced at once, as under load), the engine making a
frame for every live request at every step and ending a request after `--frames` frames (the first requests' ends
spread evenly over that many steps, so that requests start and end at every step as a served load's do, not in
waves); the codec answers each call
with silence. It prints, per level, the passes a second, the host's milliseconds a pass (wall time; with the load's
held codec calls and chunk sizes as the settings make them: `--set key=value` changes one) and the process's CPU
milliseconds a pass (all its threads: steadier than wall time on a shared machine), frames a second (what a GPU
whose step took no time would let through), and the codec's calls as the served decoder would make them: calls a
pass, streams a call, and the share of the frames a GPU would decode that is padding (streams padded to a batch
bucket, final chunks to a prepared length). No model and no GPU: it runs on any machine. `--step-ms` gives the
idle engine's step a GPU's duration, so that the passes come at a served load's rate and the codec's calls are
planned as a served load's are (the finished requests' calls between held ones then come about once a pass).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2tts import settings  # noqa: E402
from s2tts.ar.sampling import SamplingParams  # noqa: E402
from s2tts.engine.config import EngineConfig  # noqa: E402
from s2tts.engine.prompt import Prompt  # noqa: E402
from s2tts.engine.scheduler import FINISH_CANCELLED, FINISH_LENGTH, Output  # noqa: E402
from s2tts.codec.stream import SlotPool  # noqa: E402
from s2tts.engine.service import EngineService  # noqa: E402

C = 10  # codebooks, as S2 Pro's
FRAME_SECONDS = 2048 / 44100


class IdleEngine:
    """What `EngineService` asks of an `Engine`, answered at once: every live request gets a frame a step."""

    def __init__(self, config: EngineConfig, frames: int, step_s: float = 0.0):
        self.config, self.frames, self.step_s = config, frames, step_s
        self.max_batch = config.max_batch
        self.device = type("Device", (), {"type": "cpu"})()
        self.s2 = type("S2", (), {"num_codebooks": C})()
        self.last_fault, self.preemptions, self.launch_s, self.wait_s, self.finished_next = None, 0, 0.0, 0.0, False
        self.kv_capacity_tokens = config.max_batch * 2048
        self._lock = threading.Condition()
        self._new: list[str] = []
        self._cancel: set[str] = set()
        self.live: dict[str, int] = {}  # request id -> frames made
        self.codes = np.zeros((1, C), np.int32)
        self.head_starts: list[int] = []  # frames the next submitted requests count as made already (the first wave)
        self._start: dict = {}  # request id -> its head start

    def submit(self, rid, prompt, params):
        with self._lock:
            if self.head_starts:
                self._start[rid] = self.head_starts.pop(0)
            self._new.append(rid)
            self._lock.notify()

    def cancel(self, rid):
        with self._lock:
            self._cancel.add(rid)
            self._lock.notify()

    def wake(self):
        with self._lock:
            self._lock.notify_all()

    def has_work(self):
        return bool(self.live or self._new)

    def wait_for_work(self, timeout=None):
        with self._lock:
            if not self.has_work():
                self._lock.wait(timeout)
            return self.has_work()

    def decoding(self):
        return bool(self.live)

    def slots(self):
        return len(self.live), 0

    def slots_wanted(self):
        return len(self.live) + len(self._new)

    def step(self):
        if self.step_s:
            time.sleep(self.step_s)
        with self._lock:
            new, self._new = self._new, []
            cancel, self._cancel = self._cancel, set()
        out = []
        for rid in new:
            self.live[rid] = self._start.pop(rid, 0)
        for rid in list(self.live):
            if rid in cancel:
                del self.live[rid]
                out.append(Output(rid, np.zeros((0, C), np.int32), True, FINISH_CANCELLED))
                continue
            self.live[rid] += 1
            done = self.live[rid] >= self.frames
            out.append(Output(rid, self.codes, done, FINISH_LENGTH if done else None, queue_s=0.0 if self.live[rid] == 1
                              else None))
            if done:
                del self.live[rid]
        return out

    step_ahead = step

    def launch_next(self):
        return []

    def fail_all(self, reason):
        return []

    def counts(self):
        return {"waiting": len(self._new), "live": len(self.live), "free_slots": self.max_batch - len(self.live)}

    def where(self, rid):
        return "live" if rid in self.live else "unknown"


class SilentCodec:
    """A stream decoder that decodes nothing: each job's audio is silence of its length. It counts the calls the
    served decoder would make of these jobs, as `codec.stream` groups them (one call a chunk length, a final chunk
    padded to a prepared length, streams padded to the pool's batch bucket, at most `max_frames` frames a call):
    how many streams a call holds and what share of the frames a GPU would decode is padding."""

    def __init__(self, lengths, max_batch: int, max_frames: int | None = None):
        self.lengths = sorted(set(lengths))
        self.caps = SlotPool.call_caps(self.lengths, SlotPool.batch_buckets(SlotPool.BUCKETS, max_batch), max_frames)
        self.silence = np.zeros(0, np.float32)
        self.calls = self.streams = self.frames = self.computed = 0

    def slices(self, n, final=False):
        return [n]

    def _bucket(self, rows: int, n: int) -> list[int]:
        """The batches the pool decodes `rows` streams of `n` frames in: calls of at most its cap for n
        (`SlotPool.call_caps`), each at its bucket (`SlotPool.bucket_for`)."""
        cap, out = self.caps.get(n) or rows, []
        while rows > 0:
            part = min(rows, cap)
            out.append(SlotPool.bucket_for(SlotPool.BUCKETS, part))
            rows -= part
        return out

    def decode_many(self, jobs, now, queued=None):
        if queued is not None:
            queued()
        groups: dict[int, list[int]] = {}
        for _, _, codes, _, final in jobs:
            n = codes.shape[0]
            if n:
                at = SlotPool.padded_to(self.lengths, n) if final else n
                groups.setdefault(at, []).append(n)
        for at, ns in groups.items():
            buckets = self._bucket(len(ns), at)
            self.calls += len(buckets)
            self.streams += len(ns)
            self.frames += sum(ns)
            self.computed += sum(buckets) * at
        need = max((codes.shape[0] for _, _, codes, _, _ in jobs), default=0) * 2048
        if self.silence.size < need:
            self.silence = np.zeros(need, np.float32)
        return {k: self.silence[: codes.shape[0] * 2048] for k, _, codes, _, _ in jobs}

    def close(self, sid):
        pass


class Responder:
    def __init__(self, done):
        self.done = done

    def send(self, response, final):
        if final:
            self.done()

    def is_cancelled(self):
        return False


def level(streams: int, seconds: float, frames: int, values: dict, step_s: float = 0.0) -> dict:
    """One level: `streams` requests kept live for `seconds` -> its numbers."""
    config = EngineConfig.from_values(values, max_batch=streams, max_queued_requests=streams)
    engine = IdleEngine(config, frames, step_s)
    K = config.codec_batch_steps
    codec = SilentCodec(EngineService.codec_lengths(values["first_chunk_frames"], values["chunk_frames"], K), streams,
                        streams * K if K > 1 else None)
    svc = EngineService(engine, lambda codes, reason, stats, audio: (codes.shape[0], reason), lambda e: e,
                        name="host", frame_seconds=FRAME_SECONDS, codec=codec)
    svc.load.pace = lambda: 0.5  # under load, as at these levels on a GPU: held codec calls, the load's chunks
    prompt = Prompt(torch.zeros(40, dtype=torch.int64), torch.zeros(40, C, dtype=torch.int64),
                    torch.zeros(40, dtype=torch.bool))
    params = SamplingParams(seed=1, max_new_tokens=frames, ignore_end=True)
    n, lock, ended = [0], threading.Lock(), [0]

    def submit():
        with lock:
            n[0] += 1
            rid = f"r{n[0]}"
        svc.submit(rid, Responder(finished), prompt, params, values["first_chunk_frames"], values["chunk_frames"])

    def finished():
        ended[0] += 1
        submit()

    try:
        engine.head_starts = [i * frames // streams for i in range(streams)]  # the first wave's ends spread out
        for _ in range(streams):
            submit()
        time.sleep(min(1.0, seconds / 4))  # the first wave's prompts and first chunks
        p0, e0, t0, c0 = svc.loop.passes, ended[0], time.perf_counter(), time.process_time()
        w0 = len(svc.loop.first_waits)
        k0 = (codec.calls, codec.streams, codec.frames, codec.computed)
        time.sleep(seconds)
        p1, e1, t1, c1 = svc.loop.passes, ended[0], time.perf_counter(), time.process_time()
        waits = svc.loop.first_waits[w0:]
        calls, in_calls, frames, computed = (b - a for a, b in zip(k0, (codec.calls, codec.streams, codec.frames,
                                                                        codec.computed)))
    finally:
        svc.shutdown()
    passes = p1 - p0
    return {"streams": streams, "seconds": round(t1 - t0, 2), "passes": passes, "passes_per_s": round(passes / (t1 - t0), 1),
            "host_ms_per_pass": round(1e3 * (t1 - t0) / max(1, passes), 3),
            "cpu_ms_per_pass": round(1e3 * (c1 - c0) / max(1, passes), 3),
            "frames_per_s": round(passes * streams / (t1 - t0)), "requests_ended": e1 - e0,
            "codec_calls_per_pass": round(calls / max(1, passes), 3),
            "streams_per_codec_call": round(in_calls / max(1, calls), 1),
            "codec_padding_share": round(1 - frames / computed, 3) if computed else None,
            # passes from a request's first chunk (its frames made) to its audio handed out (`codec_first_steps`)
            "first_wait_passes_mean": round(float(np.mean(waits)), 2) if waits else None,
            "first_wait_passes_max": max(waits, default=None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="64,128", help="levels, comma-separated (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds measured a level (default %(default)s)")
    ap.add_argument("--frames", type=int, default=100, help="frames a request (default %(default)s)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="the idle engine's step takes this long (a GPU's step: "
                    "the passes then come at a served load's rate; default %(default)s)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting (docs/SETTINGS.md)")
    ap.add_argument("--json", help="also write the levels here")
    a = ap.parse_args(argv)
    given = dict(kv.split("=", 1) for kv in a.set)
    values = settings.resolve({"checkpoint": "-", **given})
    rows = [level(int(s), a.seconds, a.frames, values, a.step_ms / 1e3) for s in a.streams.split(",") if s.strip()]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps({"levels": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
