"""s2pro's side of group pulls (`pull_groups`): the later chunks of every request this process reads from one engine
model, taken in one call and handed to each request's inbox.

    relay = PullRelay(fetch)                # fetch(engine, group): one group pull (s2pro's BLSDownstream._next_group)
    key, inbox = relay.open("slow_ar")   # before the request is submitted with pull_group=relay.group, pull_key=key
    ...                                  # its first chunk comes as the submit's answer, the rest from `inbox.get()`
    relay.close(key)

One thread per engine model runs `fetch(engine, group) -> [(key, item)]` (slow_ar's `control`="next_group": every
chunk queued for this process's streams, waiting while none is) for as long as some request of that engine reads,
and puts each item in its request's inbox; an item is what `Downstream.generate` yields, or the `S2Error` that ends
the stream. A chunk then costs the engine's process one response a pass instead of one a chunk, and this process
one call. A failed fetch ends, with its error, every request of that engine here (the answer it lost may have
held any of their chunks), unless another read of the group was waiting there (it took nothing: tried again);
`failed(engine)` (the engine died) ends them from outside and leaves a thread still waiting in the dead process's
call behind: the next reader starts a new one, and one left behind still hands out what its last read gets.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
from typing import Any, Callable

from .. import errors
from ..errors import S2Error

log = logging.getLogger("s2tts")

RETRY_S = (0.05, 1.0)  # after a failed fetch, before the next (while requests still read): doubled each time up to
# the second
ABANDONED_S = 60.0  # an abandoned request's inbox is read for its engine's last item this long at most


def _another_waits(err: S2Error) -> bool:
    """Whether a group read was refused because another read of the group waits in that process already (slow_ar's
    `serving.pull.PullStreams.pull_group`: invalid_argument on `control`): it took nothing."""
    return err.code == "invalid_argument" and err.param == "control"


class Inbox:
    """One request's items from the relay, in order."""

    def __init__(self, engine: str):
        self.engine = engine
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.reading = False  # its first chunk came: it waits on this inbox now
        self.abandoned_at: float | None = None  # ended elsewhere (`PullRelay.abandon`): kept for its last item

    def get(self) -> Any:
        self.reading = True
        return self.items.get()


class PullRelay:
    def __init__(self, fetch: Callable[[str, str], list[tuple[int, Any]]], group: str | None = None):
        """`fetch(engine, group)`: one group pull of `engine`; `group`: this process's name there (default: a new
        random one, so that a restarted process never reads another's streams)."""
        self.fetch = fetch
        self.group = group or f"s2pro-{secrets.token_hex(6)}"
        self._keys = itertools.count(1)
        self._lock = threading.Condition()
        self._inboxes: dict[int, Inbox] = {}
        self._epoch: dict[str, int] = {}  # engine -> the epoch of its current thread
        self._threads: dict[str, threading.Thread] = {}
        self.stop = threading.Event()
        self.fetches = 0  # group pulls made (all engines)

    def open(self, engine: str) -> tuple[int, Inbox]:
        """A key and an inbox for a request about to be submitted to `engine` (its pull_key)."""
        with self._lock:
            key, epoch = next(self._keys), self._epoch.setdefault(engine, 0)
            inbox = self._inboxes[key] = Inbox(engine)
            t = self._threads.get(engine)
            if t is None or not t.is_alive():
                t = self._threads[engine] = threading.Thread(target=self._run, args=(engine, epoch), daemon=True,
                                                             name=f"s2tts-relay-{engine}")
                t.start()
            self._lock.notify_all()
        return key, inbox

    def close(self, key: int) -> None:
        """The request no longer reads: what still comes for it is dropped."""
        with self._lock:
            self._inboxes.pop(key, None)

    def abandon(self, key: int, err: S2Error) -> None:
        """The request of `key` was ended elsewhere: its reader gets `err` (if it still waits). Its inbox is still
        read for the engine's last item (a cancel's, which lets the engine's process drop the stream), for
        `ABANDONED_S` at most (an engine that lost the request sends none)."""
        with self._lock:
            inbox = self._inboxes.get(key)
            if inbox is None or inbox.abandoned_at is not None:
                return
            inbox.abandoned_at = time.monotonic()
        inbox.items.put(err)

    def failed(self, engine: str, err: S2Error) -> None:
        """`engine` died: every request reading from it gets `err`; later readers get a thread of their own."""
        with self._lock:
            self._epoch[engine] = self._epoch.get(engine, 0) + 1
            self._threads.pop(engine, None)
            ended = self._take(engine)
            self._lock.notify_all()
        for b in ended:
            b.items.put(err)

    def _take(self, engine: str) -> list[Inbox]:
        """The inboxes of `engine`, let go of; the caller holds the lock and puts the error in each."""
        ended = [k for k, b in self._inboxes.items() if b.engine == engine]
        return [self._inboxes.pop(k) for k in ended]

    def shutdown(self, timeout: float = 0.0) -> None:
        """No more fetches; waits up to `timeout` for the threads to leave the calls they are in."""
        self.stop.set()
        with self._lock:
            self._lock.notify_all()
            threads = list(self._threads.values())
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _current(self, engine: str, epoch: int) -> bool:
        return not self.stop.is_set() and self._epoch.get(engine) == epoch

    def _run(self, engine: str, epoch: int) -> None:
        retry = RETRY_S[0]
        while True:
            with self._lock:
                while self._current(engine, epoch) and not any(b.engine == engine for b in self._inboxes.values()):
                    self._lock.wait()
                if not self._current(engine, epoch):
                    return
            try:
                items = self.fetch(engine, self.group)
                self.fetches += 1
            except Exception as e:  # noqa: BLE001 - the engine failed: its requests here end with its error
                err = errors.from_exception(e, engine)
                if retry == RETRY_S[0] and not self.stop.is_set():
                    log.info("relay %s: a group read of %s failed (%s)", self.group, engine, err.wire())
                with self._lock:
                    if not self._current(engine, epoch):
                        return
                    # an answer that did not arrive may have held any of their chunks, so every request reading
                    # from that engine ends; but a read refused because another waits there (a thread `failed`
                    # left behind in a live process) took none: it is tried again
                    ended = [] if _another_waits(err) else self._take(engine)
                for b in ended:
                    b.items.put(err)
                self.stop.wait(retry)
                retry = min(RETRY_S[1], 2 * retry)
                continue
            retry = RETRY_S[0]
            with self._lock:
                # (a thread `failed` left behind hands out what its last read got all the same: its keys are this
                # relay's, so each item still goes to its own request)
                for key, item in items:
                    b = self._inboxes.get(key)
                    if b is None:
                        continue  # its reader left (cancelled, drained elsewhere)
                    b.items.put(item)
                    if isinstance(item, S2Error) or item[2]:  # its last
                        del self._inboxes[key]
                now = time.monotonic()
                for key in [k for k, b in self._inboxes.items()
                            if b.abandoned_at is not None and now - b.abandoned_at > ABANDONED_S]:
                    del self._inboxes[key]
