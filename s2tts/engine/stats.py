"""What the engine's serving loop spent, for the operator: `LoopStats` (the engine thread's passes) and `SendStats`
(the sender thread's responses), each logged as one line every `every_s`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("s2tts")


@dataclass
class LoopStats:
    """What the engine thread's passes spent, logged every `every_s` (with an in-engine codec)."""

    passes: int = 0
    steps: int = 0
    step_s: float = 0.0
    codec_s: float = 0.0
    codec_calls: int = 0
    codec_streams: int = 0
    # the engine thread's wall time in the codec's calls (`_codec_call`: with steps launched ahead, the next step's
    # launch behind a call included), part of codec_s
    codec_wait_s: float = 0.0
    frames: int = 0  # frames the steps made: a step's average is how many of the slots decoded
    loaded: int = 0  # steps taken under load (`EngineService.under_load`)
    live: int = 0  # slots held in the steps (decoding or prefilling), summed over the steps
    waiting: int = 0  # requests left waiting for a slot after the steps, summed
    firsts: int = 0  # steps that made some request's first frame (its prompt's last rows ran in them)
    firsts_s: float = 0.0  # their step time
    off_cpu_s: float = 0.0  # the steps' passes: wall time the engine thread was off its CPU (GIL waits, blocking)
    # the passes' engine calls split (`Engine.launch_s`, `wait_s`), those of the steps with prompt rows ending apart,
    # and how many of those steps had been launched behind a codec call (beside it on the device)
    launch_s: float = 0.0
    wait_s: float = 0.0
    firsts_launch_s: float = 0.0
    firsts_wait_s: float = 0.0
    firsts_early: int = 0
    tails: list = field(default_factory=list)  # seconds from a request's last frame to its final response handed out
    final_waits: list = field(default_factory=list)  # codec passes from a request's final item to its hand-out
    since: float = 0.0
    every_s: float = 10.0

    def add(self, step_s: float, rest_s: float, name: str, frames: int = 0, loaded: bool = False, live: int = 0,
            waiting: int = 0, firsts: bool = False, off_cpu_s: float = 0.0, launch_s: float = 0.0,
            wait_s: float = 0.0, early: bool = False) -> None:
        now = time.monotonic()
        if not self.since:
            self.since = now
        self.steps += 1
        self.step_s += step_s
        self.codec_s += rest_s
        self.frames += frames
        self.loaded += loaded
        self.live += live
        self.waiting += waiting
        self.firsts += firsts
        self.firsts_s += step_s if firsts else 0.0
        self.off_cpu_s += off_cpu_s
        self.launch_s += launch_s
        self.wait_s += wait_s
        if firsts:
            self.firsts_launch_s += launch_s
            self.firsts_wait_s += wait_s
            self.firsts_early += early
        if now - self.since >= self.every_s and self.codec_calls:
            tail = f"{1e3 * float(np.percentile(self.tails, 50)):.1f} ms p50" if self.tails else "-"
            log.info("%s: last %.0f s: %d steps of %.1f ms making %.1f frames each, then %.1f ms a step routing and "
                     "decoding audio (%d codec calls, %.1f streams a call, %.1f ms a step in them); under load %.0f%% "
                     "of the steps; slots held %.1f, requests waiting %.1f a step; %.0f%% of the steps with prompt rows "
                     "ending (%.1f ms, the others %.1f; launching %.1f and waiting %.1f ms of it, the others %.1f and "
                     "%.1f; %.0f%% of them launched behind a codec call); last frame to final response %s (%d "
                     "requests); the engine thread off its CPU %.2f ms a step (waiting for the GIL, or blocked: a GPU "
                     "wait spins)", name,
                     now - self.since, self.steps, 1e3 * self.step_s / self.steps, self.frames / self.steps,
                     1e3 * self.codec_s / self.steps, self.codec_calls, self.codec_streams / self.codec_calls,
                     1e3 * self.codec_wait_s / self.steps,
                     100 * self.loaded / self.steps, self.live / self.steps, self.waiting / self.steps,
                     100 * self.firsts / self.steps, 1e3 * self.firsts_s / max(1, self.firsts),
                     1e3 * (self.step_s - self.firsts_s) / max(1, self.steps - self.firsts),
                     1e3 * self.firsts_launch_s / max(1, self.firsts), 1e3 * self.firsts_wait_s / max(1, self.firsts),
                     1e3 * (self.launch_s - self.firsts_launch_s) / max(1, self.steps - self.firsts),
                     1e3 * (self.wait_s - self.firsts_wait_s) / max(1, self.steps - self.firsts),
                     100 * self.firsts_early / max(1, self.firsts), tail, len(self.tails),
                     1e3 * self.off_cpu_s / self.steps)
            self.steps, self.step_s, self.codec_s, self.codec_calls, self.codec_streams, self.frames = 0, 0.0, 0.0, 0, 0, 0
            self.codec_wait_s = 0.0
            self.loaded, self.live, self.waiting, self.firsts, self.firsts_s, self.tails = 0, 0, 0, 0, 0.0, []
            self.final_waits = []
            self.off_cpu_s = self.launch_s = self.wait_s = self.firsts_launch_s = self.firsts_wait_s = 0.0
            self.firsts_early = 0
            self.since = now


@dataclass
class SendStats:
    """How long responses waited for the sender thread and took to build and send, logged every `every_s` (from
    the sender thread). A codec call held for all streams hands the sender many responses at once."""

    waits: list = field(default_factory=list)
    work_s: float = 0.0
    since: float = 0.0
    every_s: float = 10.0

    def add(self, wait_s: float, work_s: float, name: str) -> None:
        now = time.monotonic()
        if not self.since:
            self.since = now
        self.waits.append(wait_s)
        self.work_s += work_s
        if now - self.since >= self.every_s:
            w = np.array(self.waits) * 1e3
            log.info("%s: sender, last %.0f s: %d responses, %.2f ms each to build and send, waited %.1f ms p50 / %.1f "
                     "p99 / %.1f max to be sent", name, now - self.since, w.size, 1e3 * self.work_s / w.size,
                     np.percentile(w, 50), np.percentile(w, 99), w.max())
            self.waits, self.work_s, self.since = [], 0.0, now
