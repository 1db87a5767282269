"""Pull streams: a producer's responses handed to a reader one per request-response call (how slow_ar streams
to s2pro), one stream a call or every stream of one reader in one call (`PullStreams.pull_group`)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from ..errors import S2Error, invalid
from .lifecycle import Responder

log = logging.getLogger("s2tts")

GROUP_MAX_BYTES = 8 << 20  # a group answer stops taking responses past this many bytes of them (`nbytes`)


class PullGroup:
    """The streams opened for one reader (`group`: a process that reads many streams, s2pro), answered together:
    a group pull takes every response queued in any of them, in each stream's order, and waits while none is."""

    def __init__(self, key: str):
        self.key = key
        self.lock = threading.Lock()  # its streams' lock too: one answer sees them all in one state
        self.streams: dict[str, PullStream] = {}
        self.waiting: Responder | None = None  # the group pull waiting for a response
        self.since = 0.0  # when it came
        self.last_pull = time.monotonic()
        self.ready = False  # a response was queued since the last answer
        self.due = False  # ... and its producer's pass is sent (`flush`, until the next pass's first response) or
        # an answer left some: a pull takes them at once (one that comes during a pass waits for its end: an answer
        # always ends at the end of a pass)
        self.turn = 0  # the answers so far: each starts at the next stream, so that the byte bound favours none


class PullStream:
    """A request's responses, handed to its reader one per pull: the producer sees a `Responder`, the reader
    sends a request each time it wants the next response, answered with exactly one (final) response.

    This is how `slow_ar` streams to `s2pro` (a request-response model, not a decoupled one): Triton 24.10's
    Python backend crashes and deadlocks a process that reads decoupled BLS streams from several threads
    (perf/STATUS.md, decisions), while its request-response BLS calls are safe.

    A pull that finds a response queued is answered at once; otherwise it waits for the next one. Whatever
    the reader does not take stays queued (a chunk: its codes and audio). A stream of a `PullGroup` hands its
    first response to the request that opened it and queues the rest for its group's pulls (a pull of its own
    still works). `abandoned` (no pull for `idle_timeout_s` while responses wait, or a pull that could not be
    answered) makes `is_cancelled` true, so the producer stops."""

    def __init__(self, key: str, idle_timeout_s: float = 30.0, group: PullGroup | None = None, tag: Any = None):
        self.key = key
        self.tag = key if tag is None else tag  # what names it in its group's answers
        self.idle_timeout_s = idle_timeout_s
        self.group = group
        self._items: "collections.deque[Any]" = collections.deque()
        self._waiting: Responder | None = None
        self._lock = group.lock if group is not None else threading.Lock()
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
                if self.group is not None:  # answered by `PullStreams.flush`, at the end of the producer's pass
                    self.group.ready, self.group.due = True, False
                return
        self._deliver(reader, response, final)

    def is_cancelled(self) -> bool:
        if self.abandoned:
            return True
        with self._lock:
            reader = self._waiting if self.group is None or self.group.waiting is None else self.group.waiting
            last = self.last_pull if self.group is None else max(self.last_pull, self.group.last_pull)
            idle = not self.produced_final and reader is None and time.monotonic() - last > self.idle_timeout_s
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

    def _take(self, room: int, nbytes: Callable[[Any], int]) -> tuple[list[tuple[str, Any, bool]], int]:
        """Its queued responses as (tag, response, final), until `room` bytes are used (the first always);
        the caller holds the group's lock."""
        out = []
        while self._items and (room > 0 or not out):
            response, final = self._items.popleft()
            room -= nbytes(response)
            out.append((self.tag, response, final))
            self.delivered_final |= final
        return out, room

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
        last = self.last_pull if self.group is None else max(self.last_pull, self.group.last_pull)
        return self.produced_final and not self.delivered_final and now - last > self.idle_timeout_s


class PullStreams:
    """The `PullStream`s of one model instance by the reader's key (its request id); a stream is dropped once its
    reader has the final response, or `idle_timeout_s` after it was last pulled if its final response is never
    taken. `make_error(S2Error) -> response` answers a pull that cannot be served.

    Group pulls (`pull_group`): a reader of many streams opens each with its group's key and takes the responses
    of all of them in one call, answered with a list of (stream tag, response, final); `flush` (the producer's,
    once it has sent what it had) answers a waiting group pull, and one that waited `group_wait_s` is answered
    with an empty list (so its reader is never held by a group that has nothing coming)."""

    def __init__(self, name: str, make_error: Callable[[S2Error], Any], idle_timeout_s: float = 30.0,
                 group_wait_s: float = 1.0, nbytes: Callable[[Any], int] = lambda response: 0):
        """`nbytes(response)`: a response's size, which bounds a group answer (`GROUP_MAX_BYTES`)."""
        self.name = name
        self.make_error = make_error
        self.idle_timeout_s = idle_timeout_s
        self.group_wait_s = group_wait_s
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._streams: dict[str, PullStream] = {}
        self._groups: dict[str, PullGroup] = {}

    def open(self, key: str, first_reader: Responder, group: str = "", tag: Any = None) -> PullStream | None:
        """A new stream whose first response goes to `first_reader` (the request that started it), the rest
        queued for `group`'s pulls when one is named (`tag` names it there; default `key`). None (and `first_reader` answered with `already_exists`)
        when `key` has a stream already."""
        self.sweep()
        with self._lock:
            if key in self._streams:
                dup = self._streams[key]
            else:
                dup = None
                g = (self._groups.get(group) or self._groups.setdefault(group, PullGroup(group))) if group else None
                s = self._streams[key] = PullStream(key, self.idle_timeout_s, g, tag)
                if g is not None:
                    with g.lock:
                        g.streams[key] = s
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

    def pull_group(self, group: str, reader: Responder) -> None:
        """Every response queued in `group`'s streams to `reader`: now if they are due (their producer's pass is
        sent), else when it is (`flush`) or `group_wait_s` has passed; an error if a group pull is already waiting."""
        self.sweep()
        with self._lock:  # (a group without streams and without a waiting pull is swept: both locks held here)
            g = self._groups.get(group) or self._groups.setdefault(group, PullGroup(group))
            with g.lock:
                g.last_pull = time.monotonic()
                busy = g.waiting is not None
                if not busy:
                    g.waiting, g.since = reader, g.last_pull
        if busy:
            self._answer(reader, invalid(f"group {group!r}: a group read is already waiting; read one at a time",
                                         "control"))
        elif g.due:
            self._answer_group(g)

    def flush(self) -> None:
        """The producer has sent what it had: answer each waiting group pull whose streams have queued responses
        since its last answer; a group with none waiting gives them to its next pull at once."""
        with self._lock:
            groups = [g for g in self._groups.values() if g.ready]
        for g in groups:
            with g.lock:
                g.due = g.ready
                waiting = g.waiting is not None
            if waiting:
                self._answer_group(g)

    def _answer_group(self, g: PullGroup, empty: bool = False) -> None:
        with g.lock:
            reader, g.waiting, g.ready = g.waiting, None, False
            if reader is None:
                return
            items, room, streams = [], GROUP_MAX_BYTES, list(g.streams.values())
            if streams:
                g.turn += 1
                at = g.turn % len(streams)
                streams = streams[at:] + streams[:at]
            for s in () if empty else streams:
                if room <= 0:
                    break
                took, room = s._take(room, self.nbytes)
                items += took
            g.ready = g.due = any(s._items for s in g.streams.values())  # the rest go with the next pull, at once
        try:
            reader.send(items, True)
        except Exception as e:  # noqa: BLE001 - the reader is gone with what it was given: its streams stop
            tags = {t for t, _, _ in items}
            log.info("%s: group %s's answer not delivered (%s); its %d streams abandoned", self.name, g.key, e,
                     len(tags))
            for s in list(g.streams.values()):
                if s.tag in tags:
                    s.abandoned = True

    def get(self, key: str) -> PullStream | None:
        with self._lock:
            return self._streams.get(key)

    def sweep(self) -> int:
        """Drop finished and stale streams (and groups with neither streams nor a waiting pull), answer the group
        pulls that waited `group_wait_s`; returns how many streams are left."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, s in self._streams.items() if s.finished or s.stale(now)]:
                s = self._streams.pop(key)
                if s.group is not None:
                    with s.group.lock:
                        s.group.streams.pop(key, None)
            overdue = [g for g in self._groups.values() if g.waiting is not None and now - g.since > self.group_wait_s]
            for k in [k for k, g in self._groups.items() if not g.streams and g.waiting is None]:
                del self._groups[k]
            left = len(self._streams)
        for g in overdue:
            self._answer_group(g, empty=not g.ready)
        return left

    def close(self) -> None:
        """Answer every waiting group pull (with what is queued): nothing more comes from this instance."""
        with self._lock:
            groups = list(self._groups.values())
        for g in groups:
            self._answer_group(g)

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    def _answer(self, reader: Responder, err: S2Error) -> None:
        try:
            reader.send(self.make_error(err), True)
        except Exception as e:  # noqa: BLE001
            log.info("%s: answer not delivered (%s)", self.name, e)
