"""Serving an `Engine` to many streaming requests (what `slow_ar` runs), without Triton.

One engine thread runs batched steps; one sender thread sends each request's responses
in order and polls for cancellation, so IPC never stalls the device loop. Frames are
grouped per request as it asked (`first_chunk_frames`, then `chunk_frames`): one
response per audio chunk, then one final response with the finish reason and stats.

With a `codec` (`codec.stream.StreamDecoder`: `codec_in_engine`), the engine thread also decodes, and each
response carries its audio beside its codes, so no chunk makes a round trip to another process. A request names
its codec stream (`CodecStream`: several requests, one per text segment, can continue one stream); the stream
closes with the request's last chunk when `final`, and whenever the request ends otherwise. What a codec call
decodes is a stream's frames, not its chunks: a chunk leaves once all of its frames are decoded.
- Light load (and `codec_batch_steps=1`): after each step, the frames of the chunks that step completed, all
  streams in one call.
- Under load (a pace of at least `chunking.LOAD_PACE`, or `chunking.LOAD_SLOTS` of the slots held) with
  `codec_batch_steps=K` > 1: every K steps the frames every stream made since, in slices of K (a stream's last
  frames padded to a prepared length), so that one call of one length (one CUDA graph) decodes all streams; between
  those steps only the last frames of requests that ended `codec_final_steps` steps before (a client's next
  request waits for its last audio, and a slot for that request). A call's cost on a GPU is mostly per length it
  decodes, not per frame (perf/RESULTS.md). A stream's chunks that become ready together leave as one response.

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
from .chunking import LOAD_PACE, LOAD_SLOTS, Chunker
from ..errors import S2Error
from .prompt import Prompt
from ..gpu.cuda_graphs import own_stream
from ..serving.lifecycle import RecentIds, RequestTable, Responder, Tracked
from ..serving.threads import guarded
from ..ar.sampling import SamplingParams
from ..settings import SCHEMA, default_kv_tokens
from . import FINISH_END, FINISH_ERROR, FINISH_LENGTH, Engine, Output

log = logging.getLogger("s2tts")

# What slow_ar's responses carry besides codes, as numbers: a decoupled BLS response is loaded by the receiving
# Python stub on a thread that does not hold the GIL, and a STRING tensor is decoded there by Python code, which
# crashed the s2pro process under load (perf/RESULTS.md, the soak). Numbers only on that wire.
FINISH_CODES = {"": 0, "end": 1, "length": 2, "cancelled": 3}
FINISH_NAMES = {v: k for k, v in FINISH_CODES.items()}
# the final response's `stats`; first_frame_s / first_audio_s: seconds from the request's arrival here to its first
# frame made / its first chunk handed to the sender (where a stream's time to first audio goes: perf/loadgen.py)
STATS_FIELDS = ("frames", "queue_s", "prompt_tokens", "first_frame_s", "first_audio_s")
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
        elif f.endswith("_s"):  # seconds
            out[f] = None if v < 0 else round(v, 4)
        else:
            out[f] = int(v)
    return out


@dataclass
class CodecStream:
    """Which decoder stream a request's audio continues (with an in-engine codec)."""

    sid: str
    start: bool = True  # the request's first chunk opens the stream (else it continues an earlier request's)
    final: bool = True  # the request's last chunk closes it (else a later request continues it)


@dataclass
class RequestState:
    """A request's state in the engine service: its chunker, its numbers, its codec stream and (with an in-engine
    codec) its frames and audio on their way out. (The codec's own per-stream state is `codec.StreamState`.)"""

    chunker: Chunker
    queue_s: float | None = None
    arrived: float = field(default_factory=time.monotonic)
    first_frame_s: float | None = None
    first_audio_s: float | None = None
    frames: int = 0
    prompt_tokens: int = 0
    codec: CodecStream | None = None
    codec_open: bool = False  # the codec stream holds state for this request (opened, or continued)
    codec_dropped: bool = False  # its caller closed the stream while it ran: nothing more is decoded
    # with an in-engine codec: frames made and not yet decoded, decoded audio not yet sent (and its frames), and
    # the routed items waiting for their audio, in order
    undecoded: list = field(default_factory=list)
    n_undecoded: int = 0
    audio: list = field(default_factory=list)
    n_audio: int = 0
    waiting: list = field(default_factory=list)
    released: int = 0  # frames whose audio was sent
    last_frame_at: float | None = None  # when the engine ended it (its last frame made)
    final_pass: int | None = None  # with an in-engine codec: the codec pass that took its final item


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


class EngineService:
    """`make_response(codes [n, C] int32, finish_reason, stats dict | None, audio float32 [samples] | None) ->
    response` and `make_error(S2Error) -> response` build the transport's responses."""

    def __init__(self, engine: Engine, make_response: Callable[..., Any],
                 make_error: Callable[[S2Error], Any], name: str = "slow_ar", limit: int | None = None,
                 on_unhealthy: Callable[[str], None] | None = None, cancel_poll_s: float = 0.05,
                 max_step_faults: int = 3, on_tick: Callable[["EngineService"], None] | None = None,
                 frame_seconds: float | None = None, codec=None,
                 codec_batch_steps: int = SCHEMA["codec_batch_steps"].default,
                 codec_final_steps: int = SCHEMA["codec_final_steps"].default,
                 load_chunk_frames: int = SCHEMA["load_chunk_frames"].default, direct_send: bool = False,
                 launch_ahead: bool | None = SCHEMA["launch_ahead"].default,
                 codec_concurrent: bool | None = SCHEMA["codec_concurrent"].default):
        """`frame_seconds` (audio per frame): chunks grow by the engine's measured pace (`chunking.Chunker`);
        None: fixed chunks. `codec` (a `codec.stream.StreamDecoder`): decode audio here (see the module's doc).
        `load_chunk_frames`: the least first chunk under load (`Chunker(load_frames=)`; 0: off). Defaults: the
        settings of the same names. `direct_send`: responders that only hand a response to another thread of this
        process (s2pro holding the engine): the engine thread sends each response itself, with no hand-off to the
        sender thread (which then only polls for cancels and reports). `launch_ahead` (None: on a GPU): the engine
        keeps two steps in flight, launching the next before it finishes the last and this thread handles its
        outputs (`Engine.step_ahead`), except while a codec here decodes each chunk at once (light load) and a
        request in flight has yet to send audio (its first chunk's codec call would wait behind that step).
        `codec_concurrent` (None: on a GPU): the codec's calls made by a thread of their own (`_codec_call`), on a
        GPU on a CUDA stream of their own beside the engine's (`_device_streams`): served on an H200, c=1 RTF 0.1205
        -> 0.1190, c=64 243 -> 253 audio-s/s (perf/RESULTS.md, 29th session). Every graph it replays was captured
        on a stream of its owner's own (`s2tts.gpu.cuda_graphs`: with one capture stream for all, c=64 hung)."""
        self.engine = engine
        self.launch_ahead = engine.device.type == "cuda" if launch_ahead is None else launch_ahead
        # with steps launched ahead, the next one also launched during a held codec call, behind it on the device
        # (`_launch_behind_codec`); its immediate outputs wait in _launched_early for the next pass
        self.codec_overlap = True
        # at a light load with a codec here, steps launched ahead too once every request in flight has sent audio
        # (a first chunk's decode would wait behind a launched step; c=1 loop alone on an H200: 7.2 -> 7.6 audio-s/s,
        # perf/RESULTS.md)
        self.light_ahead = True
        # with held codec calls (under load), a request's final item waits at most this many passes for the next
        # held call, then its last frames are decoded in a call of the finished requests alone (its client's next
        # request, and so its slot's next occupant, waits for them; >= codec_batch_steps: always the held call)
        self.codec_final_steps = codec_final_steps
        # the codec's calls by a thread of their own, on a GPU on a CUDA stream of their own beside the engine's
        # (which has the higher priority): a codec call's kernels fill what the step leaves of the device instead of
        # waiting behind it (the streams are made by the engine thread's first pass: `_device_streams`)
        self.codec_concurrent = engine.device.type == "cuda" if codec_concurrent is None else codec_concurrent
        self._streams: tuple | None = None  # (the engine's stream, the codec's), or () to use the current one
        # with codec_concurrent: the thread that makes the codec's calls
        self._codec_worker = (ThreadPoolExecutor(1, thread_name_prefix="s2tts-codec")
                              if self.codec_concurrent and codec else None)
        self._ahead = False  # this pass launches ahead
        self._launched_early: list = []
        self._launch_error: Exception | None = None  # raised by that launch: raised again by the next pass
        self.direct_send = direct_send
        self.codec = codec
        self._codec_closing: list[str] = []  # codec streams to close, asked from other threads (engine thread only
        self._codec_lock = threading.Lock()  # touches the decoder)
        self._codec_states: dict[str, RequestState] = {}  # engine request id -> its state, until its last output
        self.codec_batch_steps = max(1, codec_batch_steps)
        # under load a chunk waits for its frames' slice (up to 2 (codec_batch_steps - 1) steps, K - 1 on average)
        # and a step's own codec call delays it by about one more: the chunker keeps K frames of room
        # (chunking.Chunker; no stream ran dry at c=64 with it: perf/RESULTS.md)
        self.chunk_lag = self.codec_batch_steps if codec is not None else 0
        # Chunker keyword overrides (perf/bench_loop.py tries more; the rest: Chunker's defaults)
        self.chunk_options: dict = {"load_frames": load_chunk_frames} if load_chunk_frames else {}
        self._decoding: dict[int, Tracked] = {}  # requests with frames or items the codec has yet to see (engine thread)
        self._load: tuple[float, float, bool] | None = None  # (pace averaged over ~1 s, when, under load)
        self.loop = LoopStats()
        self.frame_seconds = frame_seconds
        self.step_s: float | None = None  # moving average of a decoding pass's wall time (step, and codec if here)
        self.downstream_paces: dict[str, tuple[float, float]] = {}  # (pace, when) by reporter: each s2pro process's
        self.downstream_pace_ttl_s = 5.0
        self.name = name
        self.make_response = make_response
        self.table = RequestTable(name, make_error, limit)
        self.health = self.table.health
        self.tombstones = RecentIds(ttl_s=120.0)  # ids cancelled before their request came
        self._admit_lock = threading.Lock()
        self.on_unhealthy = on_unhealthy
        self.on_tick = on_tick  # called from the sender thread every poll (metrics)
        self.cancel_poll_s = cancel_poll_s
        self.max_step_faults = max_step_faults
        self.step_faults = 0  # failed steps in a row
        self.C = engine.s2.num_codebooks
        # (record, kind "chunk"|"final"|"error", (codes, reason, stats, audio) | the S2Error, outcome, when queued)
        self.outbox: queue.Queue = queue.Queue()
        self.sends = SendStats()
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

    @staticmethod
    def codec_lengths(first_chunk_frames: int, chunk_frames: int, codec_batch_steps: int) -> list[int]:
        """The lengths an in-engine codec decodes (what a GPU's decoder prepares graphs for): the chunk lengths, and
        with held calls their slices (twice that for a stream catching up)."""
        k = codec_batch_steps
        return sorted(set(Chunker.lengths(first_chunk_frames, chunk_frames)) | ({k, 2 * k} if k > 1 else set()))

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, client_id: str, responder: Responder, prompt: Prompt, params: SamplingParams,
               first_chunk_frames: int, chunk_frames: int, codec_stream: CodecStream | None = None,
               label: str = "") -> Tracked | None:
        """Admit a request (its responses go to `responder`). A refusal (duplicate id, full, unhealthy, a request
        the engine can never run) is answered on `responder` with one final error; returns None then. With an
        in-engine codec, `codec_stream` says which decoder stream the audio continues (None: a stream of its own).
        A request whose id was cancelled before it came (`cancel`) ends at once: one final response, finish reason
        "cancelled", no frames; the engine never sees it. `label` names the request in log lines (default: its id)."""
        try:
            pace = self.pace if self.frame_seconds else None
            with self._admit_lock:  # one order between this request and a cancel for its id
                if client_id and self.tombstones.take(client_id):
                    rec = None
                else:
                    rec = self.table.open(client_id, responder, label=label,
                                          state=RequestState(Chunker(first_chunk_frames, chunk_frames, pace,
                                                                    lag=self.chunk_lag,
                                                                    loaded=self.under_load if pace else None,
                                                                    **self.chunk_options),
                                                            prompt_tokens=len(prompt)))
            if rec is None:
                log.info("%s: request %s was cancelled before it came: ended at once", self.name, client_id)
                if codec_stream is not None and not codec_stream.start:  # it would have continued (and closed) it
                    self.close_codec(codec_stream.sid)
                stats = {"frames": 0, "queue_s": None, "prompt_tokens": len(prompt), "first_frame_s": None,
                         "first_audio_s": None}
                responder.send(self.make_response(np.zeros((0, self.C), np.int32), "cancelled", stats, None), True)
                return None
            if self.codec is not None:
                rec.state.codec = CodecStream(self.caller_stream(codec_stream.sid), codec_stream.start,
                                              codec_stream.final) if codec_stream else CodecStream(f"own/{rec.iid}")
                rec.state.codec_open = not rec.state.codec.start
                self._codec_states[str(rec.iid)] = rec.state
        except S2Error as e:
            log.info("%s: request %s refused: %s", self.name, client_id, e.wire())
            self.table.refuse(responder, e)
            return None
        try:
            self.engine.submit(str(rec.iid), prompt, params)
        except Exception as e:  # noqa: BLE001 - e.g. a prompt longer than the KV cache
            err = errors.from_exception(e, self.name)
            log.info("%s: request %s refused: %s", self.name, rec.tag, err.wire())
            self._codec_states.pop(str(rec.iid), None)
            rec.fail(err)
            return None
        log.info("%s: request %s admitted: %d prompt tokens, max_new_tokens=%d", self.name, rec.tag, len(prompt),
                 params.max_new_tokens)
        return rec

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
        self.engine.cancel(str(rec.iid))
        return True

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

    @property
    def downstream_pace(self) -> tuple[float, float] | None:
        """(pace, when): the slowest pipeline pace a caller reported in the last `downstream_pace_ttl_s` (several s2pro
        processes each report the pace of their own streams)."""
        now = time.monotonic()
        fresh = [p for p in self.downstream_paces.values() if now - p[1] < self.downstream_pace_ttl_s]
        return max(fresh) if fresh else None

    def pace(self) -> float:
        """The pace chunks follow: seconds to make a second of a stream's audio, the slower of the engine's own
        (its step time) and the pipeline's as the callers last reported it (`set_downstream_pace`, if recent)."""
        own = 1.0 if self.step_s is None or not self.frame_seconds else self.step_s / self.frame_seconds
        d = self.downstream_pace  # recent ones only
        return own if d is None else max(own, d[0])

    def under_load(self) -> bool:
        """Whether the service is under load (with a measured pace: `frame_seconds`): from the moment the pace
        reaches `LOAD_PACE` (a wave of arrivals: its first chunks already count) until the pace averaged over about
        a second falls below 0.8 of that (a held codec call itself lowers the pace, and makes single steps vary:
        hence the margin and the average); and whenever requests in slots or waiting for one fill `LOAD_SLOTS` of
        the batch, whatever the pace (a fast engine at a full batch), counted at that moment: a wave of requests
        coming back after a wave of finals (their clients' round trips) is load from its first frames, though the
        pass before counted the slots the finals left. First chunks grow then (`load_chunk_frames`) and the codec
        holds its calls (`codec_batch_steps`)."""
        return self._load is not None and (self._load[2] or self._full())

    def _note_load(self) -> None:
        if not self.frame_seconds:
            return
        now, r = time.monotonic(), self.pace()
        full = self._full()
        if self._load is None:
            avg, loaded = r, r >= LOAD_PACE or full
        else:
            avg, at, loaded = self._load
            a = min(1.0, (now - at) / 1.0)
            avg = (1 - a) * avg + a * r
            if loaded:
                loaded = full or avg >= 0.8 * LOAD_PACE
            elif r >= LOAD_PACE or full:
                loaded, avg = True, max(avg, r)  # the average starts from the pace that turned it on
        self._load = (avg, now, loaded)

    def _full(self) -> bool:
        """Whether requests in slots or waiting for one fill `LOAD_SLOTS` of the batch."""
        return self._slots_wanted() >= LOAD_SLOTS * self.engine.max_batch

    def _slots_wanted(self) -> int:
        """Requests holding a slot or waiting for one."""
        return len(self.engine.live) + len(self.engine.scheduler.waiting)

    def control(self, what: str, client_id: str):
        """One of s2pro's control words for this engine, the same over BLS (slow_ar) and in-process
        (`frontend.local_engine`): `cancel` -> whether `client_id` was in flight; `close_codec` -> None (`client_id`
        names the codec stream); `status` -> the engine's counts and where `client_id` is; `pace=R` -> R, the
        pipeline's pace set (chunks follow the slower stage). Anything else is `invalid`."""
        if what == "cancel":
            return self.cancel(client_id)
        if what == "close_codec":
            return self.close_codec(client_id)
        if what == "status":
            return self.status(client_id)
        if what.startswith("pace="):
            try:
                r = float(what[5:])
            except ValueError:
                raise errors.invalid(f"control={what!r}: pace=R needs a number", "control") from None
            self.set_downstream_pace(r, client_id or "")
            return r
        raise errors.invalid(f"control={what!r}: use next, cancel, status, pace=R or close_codec (or leave it out to "
                             "generate)", "control")

    def set_downstream_pace(self, r: float, reporter: str = "") -> None:
        """The pipeline's pace as `reporter` (an s2pro process: its request-id prefix) measures it."""
        if not (0.0 < r < 1e3):
            raise errors.invalid(f"pace={r} is out of range: seconds per second of audio, > 0", "control")
        now = time.monotonic()
        kept = {k: p for k, p in self.downstream_paces.items() if now - p[1] < self.downstream_pace_ttl_s}
        self.downstream_paces = {**kept, reporter: (r, now)}  # swapped whole: readers never see it change

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
                        "far; the KV cache holds %d tokens: if this repeats, raise kv_cache_tokens, kv_cache_memory_gb or "
                        "gpu_memory_utilization, whichever sizes it)", self.name, n - self._preemptions_logged,
                        n, self.engine.kv_capacity_tokens)
            self._preemptions_logged, self._preemption_log_at = n, now

    def _device_streams(self) -> tuple:
        """(the engine's stream, the codec's) on a GPU with a codec here and `codec_concurrent`, else (). The engine's
        has the higher priority, so that the steps lose little to a codec call beside them (perf/RESULTS.md:
        without it a step waited for the call's kernels)."""
        dev = self.engine.device
        if dev.type != "cuda" or self.codec is None or not self.codec_concurrent:
            return ()
        torch.cuda.synchronize(dev)  # what other threads queued (loading, warm-up, graph captures) comes first
        return own_stream(dev, priority=-1), own_stream(dev, priority=0)  # lower: first

    def _on(self, which: int):
        """A context that puts this thread's device work on the engine's stream (0) or the codec's (1); a no-op
        without streams of their own."""
        return torch.cuda.stream(self._streams[which]) if self._streams else contextlib.nullcontext()

    def _engine_pass(self) -> None:
        if self._streams is None:
            self._streams = self._device_streams()
        with self._on(0):
            self._pass()

    def _pass(self) -> None:
        if self.codec is not None:
            self._close_codec_streams()
        if (not self._launched_early and self._launch_error is None and not self.engine.wait_for_work(timeout=0.5)) \
                or self.stop.is_set():
            return
        if not self.health.ok:  # nothing runs on an unhealthy device; drop whatever arrived meanwhile
            self._launched_early = []  # (their requests end here too)
            self.engine.fail_all("unhealthy")
            return
        if self._launch_error is not None:  # as if this pass's own launch had raised it (not the codec's fault)
            e, self._launch_error = self._launch_error, None
            raise e
        t0, cpu0 = time.monotonic(), time.thread_time()
        decoding = self.engine.decoding()  # a step of prompt rows alone is not the streams' pace
        ahead = self.launch_ahead and (self.codec is None or (self.codec_batch_steps > 1 and self.under_load())
                                       or (self.light_ahead and self._all_sounding()))
        self._ahead = ahead
        launch0, wait0 = self.engine.launch_s, self.engine.wait_s
        outputs = self.engine.step_ahead() if ahead else self.engine.step()
        if self._launched_early:  # what the launch during the last pass's codec call made at once comes first
            outputs, self._launched_early = self._launched_early + outputs, []
        # (statistics, no lock needed): the slots this step held (those live after it and those it ended) and the
        # requests left waiting for one
        live = len(self.engine.live) + sum(o.finish_reason in (FINISH_END, FINISH_LENGTH) for o in outputs)
        waiting = len(self.engine.scheduler.waiting)
        fault = self.engine.last_fault
        self._note_preemptions()
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
        t1 = time.monotonic()
        ready = [r for o in outputs for r in self._route(o)]
        if self.codec is not None:
            ready = self._codec_pass(ready)
        now = time.monotonic()
        # responses are built and sent on the sender thread (or here, with `direct_send`)
        hand = self._deliver if self.direct_send else lambda *item: self.outbox.put(item)
        for rec, kind, codes, reason, stats, audio in ready:
            if rec.state.first_audio_s is None and kind != "error":
                rec.state.first_audio_s = now - rec.state.arrived
            if kind == "error":
                hand(rec, "error", stats, None, now)
                continue
            if kind == "final" and rec.state.last_frame_at is not None and len(self.loop.tails) < 100_000:
                self.loop.tails.append(now - rec.state.last_frame_at)
                if rec.state.final_pass is not None:
                    self.loop.final_waits.append(self.loop.passes - rec.state.final_pass)
            hand(rec, kind, (codes, reason, stats, audio), reason or None, now)
        if decoding and fault is None:
            t2 = time.monotonic()
            dt = t2 - t0
            self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt
            self._note_load()
            self.loop.add(t1 - t0, t2 - t1, self.name, sum(o.codes.shape[0] for o in outputs), self.under_load(),
                          live, waiting, any(o.queue_s is not None for o in outputs),
                          max(0.0, dt - (time.thread_time() - cpu0)), self.engine.launch_s - launch0,
                          self.engine.wait_s - wait0, self.engine.finished_next)

    def _route(self, o: Output) -> list[list]:
        """One request's output -> what to send: [record, "chunk" | "final" | "error", codes, finish reason,
        stats (the S2Error for "error"), audio (None until decoded)] items."""
        rec = self.table.get(int(o.request_id))
        codec_state = self._codec_states.pop(o.request_id, None) if o.finished else None
        if rec is None or rec.closed:  # ended elsewhere (shutdown, unhealthy): make sure the engine lets go too
            if not o.finished:
                self.engine.cancel(o.request_id)
            elif codec_state is not None:
                self._end_codec(codec_state)
            return []
        st: RequestState = rec.state
        if o.queue_s is not None:
            st.queue_s = o.queue_s
        if o.finish_reason == FINISH_ERROR:
            err = errors.from_exception(o.exception, self.name) if o.exception is not None else \
                errors.internal(f"{self.name}: {o.error}")
            self._end_codec(st)
            return [[rec, "error", None, "", err, None]]
        if st.first_frame_s is None and o.codes.shape[0]:
            st.first_frame_s = time.monotonic() - st.arrived
        st.frames += o.codes.shape[0]
        if self.codec is not None and o.codes.shape[0]:
            st.undecoded.append(o.codes)
            st.n_undecoded += o.codes.shape[0]
        out = [[rec, "chunk", chunk, "", None, None] for chunk in st.chunker.add(o.codes)]
        if o.finished:
            st.last_frame_at = time.monotonic()
            tail = st.chunker.flush()
            codes = tail if tail is not None else np.zeros((0, self.C), np.int32)
            first_audio = st.first_audio_s if st.first_audio_s is not None else time.monotonic() - st.arrived
            stats = {"frames": st.frames, "queue_s": None if st.queue_s is None else round(st.queue_s, 4),
                     "prompt_tokens": st.prompt_tokens, "finish_reason": o.finish_reason,
                     "first_frame_s": st.first_frame_s, "first_audio_s": first_audio}
            out.append([rec, "final", codes, o.finish_reason, stats, None])
        return out

    # ---- the in-engine codec (engine thread only) -------------------------------------------
    def _codec_pass(self, routed: list[list]) -> list[list]:
        """This pass's routed items -> the items to send now, each chunk with its audio: decode what the pass
        calls for (see the module's doc), then let every request's waiting items go as far as its audio reaches.
        A request's items keep their order."""
        self.loop.passes += 1
        out = []
        for item in routed:
            rec, st = item[0], item[0].state
            if item[1] == "error":  # the request failed in the engine: its waiting chunks go with it
                st.waiting.clear()
                self._decoding.pop(rec.iid, None)
                out.append(item)
            elif item[3] == "cancelled" or st.codec_dropped:  # nothing more to decode: the stream just closes
                self._end_codec(st)
                for w in [*st.waiting, item]:
                    w[5] = np.zeros(0, np.float32)
                    out.append(w)
                st.waiting.clear()
                st.undecoded, st.n_undecoded = [], 0
                self._decoding.pop(rec.iid, None)
            else:
                st.waiting.append(item)
                self._decoding[rec.iid] = rec
                if item[1] == "final":
                    st.final_pass = self.loop.passes
        K = self.codec_batch_steps
        batched = K > 1 and self.under_load()
        tick = not batched or self.loop.passes % K == 0 or not self.engine.has_work() or self._short_of_audio(K)
        if tick:
            plans = []
            for rec in list(self._decoding.values()):
                if rec.closed:  # ended elsewhere (shutdown, unhealthy)
                    self._end_codec(rec.state)
                    del self._decoding[rec.iid]
                    continue
                plan = self._plan(rec.state, K if batched else 0)
                if plan:
                    plans.append((rec, plan))
            self._run_codec(plans)
        elif self.codec_final_steps < K:  # finished requests that have waited long enough: their last frames alone
            N = self.codec_final_steps
            due = [rec for rec in self._decoding.values() if not rec.closed and rec.state.final_pass is not None
                   and self.loop.passes - rec.state.final_pass >= N]
            self._run_codec([(rec, plan) for rec in due if (plan := self._plan(rec.state, K))])
        for rec in list(self._decoding.values()):
            out.extend(self._ready_items(rec))
        return out

    def _short_of_audio(self, K: int) -> bool:
        """Whether a stream that has sent less than K frames of audio (its first chunk made before the load came,
        shorter than `load_chunk_frames`) has a chunk complete: its client may run dry before a held call (up to
        2 K - 1 steps away) would decode it, so the codec runs now (on an H200 at c=64, with 2-frame first
        chunks, 5 of 1280 requests ran dry at their second or third chunk without this)."""
        for rec in self._decoding.values():
            st = rec.state
            if 0 < st.released < K and self._need(st) > 0:
                return True
        return False

    @staticmethod
    def _need(st: RequestState) -> int:
        """Frames the request's waiting chunks need decoded beyond the audio it holds."""
        return sum(w[2].shape[0] for w in st.waiting) - st.n_audio

    def _plan(self, st: RequestState, K: int) -> list[tuple[np.ndarray, bool, bool]]:
        """What to decode of one request's frames now -> [(codes, start, final)] in order, one per codec call.
        All of them once its last item is routed. Else without K (light load) the frames its waiting chunks need;
        with K (under load) as many whole slices of K frames as it has made (a chunk ending in a partial slice waits
        for the next tick), and until it has sent K frames of audio at least what its chunks need (time to first
        audio; then `_short_of_audio`)."""
        if st.codec_dropped:  # its decode failed (its error is what waits) or its stream was closed
            return []
        final_item = bool(st.waiting) and st.waiting[-1][1] == "final"
        need = self._need(st)
        if final_item:
            take = st.n_undecoded
        elif not K:
            take = need
        else:
            take = K * (st.n_undecoded // K)
            if st.released < K:
                take = max(take, need)
        final = final_item and st.codec.final
        if take <= 0 and not (final and st.codec_open):
            return []
        codes = np.concatenate(st.undecoded) if len(st.undecoded) > 1 else st.undecoded[0] if st.undecoded else \
            np.zeros((0, self.C), np.int32)
        st.undecoded = [codes[take:]] if codes.shape[0] > take else []
        st.n_undecoded -= take
        pieces = self.codec.slices(take, final) if take else [0]
        plan, at = [], 0
        for k, n in enumerate(pieces):
            plan.append((codes[at : at + n], not st.codec_open and k == 0, final and k == len(pieces) - 1))
            at += n
        st.codec_open = not final
        return plan

    def _run_codec(self, plans: list[tuple[Tracked, list]]) -> None:
        """The planned slices through the codec: every request's first in one call, its second (rare: a length
        the codec has no graph for, split) in the next... Each request's audio joins its `audio`; a request whose
        decode failed ends with the error (and is cancelled in the engine)."""
        for r in range(max((len(p) for _, p in plans), default=0)):
            now = [(rec, plan[r]) for rec, plan in plans if len(plan) > r and not rec.state.codec_dropped]
            if not now:
                continue
            self.loop.codec_calls += 1
            self.loop.codec_streams += len(now)
            jobs = [(k, rec.state.codec.sid, codes, start, final) for k, (rec, (codes, start, final)) in enumerate(now)]
            t0 = time.monotonic()
            try:
                audio = self._codec_call(jobs)
            except Exception as e:  # noqa: BLE001 - the codec failed as a whole: these requests end, the service goes on
                err = errors.from_exception(e, self.name)
                audio = {k: err for k in range(len(now))}
            self.loop.codec_wait_s += time.monotonic() - t0
            for k, (rec, (codes, _, _)) in enumerate(now):
                a, st = audio.get(k), rec.state
                if isinstance(a, np.ndarray):
                    st.audio.append(a)
                    st.n_audio += codes.shape[0]
                    continue
                err = a if isinstance(a, S2Error) else errors.internal(f"{self.name}: the codec returned no audio")
                log.warning("%s: request %s: audio decode failed: %s", self.name, rec.tag, err.wire())
                self._end_codec(st)
                st.codec_dropped = True  # nothing more is decoded for it; its waiting items become the error
                st.waiting = [[rec, "error", None, "", err, None]]
                self.engine.cancel(str(rec.iid))

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

    def _all_sounding(self) -> bool:
        """Whether every request in flight has sent audio (none waits for its first chunk)."""
        return all(rec.state.first_audio_s is not None for rec in self.table.live())

    def _launch_behind_codec(self) -> None:
        """The codec's call is queued on the device: with steps launched ahead, queue the engine's next step (on
        the engine's stream beside the call's with `codec_concurrent`, else behind it), so the device makes frames while
        this thread takes the call's audio and hands it out (otherwise it idles until the next pass launches). Its
        immediate outputs join the next pass's; an exception it raises is raised by the next pass, not charged to the
        codec call's streams. Engine thread only (inside `_engine_pass`: on the engine's stream)."""
        if self._ahead and self.codec_overlap and self._launch_error is None:
            try:
                self._launched_early += self.engine.launch_next()
            except Exception as e:  # noqa: BLE001 - the engine's, not the codec call's: raised by the next pass
                self._launch_error = e

    def _ready_items(self, rec: Tracked) -> list[list]:
        """A request's waiting items whose audio is all decoded, in order; consecutive chunks as one."""
        st, out = rec.state, []
        while st.waiting:
            item = st.waiting[0]
            n = 0 if item[2] is None else item[2].shape[0]
            if item[1] == "error":
                out.append(item)
                st.waiting.clear()
                self._decoding.pop(rec.iid, None)
                break
            if n > st.n_audio or (item[1] == "final" and (st.n_undecoded or (st.codec.final and st.codec_open))):
                break
            st.waiting.pop(0)
            st.released += n
            audio = np.concatenate(st.audio) if len(st.audio) > 1 else st.audio[0] if st.audio else np.zeros(0, np.float32)
            hop = audio.size // max(1, st.n_audio)
            item[5], rest = audio[: n * hop], audio[n * hop :]
            st.audio, st.n_audio = ([rest] if rest.size else []), st.n_audio - n
            if out and out[-1][1] == "chunk" and item[1] == "chunk" and st.released > out[-1][2].shape[0] + n:
                prev = out[-1]
                prev[2], prev[5] = np.concatenate([prev[2], item[2]]), np.concatenate([prev[5], item[5]])
            else:
                out.append(item)
            if item[1] == "final":
                self._decoding.pop(rec.iid, None)
        return out

    def _end_codec(self, st: RequestState) -> None:
        """Close the request's codec stream unless a later request continues it (then only after a normal end)."""
        if st.codec is not None and st.codec_open:
            st.codec_open = False
            with self._codec_lock:
                self._codec_closing.append(st.codec.sid)

    def _close_codec_streams(self) -> None:
        """Close the streams asked for. A request still decoding into one its caller closed (`close_codec`: the
        caller dropped it, e.g. its client went away) is cancelled, and its chunks are no longer decoded: it ends
        `cancelled`, not with a decode error for a stream that is gone."""
        with self._codec_lock:
            sids, self._codec_closing = self._codec_closing, []
        if not sids:
            return
        closing = set(sids)
        for rec in self.table.live():
            st = rec.state
            if st.codec is not None and st.codec.sid in closing and not st.codec_dropped:
                st.codec_open, st.codec_dropped = False, True
                self.engine.cancel(str(rec.iid))
        for sid in sids:
            self.codec.close(sid)

    # ---- the sender thread ------------------------------------------------------------------
    def _send_pass(self) -> None:
        try:
            item = self.outbox.get(timeout=self.cancel_poll_s)
        except queue.Empty:
            item = None
        if item is not None:
            self._deliver(*item)
        now = time.monotonic()
        if now - self._last_poll >= self.cancel_poll_s:
            self._last_poll = now
            for r in self.table.live():
                if r.responder.is_cancelled():
                    self.engine.cancel(str(r.iid))
            if self.on_tick is not None:
                self.on_tick(self)

    def _deliver(self, rec: Tracked, kind: str, payload, outcome: str | None, put_at: float) -> None:
        """Build one item's response and send it: a chunk, the final response or the error."""
        t0 = time.monotonic()
        if kind != "error":
            payload = self.make_response(*payload)
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
        self.sends.add(t0 - put_at, time.monotonic() - t0, self.name)

    # ---- faults and shutdown ----------------------------------------------------------------
    def unhealthy(self, reason: str) -> None:
        """An unrecoverable fault: fail everything in flight, refuse what comes, tell the host (once)."""
        if not self.health.fail(reason):
            return
        engine_thread = self.threads[0]
        if threading.current_thread() is engine_thread or not engine_thread.is_alive():
            self.engine.fail_all(reason)
        else:  # the engine's state is the engine thread's: it drops everything at its next pass (see _engine_pass)
            self.engine.wake()
        self.table.end_all(reason, self.on_unhealthy)

    def shutdown(self, timeout: float = 5.0) -> int:
        """Stop the threads; every request still in flight gets a final `unavailable` error. Returns how many."""
        self.stop.set()
        self.engine.wake()
        for t in self.threads:
            t.join(timeout)
        self.engine.fail_all("shutting down")
        if self._codec_worker is not None:
            self._codec_worker.shutdown(wait=False)
        return self.table.fail_all(errors.shutting_down(self.name))



# ---- an engine from a model's settings (slow_ar, or s2pro holding the engine: `engine_in_s2pro`) ---------------------
def codec_here(v, device) -> bool:
    """`codec_in_engine` as rendering decided it; a config left unrendered takes the same rule (layout.py)."""
    if v.codec_in_engine is not None:
        return v.codec_in_engine
    from ..layout import Layout

    return Layout((str(device),), (v.codec_device or str(device),)).codec_beside_engines()


def serve_engine(v, make_response: Callable[..., Any], make_error: Callable[[S2Error], Any], name: str,
                 on_unhealthy: Callable[[str], None] | None = None,
                 on_tick: Callable[["EngineService"], None] | None = None, fast_ar=None,
                 direct_send: bool = False) -> EngineService:
    """An `EngineService` built from a model's settings `v` (`settings.model_values`): the AR weights on `v.device`,
    with `codec_in_engine` the served stream decoder on the same device (warmed for the chunk lengths the chunker
    makes and the slices held calls decode), then the `Engine` with its KV pool (sized by `kv_cache_tokens`,
    `kv_cache_memory_gb` or `gpu_memory_utilization`: `kv_pool_gib`) and CUDA graphs. `fast_ar`: a `HostFastAR`
    replacing the in-process fast AR (slow_ar's fast_ar=bls)."""
    from ..codec.loading import codec_codebook_sizes, codec_frame_seconds
    from ..ar.loading import load_model

    t0 = time.perf_counter()
    model = load_model(v.checkpoint, v.device, v.dtype, weights=v.ar_weights)
    device = next(model.parameters()).device
    t1 = time.perf_counter()
    codec = _engine_codec(v, device, name) if codec_here(v, device) else None  # before the KV pool takes the rest
    t2 = time.perf_counter()
    kv_tokens, kv_gib = v.kv_cache_tokens, v.kv_cache_memory_gb
    if v.gpu_memory_utilization is not None:
        kv_gib = kv_pool_gib(v, model, device, name, codec is not None)
        if kv_gib is None:  # not on a GPU
            kv_tokens = default_kv_tokens(v)
    engine = Engine(model, residual_size=codec_codebook_sizes(v.checkpoint)[1], max_batch=v.max_batch,
                    max_seq_len=v.max_seq_len, kv_cache_tokens=kv_tokens, kv_block_tokens=v.kv_block_tokens,
                    kv_cache_memory_gb=kv_gib,
                    fast_ar=fast_ar, prefix_cache_bytes=v.prefix_cache_mb << 20,
                    max_prefill_tokens=v.max_prefill_tokens, cuda_graphs=v.cuda_graphs,
                    batch_invariant=v.batch_invariant, admit_every=v.admit_every_steps,
                    dependent_launch=v.dependent_launch)
    t3 = time.perf_counter()
    if v.gpu_memory_utilization is not None and device.type == "cuda":
        import torch

        log.info("%s: with its KV cache and CUDA graphs this process holds %.1f GiB of the GPU (PyTorch's; "
                 "gpu_memory_utilization=%g: %.1f GiB)", name, torch.cuda.memory_reserved(device) / (1 << 30),
                 v.gpu_memory_utilization, v.gpu_memory_utilization * torch.cuda.mem_get_info(device)[1] / (1 << 30))
    service = EngineService(engine, make_response, make_error, name=name, limit=v.max_batch + v.max_queued_requests,
                            on_unhealthy=on_unhealthy, on_tick=on_tick,
                            frame_seconds=codec_frame_seconds(v.checkpoint) if v.adaptive_chunks else None,
                            codec=codec, codec_batch_steps=v.codec_batch_steps, codec_final_steps=v.codec_final_steps,
                            load_chunk_frames=v.load_chunk_frames,
                            direct_send=direct_send, launch_ahead=v.launch_ahead,
                            codec_concurrent=v.codec_concurrent)
    log.info("%s ready in %.1f s (weights %.1f s, codec %.1f s, engine and its CUDA graphs %.1f s; the GPU kernels' "
             "first compile falls in the last two): device=%s dtype=%s ar_weights=%s max_batch=%d max_seq_len=%d "
             "kv_cache=%d tokens in blocks of %d cuda_graphs=%s prefix_cache=%d MiB batch_invariant=%s "
             "adaptive_chunks=%s codec_in_engine=%s launch_ahead=%s dependent_launch=%s", name, t3 - t0, t1 - t0, t2 - t1, t3 - t2, engine.device,
             engine.dtype, v.ar_weights, engine.max_batch, engine.max_seq_len, engine.kv_capacity_tokens,
             engine.blocks.block_size, sorted(engine.graphs), engine.prefix_cache.max_bytes >> 20,
             engine.batch_invariant, v.adaptive_chunks, codec is not None, service.launch_ahead,
             engine.runner.dependent_launch)
    return service


# room an engine keeps beside its weights, codec and KV pool under gpu_memory_utilization: its CUDA graphs' memory
# pool and activations (the largest pass: max_batch + max_prefill_tokens rows) and the CUDA context
GRAPHS_AND_CONTEXT_GIB = 1.5


def kv_pool_gib(v, model, device, name: str, with_codec: bool = False) -> float | None:
    """The KV pool's GiB under `gpu_memory_utilization` (None on a CPU: the default pool), from what this process
    already holds on the engine's GPU (`device`: the weights, the codec) -> `kv_gib_for_utilization`."""
    if device.type != "cuda":
        log.info("%s: gpu_memory_utilization applies to a GPU; on %s the KV cache takes its default, %d tokens", name,
                 device, default_kv_tokens(v))
        return None
    import torch

    total, held = torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device)
    gib = kv_gib_for_utilization(v.gpu_memory_utilization, total, held, model.s2.text, next(model.parameters()).dtype,
                                 v.max_seq_len, v.kv_block_tokens or v.max_seq_len)
    log.info("%s: gpu_memory_utilization=%g of %.1f GiB: %.1f GiB held (weights%s), %.1f GiB kept for CUDA graphs, "
             "activations and the context: a KV cache of %.2f GiB", name, v.gpu_memory_utilization, total / (1 << 30),
             held / (1 << 30), " and codec" if with_codec else "", GRAPHS_AND_CONTEXT_GIB, gib)
    return gib


def kv_gib_for_utilization(util: float, total: int, held: int, cfg, dtype, max_seq_len: int, block: int = 1) -> float:
    """GiB for the KV pool when an engine may take `util` of a GPU of `total` bytes and already holds `held` (its
    weights and codec), keeping `GRAPHS_AND_CONTEXT_GIB`. ValueError naming the least utilization that works when
    that is not one request of `max_seq_len` tokens in whole blocks of `block` (as `ModelRunner.kv_tokens_in`
    counts them; the slow AR's `cfg`, the cache in `dtype`)."""
    from .runner import ModelRunner

    one = -(-max_seq_len // block) * block * ModelRunner.kv_token_bytes(cfg, dtype)
    gib = (util * total - held) / (1 << 30) - GRAPHS_AND_CONTEXT_GIB
    if gib * (1 << 30) < one:
        least = (held + one) / total + GRAPHS_AND_CONTEXT_GIB * (1 << 30) / total
        raise ValueError(f"gpu_memory_utilization={util:g} gives this engine {util * total / (1 << 30):.1f} GiB of "
                         f"its GPU's {total / (1 << 30):.1f} GiB, and it already holds {held / (1 << 30):.1f} GiB "
                         f"(weights and codec) and keeps {GRAPHS_AND_CONTEXT_GIB:g} GiB for its CUDA graphs: no room "
                         f"for one request of max_seq_len={max_seq_len} in its KV cache; raise gpu_memory_utilization "
                         f"to at least {min(1.0, least + 0.005):.2f} or lower max_seq_len")
    return gib


def _engine_codec(v, device, name: str):
    """The served stream decoder (`codec.stream.open_stream_decoder`) on the engine's device, warmed for the chunk
    lengths the chunker makes and the slices held calls decode (`codec_batch_steps`, and twice that for a stream
    catching up), at up to max_batch streams per call."""
    import torch

    from ..codec.stream import making_line, open_stream_decoder

    t0 = time.monotonic()
    torch.backends.cudnn.allow_tf32 = v.codec_tf32  # the fp32 codec's convolutions (the AR has none)
    # streams open here: the live requests, and a long text's stream between two of its segments
    slots = min(v.codec_max_streams, 2 * v.max_batch)
    # a held call decodes a slice of codec_batch_steps frames of up to max_batch streams: a longer one (a stream
    # catching up) of that many streams runs as two calls rather than doubling the graphs' memory
    K = v.codec_batch_steps
    decoder, dtype, graphs = open_stream_decoder(v.checkpoint, device, v.codec_dtype, slots,
                                                 v.codec_idle_timeout_s,
                                                 EngineService.codec_lengths(v.first_chunk_frames, v.chunk_frames, K),
                                                 v.max_batch, v.max_batch * K if K > 1 else None)
    log.info("%s: codec in the engine's loop: dtype=%s%s, %d stream slots, %d CUDA graphs, in %.1f s%s", name, dtype,
             " (fp32 fallback)" if decoder.fallback is not None else "", slots, graphs, time.monotonic() - t0,
             making_line(decoder.making))
    return decoder
