"""Threads of a model process: named where the OS shows them, loops that report their own death, and a pool
of daemon workers for per-request work."""

from __future__ import annotations

import ctypes
import logging
import queue
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("s2tts")


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its Python name (default) where the OS shows threads (`top -H`,
    /proc/<pid>/task/<tid>/comm, at most 15 bytes on Linux), so that perf/cpu_use.py and profilers tell the engine's
    thread from the sender's. Does nothing where that cannot be done."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(15, (name or threading.current_thread().name).encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def guarded(name: str, body: Callable[[], None], stop: threading.Event, on_death: Callable[[str], None],
            max_consecutive_errors: int = 3) -> Callable[[], None]:
    """A thread target that runs `body()` until `stop` is set. An exception in one pass is logged;
    `max_consecutive_errors` passes in a row that raise, or anything that escapes, kill the loop:
    `on_death(reason)` is called so the model can report itself unhealthy instead of hanging."""

    def run():
        name_os_thread()
        errors = 0
        try:
            while not stop.is_set():
                try:
                    body()
                    errors = 0
                except Exception:  # noqa: BLE001
                    errors += 1
                    log.exception("%s: error in loop pass (%d in a row)", name, errors)
                    if errors >= max_consecutive_errors:
                        raise
        except BaseException as e:  # noqa: BLE001
            log.critical("%s: thread died: %s: %s", name, type(e).__name__, e)
            on_death(f"{name} thread died: {type(e).__name__}: {e}")

    return run


class WorkerPool:
    """Daemon worker threads for per-request work: made on demand up to `max_workers`, then kept.

    Not `concurrent.futures.ThreadPoolExecutor`: its workers are joined when the interpreter
    exits, so one worker blocked on a model that died keeps the process (the Triton stub, a test
    run) from ever exiting. A request's work must never be lost, so `submit` past the limit
    queues it; the admission limit (`RequestTable`) keeps that queue short.

    A worker whose request was ended elsewhere while it waits in a call that may never return (a
    model process that died) is given up (`give_up`): another worker may start in its place, so
    capacity is never lost to such calls; if the call does return, that worker leaves the pool.
    """

    def __init__(self, max_workers: int, name: str):
        self.max_workers, self.name = max_workers, name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # workers waiting for work that no queued item is promised to
        self._backlog = 0  # queued items no worker is promised to yet
        self._given_up: set[threading.Thread] = set()
        self._closed = False

    def submit(self, fn: Callable[..., None], *args) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: pool is shut down")
            self._q.put((fn, args))
            if self._idle:  # an idle worker takes it
                self._idle -= 1
            elif not self._spawn():
                self._backlog += 1

    def give_up(self, worker: threading.Thread | None) -> bool:
        """`worker`'s work was ended elsewhere while it waits in a call that may never return: one more worker may
        start in its place (at once if work is queued). True if it was a busy worker of this pool."""
        with self._lock:
            if worker is None or worker not in self._threads or worker in self._given_up or self._closed:
                return False
            self._given_up.add(worker)
            self.max_workers += 1
            if self._backlog and self._spawn():
                self._backlog -= 1
            return True

    @property
    def given_up(self) -> int:
        """Workers given up in calls that have not returned."""
        with self._lock:
            return len(self._given_up)

    @property
    def queued(self) -> int:
        """Work waiting for a worker."""
        with self._lock:
            return self._backlog

    def _spawn(self) -> bool:  # with the lock held
        if len(self._threads) >= self.max_workers:
            return False
        t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
        self._threads.append(t)
        t.start()
        return True

    def _work(self) -> None:
        me = threading.current_thread()
        name_os_thread()
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - the work reports its own errors; a worker never dies of one
                log.exception("%s: unhandled error in a worker", self.name)
            with self._lock:
                if me in self._given_up:  # its replacement serves now: this one leaves
                    self._given_up.discard(me)
                    self._threads.remove(me)
                    self.max_workers -= 1
                    if self._backlog and self._spawn():
                        self._backlog -= 1
                    return
                if self._backlog:  # it takes a queued item next
                    self._backlog -= 1
                else:
                    self._idle += 1

    @property
    def size(self) -> int:
        return len(self._threads)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Idle workers exit, and are waited for (up to `timeout` in all): a daemon thread still running when the
        interpreter is torn down (the Triton stub's, at unload) crashes it. Busy ones exit when their work
        returns (one blocked on a dead model never does; it is a daemon, so it does not hold the exit). Workers
        given up (`give_up`) are not waited for: their call may never return."""

        with self._lock:
            self._closed = True
            threads = [t for t in self._threads if t not in self._given_up]
            for _ in threads:
                self._q.put(None)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
