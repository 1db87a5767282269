"""Transport-free logic of the `s2pro` model: request validation, chunk planning, stats.

The Triton adapter (`model_repository/s2pro/1/model.py`) moves tensors; this module
decides what is valid and when a chunk of frames is decoded.
"""

from __future__ import annotations

import json
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import invalid
from .sampling import SamplingParams
from .segment import clean_text
from .settings import SCHEMA, check_field


@dataclass
class Limits:
    """The request limits of s2pro: its settings (defaults from `s2tts.settings`). A request's defaults are not
    here: `settings.field_default`."""

    max_text_chars: int = SCHEMA["max_text_chars"].default
    max_reference_seconds: float = SCHEMA["max_reference_seconds"].default
    min_reference_seconds: float = SCHEMA["min_reference_seconds"].default
    max_new_tokens: int = SCHEMA["max_new_tokens_limit"].default
    max_chunk_frames: int = SCHEMA["max_chunk_frames"].default

    @classmethod
    def from_settings(cls, v: dict) -> "Limits":
        return cls(v["max_text_chars"], v["max_reference_seconds"], v["min_reference_seconds"], v["max_new_tokens_limit"],
                   v["max_chunk_frames"])

    def as_settings(self) -> dict:
        """The limits keyed by setting name (what `settings.check_field` takes)."""
        return {"max_text_chars": self.max_text_chars, "max_reference_seconds": self.max_reference_seconds,
                "min_reference_seconds": self.min_reference_seconds,
                "max_new_tokens_limit": self.max_new_tokens, "max_chunk_frames": self.max_chunk_frames}


# A reference clip's samples are float PCM in [-1, 1]; a peak above this is a clip sent in other units (16-bit
# integers as floats), not a loud one (resampling may overshoot 1 a little)
PCM_PEAK_LIMIT = 2.0


@dataclass
class TTSRequest:
    text: str
    params: SamplingParams
    first_chunk_frames: int
    chunk_frames: int
    reference_audio: np.ndarray | None = None
    reference_sample_rate: int | None = None
    reference_text: str | None = None
    reference_codes: np.ndarray | None = None
    chunk_length: int = SCHEMA["chunk_length"].default  # UTF-8 bytes of text per segment (`s2tts.segment`)

    def validate(self, limits: Limits, num_codebooks: int) -> "TTSRequest":
        """Raises S2Error(invalid_argument) naming the input to change."""
        if not isinstance(self.text, str) or not self.text.strip():
            raise invalid("text is empty: give the words to speak", "text")
        if len(self.text) > limits.max_text_chars:
            raise invalid(f"text is {len(self.text)} characters, over the limit of {limits.max_text_chars}: split it "
                          "into several requests", "text")
        try:
            self.text = clean_text(self.text)
        except ValueError as e:
            raise invalid(str(e), "text") from None
        lim = limits.as_settings()
        p = self.params
        for name in ("temperature", "top_p", "top_k", "max_new_tokens", "seed"):
            check_field(name, getattr(p, name), lim)
        check_field("first_chunk_frames", self.first_chunk_frames, lim)
        check_field("chunk_frames", self.chunk_frames, lim)
        check_field("chunk_length", self.chunk_length, lim)
        has_audio = self.reference_audio is not None
        has_codes = self.reference_codes is not None
        if has_audio and has_codes:
            raise invalid("give either reference_audio or reference_codes, not both", "reference_codes")
        if has_audio or has_codes:
            if not self.reference_text or not self.reference_text.strip():
                raise invalid("a voice reference needs its transcript: give reference_text", "reference_text")
        elif self.reference_text:
            raise invalid("reference_text was given without reference_audio or reference_codes", "reference_text")
        if has_audio:
            a = self.reference_audio
            if self.reference_sample_rate is None:
                raise invalid("reference_audio needs reference_sample_rate", "reference_sample_rate")
            check_field("reference_sample_rate", self.reference_sample_rate, lim)
            if a.size == 0:
                raise invalid("reference_audio is empty: send the samples of the reference clip", "reference_audio")
            if not np.all(np.isfinite(a)):
                raise invalid("reference_audio holds NaN or infinite samples: send float PCM in [-1, 1]", "reference_audio")
            peak = float(np.abs(a).max())
            if peak > PCM_PEAK_LIMIT:
                raise invalid(f"reference_audio peaks at {peak:g}: send float PCM in [-1, 1] (16-bit samples divided by "
                              "32768)", "reference_audio")
            seconds = a.shape[-1] / self.reference_sample_rate
            if seconds > limits.max_reference_seconds:
                raise invalid(f"reference_audio is {seconds:.1f} s long, over the limit of {limits.max_reference_seconds:g} s: "
                              "trim it", "reference_audio")
            if seconds < limits.min_reference_seconds:
                raise invalid(f"reference_audio is {seconds:.2f} s long; send at least {limits.min_reference_seconds:g} s "
                              "(5-15 s of clean speech clone a voice best)", "reference_audio")
        if has_codes:
            c = self.reference_codes
            if c.ndim != 2 or c.shape[0] != num_codebooks or c.shape[1] == 0:
                raise invalid(f"reference_codes must have shape [{num_codebooks}, frames>0], got {list(c.shape)}",
                              "reference_codes")
        return self


# From this pace (seconds of work a second of audio: c=64 on one H100, not c=16) a server is "under load": first
# chunks grow (`Chunker(load_frames=)`) and slow_ar's in-engine codec decodes all streams together every few steps
LOAD_PACE = 0.35


class Chunker:
    """Groups streamed frames into decode chunks [n, num_codebooks] (frames first, as on every wire).

    The first chunk is `first` frames (time to first audio); later ones are at most `size`. With `pace` (a callable
    giving the production real-time factor r now: seconds of work per second of audio, as the engine measures it),
    later chunks grow only as fast as playback allows. A client plays from the first chunk; frames come one every
    r frame-durations, so the chunk ending at frame F' arrives F' r after the start while playback needs it by
    (F_1 r + F), F being the frames sent before it and F_1 the first chunk's: F' <= F_1 + F / r. `safety` (< 1)
    leaves room for the codec's time and jitter, `lag` (frames) for a delay of later chunks that the first does
    not have (chunks held to be decoded together with other streams'). Under load the first chunk grows too: its
    audio must last while the next chunk is made and about two steps more (a prefill, a codec call: the jitter
    that made streams run dry at their second chunk at c=64), F_1 >= 2 r / (1 - r), rounded up to a chunk length.
    From a pace of `uniform_from` (default 0.5) later chunks keep the first one's length instead of growing: each is
    made in F_1 r of the F_1 frame-durations the one before plays, with the same margin of F_1 (1 - r) >= 2 r frames
    every time (growing chunks spend that margin; at c=64 out of step 11% of streams ran dry with them, none with
    equal ones: perf/RESULTS.md). `load_frames` (default 0: off) sets the least first chunk from a pace of `load_from`
    (default `LOAD_PACE`, 0.35, reached at c=64 on one H100, not at c=16), or whenever `loaded()` says so: more
    audio in hand while the next chunk is made (at c=64 on an H100, 8-frame first chunks: 1 stream of 384 ran dry,
    7 with 4-frame ones; perf/RESULTS.md).
    Sizes are `first` times a power of two, or `size` (few distinct chunk lengths, so the codec still batches
    chunks of many streams together). At a pace no cadence keeps up with (r >= safety), and without `pace`, later
    chunks are `size`: the fewest codec calls.
    """

    def __init__(self, first: int, size: int, pace: Callable[[], float] | None = None, safety: float = 0.8,
                 lag: int = 0, uniform_from: float = 0.5, load_frames: int = 0, load_from: float | None = None,
                 loaded: Callable[[], bool] | None = None):
        self.first, self.size = first, size
        self.pace, self.safety, self.lag = pace, safety, lag
        self.uniform_from, self.load_frames = uniform_from, load_frames
        self.load_from = LOAD_PACE if load_from is None else load_from
        self.loaded = loaded  # "under load?" as the caller decides it (else: the pace now, from load_from)
        self.pending: list[np.ndarray] = []
        self.n_pending = 0
        self.emitted = 0  # chunks handed out
        self.first_sent = first  # the first chunk's length
        self.sent = 0  # frames handed out

    @staticmethod
    def lengths(first: int, size: int) -> list[int]:
        """The chunk lengths a chunker makes, besides a stream's last remainder: `first`, its doublings, `size`."""
        out, n = {first, size}, min(first, size)
        while n < size:
            n = min(2 * n, size)
            out.add(n)
        return sorted(out)

    def first_size(self) -> int:
        if self.pace is None:
            return self.first
        r = self.pace()
        need = self.first if r >= 1.0 else max(self.first, math.ceil(2 * r / (1 - r)))
        if self.loaded() if self.loaded is not None else self.load_from <= r < 1.0:
            need = max(need, self.load_frames)
        return next((n for n in self.lengths(self.first, self.size) if n >= need), max(self.first, self.size))

    def next_size(self) -> int:
        if self.emitted == 0:
            return self.first_size()
        if self.pace is None:
            return self.size
        r = self.pace()
        if self.uniform_from <= r < 1.0:
            return self.first_sent
        if r >= self.safety:  # no cadence keeps up at this pace: favour throughput
            return self.size
        bound = self.first_sent + self.safety * self.sent / max(r, 1e-3) - self.sent - self.lag
        n = min(self.first, self.size)
        while n < self.size and min(2 * n, self.size) <= bound:
            n = min(2 * n, self.size)
        return n

    def add(self, frames: np.ndarray) -> list[np.ndarray]:
        """frames [n, C] -> zero or more chunks [k, C] ready to decode."""
        if frames.shape[0]:
            self.pending.append(frames)
            self.n_pending += frames.shape[0]
        out = []
        k = self.next_size()
        while self.n_pending >= k:
            allf = np.concatenate(self.pending, axis=0)
            out.append(allf[:k])
            if not self.emitted:
                self.first_sent = k
            self.pending = [allf[k:]] if allf.shape[0] > k else []
            self.n_pending -= k
            self.emitted += 1
            self.sent += k
            k = self.next_size()
        return out

    def flush(self) -> np.ndarray | None:
        if not self.n_pending:
            return None
        allf = np.concatenate(self.pending, axis=0)
        self.pending, self.n_pending = [], 0
        self.emitted += 1
        self.sent += allf.shape[0]
        return allf


class PaceMeter:
    """Seconds of waiting per second of audio, from a stream's chunk arrivals (interval, audio seconds) across streams:
    the ratio of the two moving averages, not an average of ratios, so that chunks of unequal sizes arriving at
    equal intervals (slow_ar releases a stream's chunks together after a held codec call: 4 frames, then 12) give
    the pace they average to, not more."""

    def __init__(self, weight: float = 0.1):
        self.weight = weight
        self.wait_s = self.audio_s = 0.0
        self.samples = 0

    def observe(self, wait_s: float, audio_s: float) -> None:
        a = 1.0 if not self.samples else self.weight
        self.wait_s += a * (wait_s - self.wait_s)
        self.audio_s += a * (audio_s - self.audio_s)
        self.samples += 1

    @property
    def pace(self) -> float | None:
        return self.wait_s / self.audio_s if self.samples and self.audio_s > 0 else None


class CallTimes:
    """How long a process's calls across a boundary took (a response sent to the client, a BLS call), by name: every
    `every_s` one line to `log` with each name's count and p50 / p99 / max ms, and each call to `observe(name,
    seconds)` when given (a metrics histogram). Thread-safe; the thread whose call ends a period writes the line."""

    def __init__(self, name: str, log: Callable[[str], None], every_s: float = 10.0,
                 observe: Callable[[str, float], None] | None = None):
        self.name, self.log, self.every_s, self.observe = name, log, every_s, observe
        self._lock = threading.Lock()
        self._times: dict[str, list[float]] = {}
        self._since = 0.0

    def add(self, what: str, seconds: float) -> None:
        if self.observe is not None:
            self.observe(what, seconds)
        now = time.monotonic()
        with self._lock:
            if not self._since:
                self._since = now
            self._times.setdefault(what, []).append(seconds)
            if now - self._since < self.every_s:
                return
            times, since = self._times, self._since
            self._times, self._since = {}, now
        self.log(f"{self.name}, last {now - since:.0f} s: " + "; ".join(
            f"{what} {len(v)} x, {np.percentile(v, 50) * 1e3:.1f} ms p50 / {np.percentile(v, 99) * 1e3:.1f} p99 / "
            f"{max(v) * 1e3:.1f} max" for what, v in times.items()))

    @contextmanager
    def timed(self, what: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(what, time.perf_counter() - t)


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    first_audio: float | None = None
    frames: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    finish_reason: str = ""
    seed: int | None = None
    queue_s: float | None = None  # waited for a KV slot in slow_ar
    request_id: str = ""
    # where the time to first audio went: from arrival here to the first segment's call to slow_ar, and from its
    # arrival in slow_ar to its first frame and to its first chunk leaving slow_ar's engine thread
    to_engine_s: float | None = None
    engine_first_frame_s: float | None = None
    engine_first_audio_s: float | None = None

    def audio_sent(self, n_samples: int) -> None:
        if self.first_audio is None and n_samples:
            self.first_audio = time.monotonic()
        self.samples += n_samples

    def to_json(self, sample_rate: int) -> str:
        now = time.monotonic()
        return json.dumps({
            "frames": self.frames,
            "audio_seconds": round(self.samples / sample_rate, 4),
            "ttfa_s": None if self.first_audio is None else round(self.first_audio - self.started, 4),
            "total_s": round(now - self.started, 4),
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "seed": self.seed,
            "queue_s": self.queue_s,
            "to_engine_s": self.to_engine_s,
            "engine_first_frame_s": self.engine_first_frame_s,
            "engine_first_audio_s": self.engine_first_audio_s,
            "request_id": self.request_id,
        })
