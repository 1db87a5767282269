"""Where a model process's Python threads spend their time, sampled from inside the process (no tool to install).

With `S2TTS_PROFILE_DIR` set, every model process (`serving.process.setup_logging`) starts a `StackSampler`: a thread
that every `interval_s` takes every other thread's Python stack (`sys._current_frames`) and counts it. It writes
`<dir>/<name>.<pid>.folded` (one "frame;frame;...;leaf count" line per stack, root first: the input of flame-graph
tools) and `<dir>/<name>.<pid>.txt` (the leaf functions and stacks seen most, and the sampler's own lateness) every
`write_every_s` and at exit.

The sampler needs the GIL to take a sample, so how late its samples come is a measure of how long a thread that
wants the GIL waits for it (under load s2pro's worker threads share one interpreter).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ENV = "S2TTS_PROFILE_DIR"


def _frame_name(frame) -> str:
    code = frame.f_code
    return f"{Path(code.co_filename).stem}.{code.co_name}"


class StackSampler:
    def __init__(self, name: str, out_dir: str | Path, interval_s: float = 0.005, write_every_s: float = 10.0,
                 max_depth: int = 40):
        self.name, self.out_dir = name, Path(out_dir)
        self.interval_s, self.write_every_s, self.max_depth = interval_s, write_every_s, max_depth
        self.stacks: Counter = Counter()
        self.leaves: Counter = Counter()
        self.samples = 0
        self.late_s: list[float] = []  # how much later than asked each sample came
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="s2tts-sampler", daemon=True)
        base = f"{name}.{os.getpid()}"
        self.folded_path, self.text_path = self.out_dir / f"{base}.folded", self.out_dir / f"{base}.txt"

    def start(self) -> "StackSampler":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            if self._thread.is_alive() and threading.current_thread() is not self._thread:
                self._thread.join(1.0)
            self.write()

    def sample(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        with self._lock:
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None and len(stack) < self.max_depth:
                    stack.append(_frame_name(frame))
                    frame = frame.f_back
                if not stack:
                    continue
                thread = names.get(ident, "?").rstrip("0123456789-_") or "thread"
                self.stacks[";".join([thread, *reversed(stack)])] += 1
                self.leaves[stack[0]] += 1
            self.samples += 1

    def _run(self) -> None:
        last_write = time.monotonic()
        due = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            now = time.monotonic()
            self.late_s.append(now - due)
            self.sample()
            due = max(due + self.interval_s, now)
            if now - last_write >= self.write_every_s:
                self.write()
                last_write = now

    def write(self) -> None:
        with self._lock:
            stacks, leaves, samples = Counter(self.stacks), Counter(self.leaves), self.samples
            late = sorted(self.late_s)
        self.folded_path.write_text("".join(f"{s} {n}\n" for s, n in stacks.most_common()))
        lines = [f"{self.name} (pid {os.getpid()}): {samples} samples every {self.interval_s * 1e3:g} ms"]
        if late:
            pct = lambda q: 1e3 * late[min(len(late) - 1, int(q * len(late)))]  # noqa: E731
            lines.append(f"sampler late (waiting for the GIL): p50 {pct(0.5):.2f} ms, p99 {pct(0.99):.2f} ms, "
                         f"max {1e3 * late[-1]:.2f} ms")
        total = max(1, sum(leaves.values()))
        lines += ["", "leaf functions (share of thread samples):"]
        lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in leaves.most_common(25)]
        lines += ["", "stacks (thread;root;...;leaf):"]
        lines += [f"  {100 * n / total:5.1f}%  {s}" for s, n in stacks.most_common(15)]
        self.text_path.write_text("\n".join(lines) + "\n")


_started: StackSampler | None = None


def start_from_env(name: str) -> StackSampler | None:
    """Start this process's sampler if `S2TTS_PROFILE_DIR` is set (once per process); else nothing. A sample
    holds the GIL while it walks every thread's stack, so it slows the process a little:
    `S2TTS_PROFILE_INTERVAL_MS` (default 10) sets how often."""
    global _started
    out = os.environ.get(ENV)
    if not out or _started is not None:
        return _started
    interval_ms = float(os.environ.get("S2TTS_PROFILE_INTERVAL_MS", "10"))
    _started = StackSampler(name, out, interval_s=interval_ms / 1e3).start()
    return _started
