"""The life of a request inside one model instance, without Triton.

Every request a model accepts gets a `Tracked` record under an internal id. Responses
go out through the record, and the record sends exactly one final response, whatever
ends the request: the normal end, a client cancel, a validation error, an engine or
codec failure, a deadline, an admission refusal or shutdown. Whoever sends the final
response first wins; later sends for that request are dropped (and counted), so no
response can follow the final one and no request is left without one.

The client's id (a gRPC request id, the gateway's id) is kept for cancellation and for
log lines; it never keys model state, so two clients that send the same id cannot take
over each other's stream.

`Health` is the instance's own verdict: once an unrecoverable fault is seen, every
request in flight is failed, new ones are refused at once with `unavailable`, and the
adapter tells Triton (the model unloads itself, so readiness turns false).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..errors import GAVE_UP, S2Error, unavailable

log = logging.getLogger("s2tts")


class Responder(Protocol):
    """Where a request's responses go (a Triton response sender, or a test double)."""

    def send(self, response: Any, final: bool) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass(eq=False)
class Tracked:
    """One request in flight. `state` is the adapter's (a chunker, a stream handle, ...)."""

    iid: int
    client_id: str
    responder: Responder
    deadline: float | None = None
    state: Any = None
    outcome: str | None = None  # set when the final response has been sent
    dropped: int = 0  # responses refused because the final one had gone
    label: str = ""  # how log lines name it, when not by `client_id` (e.g. the client's id behind an internal one)
    _sending: int = field(default=0, repr=False)  # non-final responses being sent now
    _pending_final: tuple | None = field(default=None, repr=False)  # (final response,) waiting for those sends
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _table: "RequestTable | None" = field(default=None, repr=False)
    _slot: int | None = field(default=None, repr=False)  # its slot of the table's shared `slots`

    @property
    def closed(self) -> bool:
        return self.outcome is not None

    @property
    def tag(self) -> str:
        """How log lines name this request: its label (the caller's id, by default) and our id."""
        return f"{self.label or self.client_id}#{self.iid}"

    def send(self, response: Any) -> bool:
        """A non-final response; False (dropped) when the request has already ended. `response` may be a function
        that builds it: it is called only if the response will be sent (what it counts is then never counted for a
        response that is dropped). The IPC send runs outside the record's lock: a `finish` meanwhile does not wait
        for it, and its final response goes out right after this one (never before it)."""
        with self._lock:
            if self.outcome is not None:
                self.dropped += 1
                return False
            self._sending += 1
        try:
            self.responder.send(response() if callable(response) else response, False)
        finally:
            with self._lock:
                self._sending -= 1
                final, self._pending_final = (self._pending_final, None) if not self._sending else (None, None)
            if final is not None:
                self._deliver_final(final[0])
        return True

    def finish(self, response: Any, outcome: str) -> bool:
        """The final response, once: True if this call ended the request. `response` may be a function that builds
        it, called only by the call that ends the request (a final response is built once: what it observes, e.g.
        time to first audio, is observed once). The request leaves its table first: a client that sends its next
        request as soon as this one ends must not find the slot still taken (at c=64 with the request limit at 64,
        some did: `busy`). A non-final response being sent meanwhile goes first; later ones are dropped."""
        with self._lock:
            if self.outcome is not None:
                self.dropped += 1
                return False
            self.outcome = outcome
        if self._table is not None:
            self._table._closed(self)
        response = response() if callable(response) else response
        with self._lock:
            if self._sending:  # the sending thread delivers it once its response is out
                self._pending_final = (response,)
                return True
        self._deliver_final(response)
        return True

    def _deliver_final(self, response: Any) -> None:
        try:
            self.responder.send(response, True)
        except Exception as e:  # the client is gone; the request has ended all the same
            log.info("request %s: final response not delivered (%s)", self.tag, e)

    def fail(self, error: S2Error) -> bool:
        """End the request with an error response, once."""
        if self._table is None:
            raise RuntimeError("fail() needs a record opened by a RequestTable")
        return self.finish(lambda: self._table.make_error(error), f"error:{error.code}")


class Health:
    """ok until an unrecoverable fault; then every request is refused with `unavailable`."""

    def __init__(self, name: str):
        self.name = name
        self.reason: str | None = None
        self._lock = threading.Lock()

    @property
    def ok(self) -> bool:
        return self.reason is None

    def fail(self, reason: str) -> bool:
        """Mark unhealthy; True the first time."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
        log.error("%s is unhealthy: %s", self.name, reason)
        return True

    def error(self) -> S2Error:
        return unavailable(f"{self.name} {GAVE_UP} ({self.reason}); "
                           "it is being restarted or needs a restart of the server")

    def check(self) -> None:
        if self.reason is not None:
            raise self.error()


class RequestTable:
    """The requests in flight in one model instance, keyed by internal id.

    `limit`: the most requests in flight; `open` refuses more with `unavailable` at once (never queues).
    `slots`: instead of `limit`, slots shared with other processes (`frontend.instances.SharedSlots`: several s2pro
    instances under one `max_concurrent_requests`); a request holds one from `open` until it ends.
    `make_error(S2Error) -> response`: how the adapter answers an error (a Triton error response).
    """

    ENDED_KEPT = 4096  # client ids of ended requests remembered (`ended_recently`)

    def __init__(self, name: str, make_error: Callable[[S2Error], Any], limit: int | None = None,
                 health: Health | None = None, retry_after_s: float = 1.0, slots=None):
        self.name = name
        self.make_error = make_error
        self.limit = limit
        self.slots = slots
        self.health = health or Health(name)
        self.retry_after_s = retry_after_s
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._live: dict[int, Tracked] = {}
        self._by_client: dict[str, int] = {}
        self._ended = RecentIds(limit=self.ENDED_KEPT)  # client ids of the requests that ended last
        self.counts = {"opened": 0, "refused": 0, "finished": 0}
        self._outcomes: dict[str, int] = {}

    # ---- admission -------------------------------------------------------------------------
    def open(self, client_id: str, responder: Responder, timeout_s: float | None = None, state: Any = None,
             unique: bool = True, label: str = "") -> Tracked:
        """Admit a request, or raise S2Error (and send nothing: the caller answers the refusal through
        `refuse`). `unique`: a client id that is live already is refused with `already_exists`; the live
        request is not touched."""
        self.health.check()
        with self._lock:
            if unique and client_id and client_id in self._by_client:
                self.counts["refused"] += 1
                raise S2Error("already_exists", f"request id {client_id!r} is already in flight on {self.name}: "
                                                "give each request its own id", "request_id")
            if self.limit is not None and len(self._live) >= self.limit:
                self.counts["refused"] += 1
                raise unavailable(f"{self.name} is busy: {len(self._live)} requests in flight, the limit is "
                                  f"{self.limit}; retry in {self.retry_after_s:g} s")
            slot = None
            if self.slots is not None and (slot := self.slots.take()) is None:
                self.counts["refused"] += 1
                raise unavailable(f"{self.name} is busy: {self.slots.limit} requests in flight in its instances "
                                  f"together (max_concurrent_requests); retry in {self.retry_after_s:g} s")
            now = time.monotonic()
            rec = Tracked(next(self._ids), client_id or "", responder,
                          deadline=None if not timeout_s else now + timeout_s, state=state, label=label)
            rec._table = self
            rec._slot = slot
            self._live[rec.iid] = rec
            if client_id and unique:
                self._by_client[client_id] = rec.iid
            self.counts["opened"] += 1
        return rec

    def refuse(self, responder: Responder, error: S2Error) -> None:
        """Answer a request that was never admitted (one final error response)."""
        try:
            responder.send(self.make_error(error), True)
        except Exception as e:  # noqa: BLE001
            log.info("%s: refusal not delivered (%s)", self.name, e)

    def _closed(self, rec: Tracked) -> None:
        with self._lock:
            if self._live.pop(rec.iid, None) is not None:
                self.counts["finished"] += 1
                if rec._slot is not None:
                    self.slots.give(rec._slot)
                self._outcomes[rec.outcome] = self._outcomes.get(rec.outcome, 0) + 1
            if self._by_client.get(rec.client_id) == rec.iid:
                del self._by_client[rec.client_id]
            if rec.client_id:  # under the table's lock: no moment where the id is neither live nor ended
                self._ended.add(rec.client_id)

    def ended_recently(self, client_id: str) -> bool:
        """Whether a request with this client id ended here among the last `ENDED_KEPT` to end."""
        return client_id in self._ended

    # ---- lookups ---------------------------------------------------------------------------
    def get(self, iid: int) -> Tracked | None:
        with self._lock:
            return self._live.get(iid)

    def get_many(self, iids: list[int]) -> list[Tracked | None]:
        """`get` of each, under one hold of the table's lock (a pass's outputs)."""
        with self._lock:
            live = self._live
            return [live.get(i) for i in iids]

    def by_client(self, client_id: str) -> Tracked | None:
        with self._lock:
            iid = self._by_client.get(client_id)
            return self._live.get(iid) if iid is not None else None

    def live(self) -> list[Tracked]:
        with self._lock:
            return list(self._live.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    # ---- ending many -----------------------------------------------------------------------
    def fail_all(self, error: S2Error) -> int:
        """Fail every request in flight (shutdown, an unrecoverable fault); returns how many."""
        return sum(r.fail(error) for r in self.live())

    def end_all(self, reason: str, tell: Callable[[str], None] | None) -> int:
        """After `health` failed: every request in flight ends with `unavailable`, and `tell(reason)` informs the
        host (a model unloads itself, so Triton's readiness says so). Returns how many ended."""
        n = self.fail_all(self.health.error())
        log.error("%s: %d requests in flight ended with `unavailable`", self.name, n)
        if tell is not None:
            try:
                tell(reason)
            except Exception:  # noqa: BLE001
                log.exception("%s: could not report the fault to the host", self.name)
        return n

    def outcomes(self) -> dict[str, int]:
        """Finished requests by outcome ("ok", "length", "cancelled", "error:<code>", ...)."""
        with self._lock:
            return dict(self._outcomes)

    def stats(self) -> dict:
        with self._lock:
            return {"in_flight": len(self._live), **self.counts, "healthy": self.health.ok}


class RecentIds:
    """A bounded set of ids, the most recent kept: each for `ttl_s` at most (None: until pushed out) and at most
    `limit` at once (the oldest go first). Thread-safe. Slow_ar's tombstones (ids cancelled before their request
    came: a cancel and its request travel as separate calls, and the cancel must win whichever arrives first) and a
    table's recently ended ids."""

    def __init__(self, ttl_s: float | None = None, limit: int = 4096):
        self.ttl_s, self.limit = ttl_s, limit
        self._ids: "collections.OrderedDict[str, float]" = collections.OrderedDict()  # id -> when added
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._expire()
            self._ids[key] = time.monotonic()
            self._ids.move_to_end(key)
            while len(self._ids) > self.limit:
                self._ids.popitem(last=False)

    def take(self, key: str) -> bool:
        """True (once) if `key` is held: it is removed."""
        with self._lock:
            self._expire()
            return self._ids.pop(key, None) is not None

    def __contains__(self, key: str) -> bool:
        with self._lock:
            self._expire()
            return key in self._ids

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._ids)

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        now = time.monotonic()
        while self._ids and now - next(iter(self._ids.values())) > self.ttl_s:
            self._ids.popitem(last=False)

