"""Serving an `Engine` to many streaming requests (what `slow_ar` runs), without Triton.

One engine thread runs batched steps; one sender thread sends each request's responses
in order and polls for cancellation, so IPC never stalls the device loop. Frames are
grouped per request as it asked (`first_chunk_frames`, then `chunk_frames`): one
response per audio chunk, then one final response with the finish reason and stats.

Requests are tracked by `lifecycle.RequestTable` under internal ids (the engine sees
only those); the caller's id serves for cancellation, status and log lines. Every
outcome ends in exactly one final response. Faults:
- a failed step ends the requests that step touched (`internal`, or `resource_exhausted`
  for out-of-memory) and the service goes on;
- a sticky device error, `max_step_faults` failed steps in a row, or a dead thread make
  the service unhealthy: every request in flight ends with `unavailable`, new ones are
  refused at once, and `on_unhealthy` tells the host (slow_ar unloads itself, so Triton's
  readiness turns false).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import errors
from .engine import FINISH_ERROR, Engine, Output
from .errors import S2Error
from .lifecycle import RequestTable, Responder, Tracked, guarded
from .prompt import Prompt
from .sampling import SamplingParams
from .service import Chunker

log = logging.getLogger("s2tts")

# What slow_ar's responses carry besides codes, as numbers: a decoupled BLS response is loaded by the receiving
# Python stub on a thread that does not hold the GIL, and a STRING tensor is decoded there by Python code, which
# crashed the s2pro process under load (perf/RESULTS.md, the soak). Numbers only on that wire.
FINISH_CODES = {"": 0, "end": 1, "length": 2, "cancelled": 3}
FINISH_NAMES = {v: k for k, v in FINISH_CODES.items()}
STATS_FIELDS = ("frames", "queue_s", "prompt_tokens")  # the final response's `stats`
STATUS_FIELDS = ("healthy", "waiting", "live", "free_slots", "in_flight", "request")  # a `status` answer
REQUEST_STATES = ("unknown", "waiting", "live")


def encode_fields(values: dict, fields) -> np.ndarray:
    """dict -> float32 vector in `fields` order (None -> -1; booleans -> 0/1; request states -> their index)."""
    out = []
    for f in fields:
        v = values.get(f)
        if f == "request":
            v = REQUEST_STATES.index(v) if v in REQUEST_STATES else 0
        out.append(-1.0 if v is None else float(v))
    return np.array(out, np.float32)


def decode_fields(arr, fields) -> dict:
    vals = [float(x) for x in np.asarray(arr).reshape(-1)]
    out = {}
    for f, v in zip(fields, vals):
        if f == "request":
            out[f] = REQUEST_STATES[int(v)] if 0 <= int(v) < len(REQUEST_STATES) else "unknown"
        elif f == "healthy":
            out[f] = v > 0.5
        elif f == "queue_s":
            out[f] = None if v < 0 else round(v, 4)
        else:
            out[f] = int(v)
    return out


@dataclass
class StreamState:
    chunker: Chunker
    queue_s: float | None = None
    frames: int = 0
    prompt_tokens: int = 0


class EngineService:
    """`make_response(codes [n, C] int32, finish_reason, stats dict | None) -> response` and
    `make_error(S2Error) -> response` build the transport's responses."""

    def __init__(self, engine: Engine, make_response: Callable[[np.ndarray, str, dict | None], Any],
                 make_error: Callable[[S2Error], Any], name: str = "slow_ar", limit: int | None = None,
                 on_unhealthy: Callable[[str], None] | None = None, cancel_poll_s: float = 0.05,
                 max_step_faults: int = 3, on_tick: Callable[["EngineService"], None] | None = None,
                 frame_seconds: float | None = None):
        """`frame_seconds` (audio per frame): chunks grow by the engine's measured pace (`service.Chunker`);
        None: fixed chunks."""
        self.engine = engine
        self.frame_seconds = frame_seconds
        self.step_s: float | None = None  # moving average of the wall time of a step that decoded (one frame each)
        self.downstream_pace: tuple[float, float] | None = None  # (pace, when) reported by the caller (s2pro)
        self.downstream_pace_ttl_s = 5.0
        self.name = name
        self.make_response = make_response
        self.table = RequestTable(name, make_error, limit)
        self.health = self.table.health
        self.on_unhealthy = on_unhealthy
        self.on_tick = on_tick  # called from the sender thread every poll (metrics)
        self.cancel_poll_s = cancel_poll_s
        self.max_step_faults = max_step_faults
        self.step_faults = 0  # failed steps in a row
        self.C = engine.s2.num_codebooks
        self.outbox: queue.Queue = queue.Queue()  # (record, kind "chunk"|"final"|"error", payload, outcome)
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=guarded(f"{name} engine loop", self._engine_pass, self.stop, self.unhealthy),
                             name="s2tts-engine", daemon=True),
            threading.Thread(target=guarded(f"{name} sender loop", self._send_pass, self.stop, self.unhealthy),
                             name="s2tts-sender", daemon=True),
        ]
        self._last_poll = 0.0
        self._preemptions_logged, self._preemption_log_at = 0, 0.0
        for t in self.threads:
            t.start()

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, client_id: str, responder: Responder, prompt: Prompt, params: SamplingParams,
               first_chunk_frames: int, chunk_frames: int) -> Tracked | None:
        """Admit a request (its responses go to `responder`). A refusal (duplicate id, full, unhealthy, a request
        the engine can never run) is answered on `responder` with one final error; returns None then."""
        try:
            pace = self.pace if self.frame_seconds else None
            rec = self.table.open(client_id, responder,
                                  state=StreamState(Chunker(first_chunk_frames, chunk_frames, pace), prompt_tokens=len(prompt)))
        except S2Error as e:
            log.info("%s: request %s refused: %s", self.name, client_id, e.wire())
            self.table.refuse(responder, e)
            return None
        try:
            self.engine.submit(str(rec.iid), prompt, params)
        except Exception as e:  # noqa: BLE001 - e.g. a prompt longer than the KV cache
            err = errors.from_exception(e, self.name)
            log.info("%s: request %s refused: %s", self.name, rec.tag, err.wire())
            rec.fail(err)
            return None
        log.info("%s: request %s admitted: %d prompt tokens, max_new_tokens=%d", self.name, rec.tag, len(prompt),
                 params.max_new_tokens)
        return rec

    def cancel(self, client_id: str) -> bool:
        rec = self.table.by_client(client_id)
        if rec is None:
            return False
        self.engine.cancel(str(rec.iid))
        return True

    def pace(self) -> float:
        """The pace chunks follow: seconds to make a second of a stream's audio, the slower of the engine's own
        (its step time) and the pipeline's as the caller last reported it (`set_downstream_pace`, if recent)."""
        own = 1.0 if self.step_s is None or not self.frame_seconds else self.step_s / self.frame_seconds
        d = self.downstream_pace
        if d is not None and time.monotonic() - d[1] < self.downstream_pace_ttl_s:
            return max(own, d[0])
        return own

    def set_downstream_pace(self, r: float) -> None:
        if not (0.0 < r < 1e3):
            raise errors.invalid(f"pace={r} is out of range: seconds per second of audio, > 0", "control")
        self.downstream_pace = (r, time.monotonic())

    def status(self, client_id: str | None = None) -> dict:
        out = {"healthy": self.health.ok, "reason": self.health.reason, **self.engine.counts(),
               "in_flight": len(self.table)}
        if client_id is not None:
            rec = self.table.by_client(client_id)
            out["request"] = self.engine.where(str(rec.iid)) if rec is not None else "unknown"
        return out

    # ---- the engine thread ------------------------------------------------------------------
    def _note_preemptions(self) -> None:
        """Say when the KV cache ran short and requests were paused (at most every 10 s: it can happen every step)."""
        n = self.engine.preemptions
        now = time.monotonic()
        if n > self._preemptions_logged and now - self._preemption_log_at >= 10.0:
            log.warning("%s: the KV cache ran out of blocks: %d request(s) paused to resume where they stopped (%d so "
                        "far; kv_cache_tokens=%d: raise it if this repeats)", self.name, n - self._preemptions_logged,
                        n, self.engine.kv_capacity_tokens)
            self._preemptions_logged, self._preemption_log_at = n, now

    def _engine_pass(self) -> None:
        if not self.engine.wait_for_work(timeout=0.5) or self.stop.is_set():
            return
        if not self.health.ok:  # nothing runs on an unhealthy device; drop whatever arrived meanwhile
            self.engine.fail_all("unhealthy")
            return
        t0 = time.monotonic()
        decoding = bool(self.engine.live)
        outputs = self.engine.step()
        if decoding and self.engine.last_fault is None:
            dt = time.monotonic() - t0
            self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt
        self._note_preemptions()
        fault = self.engine.last_fault
        if fault is None:
            self.step_faults = 0
        else:
            self.step_faults += 1
            if errors.is_fatal_device_error(fault):  # before routing: the touched requests end `unavailable` too
                self.unhealthy(f"unrecoverable device error: {type(fault).__name__}: {fault}")
            elif self.step_faults >= self.max_step_faults:
                self.unhealthy(f"{self.step_faults} engine steps failed in a row; the last: {type(fault).__name__}: {fault}")
            else:
                log.warning("%s: engine step failed (%s: %s); the requests it touched end with an error", self.name,
                            type(fault).__name__, fault)
        for o in outputs:
            self._route(o)

    def _route(self, o: Output) -> None:
        rec = self.table.get(int(o.request_id))
        if rec is None or rec.closed:  # ended elsewhere (shutdown, unhealthy): make sure the engine lets go too
            if not o.finished:
                self.engine.cancel(o.request_id)
            return
        st: StreamState = rec.state
        if o.queue_s is not None:
            st.queue_s = o.queue_s
        if o.finish_reason == FINISH_ERROR:
            err = errors.from_exception(o.exception, self.name) if o.exception is not None else \
                errors.internal(f"{self.name}: {o.error}")
            self.outbox.put((rec, "error", err, None))
            return
        st.frames += o.codes.shape[0]
        for chunk in st.chunker.add(o.codes):
            self.outbox.put((rec, "chunk", self.make_response(chunk, "", None), None))
        if o.finished:
            tail = st.chunker.flush()
            codes = tail if tail is not None else np.zeros((0, self.C), np.int32)
            stats = {"frames": st.frames, "queue_s": None if st.queue_s is None else round(st.queue_s, 4),
                     "prompt_tokens": st.prompt_tokens, "finish_reason": o.finish_reason}
            self.outbox.put((rec, "final", self.make_response(codes, o.finish_reason, stats), o.finish_reason))

    # ---- the sender thread ------------------------------------------------------------------
    def _send_pass(self) -> None:
        try:
            rec, kind, payload, outcome = self.outbox.get(timeout=self.cancel_poll_s)
        except queue.Empty:
            rec = None
        if rec is not None:
            if kind == "chunk":
                try:
                    rec.send(payload)
                except Exception as e:  # noqa: BLE001 - the client went away
                    log.info("%s: request %s: response not delivered (%s); cancelling", self.name, rec.tag, e)
                    self.engine.cancel(str(rec.iid))
            elif kind == "final":
                if rec.finish(payload, outcome):
                    log.info("%s: request %s done, finish reason %s", self.name, rec.tag, outcome)
            else:
                if rec.fail(payload):
                    log.warning("%s: request %s failed: %s", self.name, rec.tag, payload.wire())
        now = time.monotonic()
        if now - self._last_poll >= self.cancel_poll_s:
            self._last_poll = now
            for r in self.table.live():
                if r.responder.is_cancelled():
                    self.engine.cancel(str(r.iid))
            if self.on_tick is not None:
                self.on_tick(self)

    # ---- faults and shutdown ----------------------------------------------------------------
    def unhealthy(self, reason: str) -> None:
        """An unrecoverable fault: fail everything in flight, refuse what comes, tell the host (once)."""
        if not self.health.fail(reason):
            return
        self.engine.fail_all(reason)
        n = self.table.fail_all(self.health.error())
        log.error("%s: %d requests in flight ended with `unavailable`", self.name, n)
        if self.on_unhealthy is not None:
            try:
                self.on_unhealthy(reason)
            except Exception:  # noqa: BLE001
                log.exception("%s: could not report the fault to the host", self.name)

    def shutdown(self, timeout: float = 5.0) -> int:
        """Stop the threads; every request still in flight gets a final `unavailable` error. Returns how many."""
        self.stop.set()
        self.engine.wake()
        for t in self.threads:
            t.join(timeout)
        self.engine.fail_all("shutting down")
        return self.table.fail_all(errors.shutting_down(self.name))

