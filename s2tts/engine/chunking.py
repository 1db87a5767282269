"""How a stream's frames become audio chunks: `Chunker` (frames first, growing with the measured pace so playback
does not run dry), `PaceMeter` (seconds of work a second of audio, across streams) and what puts a server under load
(`LOAD_PACE`, `LOAD_SLOTS`, `LOAD_STREAMS`). slow_ar's engine service and dac_decoder plan chunks with them; s2pro measures the
pace."""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

# From this pace (seconds of work a second of audio) a server is "under load": first chunks grow
# (`Chunker(load_frames=)`) and slow_ar's in-engine codec decodes all streams together every few steps
LOAD_PACE = 0.35
# ... or, in slow_ar's loop with its codec (`EngineService.under_load`), from this share of the engine's slots held: a
# pace alone stops counting a full batch as load once the pipeline is fast enough, and a full batch whose pace sits
# at the threshold would drop out of load on some steps, admitting streams with the short first chunks that run dry
LOAD_SLOTS = 0.75
# ... or from this many streams whatever the slots: `max_batch` is sized to the GPU's memory, which can hold more
# streams than its decode keeps real time, and from this many on one held codec call pays for itself (the share
# above of an H200's 64-slot engine, where the held calls were measured)
LOAD_STREAMS = 48


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
    every time (growing chunks spend that margin: under a heavy load with streams out of step, some run dry with
    growing chunks, none with equal ones). `load_frames` (default 0: off) sets the least first chunk from a pace of
    `load_from` (default `LOAD_PACE`), or whenever `loaded()` says so: more audio in hand while the next chunk is made,
    so fewer streams run dry under load.
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
        if self.n_pending < self.first and self.n_pending < self.size:  # no chunk is shorter than both: none yet
            return []
        out = []
        k = self.next_size()
        if self.n_pending < k:
            return out
        allf = np.concatenate(self.pending, axis=0) if len(self.pending) > 1 else self.pending[0]
        at = 0
        while self.n_pending >= k:
            out.append(allf[at : at + k])
            if not self.emitted:
                self.first_sent = k
            at += k
            self.n_pending -= k
            self.emitted += 1
            self.sent += k
            k = self.next_size()
        self.pending = [allf[at:]] if allf.shape[0] > at else []
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


class LoadMeter:
    """The pace a serving loop's chunks follow and whether it is under load.

    `pace()`: seconds of work a second of a stream's audio, the slower of the loop's own (its decoding passes'
    moving average, `observe`) and the pipeline's as its callers last reported it (`report`, each kept for
    `report_ttl_s`: several s2pro processes each report the pace of their own streams). Without `frame_seconds` the
    pace is 1.0 (no measured pace: fixed chunks) and the loop is never under load.

    `under_load()`: from the moment the pace reaches `LOAD_PACE` (a wave of arrivals: its first chunks already
    count) until the pace averaged over about a second falls below 0.8 of that (a held codec call itself lowers the
    pace and makes single passes vary: hence the margin and the average); and whenever requests holding a slot or
    waiting for one (`slots_wanted()`) fill `LOAD_SLOTS` of the `max_batch` slots or number `LOAD_STREAMS`, counted
    when asked (a wave of requests coming back after a wave of finals is load from its first frames)."""

    def __init__(self, frame_seconds: float | None, max_batch: int, slots_wanted: Callable[[], int],
                 report_ttl_s: float = 5.0):
        self.frame_seconds, self.max_batch, self.slots_wanted = frame_seconds, max_batch, slots_wanted
        self.report_ttl_s = report_ttl_s
        self.step_s: float | None = None  # moving average of a decoding pass's wall time
        self.reports: dict[str, tuple[float, float]] = {}  # reporter -> (pace, when)
        self._state: tuple[float, float, bool] | None = None  # (pace averaged over ~1 s, when, under load)

    def observe(self, pass_s: float) -> None:
        """A decoding pass took `pass_s` seconds (its step, and the codec's calls if the loop decodes)."""
        self.step_s = pass_s if self.step_s is None else 0.8 * self.step_s + 0.2 * pass_s
        if not self.frame_seconds:
            return
        now, r, full = time.monotonic(), self.pace(), self._full()
        if self._state is None:
            avg, loaded = r, r >= LOAD_PACE or full
        else:
            avg, at, loaded = self._state
            a = min(1.0, (now - at) / 1.0)
            avg = (1 - a) * avg + a * r
            if loaded:
                loaded = full or avg >= 0.8 * LOAD_PACE
            elif r >= LOAD_PACE or full:
                loaded, avg = True, max(avg, r)  # the average starts from the pace that turned it on
        self._state = (avg, now, loaded)

    def under_load(self) -> bool:
        return self._state is not None and (self._state[2] or self._full())

    def _full(self) -> bool:
        return self.slots_wanted() >= min(LOAD_SLOTS * self.max_batch, LOAD_STREAMS)

    def pace(self) -> float:
        own = 1.0 if self.step_s is None or not self.frame_seconds else self.step_s / self.frame_seconds
        d = self.reported()
        return own if d is None else max(own, d[0])

    def reported(self) -> tuple[float, float] | None:
        """(pace, when): the slowest pace a caller reported within `report_ttl_s`."""
        now = time.monotonic()
        fresh = [p for p in self.reports.values() if now - p[1] < self.report_ttl_s]
        return max(fresh) if fresh else None

    def report(self, r: float, reporter: str = "") -> None:
        """The pipeline's pace as `reporter` (an s2pro process) measures it. ValueError when out of range."""
        if not (0.0 < r < 1e3):
            raise ValueError(f"pace={r} is out of range: seconds per second of audio, > 0")
        now = time.monotonic()
        kept = {k: p for k, p in self.reports.items() if now - p[1] < self.report_ttl_s}
        self.reports = {**kept, reporter: (r, now)}  # swapped whole: readers never see it change
