"""`CallTimes`: how long a process's calls across a process boundary take (responses sent to clients, BLS calls),
logged and observed as a metric."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable

import numpy as np


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
