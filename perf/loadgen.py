#!/usr/bin/env python3
"""Load generator for the S2 Pro service: streaming requests at levels of concurrency, client-side timing.

    # gRPC straight to Triton's `s2pro` model (one S2ProClient per worker, one gRPC stream per request)
    python perf/loadgen.py --url 127.0.0.1:8001 --concurrency 1,4,16,64 --frames 100 --json out.json

    # the OpenAI-compatible gateway (POST /v1/audio/speech, stream_format=audio, response_format=pcm)
    python perf/loadgen.py --target http://127.0.0.1:8080 --concurrency 1,4 --frames 100

    # a voice-clone mix: half the requests clone a synthetic 10 s reference, encoded once via dac_encoder
    python perf/loadgen.py --url 127.0.0.1:8001 --clone-fraction 0.5 --clone-mode codes

    # the peak within the SLO: c = 64, 96, 128, ... up to 512, until a level's TTFA p99 is over 500 ms, a stream
    # runs dry or a request fails
    python perf/loadgen.py --url 127.0.0.1:8001 --sweep 64:32:512 --slo-ttfa-p99-ms 500 --frames 100

Each level runs a fixed number of requests (--requests-per-level: default max(2*c, 8), N, or C:N per level) from c closed-loop
workers; every request has its own prompt text (unique in the run), its own seed, and generates exactly
--frames frames (`ignore_eos`; the gateway path cannot ask for that, see --http-ignore-eos). Before the
first level --warmup requests run alone; before each level every worker runs one short request (--warmup-frames),
and then the workers' first requests start spread over one request's time (ramp_delay; --no-ramp: all at once, a
burst of c that identical requests keep in phase for the whole level).

The levels: --concurrency lists them; --sweep START[:STEP[:MAX]] grows them instead (START, START+STEP, ...; no STEP:
doubling) up to MAX and stops at the first level that breaks the SLO: its TTFA p99 over --slo-ttfa-p99-ms, a stream
that ran dry (stall_at_chunk), or a request that failed or did not run. The result's "sweep" names the peak
audio-s/s among the levels that met the SLO and the level that broke it, and why (sweep_summary()).

Per level (client-side; the units as perf/README.md defines them):
  TTFA      request sent -> first non-empty audio, ms: mean / p50 / p90 / p99
  RTF       each request's wall time / its own audio seconds, averaged (also p50, p99)
  audio_s_per_s, req_per_s, frames_per_s   totals over the level's wall time (first send -> last end)
  audio_s_per_s_steady   the audio that arrived while every worker was loaded (from the last worker's first send
                  to the first worker's last end), over that window: the rate without the ramp and the drain
  stall_fraction  share of requests whose audio would underrun if played from its first chunk's arrival;
                  stall_at_chunk (the first late chunk's index: requests) and dry_ms_max (longest silence)
  gpu_mem_peak_mib  peak memory.used summed over visible GPUs during the level (pynvml, else nvidia-smi;
                    "n/a" without a GPU). It counts every process on the GPU, the server's included.
Output: --json FILE (config, per level the numbers and the per-request records, with --sweep its "sweep") and a
markdown table (with --sweep its section "peak within the SLO" under it), printed last.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import sys
import threading
import time
import uuid
import wave
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

HOP = 2048  # samples per frame of the S2 Pro codec (44100 / 2048 = 21.53 frames per second of audio)

# ---------------------------------------------------------------------------------------------- prompts

_OPENINGS = [
    "The quick brown fox jumps over the lazy dog",
    "Hello and welcome to the evening news",
    "Streaming speech synthesis turns text into sound as it is written",
    "A voice reference is a short clip and its transcript",
    "Every morning the baker opens the shop before sunrise",
    "The train to the coast leaves from platform nine",
    "Please remember to bring an umbrella tomorrow",
    "Our quarterly results were better than we expected",
    "The museum will be closed for renovation until spring",
    "She sells sea shells by the sea shore",
    "If you can hear this, the system is working",
    "Turn left at the second traffic light and keep going",
]
_MIDDLES = [
    "and everyone in the room seemed to agree with that",
    "although nobody could say exactly why it happened",
    "so we decided to take a short break and try again",
    "while the rain kept falling softly on the roof",
    "because the instructions were written very clearly",
    "which surprised the engineers more than anyone else",
    "until the music stopped and the lights came back on",
    "and then the story took an unexpected turn",
]
REFERENCE_TEXT = ("This is the reference recording for the voice clone benchmark, read slowly and clearly, "
                  "with a calm and even tone from the first word to the last.")


def prompt_text(i: int) -> str:
    """A unique, natural-looking sentence for request number i (~100-150 characters)."""
    a = _OPENINGS[i % len(_OPENINGS)]
    b = _MIDDLES[(i // len(_OPENINGS) + i) % len(_MIDDLES)]
    return f"{a}, {b}. This is request number {i}."


def reference_waveform(seconds: float = 10.0, sr: int = 44100, seed: int = 0) -> np.ndarray:
    """A speech-like synthetic signal: a gliding harmonic voice with syllable envelopes and breath noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t) + 15 * np.sin(2 * np.pi * 2.3 * t)  # pitch contour
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voice = sum(np.sin(k * phase) / k for k in range(1, 8))
    syll = np.clip(np.sin(2 * np.pi * 4.0 * t + 0.5 * np.sin(2 * np.pi * 0.3 * t)), 0, None) ** 0.6  # ~4 syllables/s
    pauses = (np.sin(2 * np.pi * 0.25 * t) > -0.8).astype(np.float64)  # short pauses
    noise = rng.standard_normal(t.size)
    noise = np.convolve(noise, np.ones(8) / 8, mode="same")  # low-passed breath
    x = (0.25 * voice * syll + 0.03 * noise * (0.3 + syll)) * pauses
    return (0.5 * x / (np.abs(x).max() + 1e-9)).astype(np.float32)


def reference_for(job: "Job", o: "Options", refs: dict) -> np.ndarray:
    """The reference clip a clone_audio request sends: the shared one, or with --fresh-references one no earlier
    request sent (the shared clip plus faint noise of the request's own seed), so that the server meets a new voice:
    dac_encoder encodes it and slow_ar prefills its prefix, which its prefix cache cannot hold yet."""
    x = refs["audio"]
    if not o.fresh_references:
        return x
    rng = np.random.default_rng(1_000_003 + job.idx)
    return (x + 1e-3 * rng.standard_normal(x.size)).astype(np.float32)


def wav_bytes(x: np.ndarray, sr: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- GPU memory


class GpuMonitor:
    """Polls GPU memory (and utilization) in a thread; peak and mean since the last reset()."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.kind, self.names = None, []
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            if n:
                self._nvml = pynvml
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
                self.names = [self._str(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
                self.kind = "pynvml"
        except Exception:
            self._nvml = None
        if self.kind is None and shutil.which("nvidia-smi"):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                     text=True, timeout=20)
                if out.returncode == 0 and out.stdout.strip():
                    self.names = [s.strip() for s in out.stdout.strip().splitlines()]
                    self.kind = "nvidia-smi"
                    self.interval = max(interval, 0.5)
            except (OSError, subprocess.SubprocessError):
                pass
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.reset()
        self._thread = None
        if self.kind:
            self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-monitor")
            self._thread.start()

    @staticmethod
    def _str(s):
        return s.decode() if isinstance(s, bytes) else str(s)

    @property
    def available(self) -> bool:
        return self.kind is not None

    def sample(self) -> tuple[list[float], list[float]] | None:
        """(memory.used MiB per GPU, utilization % per GPU)."""
        try:
            if self.kind == "pynvml":
                nv = self._nvml
                mem = [nv.nvmlDeviceGetMemoryInfo(h).used / 2**20 for h in self._handles]
                util = [float(nv.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles]
                return mem, util
            if self.kind == "nvidia-smi":
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10)
                rows = [r.split(",") for r in out.stdout.strip().splitlines()]
                return [float(r[0]) for r in rows], [float(r[1]) for r in rows]
        except Exception:
            return None
        return None

    def _run(self):
        while not self._stop.is_set():
            s = self.sample()
            if s:
                mem, util = s
                with self._lock:
                    self._peak = max(self._peak, sum(mem))
                    self._peak_per = [max(a, b) for a, b in zip(self._peak_per, mem)] if self._peak_per else list(mem)
                    self._util_sum += sum(util) / max(len(util), 1)
                    self._n += 1
            self._stop.wait(self.interval)

    def reset(self):
        with getattr(self, "_lock", threading.Lock()):
            self._peak, self._peak_per, self._util_sum, self._n = 0.0, [], 0.0, 0

    def read(self) -> dict:
        if not self.available:
            return {"gpu_mem_peak_mib": "n/a", "gpu_mem_peak_per_gpu_mib": "n/a", "gpu_util_mean": "n/a"}
        s = self.sample()  # at least one reading even for a very short level
        with self._lock:
            if s:
                self._peak = max(self._peak, sum(s[0]))
            return {"gpu_mem_peak_mib": round(self._peak, 1), "gpu_mem_peak_per_gpu_mib": [round(x, 1) for x in self._peak_per],
                    "gpu_util_mean": round(self._util_sum / self._n, 1) if self._n else "n/a"}

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------- requests


@dataclass
class Job:
    idx: int
    text: str
    seed: int
    frames: int
    kind: str = "plain"  # plain | clone_codes | clone_audio
    warmup: bool = False


@dataclass
class Record:
    idx: int
    kind: str
    ok: bool = False
    error: str | None = None
    t_send: float = 0.0  # seconds since the level started
    ttfa_s: float | None = None
    arrived_s: float | None = None  # the first audio's arrival in the client process (its gRPC stream thread)
    total_s: float | None = None
    samples: int = 0
    sample_rate: int = 0
    audio_s: float = 0.0
    frames: int = 0
    chunks: int = 0
    stall: bool | None = None  # would playback from the first chunk underrun?
    stall_at_chunk: int | None = None  # the first chunk that came after the audio before it had played (0-based)
    dry_s: float = 0.0  # how long playback would have been silent, all gaps together
    chunk_frames: list = field(default_factory=list)  # each chunk's length in frames, in order (gRPC)
    max_gap_s: float | None = None  # largest gap between chunk arrivals
    server: dict = field(default_factory=dict)  # the model's final stats (gRPC only)
    pid: int = 0  # the client process that ran it (`--procs`)
    worker: int = 0  # the worker that ran it (0..c-1 across processes)
    arrivals: list = field(default_factory=list)  # each chunk's arrival, seconds since the level started
    chunk_audio_s: list = field(default_factory=list)  # each chunk's audio seconds, in order

    @property
    def rtf(self) -> float | None:
        return self.total_s / self.audio_s if self.ok and self.audio_s > 0 else None


def _stall(arrivals: list[float], durations: list[float]) -> tuple[bool, float, int | None, float]:
    """Playback starts at the first chunk; chunk k must arrive before the audio before it has played.
    -> (ran dry, largest gap between arrivals, the first late chunk's index, seconds of silence in all)."""
    gap, first_late, dry = 0.0, None, 0.0
    played_until = arrivals[0]
    for k, (t, d) in enumerate(zip(arrivals, durations)):
        if k:
            gap = max(gap, t - arrivals[k - 1])
            if t > played_until + 1e-3:
                first_late = k if first_late is None else first_late
                dry += t - played_until
                played_until = t
        played_until += d
    return first_late is not None, gap, first_late, dry


class GrpcWorker:
    """One worker: its own S2ProClient; each request on a new gRPC stream unless reuse_stream."""

    def __init__(self, url: str, model: str, opts: "Options", refs: dict):
        from s2tts.client import S2ProClient

        self.client = S2ProClient(url, model)
        self.opts, self.refs = opts, refs

    def run(self, job: Job, level_t0: float) -> Record:
        from s2tts.client import AudioChunk, Final, TTSInput

        o = self.opts
        rec = Record(job.idx, job.kind)
        req = TTSInput(text=job.text, seed=job.seed, max_new_tokens=job.frames, ignore_eos=o.ignore_eos,
                       temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                       first_chunk_frames=o.first_chunk_frames, chunk_frames=o.chunk_frames)
        if job.kind == "clone_codes":
            req.reference_codes, req.reference_text = self.refs["codes"], REFERENCE_TEXT
        elif job.kind == "clone_audio":
            req.reference_audio, req.reference_sample_rate = reference_for(job, o, self.refs), self.refs["sr"]
            req.reference_text = REFERENCE_TEXT
        arrivals, durations = [], []
        rec.t_send = time.perf_counter() - level_t0
        events = self.client.stream(req, timeout=o.timeout)
        try:
            for ev in events:
                if isinstance(ev, AudioChunk):
                    if ev.audio.size:
                        if rec.ttfa_s is None:
                            rec.ttfa_s, rec.arrived_s = ev.t, ev.arrived
                        rec.samples += int(ev.audio.size)
                        rec.sample_rate = ev.sample_rate
                        rec.chunks += 1
                        arrivals.append(ev.t)
                        durations.append(ev.audio.size / ev.sample_rate)
                    rec.total_s = ev.t
                elif isinstance(ev, Final):
                    rec.server = ev.stats
                    rec.total_s = ev.t
                if rec.total_s is not None and rec.total_s > o.timeout:
                    raise TimeoutError(f"request took over {o.timeout} s")
            rec.ok = rec.samples > 0
            if not rec.ok:
                rec.error = "no audio"
        except Exception as e:  # noqa: BLE001 - recorded and counted
            rec.error = f"{type(e).__name__}: {e}"[:500]
            events.close()  # releases the client's lock
            self.client.close(cancel=True)  # drop anything still in flight on this stream
        finally:
            events.close()
            if not o.reuse_stream:
                self.client.close()
        _finish(rec, arrivals, durations, o)
        return rec

    def close(self):
        try:
            self.client.__exit__(None, None, None)
        except Exception:
            pass


class HttpWorker:
    """One worker: its own httpx.Client; POST /v1/audio/speech streaming 16-bit PCM."""

    def __init__(self, target: str, opts: "Options", refs: dict):
        import httpx

        self.http = httpx.Client(base_url=target.rstrip("/"), timeout=httpx.Timeout(opts.timeout, connect=30.0),
                                 headers={"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None)
        self.opts, self.refs = opts, refs

    def run(self, job: Job, level_t0: float) -> Record:
        o = self.opts
        rec = Record(job.idx, job.kind)
        body = {"model": o.http_model, "input": job.text, "response_format": "pcm", "stream_format": "audio",
                "seed": job.seed, "max_new_tokens": job.frames}
        for k in ("temperature", "top_p", "top_k", "first_chunk_frames", "chunk_frames"):
            if getattr(o, k) is not None:
                body[k] = getattr(o, k)
        if o.http_ignore_eos and o.ignore_eos:
            body["ignore_eos"] = True
        if job.kind == "clone_codes":
            body["voice"] = self.refs["voice"]
        elif job.kind == "clone_audio":
            data_url = self.refs["data_url"]
            if o.fresh_references:
                data_url = "data:audio/wav;base64," + base64.b64encode(wav_bytes(reference_for(job, o, self.refs),
                                                                                 self.refs["sr"])).decode()
            body["ref_audio"], body["ref_text"] = data_url, REFERENCE_TEXT
        arrivals, durations = [], []
        t0 = time.perf_counter()
        rec.t_send = t0 - level_t0
        try:
            with self.http.stream("POST", "/v1/audio/speech", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
                sr = int(r.headers.get("x-s2-sample-rate", "44100"))
                rec.sample_rate = sr
                nbytes = 0
                for chunk in r.iter_bytes():
                    t = time.perf_counter() - t0
                    if chunk:
                        if rec.ttfa_s is None:
                            rec.ttfa_s = t
                        nbytes += len(chunk)
                        rec.chunks += 1
                        arrivals.append(t)
                        durations.append(len(chunk) / 2 / sr)
                    if t > o.timeout:
                        raise TimeoutError(f"request took over {o.timeout} s")
                rec.total_s = time.perf_counter() - t0
                rec.samples = nbytes // 2
            rec.ok = rec.samples > 0
            if not rec.ok:
                rec.error = "no audio"
        except Exception as e:  # noqa: BLE001
            rec.error = f"{type(e).__name__}: {e}"[:500]
        _finish(rec, arrivals, durations, o)
        return rec

    def close(self):
        self.http.close()


def _finish(rec: Record, arrivals, durations, o) -> None:
    rec.pid = os.getpid()
    rec.arrivals = [round(rec.t_send + t, 5) for t in arrivals]
    rec.chunk_audio_s = [round(d, 6) for d in durations]
    if rec.sample_rate:
        rec.audio_s = rec.samples / rec.sample_rate
    rec.frames = int(rec.server.get("frames", round(rec.samples / HOP))) if rec.ok else 0
    if arrivals:
        rec.stall, rec.max_gap_s, rec.stall_at_chunk, rec.dry_s = _stall(arrivals, durations)
        frames = [d * rec.sample_rate / HOP for d in durations]
        # gRPC chunks are whole frames; HTTP's are byte runs of the response (no chunk lengths then)
        rec.chunk_frames = [round(f) for f in frames] if all(abs(f - round(f)) < 1e-6 for f in frames) else []


# ---------------------------------------------------------------------------------------------- references


def prepare_references(o: "Options") -> dict:
    """The synthetic reference: its waveform, and (once) its codes from `dac_encoder` / a registered gateway voice."""
    refs: dict = {}
    if o.clone_fraction <= 0:
        return refs
    x = reference_waveform(o.ref_seconds, o.ref_sample_rate)
    refs.update(audio=x, sr=o.ref_sample_rate)
    modes = {"codes", "audio"} if o.clone_mode == "mixed" else {o.clone_mode}
    if o.target:
        import httpx

        wav = wav_bytes(x, o.ref_sample_rate)
        refs["data_url"] = "data:audio/wav;base64," + base64.b64encode(wav).decode()
        if "codes" in modes:  # a registered voice: the gateway sends its stored codes (encoded once)
            name = f"loadgen-{uuid.uuid4().hex[:10]}"
            h = {"Authorization": f"Bearer {o.api_key}"} if o.api_key else {}
            r = httpx.post(o.target.rstrip("/") + "/v1/audio/voices", headers=h, timeout=120,
                           data={"name": name, "ref_text": REFERENCE_TEXT}, files={"audio_sample": ("ref.wav", wav, "audio/wav")})
            if r.status_code >= 300:
                raise RuntimeError(f"registering the reference voice failed: HTTP {r.status_code} {r.text[:300]}")
            refs["voice"] = name
    elif "codes" in modes:
        import tritonclient.grpc as g

        c = g.InferenceServerClient(o.url)
        a = g.InferInput("waveform", [x.size], "FP32")
        a.set_data_from_numpy(x)
        b = g.InferInput("sample_rate", [1], "INT32")
        b.set_data_from_numpy(np.array([o.ref_sample_rate], np.int32))
        t = time.perf_counter()
        res = c.infer(o.encoder_model, [a, b], client_timeout=o.timeout)
        refs["encode_s"] = time.perf_counter() - t
        refs["codes"] = res.as_numpy("codes").astype(np.int32)
        c.close()
    return refs


def cleanup_references(o: "Options", refs: dict) -> None:
    if o.target and refs.get("voice"):
        import httpx

        try:
            h = {"Authorization": f"Bearer {o.api_key}"} if o.api_key else {}
            httpx.delete(o.target.rstrip("/") + f"/v1/audio/voices/{refs['voice']}", headers=h, timeout=30)
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------- the sweep


def make_worker(o: "Options", refs: dict):
    """A worker for `o`'s target: HTTP to the gateway, else gRPC to Triton."""
    if o.target:
        return HttpWorker(o.target, o, refs)
    return GrpcWorker(o.url, o.model, o, refs)


def ramp_delay(rank: int, c: int, warm_s: float | None, o: "Options") -> float:
    """Seconds after the level's start at which worker `rank` of `c` sends its first request (`--ramp`): the
    workers' first requests spread evenly over one request's time, estimated from the worker's own warm-up request
    (its wall time scaled by frames / warm-up frames), so that the level's requests start and end at every step as a
    steady load's do, not in waves of c at once (identical requests started together stay in phase). 0 without a
    ramp or a warm-up."""
    if not o.ramp or warm_s is None or c <= 1:
        return 0.0
    return rank / c * warm_s * o.frames / max(1, o.warmup_frames)


def run_workers(workers: list, warm_jobs: list[Job], barrier, start, clock, next_job, o: "Options",
                ranks: list[int] | None = None, c: int | None = None):
    """Each worker in a thread of its own: its warm-up job (if any), then `barrier` (the level's start), then, from
    its `ramp_delay` on, jobs from `next_job()` (None: none left) until the deadline. `start()` runs in the calling
    thread once the threads are started (it passes the barrier itself, or returns at once when another process
    does); `clock()` -> (t0, deadline), read after the barrier. `ranks`: each worker's index among the level's `c`
    workers (default: these alone). -> (records, warm-up errors)."""
    records: list[Record] = []
    warm_errors: list[str] = []
    lock = threading.Lock()
    ranks = list(range(len(workers))) if ranks is None else ranks
    c = len(workers) if c is None else c

    def loop(k: int):
        w = workers[k]
        warm_s = None
        if warm_jobs:
            r = w.run(warm_jobs[k], time.perf_counter())
            warm_s = r.total_s if r.ok else None
            if not r.ok:
                with lock:
                    warm_errors.append(r.error or "?")
        try:
            barrier.wait(timeout=o.timeout + 60)
        except threading.BrokenBarrierError:
            return
        t0, deadline = clock()
        time.sleep(max(0.0, t0 + ramp_delay(ranks[k], c, warm_s, o) - time.perf_counter()))
        while time.perf_counter() < deadline:
            job = next_job()
            if job is None:
                return
            r = w.run(job, t0)
            r.worker = ranks[k]
            with lock:
                records.append(r)

    threads = [threading.Thread(target=loop, args=(k,), daemon=True, name=f"w{k}") for k in range(len(workers))]
    for t in threads:
        t.start()
    start()
    before_start = time.perf_counter() + o.timeout + 180  # a start that never comes (a worker stuck in warm-up)
    for t in threads:
        while t.is_alive():
            t.join(timeout=1.0)
            deadline = clock()[1]  # 0 until the level starts
            if time.perf_counter() > (deadline + o.timeout + 30 if deadline else before_start):
                break
    for w in workers:
        w.close()
    return records, warm_errors


def _level_process(o: "Options", refs: dict, ranks: list[int], c: int, warm_jobs: list[Job], jobs, barrier,
                   clock_values, out) -> None:
    """A process's share of a level's workers (`--procs`): the workers of `ranks` (their indexes among the level's
    `c`), their warm-up jobs (or none), then jobs from the shared queue; its records and warm-up errors into `out`.
    The parent passes the barrier when every worker waits at it, after writing the level's start and deadline
    (time.perf_counter: CLOCK_MONOTONIC, one clock for every process)."""
    def next_job():
        try:
            return jobs.get(timeout=1.0)
        except queue.Empty:
            return None

    try:
        workers = [make_worker(o, refs) for _ in ranks]
        records, warm_errors = run_workers(workers, warm_jobs, barrier, lambda: None,
                                           lambda: (clock_values[0], clock_values[1]), next_job, o, ranks, c)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which counts the level's requests
        records, warm_errors = [], [f"worker process: {type(e).__name__}: {e}"[:300]]
    out.put((records, warm_errors))


@dataclass
class Options:
    url: str = "127.0.0.1:8001"
    model: str = "s2pro"
    encoder_model: str = "dac_encoder"
    target: str | None = None
    http_model: str = "s2-pro"
    api_key: str | None = None
    http_ignore_eos: bool = False
    concurrency: tuple = (1, 4, 16, 64)
    requests_per_level: int | None = None
    level_requests: dict = field(default_factory=dict)  # concurrency -> requests, over requests_per_level
    frames: int = 100
    ignore_eos: bool = True
    warmup: int = 2
    warmup_frames: int = 16
    level_warmup: bool = True
    clone_fraction: float = 0.0
    clone_mode: str = "codes"  # codes | audio | mixed
    fresh_references: bool = False  # every audio clone a reference never sent before: a voice's first use
    ref_seconds: float = 10.0
    ref_sample_rate: int = 44100
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    first_chunk_frames: int | None = None
    chunk_frames: int | None = None
    timeout: float = 300.0
    level_timeout: float = 1800.0
    reuse_stream: bool = False
    seed: int = 0
    gpu_poll_s: float = 0.2
    procs: int = 1  # processes a level's workers are split over (each its own GIL): 1 = this process's threads
    sweep: "SweepPlan | None" = None  # levels grown until one breaks the SLO, instead of `concurrency`
    slo_ttfa_p99_ms: float = 500.0  # the sweep's SLO: TTFA p99 at most this, no stream ran dry, every request ok
    ramp: bool = True  # each level's first requests spread over one request's time (`ramp_delay`), not sent at once


class Sweep:
    def __init__(self, o: Options):
        self.o = o
        self.next_idx = 0
        self.n_clone = 0
        self.refs: dict = {}

    def job(self, frames: int | None = None, warmup: bool = False) -> Job:
        """The next request: unique text and seed; clone or plain by --clone-fraction (deterministic)."""
        o, i = self.o, self.next_idx
        self.next_idx += 1
        kind = "plain"
        if o.clone_fraction > 0 and math.floor((i + 1) * o.clone_fraction) > math.floor(i * o.clone_fraction):
            if o.clone_mode == "mixed":
                kind = "clone_codes" if self.n_clone % 2 == 0 else "clone_audio"
            else:
                kind = f"clone_{o.clone_mode}"
            self.n_clone += 1
        return Job(i, prompt_text(i), o.seed + i, frames or o.frames, kind, warmup)

    def worker(self):
        return make_worker(self.o, self.refs)

    def level(self, c: int, gpu: GpuMonitor) -> dict:
        o = self.o
        n = o.level_requests.get(c) or o.requests_per_level or max(2 * c, 8)
        jobs = [self.job() for _ in range(n)]
        warm_jobs = [self.job(frames=o.warmup_frames, warmup=True) for _ in range(c)] if o.level_warmup else []
        procs = max(1, min(o.procs, c))
        if procs > 1:
            records, warm_errors, wall = self._level_processes(c, procs, jobs, warm_jobs, gpu)
        else:
            records, warm_errors, wall = self._level_threads(c, jobs, warm_jobs, gpu)
        gstats = gpu.read()
        return summarize(c, n, sorted(records, key=lambda r: r.idx), wall, gstats, warm_errors, o)

    def _level_threads(self, c: int, jobs: list[Job], warm_jobs: list[Job], gpu: GpuMonitor):
        o = self.o
        pending: queue.Queue = queue.Queue()
        for j in jobs:
            pending.put(j)
        state = {"t0": 0.0, "deadline": 0.0}

        def start_clock():  # runs once, before any worker passes the barrier
            gpu.reset()
            state["t0"] = time.perf_counter()
            state["deadline"] = state["t0"] + o.level_timeout

        barrier = threading.Barrier(c + 1, action=start_clock)

        def start():
            try:
                barrier.wait(timeout=o.timeout + 120)
            except threading.BrokenBarrierError:
                start_clock()

        def next_job():
            try:
                return pending.get_nowait()
            except queue.Empty:
                return None

        records, warm_errors = run_workers([self.worker() for _ in range(c)], warm_jobs, barrier, start,
                                           lambda: (state["t0"], state["deadline"]), next_job, o)
        return records, warm_errors, time.perf_counter() - state["t0"]

    def _level_processes(self, c: int, procs: int, jobs: list[Job], warm_jobs: list[Job], gpu: GpuMonitor):
        """The level's c workers split over `procs` spawned processes (threads in each), sharing one job queue and
        one start; the parent keeps the clock and the GPU monitor."""
        import multiprocessing as mp

        o = self.o
        ctx = mp.get_context("spawn")  # no fork: the parent holds gRPC channels and threads
        pending, out = ctx.Queue(), ctx.Queue()
        for j in jobs:
            pending.put(j)
        barrier = ctx.Barrier(c + 1)
        clock_values = ctx.Array("d", 2, lock=False)
        ranks = [list(range(k, c, procs)) for k in range(procs)]  # the workers of each process
        shares = [warm_jobs[k::procs] for k in range(procs)]  # their warm-up jobs (none without level warm-up)
        ps = [ctx.Process(target=_level_process, args=(o, self.refs, ranks[k], c, shares[k], pending, barrier,
                                                       clock_values, out), daemon=True, name=f"loadgen-{k}")
              for k in range(procs)]
        for p in ps:
            p.start()
        limit = time.perf_counter() + o.timeout + 120  # every worker warmed up and waiting, or give up
        while barrier.n_waiting < c and time.perf_counter() < limit and all(p.is_alive() for p in ps):
            time.sleep(0.01)
        gpu.reset()
        t0 = time.perf_counter()
        clock_values[0], clock_values[1] = t0, t0 + o.level_timeout
        try:
            barrier.wait(timeout=5.0)
        except threading.BrokenBarrierError:
            barrier.abort()
        records: list[Record] = []
        warm_errors: list[str] = []
        wait_until, got = clock_values[1] + o.timeout + 60, 0
        while got < procs:
            try:
                r, w = out.get(timeout=1.0)
            except queue.Empty:
                if time.perf_counter() > wait_until or not any(p.is_alive() for p in ps):
                    warm_errors.append(f"{procs - got} of {procs} worker processes sent no results")
                    break
                continue
            got += 1
            records += r
            warm_errors += w
        wall = time.perf_counter() - t0
        for p in ps:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        return records, warm_errors, wall

    def run(self, on_level=None) -> dict:
        """on_level(result): called after each level (e.g. to save partial results)."""
        o = self.o
        gpu = GpuMonitor(o.gpu_poll_s)
        result = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(o).items() if k != "api_key"},
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
                  "gpu": {"monitor": gpu.kind or "n/a", "names": gpu.names}, "levels": []}
        result["server"] = server_info(o)
        if gpu.available:
            s = gpu.sample()
            result["gpu"]["mem_used_before_mib"] = round(sum(s[0]), 1) if s else "n/a"
        t = time.perf_counter()
        self.refs.update(prepare_references(o))
        if "encode_s" in self.refs:
            result["reference"] = {"seconds": o.ref_seconds, "sample_rate": o.ref_sample_rate,
                                   "codes_shape": list(self.refs["codes"].shape), "encode_s": round(self.refs["encode_s"], 4)}
        try:
            warm = []
            if o.warmup:
                w = self.worker()
                for _ in range(o.warmup):
                    warm.append(w.run(self.job(), time.perf_counter()))
                w.close()
            result["warmup"] = {"requests": len(warm), "ok": sum(r.ok for r in warm), "s": round(time.perf_counter() - t, 2),
                                "errors": [r.error for r in warm if r.error][:3]}
            if warm and not any(r.ok for r in warm):
                raise RuntimeError(f"every warm-up request failed: {warm[0].error}")
            for c in (o.sweep.levels() if o.sweep else o.concurrency):
                lv = self.level(c, gpu)
                result["levels"].append(lv)
                if o.sweep:
                    result["sweep"] = sweep_summary(result["levels"], o.sweep, o.slo_ttfa_p99_ms, done=False)
                if on_level:
                    on_level(result)
                print(json.dumps({k: v for k, v in lv.items() if k not in ("records", "error_samples")}), file=sys.stderr, flush=True)
                if o.sweep and slo_breaks(lv, o.slo_ttfa_p99_ms):
                    break
            if o.sweep:
                result["sweep"] = sweep_summary(result["levels"], o.sweep, o.slo_ttfa_p99_ms, done=True)
        finally:
            cleanup_references(o, self.refs)
            gpu.close()
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        return result


def server_info(o: Options) -> dict:
    """What the server runs (model configs' parameters), for the record; best-effort."""
    if o.target:
        try:
            import httpx

            return {"target": o.target, "health": httpx.get(o.target.rstrip("/") + "/health", timeout=10).json()}
        except Exception as e:  # noqa: BLE001
            return {"target": o.target, "error": str(e)[:200]}
    try:
        import tritonclient.grpc as g

        c = g.InferenceServerClient(o.url)
        info = {"url": o.url, "version": c.get_server_metadata(as_json=True).get("version")}
        for m in (o.model, "slow_ar", "dac_decoder"):
            try:
                cfg = c.get_model_config(m, as_json=True)["config"]
                info[m] = {k: v.get("string_value") for k, v in cfg.get("parameters", {}).items()
                           if k != "checkpoint" and not str(v.get("string_value", "")).startswith("${")}
            except Exception:
                pass
        c.close()
        return info
    except Exception as e:  # noqa: BLE001
        return {"url": o.url, "error": str(e)[:200]}


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


def _r(x, nd=4):
    return None if x is None else round(float(x), nd)


def steady(records: list[Record]) -> tuple[float, float, float] | None:
    """The level's steady window: from the last worker's first send (every worker loaded) to the first worker's last
    end (from then on the load drains). -> (start s, end s, audio-s/s of the chunks that arrived in it), None when
    the window is empty (too few requests a worker)."""
    first, last = {}, {}
    for r in records:
        first[r.worker] = min(first.get(r.worker, r.t_send), r.t_send)
        last[r.worker] = max(last.get(r.worker, 0.0), r.t_send + (r.total_s or 0.0))
    if not first:
        return None
    t_s, t_e = max(first.values()), min(last.values())
    if t_e <= t_s:
        return None
    audio = sum(d for r in records if r.ok for t, d in zip(r.arrivals, r.chunk_audio_s) if t_s <= t <= t_e)
    return t_s, t_e, audio / (t_e - t_s)


def summarize(c: int, n: int, records: list[Record], wall: float, gstats: dict, warm_errors: list[str], o: Options) -> dict:
    ok = [r for r in records if r.ok]
    window = steady(records)
    ttfa = [r.ttfa_s * 1e3 for r in ok if r.ttfa_s is not None]
    rtf = [r.rtf for r in ok if r.rtf is not None]
    audio = sum(r.audio_s for r in ok)
    frames = sum(r.frames for r in ok)
    # wall of the measured requests: from the level start to the last end
    end = max((r.t_send + (r.total_s or 0.0) for r in records), default=wall)
    span = max(min(wall, end) if records else wall, 1e-9)
    stv = [r.server.get("ttfa_s") for r in ok if isinstance(r.server.get("ttfa_s"), (int, float))]
    stalls = [r.stall for r in ok if r.stall is not None]
    errs = [r.error for r in records if r.error]
    lv = {
        "concurrency": c, "requests": n, "completed": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "not_run": n - len(records), "client_processes": len({r.pid for r in records}),
        "clone_requests": sum(r.kind != "plain" for r in records),
        "wall_s": _r(span, 3),
        "ttfa_ms_mean": _r(np.mean(ttfa), 2) if ttfa else None, "ttfa_ms_p50": _r(_pct(ttfa, 50), 2),
        "ttfa_ms_p90": _r(_pct(ttfa, 90), 2), "ttfa_ms_p99": _r(_pct(ttfa, 99), 2),
        "ttfa_ms_max": _r(max(ttfa), 2) if ttfa else None,
        "server_ttfa_ms_mean": _r(np.mean(stv) * 1e3, 2) if stv else None,
        "rtf_mean": _r(np.mean(rtf)) if rtf else None, "rtf_p50": _r(_pct(rtf, 50)), "rtf_p99": _r(_pct(rtf, 99)),
        "audio_s_per_s": _r(audio / span, 3), "req_per_s": _r(len(ok) / span, 3), "frames_per_s": _r(frames / span, 2),
        # every worker loaded (`steady`): the level's rate without its start and its drain
        "audio_s_per_s_steady": _r(window[2], 3) if window else None,
        "steady_window_s": [_r(window[0], 3), _r(window[1], 3)] if window else None,
        "audio_s_per_request_mean": _r(audio / len(ok)) if ok else None,
        "frames_per_request_mean": _r(frames / len(ok), 2) if ok else None,
        "frames_short": sum(r.frames < o.frames for r in ok),
        "chunks_per_request_mean": _r(np.mean([r.chunks for r in ok]), 2) if ok else None,
        "max_chunk_gap_ms_p99": _r(_pct([r.max_gap_s * 1e3 for r in ok if r.max_gap_s is not None], 99), 2),
        "stall_fraction": _r(sum(stalls) / len(stalls), 3) if stalls else None,
        # where streams ran dry (the first late chunk's index: count) and for how long
        "stall_at_chunk": dict(sorted(Counter(r.stall_at_chunk for r in ok if r.stall_at_chunk is not None).items())),
        "dry_ms_max": _r(max((r.dry_s for r in ok), default=0.0) * 1e3, 1),
        "ttfa_parts_ms_p50": ttfa_parts(ok),
        **first_chunk_relay(ok),
        **gstats,
        "warmup_errors": len(warm_errors),
        "error_samples": sorted(set(errs))[:5] + sorted(set(warm_errors))[:2],
        "records": [{**{k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(r).items()}, "rtf": _r(r.rtf, 5)}
                     for r in records],
    }
    return lv


# where a request's time to first audio went, as the server reports it (s2pro's final stats), in order
TTFA_PARTS = (("to slow_ar", "to_engine_s"), ("queue", "queue_s"), ("first frame", "engine_first_frame_s"),
              ("first chunk out of slow_ar", "engine_first_audio_s"), ("sent by s2pro", "ttfa_s"))


def ttfa_parts(ok: list[Record]) -> dict:
    """Median milliseconds of each part of TTFA_PARTS (from the request's arrival in s2pro, but the slow_ar ones: from
    its arrival in slow_ar), the first audio's arrival in the client process (gRPC: its stream thread) and the
    client's own TTFA (when a worker read it); {} when the server reports none."""
    out = {}
    for name, key in TTFA_PARTS:
        v = [r.server[key] * 1e3 for r in ok if isinstance(r.server.get(key), (int, float))]
        if v:
            out[name] = _r(_pct(v, 50), 1)
    if out:
        arrived = [r.arrived_s * 1e3 for r in ok if r.arrived_s is not None]
        if arrived:  # in the client process (gRPC): the rest of "received" is the client's own thread scheduling
            out["at the client"] = _r(_pct(arrived, 50), 1)
        out["received"] = _r(_pct([r.ttfa_s * 1e3 for r in ok if r.ttfa_s is not None], 50), 1)
    return out


def first_chunk_relay(ok: list[Record]) -> dict:
    """`first_chunk_relay_ms_p50` / `_p99`: from slow_ar handing a request's first chunk to its sender to s2pro's
    send of it (the rest of s2pro's time to first audio, the request's crossing into slow_ar included); {} when the
    server reports none."""
    v = [(s["ttfa_s"] - s["to_engine_s"] - s["engine_first_audio_s"]) * 1e3 for s in (r.server for r in ok)
         if all(isinstance(s.get(k), (int, float)) for k in ("ttfa_s", "to_engine_s", "engine_first_audio_s"))]
    return {"first_chunk_relay_ms_p50": _r(_pct(v, 50), 1), "first_chunk_relay_ms_p99": _r(_pct(v, 99), 1)} if v else {}


COLUMNS = [("c", "concurrency"), ("reqs ok/n", None), ("TTFA mean ms", "ttfa_ms_mean"), ("TTFA p50 ms", "ttfa_ms_p50"),
           ("TTFA p99 ms", "ttfa_ms_p99"), ("RTF mean", "rtf_mean"), ("audio-s/s", "audio_s_per_s"),
           ("audio-s/s steady", "audio_s_per_s_steady"), ("req/s", "req_per_s"),
           ("frames/s", "frames_per_s"), ("stalls", "stall_fraction"), ("peak GPU MiB", "gpu_mem_peak_mib")]


def markdown(result: dict) -> str:
    cfg = result["config"]
    head = (f"S2 Pro load ({'HTTP ' + cfg['target'] if cfg.get('target') else 'gRPC ' + cfg['url']}), "
            f"{cfg['frames']} frames/request ({cfg['frames'] * HOP / 44100:.2f} s of audio), "
            f"clone fraction {cfg['clone_fraction']} ({cfg['clone_mode']}{', fresh references' if cfg.get('fresh_references') else ''}), GPU: {', '.join(result['gpu']['names']) or 'n/a'}")
    lines = [head, "", "| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for lv in result["levels"]:
        cells = []
        for name, key in COLUMNS:
            if key is None:
                cells.append(f"{lv['ok']}/{lv['requests']}")
            else:
                v = lv.get(key)
                cells.append("n/a" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    if result.get("sweep"):
        lines += ["", sweep_markdown(result["sweep"])]
    return "\n".join(lines)


def chunk_notes(result: dict) -> str:
    """One line per level: the chunks a request got (and the client's processes, if more than one) and, where streams
    ran dry, at which chunk and for how long."""
    out = []
    for lv in result["levels"]:
        line = f"- c={lv['concurrency']}: {lv['chunks_per_request_mean']} chunks a request"
        if lv.get("client_processes", 1) > 1:
            line += f" (the client in {lv['client_processes']} processes)"
        if lv.get("stall_at_chunk"):
            at = ", ".join(f"chunk {k}: {n}" for k, n in lv["stall_at_chunk"].items())
            line += f"; ran dry first at {at}; longest silence {lv['dry_ms_max']} ms"
            dry = [r for r in lv.get("records", []) if r.get("stall_at_chunk") is not None]
            if dry:  # when those requests were sent, and their chunks' lengths up to the late one
                sent = sorted(r["t_send"] for r in dry)
                line += (f" (sent {sent[0]:.2f}-{sent[-1]:.2f} s into the level's {lv.get('wall_s')} s; chunks up to "
                         "the late one, frames: " + ", ".join(
                             "/".join(map(str, r["chunk_frames"][: r["stall_at_chunk"] + 1])) or "?" for r in dry[:6])
                         + ")")
        if lv.get("ttfa_parts_ms_p50"):
            line += "; first audio, p50 ms: " + ", ".join(f"{k} {v}" for k, v in lv["ttfa_parts_ms_p50"].items())
        if lv.get("first_chunk_relay_ms_p99") is not None:
            line += (f"; first chunk from slow_ar's sender to s2pro's send {lv['first_chunk_relay_ms_p50']} ms p50, "
                     f"{lv['first_chunk_relay_ms_p99']} p99")
        out.append(line)
    return "\n".join(out)


def parse_level_requests(text: str) -> tuple[int | None, dict[int, int]]:
    """'8,64:384' -> (8, {64: 384}): N for every level, C:N for one level's concurrency C."""
    every, per = None, {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        c, _, n = item.rpartition(":")
        try:
            value, level = int(n), int(c) if c else None
        except ValueError:
            raise ValueError(f"--requests-per-level: {item!r} is neither N nor C:N") from None
        if value < 1 or (level is not None and level < 1):
            raise ValueError(f"--requests-per-level: {item!r} needs positive integers")
        if level is None:
            every = value
        else:
            per[level] = value
    return every, per


@dataclass(frozen=True)
class SweepPlan:
    """--sweep's levels: start, then start + step each (step None: doubling), none above max."""
    start: int
    step: int | None
    max: int

    def levels(self):
        c = self.start
        while c <= self.max:
            yield c
            c = c + self.step if self.step else 2 * c

    def rule(self) -> str:
        return f"{self.start}, then {'+' + str(self.step) if self.step else 'x2'} each, up to {self.max}"


SWEEP_MAX = 1024  # --sweep's last level when its MAX is not given


def parse_sweep(text: str) -> SweepPlan:
    """'64' -> 64, 128, 256, ... up to SWEEP_MAX; '64:32' -> 64, 96, 128, ...; '64:32:512' -> ... up to 512."""
    parts = text.split(":")
    try:
        if not 1 <= len(parts) <= 3 or not parts[0].strip():
            raise ValueError
        start = int(parts[0])
        step = int(parts[1]) if len(parts) > 1 and parts[1].strip() else None
        top = int(parts[2]) if len(parts) > 2 and parts[2].strip() else max(SWEEP_MAX, start)
    except ValueError:
        raise ValueError(f"--sweep: {text!r} is not START[:STEP[:MAX]] (integers, e.g. 64:32:512)") from None
    if start < 1 or (step is not None and step < 1) or top < start:
        raise ValueError(f"--sweep: {text!r} needs START >= 1, STEP >= 1 and MAX >= START")
    return SweepPlan(start, step, top)


def underruns(lv: dict) -> int:
    """A level's streams that ran dry (each counted once, at its first late chunk)."""
    return sum(lv.get("stall_at_chunk", {}).values())


def slo_breaks(lv: dict, ttfa_p99_ms: float) -> dict[str, str]:
    """How a level breaks the sweep's SLO, {} when it meets it: "requests" (one failed or did not run),
    "ttfa_p99" (over `ttfa_p99_ms`), "underruns" (a stream ran dry); each with a sentence that says so."""
    out = {}
    failed = lv["errors"] + lv["not_run"]
    if failed or not lv["ok"]:
        why = f"{lv['errors']} of {lv['requests']} requests failed, {lv['not_run']} not run"
        if lv.get("error_samples"):
            why += f" ({lv['error_samples'][0]})"
        out["requests"] = why
    p99 = lv.get("ttfa_ms_p99")
    if p99 is not None and p99 > ttfa_p99_ms:
        out["ttfa_p99"] = f"TTFA p99 {p99} ms > {ttfa_p99_ms:g} ms"
    dry = underruns(lv)
    if dry:
        out["underruns"] = f"{dry} of {lv['ok']} streams ran dry"
    return out


def sweep_summary(levels: list[dict], plan: SweepPlan, ttfa_p99_ms: float, done: bool = True) -> dict:
    """The sweep's verdict over its levels in the order run: the peak audio-s/s among those before the first that
    breaks the SLO ("peak", None if the first breaks it), that level and why ("broken", None if none did), and what
    ended the sweep ("stopped_by": "requests" when a request failed, else "slo", or "max" when every level met it;
    None while it runs)."""
    def row(lv):
        return {"concurrency": lv["concurrency"], "audio_s_per_s": lv["audio_s_per_s"],
                "audio_s_per_s_steady": lv.get("audio_s_per_s_steady"), "ttfa_ms_p50": lv["ttfa_ms_p50"],
                "ttfa_ms_p99": lv["ttfa_ms_p99"], "underruns": underruns(lv), "ok": lv["ok"], "requests": lv["requests"]}

    met, broken = [], None
    for lv in levels:
        why = slo_breaks(lv, ttfa_p99_ms)
        if why:
            broken = {**row(lv), "reasons": why}
            break
        met.append(lv)
    peak = max(met, key=lambda lv: lv["audio_s_per_s"], default=None)
    stopped = ("requests" if "requests" in broken["reasons"] else "slo") if broken else ("max" if done else None)
    return {"plan": {**asdict(plan), "rule": plan.rule()},
            "slo": {"ttfa_ms_p99_max": ttfa_p99_ms, "underruns_max": 0, "requests": "every one ok"},
            "concurrencies": [lv["concurrency"] for lv in levels], "met": [lv["concurrency"] for lv in met],
            "peak": row(peak) if peak else None, "broken": broken, "stopped_by": stopped}


def sweep_markdown(sw: dict) -> str:
    """The section "peak within the SLO": one row, the peak level's numbers and the first level over the SLO."""
    head = (f"### peak within the SLO (TTFA p99 <= {sw['slo']['ttfa_ms_p99_max']:g} ms, no stream ran dry, every "
            f"request ok; levels {sw['plan']['rule']})")
    cols = ["c", "audio-s/s", "audio-s/s steady", "TTFA p50 ms", "TTFA p99 ms", "underruns", "first level over the SLO"]
    b = sw["broken"]
    if b:
        over = f"c={b['concurrency']}: " + "; ".join(b["reasons"].values())
    else:
        over = f"none up to c={sw['concurrencies'][-1]}" + (" (MAX reached)" if sw["stopped_by"] == "max" else "") \
            if sw["concurrencies"] else "none run"
    p = sw["peak"]
    cells = ([str(p.get(k)) for k in ("concurrency", "audio_s_per_s", "audio_s_per_s_steady", "ttfa_ms_p50",
                                       "ttfa_ms_p99", "underruns")] if p else ["none"] + ["-"] * 5)
    over = over.replace("|", "/")  # an error text inside the table's cell
    return "\n".join([head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
                      "| " + " | ".join(cells + [over]) + " |"])


def parse_args(argv=None) -> tuple[Options, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address (default %(default)s)")
    ap.add_argument("--model", default="s2pro")
    ap.add_argument("--encoder-model", default="dac_encoder")
    ap.add_argument("--target", help="use the HTTP gateway at this base URL instead of gRPC (e.g. http://127.0.0.1:8080)")
    ap.add_argument("--http-model", default="s2-pro", help="`model` field of the HTTP request")
    ap.add_argument("--api-key", default=os.environ.get("S2TTS_API_KEY"), help="gateway API key (default: env S2TTS_API_KEY)")
    ap.add_argument("--http-ignore-eos", action="store_true",
                    help="also send ignore_eos over HTTP (only for a gateway that accepts the field)")
    ap.add_argument("--concurrency", help="comma-separated levels (default 1,4,16,64)")
    ap.add_argument("--sweep", metavar="START[:STEP[:MAX]]",
                    help="instead of --concurrency, find the peak within the SLO: levels START, START+STEP, "
                         f"START+2*STEP, ... (no STEP: START, 2*START, 4*START, ...) up to MAX (default {SWEEP_MAX}), "
                         "stopping after the first level that breaks the SLO (--slo-ttfa-p99-ms, no stream ran dry, "
                         "every request ok); e.g. 64:32:512")
    ap.add_argument("--slo-ttfa-p99-ms", type=float, default=500.0,
                    help="--sweep's SLO: a level's TTFA p99 at most this (default %(default)s)")
    ap.add_argument("--requests-per-level", default="",
                    help="requests per level (default max(2*c, 8)): N for every level, C:N for the level of "
                         "concurrency C, or both, e.g. '8,64:384' (a long c=64 level beside short others); "
                         "with --sweep the same for its levels")
    ap.add_argument("--frames", type=int, default=100, help="frames per request (default %(default)s = 4.64 s of audio)")
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at the end token")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests, one at a time, before the sweep")
    ap.add_argument("--warmup-frames", type=int, default=16, help="frames of each worker's warm-up request per level")
    ap.add_argument("--no-level-warmup", action="store_true", help="no per-worker warm-up request before each level")
    ap.add_argument("--no-ramp", action="store_true",
                    help="every worker's first request at the level's start (a burst of c requests, which identical "
                         "requests keep in phase), rather than spread over one request's time (ramp_delay)")
    ap.add_argument("--clone-fraction", type=float, default=0.0, help="share of voice-clone requests, 0..1")
    ap.add_argument("--clone-mode", choices=["codes", "audio", "mixed"], default="codes",
                    help="codes: reference encoded once via dac_encoder (HTTP: a registered voice); audio: the waveform "
                         "sent with every request (HTTP: ref_audio); mixed: alternate")
    ap.add_argument("--fresh-references", action="store_true",
                    help="every audio clone sends a reference clip no earlier request sent (its own faint noise): "
                         "each is a voice's first use, encoded and its prefix prefilled (the targets' first-use row)")
    ap.add_argument("--ref-seconds", type=float, default=10.0)
    ap.add_argument("--ref-sample-rate", type=int, default=44100)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--first-chunk-frames", type=int)
    ap.add_argument("--chunk-frames", type=int)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--level-timeout", type=float, default=1800.0, help="no new requests start after this long in a level")
    ap.add_argument("--reuse-stream", action="store_true", help="one gRPC stream per worker instead of one per request")
    ap.add_argument("--seed", type=int, default=0, help="request i uses seed+i")
    ap.add_argument("--procs", type=int, default=1,
                    help="split each level's workers over this many processes (each with its own GIL; a level of "
                         "fewer workers uses one each): at c=128 one Python process is at one core and its own "
                         "receiving delays what it measures (default %(default)s: threads of this process)")
    ap.add_argument("--json", help="write the full result here")
    ap.add_argument("--markdown", help="also write the table here")
    a = ap.parse_args(argv)
    plan = None
    if a.sweep is not None:
        if a.concurrency is not None:
            ap.error("--sweep and --concurrency are alternatives: give one of them")
        try:
            plan = parse_sweep(a.sweep)
        except ValueError as e:
            ap.error(str(e))
        levels = ()
    else:
        try:
            levels = tuple(int(x) for x in (a.concurrency or "1,4,16,64").split(",") if x.strip())
        except ValueError:
            levels = ()
        if not levels or min(levels) < 1:
            ap.error("--concurrency needs positive integers, e.g. 1,4,16")
    if not a.slo_ttfa_p99_ms > 0:
        ap.error("--slo-ttfa-p99-ms must be above 0")
    if not 0 <= a.clone_fraction <= 1:
        ap.error("--clone-fraction must be in [0, 1]")
    try:
        per_level, level_requests = parse_level_requests(a.requests_per_level)
    except ValueError as e:
        ap.error(str(e))
    o = Options(url=a.url, model=a.model, encoder_model=a.encoder_model, target=a.target, http_model=a.http_model,
                api_key=a.api_key, http_ignore_eos=a.http_ignore_eos, concurrency=levels,
                requests_per_level=per_level, level_requests=level_requests, frames=a.frames, ignore_eos=not a.no_ignore_eos, warmup=a.warmup,
                warmup_frames=a.warmup_frames, level_warmup=not a.no_level_warmup, ramp=not a.no_ramp, clone_fraction=a.clone_fraction,
                clone_mode=a.clone_mode, fresh_references=a.fresh_references, ref_seconds=a.ref_seconds, ref_sample_rate=a.ref_sample_rate,
                temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, first_chunk_frames=a.first_chunk_frames,
                chunk_frames=a.chunk_frames, timeout=a.timeout, level_timeout=a.level_timeout, reuse_stream=a.reuse_stream,
                seed=a.seed, procs=a.procs, sweep=plan, slo_ttfa_p99_ms=a.slo_ttfa_p99_ms)
    if a.procs < 1:
        ap.error("--procs must be at least 1")
    return o, a


def main(argv=None) -> int:
    o, a = parse_args(argv)

    def save(result, partial=True):
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({**result, "partial": partial}, indent=1))

    result = Sweep(o).run(on_level=save)
    save(result, partial=False)
    table = markdown(result)
    if a.markdown:
        Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(a.markdown).write_text(table + "\n\n" + chunk_notes(result) + "\n")
    print(table, flush=True)
    bad = sum(lv["ok"] == 0 for lv in result["levels"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
