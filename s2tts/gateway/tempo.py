"""Streaming time-stretch (WSOLA) in numpy: changes speed, keeps pitch.

`TimeStretch(speed).push(x)` returns the output samples that are final so far;
`flush()` returns the rest. Pushing the audio in any chunking gives the same
samples as pushing it whole, so streamed and whole-file answers agree.

WSOLA (Verhelst & Roelands 1993): output frame k (Hann window `win`, hop
`win/2`) is cut from the input near k * hop * speed, shifted by at most `tol`
samples to the position that best continues the previous frame (largest
cross-correlation with the samples that followed it in the input).

Hand-written because FFmpeg's `atempo` (through PyAV) ends a stream differently depending on how it was cut, and even
made to end as this one does it lands further from an ideal stretch at every speed measured (perf/AUDIO_LIBS.md).
"""

from __future__ import annotations

import numpy as np


class TimeStretch:
    def __init__(self, speed: float, sample_rate: int = 44100):
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed {speed} is outside 0.25..4.0")
        self.speed = float(speed)
        # ~23 ms window at 44.1 kHz, even, scaled with the sample rate.
        self.win = max(64, int(round(1024 * sample_rate / 44100)) // 2 * 2)
        self.hop = self.win // 2  # synthesis hop
        self.tol = self.hop // 2  # search range +-tol
        self.window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(self.win) / self.win)).astype(np.float32)
        # The input is padded with `hop` zeros in front so the first output half-window is complete.
        self._buf = np.zeros(self.hop, np.float32)  # input samples from absolute position `_base`
        self._base = 0
        self._in_total = 0  # real input samples received
        self._k = 0  # next output frame
        self._prev_pos: int | None = None  # input position of frame k-1
        self._acc = np.zeros(self.win, np.float32)  # overlap-add accumulator starting at output k*hop
        self._skip = self.hop  # leading output samples still to drop
        self._returned = 0  # output samples returned
        self._flushed = False

    def _frame_pos(self, k: int, limit: int) -> int:
        """Input position (in padded coordinates) of output frame k."""
        nominal = int(round(k * self.hop * self.speed))
        if self._prev_pos is None:
            return nominal
        lo, hi = max(0, nominal - self.tol), max(0, nominal + self.tol)
        hi = min(hi, limit - self.win)
        if hi <= lo:
            return max(0, min(nominal, limit - self.win))
        ref_start = self._prev_pos + self.hop - self._base
        ref = self._buf[ref_start:ref_start + self.win]
        seg = self._buf[lo - self._base:hi - self._base + self.win]
        if len(ref) < self.win or not np.any(ref):
            return nominal if nominal + self.win <= limit else lo
        corr = np.correlate(seg, ref, mode="valid")
        return lo + int(np.argmax(corr))

    def _run(self, end_in: int) -> np.ndarray:
        """Make frames whose search window lies below input position `end_in` (padded coordinates)."""
        out = []
        while True:
            nominal = int(round(self._k * self.hop * self.speed))
            need = nominal + self.tol + self.win
            if self._prev_pos is not None:
                need = max(need, self._prev_pos + self.hop + self.win)
            if need > end_in:
                break
            pos = self._frame_pos(self._k, end_in)
            frame = self._buf[pos - self._base:pos - self._base + self.win]
            self._acc += frame * self.window
            out.append(self._acc[:self.hop].copy())
            self._acc = np.concatenate([self._acc[self.hop:], np.zeros(self.hop, np.float32)])
            self._prev_pos = pos
            self._k += 1
            # Keep only what later frames can reach.
            keep_from = min(self._prev_pos, int(round(self._k * self.hop * self.speed)) - self.tol)
            drop = max(0, keep_from - self._base)
            if drop:
                self._buf = self._buf[drop:]
                self._base += drop
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def push(self, x: np.ndarray) -> np.ndarray:
        if self._flushed:
            raise RuntimeError("push after flush")
        x = np.asarray(x, np.float32).reshape(-1)
        self._in_total += len(x)
        self._buf = np.concatenate([self._buf, x])
        return self._take(self._run(self._base + len(self._buf)))

    def flush(self) -> np.ndarray:
        self._flushed = True
        target = int(round(self._in_total / self.speed))
        out = []
        pad = np.zeros(self.win + self.tol + self.hop, np.float32)
        while self._returned < target:  # feed silence until the output reaches the target length
            self._buf = np.concatenate([self._buf, pad])
            out.append(self._take(self._run(self._base + len(self._buf))))
        y = np.concatenate(out) if out else np.zeros(0, np.float32)
        cut = self._returned - target  # returned too much in this call: cut the tail
        if cut > 0:
            y = y[:len(y) - cut]
            self._returned = target
        return y

    def _take(self, y: np.ndarray) -> np.ndarray:
        # The first `hop` output samples belong to the leading padding.
        if self._skip:
            n = min(self._skip, len(y))
            y = y[n:]
            self._skip -= n
        self._returned += len(y)
        return y


def time_stretch(x: np.ndarray, speed: float, sample_rate: int = 44100) -> np.ndarray:
    ts = TimeStretch(speed, sample_rate)
    return np.concatenate([ts.push(x), ts.flush()])
