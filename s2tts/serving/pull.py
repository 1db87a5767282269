"""Pull streams: a producer's responses handed to a reader one per request-response call (how slow_ar streams
to s2pro)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from ..errors import S2Error, invalid
from .lifecycle import Responder

log = logging.getLogger("s2tts")


class PullStream:
    """A request's responses, handed to its reader one per pull: the producer sees a `Responder`, the reader
    sends a request each time it wants the next response, answered with exactly one (final) response.

    This is how `slow_ar` streams to `s2pro` (a request-response model, not a decoupled one): Triton 24.10's
    Python backend crashes and deadlocks a process that reads decoupled BLS streams from several threads
    (perf/STATUS.md, decisions), while its request-response BLS calls are safe.

    A pull that finds a response queued is answered at once; otherwise it waits for the next one. Whatever
    the reader does not take stays queued (responses are small: codes). `abandoned` (no pull for
    `idle_timeout_s` while responses wait, or a pull that could not be answered) makes `is_cancelled` true,
    so the producer stops."""

    def __init__(self, key: str, idle_timeout_s: float = 30.0):
        self.key = key
        self.idle_timeout_s = idle_timeout_s
        self._items: "collections.deque[Any]" = collections.deque()
        self._waiting: Responder | None = None
        self._lock = threading.Lock()
        self.produced_final = False  # the producer's last response is queued or delivered
        self.delivered_final = False  # ... and the reader has it: nothing left to pull
        self.last_pull = time.monotonic()
        self.abandoned = False

    # ---- the producer's side (a Responder) -------------------------------------------------
    def send(self, response: Any, final: bool) -> None:
        with self._lock:
            if self.produced_final:
                raise RuntimeError(f"stream {self.key}: a response after the final one")
            self.produced_final = final
            reader, self._waiting = self._waiting, None
            if reader is None:
                self._items.append((response, final))
                return
        self._deliver(reader, response, final)

    def is_cancelled(self) -> bool:
        if self.abandoned:
            return True
        with self._lock:
            reader = self._waiting
            idle = not self.produced_final and reader is None and time.monotonic() - self.last_pull > self.idle_timeout_s
        if idle:
            log.info("stream %s: not read for %.0f s; abandoned", self.key, self.idle_timeout_s)
            self.abandoned = True
        elif reader is not None and reader.is_cancelled():
            self.abandoned = True
        return self.abandoned

    # ---- the reader's side -----------------------------------------------------------------
    def pull(self, reader: Responder) -> bool:
        """Answer `reader` with the next response, now or when it comes. False (nothing sent) if a pull is
        already waiting or the reader already has the final response (`PullStreams.pull` says which)."""
        with self._lock:
            self.last_pull = time.monotonic()
            if self._waiting is not None or self.delivered_final:
                return False
            if not self._items:
                self._waiting = reader
                return True
            response, final = self._items.popleft()
        self._deliver(reader, response, final)
        return True

    def _deliver(self, reader: Responder, response: Any, final: bool) -> None:
        if final:
            self.delivered_final = True
        try:
            reader.send(response, True)  # one answer per pull
        except Exception as e:  # noqa: BLE001 - the reader is gone: the producer stops at its next check
            log.info("stream %s: response not delivered (%s); abandoned", self.key, e)
            self.abandoned = True

    @property
    def finished(self) -> bool:
        """Nothing more will happen on it: the reader has the final response, or it was abandoned with its final
        response queued."""
        return self.delivered_final or (self.abandoned and self.produced_final)

    def stale(self, now: float) -> bool:
        """Its final response is waiting and nobody has pulled for `idle_timeout_s`."""
        return self.produced_final and not self.delivered_final and now - self.last_pull > self.idle_timeout_s


class PullStreams:
    """The `PullStream`s of one model instance by the reader's key (its request id); a stream is dropped once its
    reader has the final response, or `idle_timeout_s` after it was last pulled if its final response is never
    taken. `make_error(S2Error) -> response` answers a pull that cannot be served."""

    def __init__(self, name: str, make_error: Callable[[S2Error], Any], idle_timeout_s: float = 30.0):
        self.name = name
        self.make_error = make_error
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._streams: dict[str, PullStream] = {}

    def open(self, key: str, first_reader: Responder) -> PullStream | None:
        """A new stream whose first response goes to `first_reader` (the request that started it). None (and
        `first_reader` answered with `already_exists`) when `key` has a stream already."""
        self.sweep()
        with self._lock:
            if key in self._streams:
                dup = self._streams[key]
            else:
                dup = None
                s = self._streams[key] = PullStream(key, self.idle_timeout_s)
        if dup is not None:
            self._answer(first_reader, S2Error(
                "already_exists", f"request id {key!r} already has a stream on {self.name}: give each request its "
                "own id", "request_id"))
            return None
        s.pull(first_reader)
        return s

    def pull(self, key: str, reader: Responder) -> None:
        """The next response of stream `key` to `reader`, or an error saying why there is none."""
        self.sweep()
        with self._lock:
            s = self._streams.get(key)
        if s is None or s.delivered_final:
            self._answer(reader, S2Error("not_found", f"{self.name} has no stream {key!r}: it ended (its final "
                                         "response was read), was never started, or was dropped after "
                                         f"{self.idle_timeout_s:g} s without a read", "request_id"))
        elif not s.pull(reader):
            self._answer(reader, invalid(f"stream {key!r}: a read is already waiting for its next response; "
                                         "read one response at a time", "control"))

    def get(self, key: str) -> PullStream | None:
        with self._lock:
            return self._streams.get(key)

    def sweep(self) -> int:
        """Drop finished and stale streams; returns how many are left."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, s in self._streams.items() if s.finished or s.stale(now)]:
                del self._streams[key]
            return len(self._streams)

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    def _answer(self, reader: Responder, err: S2Error) -> None:
        try:
            reader.send(self.make_error(err), True)
        except Exception as e:  # noqa: BLE001
            log.info("%s: answer not delivered (%s)", self.name, e)
