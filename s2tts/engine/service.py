"""Serving an `Engine` to many streaming requests (what `slow_ar` runs), without Triton.

One engine thread runs the loop; one sender thread sends each request's responses in order and polls for
cancellation, so IPC never stalls the device. Frames are grouped per request as it asked (`first_chunk_frames`,
then `chunk_frames`, growing with the pace: `chunking.Chunker`): one response per audio chunk, then one final
response with the finish reason and stats. Every outcome ends in exactly one final response.

A pass of the engine thread (`_pass`) is five verbs:
1. `_take_requests`: what other threads asked of the loop (codec streams to close);
2. `_step`: one engine step (`Engine.step`, or `step_ahead` to keep two in flight) and its faults judged;
3. `_route`: each request's output -> its chunks and final item (`Outgoing`);
4. `_decode_audio` (with the codec here): `codec_plan.plan_codec` says what to decode, the codec decodes it, and
   every request's items leave as far as its audio reaches;
5. `_hand_out`: to the sender thread (or sent here, `direct_send`), and the pass recorded (`LoopStats`).

With a `codec` (`codec.stream.StreamDecoder`: `codec_in_engine`), every response carries its chunk's audio beside
its codes, so no chunk makes a round trip to another process. A request names its codec stream (`CodecStream`:
several requests, one per text segment, can continue one stream); the stream closes with the request's last chunk
when `final`, and whenever the request ends otherwise.

Requests are tracked by `serving.lifecycle.RequestTable` under internal ids (the engine sees only those); the
caller's id serves for cancellation, status and log lines. Every cancel, whoever asks it, goes through `_cancel`.
Faults:
- a failed step ends the requests that step touched (`internal`, or `resource_exhausted` for out-of-memory) and
  the service goes on;
- a sticky device error, `max_step_faults` failed steps in a row, or a dead thread make the service unhealthy:
  every request in flight ends with `unavailable`, new ones are refused at once, and `on_unhealthy` tells the host
  (slow_ar unloads itself, so Triton's readiness turns false).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .. import errors
from ..ar.sampling import SamplingParams
from ..errors import S2Error
from ..gpu.cuda_graphs import own_stream
from ..serving.lifecycle import RecentIds, RequestTable, Responder, Tracked
from ..serving.threads import guarded
from .chunking import Chunker, LoadMeter
from .codec_plan import CodecPlan, StreamView, plan_codec
from .core import Engine
from .prompt import Prompt
from .scheduler import FINISH_END, FINISH_ERROR, FINISH_LENGTH, Output
from .stats import LoopStats, SendStats

log = logging.getLogger("s2tts")


@dataclass
class CodecStream:
    """Which decoder stream a request's audio continues (with an in-engine codec)."""

    sid: str
    start: bool = True  # the request's first chunk opens the stream (else it continues an earlier request's)
    final: bool = True  # the request's last chunk closes it (else a later request continues it)


@dataclass(eq=False)
class Outgoing:
    """One response on its way out: a chunk of frames (with its audio once decoded), the final item, or an error."""

    rec: Tracked
    kind: str  # "chunk" | "final" | "error"
    codes: np.ndarray | None = None  # [n, C] int32
    reason: str = ""  # the finish reason ("final")
    stats: dict | None = None  # the final item's numbers
    error: S2Error | None = None  # "error"
    audio: np.ndarray | None = None  # float32, set when its frames are decoded (or empty: nothing to decode)

    @property
    def frames(self) -> int:
        return 0 if self.codes is None else self.codes.shape[0]


@dataclass
class RequestState:
    """A request's state in the service: its chunker, its numbers, and with an in-engine codec its frames and audio on
    their way out. (The codec's own per-stream state is `codec.StreamState`.)"""

    chunker: Chunker
    prompt_tokens: int = 0
    queue_s: float | None = None
    arrived: float = field(default_factory=time.monotonic)
    first_frame_s: float | None = None
    first_audio_s: float | None = None
    last_frame_at: float | None = None  # when the engine ended it (its last frame made)
    frames: int = 0
    codec: CodecStream | None = None
    codec_dropped: bool = False  # nothing more is decoded (its decode failed, or its caller closed the stream)
    # with an in-engine codec: its counts as the codec's planner reads them (frames undecoded, waiting, decoded,
    # released; whether its stream is open), beside the frames, the decoded audio and the items themselves
    counts: StreamView | None = None
    undecoded: list = field(default_factory=list)  # frames made and not yet decoded, in order
    audio: list = field(default_factory=list)  # decoded audio not yet sent, in order
    waiting: list[Outgoing] = field(default_factory=list)  # routed items waiting for their audio, in order

    def add_frames(self, codes: np.ndarray) -> None:
        self.undecoded.append(codes)
        self.counts.undecoded += codes.shape[0]

    def take(self, n: int, C: int) -> np.ndarray:
        """Its next n undecoded frames [n, C]."""
        codes = np.concatenate(self.undecoded) if len(self.undecoded) > 1 else \
            self.undecoded[0] if self.undecoded else np.zeros((0, C), np.int32)
        self.undecoded = [codes[n:]] if codes.shape[0] > n else []
        self.counts.undecoded -= n
        return codes[:n]

    def add_audio(self, audio: np.ndarray, frames: int) -> None:
        self.audio.append(audio)
        self.counts.audio += frames

    def wait(self, item: Outgoing) -> None:
        self.waiting.append(item)
        self.counts.waiting += item.frames

    def drop_waiting(self) -> list[Outgoing]:
        out, self.waiting, self.counts.waiting = self.waiting, [], 0
        return out

    def drop_frames(self) -> None:
        self.undecoded, self.counts.undecoded = [], 0

    def release(self) -> list[Outgoing]:
        """Its waiting items whose audio is all decoded, in order, consecutive chunks as one (and an error at once)."""
        out: list[Outgoing] = []
        c = self.counts
        while self.waiting:
            item = self.waiting[0]
            if item.kind == "error":
                out.append(item)
                self.drop_waiting()
                break
            n = item.frames
            if n > c.audio or (item.kind == "final" and (c.undecoded or (c.closes and c.open))):
                break
            self.waiting.pop(0)
            c.waiting -= n
            c.released += n
            audio = np.concatenate(self.audio) if len(self.audio) > 1 else \
                self.audio[0] if self.audio else np.zeros(0, np.float32)
            hop = audio.size // max(1, c.audio)
            item.audio, rest = audio[: n * hop], audio[n * hop:]
            self.audio, c.audio = ([rest] if rest.size else []), c.audio - n
            prev = out[-1] if out else None
            if prev is not None and prev.kind == "chunk" and item.kind == "chunk" and c.released > prev.frames + n:
                prev.codes, prev.audio = np.concatenate([prev.codes, item.codes]), np.concatenate([prev.audio, item.audio])
            else:
                out.append(item)
        return out


@dataclass
class _Step:
    """What one pass's engine step gave: its outputs and what the pass records of it."""

    outputs: list[Output]
    decoding: bool  # some request was past its prompt (the step made frames, the streams' pace)
    fault: BaseException | None
    live: int  # slots the step held (those live after it and those it ended)
    waiting: int  # requests left waiting for a slot
    started: float  # monotonic time at the pass's start, and the engine thread's CPU time then
    cpu: float
    stepped: float  # monotonic time once the step was done (and judged)
    launch_s: float  # the engine's host time launching and waiting, this step
    wait_s: float


class EngineService:
    """`make_response(codes [n, C] int32, finish_reason, stats dict | None, audio float32 [samples] | None) ->
    response` and `make_error(S2Error) -> response` build the transport's responses."""

    def __init__(self, engine: Engine, make_response: Callable[..., Any], make_error: Callable[[S2Error], Any],
                 name: str = "slow_ar", on_unhealthy: Callable[[str], None] | None = None,
                 on_tick: Callable[["EngineService"], None] | None = None, frame_seconds: float | None = None,
                 codec=None, direct_send: bool = False, limit: int | None = None,
                 on_sent: Callable[[], None] | None = None):
        """The loop reads `engine.config` (`EngineConfig`). `frame_seconds` (audio per frame): with
        `adaptive_chunks`, chunks grow by the measured pace; None: fixed chunks. `codec` (a
        `codec.stream.StreamDecoder`): decode audio here. `direct_send`: responders that only hand a response to
        another thread of this process (s2pro holding the engine): the engine thread sends each response itself
        (the sender thread then only polls for cancels and reports). `limit`: the most requests in flight (default
        `max_batch` + `max_queued_requests`). `on_tick(service)` is called from the sender thread every poll, `on_sent()` each time
        it has sent a pass's responses (and after responses sent outside a pass: a transport that answers several
        requests' responses together sends them then).

        `launch_ahead` (None: on a GPU): the engine keeps two steps in flight (`Engine.step_ahead`), except while
        the codec here decodes each chunk at once (light load) and a request in flight has yet to send audio (its
        first chunk's codec call would wait behind that step). `codec_concurrent` (None: on a GPU): the codec's
        calls are made by a thread of their own, on a GPU on a CUDA stream of their own beside the engine's (which
        has the higher priority): a codec call's kernels fill what the step leaves of the device instead of waiting
        behind it. Every graph replayed was captured on a stream of its owner's own (`gpu.cuda_graphs`)."""
        c = self.config = engine.config
        on_gpu = engine.device.type == "cuda"
        self.engine, self.codec, self.name = engine, codec, name
        self.make_response, self.direct_send = make_response, direct_send
        self.on_unhealthy, self.on_tick, self.on_sent = on_unhealthy, on_tick, on_sent
        self.C = engine.s2.num_codebooks
        self.launch_ahead = on_gpu if c.launch_ahead is None else c.launch_ahead
        self.codec_concurrent = on_gpu if c.codec_concurrent is None else c.codec_concurrent
        self.codec_batch_steps, self.codec_final_steps = max(1, c.codec_batch_steps), c.codec_final_steps
        self.codec_first_steps = c.codec_first_steps
        # switches a benchmark may turn off (perf/bench_loop.py): with steps launched ahead, the next one also
        # launched during a held codec call, behind it on the device (`_launch_behind_codec`); and at a light load
        # with the codec here, steps launched ahead too once every request in flight has sent audio
        self.codec_overlap = True
        self.light_ahead = True
        # under load a chunk waits for its frames' slice (up to 2 (K - 1) steps) and a step's own codec call delays
        # it by about one more: the chunker keeps K frames of room; Chunker keyword overrides beside it
        self.chunk_lag = self.codec_batch_steps if codec is not None else 0
        self.chunk_options: dict = {"load_frames": c.load_chunk_frames} if c.load_chunk_frames else {}
        self.frame_seconds = frame_seconds if c.adaptive_chunks else None
        self.load = LoadMeter(self.frame_seconds, engine.max_batch, engine.slots_wanted)
        self.table = RequestTable(name, make_error, c.max_batch + c.max_queued_requests if limit is None else limit)
        self.health = self.table.health
        self.tombstones = RecentIds(ttl_s=120.0)  # ids cancelled before their request came
        self._admit_lock = threading.Lock()  # one order between a request and a cancel for its id
        self.loop, self.sends = LoopStats(), SendStats()
        self.step_faults = 0  # failed steps in a row
        # engine thread's state between passes
        self._states: dict[str, RequestState] = {}  # engine request id -> its state, until its last output
        self._decoding: dict[int, Tracked] = {}  # requests with frames or items the codec has yet to see
        self._ahead = False  # this pass launches ahead
        self._launched_early: list[Output] = []  # what the launch behind a codec call gave at once
        self._early_fault: BaseException | None = None  # ... and its fault, judged with the next pass's
        self._launch_error: Exception | None = None  # ... or raised: raised again by the next pass
        self._streams: tuple | None = None  # (the engine's CUDA stream, the codec's), or () to use the current one
        self._codec_worker = ThreadPoolExecutor(1, thread_name_prefix="s2tts-codec") \
            if self.codec_concurrent and codec else None
        self._codec_closing: list[str] = []  # codec streams to close, asked from other threads
        self._codec_lock = threading.Lock()
        self._preemptions_logged, self._preemption_log_at = 0, 0.0
        # sender thread: (Outgoing, when queued)
        self.outbox: queue.Queue = queue.Queue()
        self._last_poll = 0.0
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=guarded(f"{name} engine loop", self._engine_pass, self.stop, self.unhealthy),
                             name="s2tts-engine", daemon=True),
            threading.Thread(target=guarded(f"{name} sender loop", self._send_pass, self.stop, self.unhealthy),
                             name="s2tts-sender", daemon=True),
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def codec_lengths(first_chunk_frames: int, chunk_frames: int, codec_batch_steps: int) -> list[int]:
        """The lengths an in-engine codec decodes (what a GPU's decoder prepares graphs for): the chunk lengths, and
        with held calls their slices (twice that for a stream catching up)."""
        k = codec_batch_steps
        return sorted(set(Chunker.lengths(first_chunk_frames, chunk_frames)) | ({k, 2 * k} if k > 1 else set()))

    # ---- requests, from any thread ---------------------------------------------------------------
    def submit(self, client_id: str, responder: Responder, prompt: Prompt, params: SamplingParams,
               first_chunk_frames: int, chunk_frames: int, codec_stream: CodecStream | None = None,
               label: str = "") -> Tracked | None:
        """Admit a request (its responses go to `responder`). A refusal (duplicate id, full, unhealthy, a request
        the engine can never run) is answered on `responder` with one final error; returns None then. With an
        in-engine codec, `codec_stream` says which decoder stream the audio continues (None: a stream of its own).
        A request whose id was cancelled before it came (`cancel`) ends at once: one final response, finish reason
        "cancelled", no frames; the engine never sees it. `label` names the request in log lines (default: its id)."""
        try:
            pace = self.load.pace if self.frame_seconds else None
            chunker = Chunker(first_chunk_frames, chunk_frames, pace, lag=self.chunk_lag,
                              loaded=self.load.under_load if pace else None, **self.chunk_options)
        except S2Error as e:
            return self._refuse(responder, client_id, e)
        rec = refused = failed = None
        # the record, its codec stream and the engine's request under one lock: a cancel that finds the record
        # finds the engine's request too (an abort the engine takes before the request would be lost)
        with self._admit_lock:
            cancelled = bool(client_id) and self.tombstones.take(client_id)
            if not cancelled:
                try:
                    rec = self.table.open(client_id, responder, label=label, state=RequestState(chunker, len(prompt)))
                except S2Error as e:
                    refused = e
            if rec is not None:
                if self.codec is not None:
                    st = rec.state
                    codec = CodecStream(self.caller_stream(codec_stream.sid), codec_stream.start, codec_stream.final) \
                        if codec_stream else CodecStream(f"own/{rec.iid}")
                    st.counts = StreamView(rec.iid, closes=codec.final, open=not codec.start)
                    st.codec = codec  # (last: a request with a codec stream has its counts, for the engine thread)
                self._states[str(rec.iid)] = rec.state
                try:
                    self.engine.submit(str(rec.iid), prompt, params)
                except Exception as e:  # noqa: BLE001 - e.g. a prompt longer than the KV cache
                    failed = errors.from_exception(e, self.name)
                    self._states.pop(str(rec.iid), None)
        if refused is not None:
            return self._refuse(responder, client_id, refused)
        if cancelled:
            log.info("%s: request %s was cancelled before it came: ended at once", self.name, client_id)
            if codec_stream is not None and not codec_stream.start:  # it would have continued (and closed) it
                self.close_codec(codec_stream.sid)
            stats = {"frames": 0, "queue_s": None, "prompt_tokens": len(prompt), "first_frame_s": None,
                     "first_audio_s": None}
            responder.send(self.make_response(np.zeros((0, self.C), np.int32), "cancelled", stats, None), True)
            return None
        if failed is not None:
            log.info("%s: request %s refused: %s", self.name, rec.tag, failed.wire())
            rec.fail(failed)
            return None
        log.info("%s: request %s admitted: %d prompt tokens, max_new_tokens=%d", self.name, rec.tag, len(prompt),
                 params.max_new_tokens)
        return rec

    def _refuse(self, responder: Responder, client_id: str, err: S2Error) -> None:
        log.info("%s: request %s refused: %s", self.name, client_id, err.wire())
        self.table.refuse(responder, err)

    def cancel(self, client_id: str) -> bool:
        """Cancel the request with the caller's id `client_id`: True if it is in flight here. A cancel for an id
        never seen is remembered (`tombstones`): the request, if it comes later, ends at once, so a cancel wins
        whatever order the two arrive in. An id that ended here recently leaves no tombstone (its cancel came late)."""
        with self._admit_lock:
            rec = self.table.by_client(client_id)
            if rec is None:
                if client_id and not self.table.ended_recently(client_id):
                    self.tombstones.add(client_id)
                return False
        self._cancel(rec.iid, "its caller cancelled it")
        return True

    def _cancel(self, iid: int | str, why: str) -> None:
        """The one way a request is cancelled in the engine (it ends at the next step with FINISH_CANCELLED)."""
        log.debug("%s: cancelling request #%s: %s", self.name, iid, why)
        self.engine.cancel(str(iid))

    def close_codec(self, sid: str) -> None:
        """Close the caller's codec stream `sid` if it is open (a caller that will not continue it); the engine thread
        does it."""
        if self.codec is not None:
            with self._codec_lock:
                self._codec_closing.append(self.caller_stream(sid))
            self.engine.wake()

    @staticmethod
    def caller_stream(sid: str) -> str:
        """The decoder's name for a caller's codec stream `sid`: "caller/<sid>", apart from the streams of requests
        that name none ("own/<internal id>"), whatever name a caller picks."""
        return f"caller/{sid}"

    def control(self, what: str, client_id: str):
        """One of s2pro's control words for this engine, the same over BLS (slow_ar) and in-process (s2pro holding
        the engine): `cancel` -> whether `client_id` was in flight; `close_codec` -> None (`client_id` names the
        codec stream); `status` -> the engine's counts and where `client_id` is; `pace=R` -> R, the pipeline's pace
        set (chunks follow the slower stage). Anything else is `invalid`."""
        if what == "cancel":
            return self.cancel(client_id)
        if what == "close_codec":
            return self.close_codec(client_id)
        if what == "status":
            return self.status(client_id)
        if what.startswith("pace="):
            try:
                r = float(what[5:])
                self.load.report(r, client_id or "")
            except ValueError as e:
                raise errors.invalid(f"control={what!r}: pace=R needs a number of seconds per second of audio, > 0 "
                                     f"({e})", "control") from None
            return r
        raise errors.invalid(f"control={what!r}: use next, cancel, status, pace=R or close_codec (or leave it out to "
                             "generate)", "control")

    def status(self, client_id: str | None = None) -> dict:
        out = {"healthy": self.health.ok, "reason": self.health.reason, **self.engine.counts(),
               "in_flight": len(self.table)}
        if client_id is not None:
            rec = self.table.by_client(client_id)
            out["request"] = self.engine.where(str(rec.iid)) if rec is not None else "unknown"
        return out

    def under_load(self) -> bool:
        """Whether the loop is under load (`chunking.LoadMeter`): first chunks grow then (`load_chunk_frames`) and the
        codec holds its calls (`codec_batch_steps`)."""
        return self.load.under_load()

    # ---- the engine thread ------------------------------------------------------------------------
    def _engine_pass(self) -> None:
        if self._streams is None:
            self._streams = self._device_streams()
        with self._on(0):
            self._pass()

    def _pass(self) -> None:
        self._take_requests()
        if not self._ready():
            return
        step = self._step()
        recs = self.table.get_many([int(o.request_id) for o in step.outputs])
        items = [item for o, rec in zip(step.outputs, recs) for item in self._route(o, rec)]
        if self.codec is not None:
            items = self._decode_audio(items)
        self._hand_out(items)
        self._record(step)

    def _take_requests(self) -> None:
        """Close the codec streams other threads asked closed. A request still decoding into one its caller closed
        (the caller dropped it, e.g. its client went away) is cancelled and nothing more of it is decoded: it ends
        `cancelled`, not with a decode error for a stream that is gone; one the engine had ended already (its last
        items waiting for their audio) ends now, those items without it."""
        if self.codec is None:
            return
        with self._codec_lock:
            sids, self._codec_closing = self._codec_closing, []
        if not sids:
            return
        closing, ended = set(sids), []
        for rec in self.table.live():
            st = rec.state
            if st.codec is not None and st.codec.sid in closing and not st.codec_dropped:
                st.counts.open, st.codec_dropped = False, True
                if not st.counts.ended:
                    self._cancel(rec.iid, "its codec stream was closed")
                    continue
                for item in st.drop_waiting():
                    item.audio = np.zeros(0, np.float32)
                    ended.append(item)
                st.drop_frames()
                self._decoding.pop(rec.iid, None)
        for sid in sids:
            self.codec.close(sid)
        if ended:
            self._hand_out(ended)

    def _ready(self) -> bool:
        """Whether a step should run now: waits a while for work; on an unhealthy device drops what arrived; raises
        what the launch behind the last codec call raised (as if this pass's own launch had)."""
        if (not self._launched_early and self._launch_error is None and not self.engine.wait_for_work(timeout=0.5)) \
                or self.stop.is_set():
            return False
        if not self.health.ok:  # nothing runs on an unhealthy device; drop whatever arrived meanwhile
            self._launched_early = []  # (their requests end here too)
            self._fail_all("unhealthy")
            return False
        if self._launch_error is not None:
            e, self._launch_error = self._launch_error, None
            raise e
        return True

    def _step(self) -> _Step:
        """One engine step, launched ahead where that pays (see `__init__`), with what the launch behind the last
        codec call gave first; a fault is counted and judged."""
        t0, cpu0 = time.monotonic(), time.thread_time()
        decoding = self.engine.decoding()  # a step of prompt rows alone is not the streams' pace
        self._ahead = self.launch_ahead and (self.codec is None or (self.codec_batch_steps > 1 and self.under_load())
                                             or (self.light_ahead and self._all_sounding()))
        launch0, wait0 = self.engine.launch_s, self.engine.wait_s
        outputs = self.engine.step_ahead() if self._ahead else self.engine.step()
        if self._launched_early:
            outputs, self._launched_early = self._launched_early + outputs, []
        live, waiting = self.engine.slots()
        live += sum(o.finish_reason in (FINISH_END, FINISH_LENGTH) for o in outputs)
        fault, self._early_fault = self.engine.last_fault or self._early_fault, None
        self._note_preemptions()
        self._judge(fault)
        return _Step(outputs, decoding, fault, live, waiting, t0, cpu0, time.monotonic(),
                     self.engine.launch_s - launch0, self.engine.wait_s - wait0)

    def _judge(self, fault: BaseException | None) -> None:
        """A failed step's requests end with its error (in `_route`); a sticky device error, or too many failed steps
        in a row, make the service unhealthy."""
        if fault is None:
            self.step_faults = 0
            return
        self.step_faults += 1
        if errors.is_fatal_device_error(fault):  # before routing: the touched requests end `unavailable` too
            self.unhealthy(f"unrecoverable device error: {type(fault).__name__}: {fault}")
        elif self.step_faults >= self.config.max_step_faults:
            self.unhealthy(f"{self.step_faults} engine steps failed in a row; the last: {type(fault).__name__}: {fault}")
        else:
            log.warning("%s: engine step failed (%s: %s); the requests it touched end with an error", self.name,
                        type(fault).__name__, fault)

    def _route(self, o: Output, rec: Tracked | None) -> list[Outgoing]:
        """One request's output (`rec`: its entry in the table, None once gone) -> what to send: its completed
        chunks, and its final item or error when it ended."""
        st = self._states.pop(o.request_id, None) if o.finished else None
        if rec is None or rec.closed:  # ended elsewhere (shutdown, unhealthy): make sure the engine lets go too
            if not o.finished:
                self._cancel(o.request_id, "it ended elsewhere")
            elif st is not None:
                self._end_codec(st)
            return []
        st = rec.state
        if o.queue_s is not None:
            st.queue_s = o.queue_s
        if o.finish_reason == FINISH_ERROR:
            err = errors.from_exception(o.exception, self.name) if o.exception is not None else \
                errors.internal(f"{self.name}: {o.error}")
            self._end_codec(st)
            return [Outgoing(rec, "error", error=err)]
        n = o.codes.shape[0]
        if st.first_frame_s is None and n:
            st.first_frame_s = time.monotonic() - st.arrived
        st.frames += n
        if self.codec is not None and n:
            st.add_frames(o.codes)
        out = [Outgoing(rec, "chunk", chunk) for chunk in st.chunker.add(o.codes)]
        if o.finished:
            st.last_frame_at = time.monotonic()
            tail = st.chunker.flush()
            stats = {"frames": st.frames, "queue_s": None if st.queue_s is None else round(st.queue_s, 4),
                     "prompt_tokens": st.prompt_tokens, "finish_reason": o.finish_reason,
                     "first_frame_s": st.first_frame_s,
                     "first_audio_s": st.first_audio_s if st.first_audio_s is not None else time.monotonic() - st.arrived}
            out.append(Outgoing(rec, "final", tail if tail is not None else np.zeros((0, self.C), np.int32),
                                o.finish_reason, stats))
        return out

    # ---- the in-engine codec (engine thread only) ----------------------------------------------------
    def _decode_audio(self, routed: list[Outgoing]) -> list[Outgoing]:
        """This pass's routed items -> the items to send now, each chunk with its audio: the items join their
        requests' queues, the plan's frames are decoded, and every request's items leave as far as its audio
        reaches (in order)."""
        self.loop.passes += 1
        out = [now for item in routed for now in self._queue_for_audio(item)]
        views = []
        for iid, rec in list(self._decoding.items()):
            if rec.closed:  # ended elsewhere (shutdown, unhealthy)
                self._end_codec(rec.state)
                del self._decoding[iid]
            elif not rec.state.codec_dropped:
                views.append(rec.state.counts)
        plan = plan_codec(views, passes=self.loop.passes, batch_steps=self.codec_batch_steps,
                          under_load=self.under_load(),
                          engine_idle=not self.engine.has_work(), final_steps=self.codec_final_steps,
                          first_steps=self.codec_first_steps,
                          slices=self.codec.slices)
        if plan.takes:
            self._run_codec(plan)
        # only a request that got audio or items this pass can release any (the last pass released what it could)
        touched = dict.fromkeys([item.rec.iid for item in routed] + [t.key for t in plan.takes])
        for iid in touched:
            rec = self._decoding.get(iid)
            if rec is None:
                continue
            ready = rec.state.release()
            out.extend(ready)
            if ready and ready[-1].kind in ("final", "error"):
                del self._decoding[iid]
        return out

    def _queue_for_audio(self, item: Outgoing) -> list[Outgoing]:
        """A routed item joins its request's queue to wait for its audio -> what leaves now instead: an error (the
        request's waiting chunks go with it) and, for a request cancelled or whose stream was dropped, its waiting
        items and this one, with no audio."""
        rec, st = item.rec, item.rec.state
        if item.kind == "error":
            st.drop_waiting()
            self._decoding.pop(rec.iid, None)
            return [item]
        if item.reason == "cancelled" or st.codec_dropped:  # nothing more to decode: the stream just closes
            self._end_codec(st)
            now = [*st.drop_waiting(), item]
            for w in now:
                w.audio = np.zeros(0, np.float32)
            st.drop_frames()
            self._decoding.pop(rec.iid, None)
            return now
        st.wait(item)
        self._decoding[rec.iid] = rec
        if item.kind == "final":
            st.counts.ended_at = self.loop.passes
        elif st.counts.first_at is None:
            st.counts.first_at = self.loop.passes
        return []

    def _run_codec(self, plan: CodecPlan) -> None:
        """The plan's takes cut from their requests' frames, then its calls through the codec in order. Each
        request's audio joins its `audio`; a request whose decode failed ends with the error (and is cancelled)."""
        codes = {}
        for t in plan.takes:
            st = self._decoding[t.key].state
            codes[t.key] = st.take(t.frames, self.C)
            st.counts.open = not t.closes
        for call in plan.calls:
            now = [s for s in call if not self._decoding[s.key].state.codec_dropped]
            if not now:
                continue
            self.loop.codec_calls += 1
            self.loop.codec_streams += len(now)
            jobs = [(k, self._decoding[s.key].state.codec.sid, codes[s.key][s.offset: s.offset + s.frames], s.start,
                     s.final) for k, s in enumerate(now)]
            t0 = time.monotonic()
            try:
                audio = self._codec_call(jobs)
            except Exception as e:  # noqa: BLE001 - the codec failed as a whole: these requests end, the service goes on
                err = errors.from_exception(e, self.name)
                audio = {k: err for k in range(len(now))}
            self.loop.codec_wait_s += time.monotonic() - t0
            for k, s in enumerate(now):
                rec = self._decoding[s.key]
                a, st = audio.get(k), rec.state
                if isinstance(a, np.ndarray):
                    st.add_audio(a, s.frames)
                    continue
                err = a if isinstance(a, S2Error) else errors.internal(f"{self.name}: the codec returned no audio")
                log.warning("%s: request %s: audio decode failed: %s", self.name, rec.tag, err.wire())
                self._end_codec(st)
                st.codec_dropped = True  # nothing more is decoded for it; its waiting items become the error
                st.drop_waiting()
                st.wait(Outgoing(rec, "error", error=err))
                self._cancel(rec.iid, "its audio could not be decoded")

    def _codec_call(self, jobs: list) -> dict:
        """`codec.decode_many(jobs)`, the engine's next step launched once the call's device work is queued
        (`_launch_behind_codec`). With `codec_concurrent` the codec's thread makes the call (on the codec's stream)
        while this one waits, launches the step itself when the call says its work is queued (the engine is only
        touched from this thread), and takes the result."""
        if self._codec_worker is None:
            return self.codec.decode_many(jobs, time.monotonic(), queued=self._launch_behind_codec)
        queued = threading.Event()
        call = self._codec_worker.submit(self._codec_on_worker, jobs, queued)
        call.add_done_callback(lambda _: queued.set())  # (a call that raised before queueing its work)
        queued.wait()
        self._launch_behind_codec()
        return call.result()

    def _codec_on_worker(self, jobs: list, queued: threading.Event) -> dict:
        with self._on(1):
            return self.codec.decode_many(jobs, time.monotonic(), queued=queued.set)

    def _launch_behind_codec(self) -> None:
        """The codec's call is queued on the device: with steps launched ahead, queue the engine's next step (on the
        engine's stream beside the call's with `codec_concurrent`, else behind it), so the device makes frames while
        this thread takes the call's audio and hands it out. Its immediate outputs join the next pass's; an exception
        it raises is raised by the next pass, not charged to the codec call's streams."""
        if self._ahead and self.codec_overlap and self._launch_error is None:
            try:
                self._launched_early += self.engine.launch_next()
                self._early_fault = self.engine.last_fault or self._early_fault
            except Exception as e:  # noqa: BLE001 - the engine's, not the codec call's: raised by the next pass
                self._launch_error = e

    def _end_codec(self, st: RequestState) -> None:
        """Close the request's codec stream unless a later request continues it (then only after a normal end)."""
        if st.codec is not None and st.counts.open:
            st.counts.open = False
            with self._codec_lock:
                self._codec_closing.append(st.codec.sid)

    def _all_sounding(self) -> bool:
        """Whether every request in flight has sent audio (none waits for its first chunk)."""
        return all(rec.state.first_audio_s is not None for rec in self.table.live())

    # ---- handing out, and the pass recorded ----------------------------------------------------------
    def _hand_out(self, items: list[Outgoing]) -> None:
        """The pass's items to the sender thread in one hand-off (or sent here, `direct_send`), in order; a request's
        first audio and the time from its last frame to its final response noted."""
        now = time.monotonic()
        for item in items:
            st = item.rec.state
            if item.kind == "error":
                continue
            if st.first_audio_s is None:
                st.first_audio_s = now - st.arrived
                if st.counts is not None and st.counts.first_at is not None and len(self.loop.first_waits) < 100_000:
                    self.loop.first_waits.append(self.loop.passes - st.counts.first_at)
            if item.kind == "final" and st.last_frame_at is not None and len(self.loop.tails) < 100_000:
                self.loop.tails.append(now - st.last_frame_at)
                if st.counts is not None and st.counts.ended_at is not None:
                    self.loop.final_waits.append(self.loop.passes - st.counts.ended_at)
        if self.direct_send:
            for item in items:
                self._deliver(item, now)
        elif items:
            self.outbox.put((items, now))

    def _record(self, step: _Step) -> None:
        """A decoding pass without a fault sets the pace and load, and its numbers join the loop's statistics."""
        if not step.decoding or step.fault is not None:
            return
        t2 = time.monotonic()
        dt = t2 - step.started
        self.load.observe(dt)
        self.loop.add(step.stepped - step.started, t2 - step.stepped, self.name,
                      sum(o.codes.shape[0] for o in step.outputs), self.under_load(), step.live, step.waiting,
                      any(o.queue_s is not None for o in step.outputs),
                      max(0.0, dt - (time.thread_time() - step.cpu)), step.launch_s, step.wait_s,
                      self.engine.finished_next)

    def _note_preemptions(self) -> None:
        """Say when the KV cache ran short and requests were paused (at most every 10 s: it can happen every step)."""
        n = self.engine.preemptions
        now = time.monotonic()
        if n > self._preemptions_logged and now - self._preemption_log_at >= 10.0:
            log.warning("%s: the KV cache ran out of blocks: %d request(s) paused to resume where they stopped (%d so "
                        "far; the KV cache holds %d tokens: if this repeats, raise kv_cache_tokens, kv_cache_memory_gb or "
                        "gpu_memory_utilization, whichever sizes it)", self.name, n - self._preemptions_logged,
                        n, self.engine.kv_capacity_tokens)
            self._preemptions_logged, self._preemption_log_at = n, now

    def _device_streams(self) -> tuple:
        """(the engine's stream, the codec's) on a GPU with a codec here and `codec_concurrent`, else (). The engine's
        has the higher priority, so that the steps lose little to a codec call beside them."""
        dev = self.engine.device
        if dev.type != "cuda" or self.codec is None or not self.codec_concurrent:
            return ()
        torch.cuda.synchronize(dev)  # what other threads queued (loading, warm-up, graph captures) comes first
        return own_stream(dev, priority=-1), own_stream(dev, priority=0)  # lower: first

    def _on(self, which: int):
        """A context that puts this thread's device work on the engine's stream (0) or the codec's (1); a no-op
        without streams of their own."""
        return torch.cuda.stream(self._streams[which]) if self._streams else contextlib.nullcontext()

    # ---- the sender thread ------------------------------------------------------------------------
    def _send_pass(self) -> None:
        try:
            items, put_at = self.outbox.get(timeout=self.config.cancel_poll_s)
        except queue.Empty:
            items = ()
        for item in items:
            self._deliver(item, put_at)
        if items and self.on_sent is not None:
            self.on_sent()
        now = time.monotonic()
        if now - self._last_poll >= self.config.cancel_poll_s:
            self._last_poll = now
            for r in self.table.live():
                if r.responder.is_cancelled():
                    self._cancel(r.iid, "its client cancelled it")
            if self.on_tick is not None:
                self.on_tick(self)

    def _deliver(self, item: Outgoing, put_at: float) -> None:
        """Build one item's response and send it: a chunk, the final response or the error."""
        t0 = time.monotonic()
        rec = item.rec
        response = None if item.kind == "error" else self.make_response(item.codes, item.reason, item.stats, item.audio)
        if item.kind == "chunk":
            try:
                rec.send(response)
            except Exception as e:  # noqa: BLE001 - the client went away
                log.info("%s: request %s: response not delivered (%s); cancelling", self.name, rec.tag, e)
                self._cancel(rec.iid, "its response could not be delivered")
        elif item.kind == "final":
            if rec.finish(response, item.reason):
                log.info("%s: request %s done, finish reason %s", self.name, rec.tag, item.reason)
        elif rec.fail(item.error):
            log.warning("%s: request %s failed: %s", self.name, rec.tag, item.error.wire())
        self.sends.add(t0 - put_at, time.monotonic() - t0, self.name)

    # ---- faults and shutdown ----------------------------------------------------------------------
    def unhealthy(self, reason: str) -> None:
        """An unrecoverable fault: fail everything in flight, refuse what comes, tell the host (once)."""
        if not self.health.fail(reason):
            return
        engine_thread = self.threads[0]
        if threading.current_thread() is engine_thread or not engine_thread.is_alive():
            self._fail_all(reason)
        else:  # the engine's state is the engine thread's: it drops everything at its next pass (`_ready`)
            self.engine.wake()
        self.table.end_all(reason, self._tell_unhealthy)

    def _tell_unhealthy(self, reason: str) -> None:
        """Once every request in flight has its error: those go out (`on_sent`), then the host learns of the fault."""
        if self.on_sent is not None:
            self.on_sent()
        if self.on_unhealthy is not None:
            self.on_unhealthy(reason)

    def _fail_all(self, reason: str) -> None:
        """Every request the engine holds ends there (their records end through the table) and their states go."""
        for o in self.engine.fail_all(reason):
            self._states.pop(o.request_id, None)

    def shutdown(self, timeout: float = 5.0) -> int:
        """Stop the threads; every request still in flight gets a final `unavailable` error. Returns how many."""
        self.stop.set()
        self.engine.wake()
        for t in self.threads:
            t.join(timeout)
        self._fail_all("shutting down")
        if self._codec_worker is not None:
            self._codec_worker.shutdown(wait=False)
        return self.table.fail_all(errors.shutting_down(self.name))
