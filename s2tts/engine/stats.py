"""What the engine's serving loop spent: `LoopStats` (the engine thread's passes) and `SendStats` (the sender
thread's responses). Each closes a window every `every_s`: a typed summary (`LoopWindow`, `SendWindow`) kept as
`last` (slow_ar publishes it as metrics: `serving.metrics.Metrics.report_engine`) and in `windows` (the recent ones,
for tools and tests), and written as one log line for the operator."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("s2tts")


@dataclass(frozen=True)
class LoopWindow:
    """The engine thread's decoding passes over `seconds`: per step, means in milliseconds."""

    seconds: float
    steps: int
    step_ms: float  # the engine's step (launch, and wait for its frames)
    frames_per_step: float  # frames the steps made: how many slots decoded
    rest_ms: float  # routing and decoding audio after the step
    codec_calls: int
    streams_per_call: float
    codec_wait_ms: float  # the engine thread in the codec's calls (part of rest_ms)
    under_load: float  # share of the steps taken under load
    slots_held: float  # slots held in a step (decoding or prefilling)
    waiting: float  # requests left waiting for a slot after a step
    firsts: float  # share of the steps that made some request's first frame (its prompt's last rows ran in them)
    firsts_ms: float  # ... their step, and the others'
    others_ms: float
    firsts_launch_ms: float  # ... split into launching and waiting, and the others'
    firsts_wait_ms: float
    others_launch_ms: float
    others_wait_ms: float
    firsts_behind_codec: float  # share of those steps launched behind a codec call
    final_tail_ms: float | None  # p50 from a request's last frame to its final response handed out
    finals: int  # requests whose final response was handed out
    off_cpu_ms: float  # the engine thread off its CPU (waiting for the GIL, or blocked)

    def line(self, name: str) -> str:
        tail = "-" if self.final_tail_ms is None else f"{self.final_tail_ms:.1f} ms p50"
        return (f"{name}: last {self.seconds:.0f} s: {self.steps} steps of {self.step_ms:.1f} ms making "
                f"{self.frames_per_step:.1f} frames each, then {self.rest_ms:.1f} ms a step routing and decoding audio "
                f"({self.codec_calls} codec calls, {self.streams_per_call:.1f} streams a call, {self.codec_wait_ms:.1f} "
                f"ms a step in them); under load {100 * self.under_load:.0f}% of the steps; slots held "
                f"{self.slots_held:.1f}, requests waiting {self.waiting:.1f} a step; {100 * self.firsts:.0f}% of the "
                f"steps with prompt rows ending ({self.firsts_ms:.1f} ms, the others {self.others_ms:.1f}; launching "
                f"{self.firsts_launch_ms:.1f} and waiting {self.firsts_wait_ms:.1f} ms of it, the others "
                f"{self.others_launch_ms:.1f} and {self.others_wait_ms:.1f}; {100 * self.firsts_behind_codec:.0f}% of "
                f"them launched behind a codec call); last frame to final response {tail} ({self.finals} requests); "
                f"the engine thread off its CPU {self.off_cpu_ms:.2f} ms a step")


@dataclass
class LoopStats:
    """The engine thread's passes, summed since the window opened (with an in-engine codec a window closes once it
    is `every_s` old and the codec was called in it)."""

    passes: int = 0  # codec passes, ever (the codec's plan counts them)
    steps: int = 0
    step_s: float = 0.0
    rest_s: float = 0.0
    codec_calls: int = 0
    codec_streams: int = 0
    codec_wait_s: float = 0.0
    frames: int = 0
    loaded: int = 0
    live: int = 0
    waiting: int = 0
    firsts: int = 0
    firsts_s: float = 0.0
    off_cpu_s: float = 0.0
    launch_s: float = 0.0
    wait_s: float = 0.0
    firsts_launch_s: float = 0.0
    firsts_wait_s: float = 0.0
    firsts_early: int = 0
    tails: list = field(default_factory=list)  # seconds from a request's last frame to its final response handed out
    final_waits: list = field(default_factory=list)  # codec passes from a request's final item to its hand-out
    first_waits: list = field(default_factory=list)  # codec passes from a request's first chunk to its hand-out
    since: float = 0.0
    every_s: float = 10.0
    last: LoopWindow | None = None
    windows: deque = field(default_factory=lambda: deque(maxlen=64))

    def add(self, step_s: float, rest_s: float, name: str, frames: int = 0, loaded: bool = False, live: int = 0,
            waiting: int = 0, firsts: bool = False, off_cpu_s: float = 0.0, launch_s: float = 0.0,
            wait_s: float = 0.0, early: bool = False) -> None:
        """One decoding pass: its step's time, the rest of the pass, the frames it made, whether under load, the slots
        it held and the requests left waiting, whether it made a first frame, the engine thread's time off its CPU,
        the step's launching and waiting, and whether it was launched behind a codec call."""
        now = time.monotonic()
        if not self.since:
            self.since = now
        self.steps += 1
        self.step_s += step_s
        self.rest_s += rest_s
        self.frames += frames
        self.loaded += loaded
        self.live += live
        self.waiting += waiting
        self.off_cpu_s += off_cpu_s
        self.launch_s += launch_s
        self.wait_s += wait_s
        if firsts:
            self.firsts += 1
            self.firsts_s += step_s
            self.firsts_launch_s += launch_s
            self.firsts_wait_s += wait_s
            self.firsts_early += early
        if now - self.since >= self.every_s and self.codec_calls:
            self._close(now, name)

    def _close(self, now: float, name: str) -> None:
        n, f, o = self.steps, max(1, self.firsts), max(1, self.steps - self.firsts)
        w = LoopWindow(
            seconds=now - self.since, steps=n, step_ms=1e3 * self.step_s / n, frames_per_step=self.frames / n,
            rest_ms=1e3 * self.rest_s / n, codec_calls=self.codec_calls,
            streams_per_call=self.codec_streams / max(1, self.codec_calls), codec_wait_ms=1e3 * self.codec_wait_s / n,
            under_load=self.loaded / n, slots_held=self.live / n, waiting=self.waiting / n, firsts=self.firsts / n,
            firsts_ms=1e3 * self.firsts_s / f, others_ms=1e3 * (self.step_s - self.firsts_s) / o,
            firsts_launch_ms=1e3 * self.firsts_launch_s / f, firsts_wait_ms=1e3 * self.firsts_wait_s / f,
            others_launch_ms=1e3 * (self.launch_s - self.firsts_launch_s) / o,
            others_wait_ms=1e3 * (self.wait_s - self.firsts_wait_s) / o, firsts_behind_codec=self.firsts_early / f,
            final_tail_ms=1e3 * float(np.percentile(self.tails, 50)) if self.tails else None, finals=len(self.tails),
            off_cpu_ms=1e3 * self.off_cpu_s / n)
        self.last = w
        self.windows.append(w)
        log.info("%s", w.line(name))
        self.steps = self.codec_calls = self.codec_streams = self.frames = 0
        self.loaded = self.live = self.waiting = self.firsts = self.firsts_early = 0
        self.step_s = self.rest_s = self.codec_wait_s = self.firsts_s = self.off_cpu_s = 0.0
        self.launch_s = self.wait_s = self.firsts_launch_s = self.firsts_wait_s = 0.0
        self.tails, self.final_waits, self.first_waits = [], [], []
        self.since = now


@dataclass(frozen=True)
class SendWindow:
    """The sender thread's responses over `seconds`."""

    seconds: float
    responses: int
    work_ms: float  # to build and send one
    wait_p50_ms: float  # waiting for the sender thread
    wait_p99_ms: float
    wait_max_ms: float

    def line(self, name: str) -> str:
        return (f"{name}: sender, last {self.seconds:.0f} s: {self.responses} responses, {self.work_ms:.2f} ms each to "
                f"build and send, waited {self.wait_p50_ms:.1f} ms p50 / {self.wait_p99_ms:.1f} p99 / "
                f"{self.wait_max_ms:.1f} max to be sent")


@dataclass
class SendStats:
    """How long responses waited for the sender thread and took to build and send, a window every `every_s` (from
    the sender thread). A codec call held for all streams hands the sender many responses at once."""

    waits: list = field(default_factory=list)
    work_s: float = 0.0
    since: float = 0.0
    every_s: float = 10.0
    last: SendWindow | None = None
    windows: deque = field(default_factory=lambda: deque(maxlen=64))

    def add(self, wait_s: float, work_s: float, name: str) -> None:
        now = time.monotonic()
        if not self.since:
            self.since = now
        self.waits.append(wait_s)
        self.work_s += work_s
        if now - self.since >= self.every_s:
            w = np.array(self.waits) * 1e3
            self.last = SendWindow(now - self.since, int(w.size), 1e3 * self.work_s / w.size,
                                   float(np.percentile(w, 50)), float(np.percentile(w, 99)), float(w.max()))
            self.windows.append(self.last)
            log.info("%s", self.last.line(name))
            self.waits, self.work_s, self.since = [], 0.0, now
