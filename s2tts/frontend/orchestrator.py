"""What `s2pro` does for each request, without Triton: reference -> prompt -> frames -> audio.

    TTSService(downstream, prompts, s2, settings, make_chunk, make_final, make_error)

Every audio chunk says where it is (`make_chunk`'s `where`): the text segment it speaks (`segment`, its index, and
`text`, as spoken: cleaned, speaker tags included) and its frames' place in the request's audio (`frame`, `frames`:
frame i's audio begins at sample i * hop, so a segment's start and end are exact to the frame). Offsets in the
client's own text are the client's to find (`segment.locate`).

`Downstream` is the rest of the pipeline (in Triton: BLS calls to dac_encoder, slow_ar and
dac_decoder; in tests: anything with the same methods). Each admitted request runs on a
worker thread of a pool and ends in exactly one final response (`serving.lifecycle.Tracked`); the
worker checks the client's cancel at each response from slow_ar. A supervisor thread
watches every request in flight:
- a request whose worker has waited on a model for 0.5 s is checked for a client cancel, and
  ended at once if so (its admission slot frees without waiting for slow_ar's next chunk);
- past `request_timeout_s` the request ends with `deadline_exceeded`;
- after `stall_timeout_s` of silence from the model it waits on, s2pro asks slow_ar whether
  the request is alive; a model that does not answer (its process died) or lost the request
  ends it with `unavailable`.
Every exit that did not see the end of generation cancels it in slow_ar, and every opened
codec stream is closed. A model whose process died, or that reported an unrecoverable fault,
is reloaded when `auto_recover` is on (the requests that depended on it end at once);
meanwhile new requests are refused with `unavailable`.

s2pro also measures the pipeline's pace (the moving average of the seconds between a stream's audio
chunks over that of their audio, across streams: `engine.chunking.PaceMeter`) and, while it has new measurements,
reports it to slow_ar about once a second (`control` = `pace=R`): slow_ar's chunker must not outrun the slowest
stage, which slow_ar's own step time does not see when the codec is the bottleneck.

With several engines (`device` lists several devices: `s2tts.layout`), each request is placed on
the replica with the fewest requests and stays there, codec stream included; a replica that is
recovering takes no new requests while the others go on.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from .. import errors
from ..engine.chunking import PaceMeter
from ..errors import S2Error
from ..layout import DECODER, ENCODER, ENGINE, Layout, role_of
from ..serving.lifecycle import RequestTable, Responder, Tracked
from ..serving.threads import WorkerPool, guarded
from .instances import ReloadGate, SessionRelay, SharedLoad, SharedSlots
from .request import Stats, TTSRequest
from .segment import batches, clean_text, overall_finish_reason
from .session import SessionEnded, TextSession

log = logging.getLogger("s2tts")

RELOAD_GATE_WAIT_S = 1.0  # at most, for another instance to see this one's reload before its requests end


class Downstream(Protocol):
    def encode(self, audio: np.ndarray, sample_rate: int, tag: str) -> np.ndarray:
        """-> codes [num_codebooks, frames]; raises S2Error."""

    def generate(self, engine: str, rid: str, prompt, req: TTSRequest, codec: tuple[str, bool, bool],
                 label: str = "") -> Iterator[tuple[np.ndarray, np.ndarray | None, str, dict | None]]:
        """The stream of slow_ar replica `engine`: (frames [n, C], their audio if slow_ar decoded it (codec_in_engine)
        else None, finish reason or "", stats on the last); raises S2Error. `codec` = (codec stream id, the first
        chunk opens it, the last chunk closes it), for a slow_ar that decodes. `rid` keys the stream; `label` (the
        client's id) only names it in log lines."""

    def control(self, engine: str, rid: str, what: str) -> dict:
        """A control request to slow_ar replica `engine` ("cancel" | "status" | "pace=R") -> its answer; raises
        S2Error."""

    def decode(self, decoder: str, sid: str, frames: np.ndarray, start: bool, final: bool,
               label: str = "") -> np.ndarray:
        """One chunk [n, C] of codec stream `sid` on dac_decoder replica `decoder` -> float32 audio; raises S2Error.
        `label`: as in `generate`."""

    def is_ready(self, model: str) -> bool: ...

    def reload(self, model: str) -> None:
        """Unload and load `model` again (raises if the server does not allow it)."""

    def holds(self, model: str) -> bool:
        """`model` runs inside this process (`frontend.local_engine.LocalEngines`): it is never reloaded on its own; its
        fault unloads this process's model instead. Optional (default: False)."""

    def failed(self, model: str) -> None:
        """`model` failed: whatever this process waits on from it ends with `unavailable`. Optional."""

    def abandon(self, engine: str, rid: str) -> None:
        """The request `rid` was ended from outside its worker: a worker still waiting for its chunks from `engine`
        (which may have lost the request) stops waiting. Optional."""


class Cancelled(Exception):
    pass


@dataclass
class Work:
    """A request's progress, read by the supervisor."""

    req: TTSRequest
    stats: Stats
    rid: str = ""  # slow_ar's request id: "<TTSService.prefix>/<internal id>" (".<k>" added for segment k > 0)
    replica: int = -1  # where the whole request runs (s2tts/layout.py): its engine and that engine's decoder
    engine: str = ENGINE
    decoder: str = DECODER
    sid: str = ""  # the codec stream's id: one for all of a request's segments
    phase: str = "queued"  # queued | encoding | generating | decoding | waiting_text (a session) | done
    progress: float = field(default_factory=time.monotonic)
    generation_open: bool = False  # slow_ar has the request and no cancel was sent
    stream_done: bool = False  # slow_ar's stream reached its final response
    decoder_open: bool = False  # a dac_decoder stream is open
    engine_codec_open: bool = False  # slow_ar decodes this request's audio and may hold its codec stream open
    last_check: float = 0.0
    last_cancel_check: float = 0.0
    stream: Any = None  # the segment's slow_ar stream being read
    seq: int = 0  # audio chunks sent
    last_sent: float = 0.0  # when the last one went (the pipeline's pace)
    worker: threading.Thread | None = None  # the pool's worker serving it, while it does
    checking: bool = False  # a liveness check of its model is under way (off the supervisor's thread)
    session: TextSession | None = None  # a text session's buffer (`session_id`): its segments come as text does
    segment: tuple[int, str] = (0, "")  # the text segment being spoken: (its index, its text)

    def step(self, phase: str) -> None:
        self.phase, self.progress = phase, time.monotonic()


class TTSService:
    def __init__(self, downstream: Downstream, prompts, s2, values: dict,
                 make_chunk: Callable[[np.ndarray, np.ndarray, int, dict], Any],
                 make_final: Callable[[Stats, int], Any], make_error: Callable[[S2Error], Any],
                 name: str = "s2pro", supervise_s: float = 0.2, on_tick: Callable[["TTSService"], None] | None = None,
                 spare_workers: int = 16, on_unhealthy: Callable[[str], None] | None = None,
                 shared_dir: str | None = None):
        """`shared_dir`: the run directory of several instances of this service in one server
        (`instances.run_dir`): `max_concurrent_requests` then counts all of their requests, and text for a session
        another instance holds is relayed to it (`instances.SessionRelay`)."""
        self.down = downstream
        self.prompts = prompts
        self.s2 = s2
        self.v = values
        self.name = name
        self.make_chunk, self.make_final = make_chunk, make_final
        self.reload_backoff_s = 30.0
        self.slots = self.relay = self.reload_gate = self.shared_load = None
        if shared_dir is not None:
            self.slots = SharedSlots(Path(shared_dir) / "slots", values["max_concurrent_requests"])
            self.relay = SessionRelay(shared_dir, self._append_here, name)
            # another instance's reload that ended up to 10 s before this one noticed the fault answers it too
            self.reload_gate = ReloadGate(shared_dir, within_s=10.0)
        self.table = RequestTable(name, make_error, limit=None if self.slots else values["max_concurrent_requests"],
                                  slots=self.slots)
        # the names this service gives its requests downstream (slow_ar request ids, codec streams):
        # "<name>~<random>/<internal id>", never a client's id, and new with each start of this process (slow_ar and
        # the codec outlive a reload of s2pro); log lines name a request "<client id>#<internal id>"
        self.prefix = f"{name}~{secrets.token_hex(3)}"
        self.layout = Layout.from_values(values)
        self._models = sorted({ENCODER} | {f(i) for i in range(self.layout.replicas)
                                           for f in (self.layout.engine, self.layout.decoder)})
        if shared_dir is not None and self.layout.replicas > 1:  # placement by every instance's requests
            self.shared_load = SharedLoad(shared_dir, self.layout.replicas)
        # A pool: fewer Python threads made and destroyed under load; room above the admission limit for workers
        # left waiting on a model that died, and a worker
        # still waiting `give_up_s` after its request was ended elsewhere is replaced (`WorkerPool.give_up`).
        self.pool = WorkerPool(values["max_concurrent_requests"] + spare_workers, "s2pro-worker")
        self.give_up_s = min(2.0, values["stall_timeout_s"] / 2)  # (before a queued request would be refused)
        self._ended_elsewhere: list[tuple[float, Work]] = []  # (when, request) ended while its worker waited
        self._ended_lock = threading.Lock()
        # how long the supervisor's checks wait for a model's answer (they run off its thread; it never waits)
        self.check_timeout_s = min(10.0, values["stall_timeout_s"])
        self.supervise_s = supervise_s
        self.cancel_check_s = 0.5  # a request waiting this long on a model: the supervisor checks for a cancel
        self.on_tick = on_tick  # called every supervisor pass (metrics)
        self.recovering: dict[str, float] = {}  # model -> when its reload started
        self.last_reload: dict[str, float] = {}
        self.pace_meter = PaceMeter()  # the pipeline's pace (see the module's doc)
        self.pace_report_s = 1.0
        self._pace_reported = (0.0, 0)  # (when, samples then)
        self._pace_busy = False  # a report is under way (off the supervisor's thread)
        self._lock = threading.Lock()
        self.sessions: dict[str, Tracked] = {}  # open text sessions by the client's session_id
        self.stop = threading.Event()
        self.on_unhealthy = on_unhealthy  # told once when this service gives up (the host unloads it: not ready)
        self.supervisor = threading.Thread(target=guarded(f"{name} supervisor", self._supervise, self.stop,
                                                          self._supervisor_died, max_consecutive_errors=10**9),
                                           name="s2tts-supervisor", daemon=True)
        self.supervisor.start()

    def _supervisor_died(self, reason: str) -> None:
        """Without its supervisor nothing ends a stalled request or enforces a deadline: the service refuses new
        requests, ends those in flight with `unavailable` and tells the host (s2pro unloads itself, so Triton's
        readiness turns false and an orchestrator restarts it)."""
        if self.table.health.fail(reason):
            self.table.end_all(reason, self.on_unhealthy)

    # ---- admission ------------------------------------------------------------------------
    def submit(self, client_id: str, responder: Responder, req: TTSRequest) -> Tracked | None:
        elsewhere = set() if self.reload_gate is None else {m for m in self._models  # reloaded by another instance
                                                             if self.reload_gate.busy(m)}
        with self._lock:
            recovering = sorted(set(self.recovering) | elsewhere)
            up = [i for i in range(self.layout.replicas)
                  if self.layout.engine(i) not in recovering and self.layout.decoder(i) not in recovering]
        if not up or (ENCODER in recovering and req.reference_audio is not None):
            self.table.refuse(responder, errors.unavailable(
                f"{', '.join(recovering)} is restarting after a fault; retry in a few seconds"))
            return None
        try:
            rec = self.table.open(client_id, responder, timeout_s=self.v["request_timeout_s"], unique=False,
                                  state=Work(req, Stats(seed=req.params.seed, request_id=client_id)))
        except S2Error as e:
            log.info("%s: request %s refused: %s", self.name, client_id, e.wire())
            self.table.refuse(responder, e)
            return None
        w: Work = rec.state
        w.rid = w.sid = f"{self.prefix}/{rec.iid}"  # never the client's id: no client can name another's stream
        if req.session_id:
            with self._lock:
                taken = req.session_id in self.sessions or (self.relay is not None
                                                             and not self.relay.claim(req.session_id))
                if not taken:
                    w.session = TextSession(req.chunk_length)
                    w.session.push(req.text)
                    self.sessions[req.session_id] = rec
            if taken:
                rec.fail(S2Error("already_exists", f"text session {req.session_id!r} is open: send its text with "
                                 "text_event=text, or open another session_id", "session_id"))
                return None
        w.replica = self._place(req, up, rec)
        w.engine, w.decoder = self.layout.engine(w.replica), self.layout.decoder(w.replica)
        self.pool.submit(self._serve, rec)
        return rec

    def append(self, session_id: str, event: str, text: str) -> dict:
        """Text for an open session (`event`: text | flush | end) -> {"session_id", "pending_chars"}; S2Error
        `not_found` for a session that is not open (here, or in another instance sharing `shared_dir`),
        `invalid_argument` for text after its end."""
        with self._lock:
            here = session_id in self.sessions
        if not here and self.relay is not None:
            out = self.relay.relay(session_id, event, text)
            if out is not None:
                return out
        return self._append_here(session_id, event, text)

    def _append_here(self, session_id: str, event: str, text: str) -> dict:
        with self._lock:
            rec = self.sessions.get(session_id)
        if rec is None or rec.closed:
            raise S2Error("not_found", f"no open text session {session_id!r}: open it first (text_event=open, its "
                          "request streams the audio), or it has ended", "session_id")
        if rec.state.session.pending + len(text) > self.v["max_text_chars"]:
            raise S2Error("resource_exhausted", f"text session {session_id!r} holds {rec.state.session.pending} "
                          f"characters not yet spoken; more than max_text_chars={self.v['max_text_chars']} would "
                          "wait: send the rest when some has been spoken", "text")
        try:
            pending = rec.state.session.push(text, event)
        except SessionEnded as e:
            raise S2Error("invalid_argument", f"text session {session_id!r}: {e}", "session_id") from None
        return {"session_id": session_id, "pending_chars": pending}

    def load(self, but: Tracked | None = None) -> list[int]:
        """Requests in flight (not yet answered with their final response) on each replica."""
        load = [0] * self.layout.replicas
        for rec in self.table.live():
            if rec is not but and not rec.closed and rec.state.replica >= 0:
                load[rec.state.replica] += 1
        return load

    def _place(self, req: TTSRequest, up: list[int], rec: Tracked) -> int:
        """The replica with the fewest requests in flight (this instance's and, with several, the others' as they
        last published them); among equals, the one this voice usually goes to (its voice prefix is in that engine's
        prefix cache), then the next ones in order."""
        if len(up) == 1:
            return up[0]
        first, n = self.layout.preferred(req.reference_text or ""), self.layout.replicas
        # one placement at a time (in all the instances), so that simultaneous arrivals see each other
        with self._lock, (self.shared_load.placing() if self.shared_load is not None else contextlib.nullcontext()):
            load = self.load(but=rec)
            if self.shared_load is not None:
                load = [a + b for a, b in zip(load, self.shared_load.others())]
            i = min(up, key=lambda i: (load[i], (i - first) % n))
            rec.state.replica = i
            self._publish_load()
        return i

    def _publish_load(self) -> None:
        """This instance's requests on each engine, for the other instances' placements (at each placement, each
        request's end and each supervisor pass)."""
        if self.shared_load is not None:
            self.shared_load.publish(self.load())

    # ---- one request, on its worker thread --------------------------------------------------
    def _serve(self, rec: Tracked) -> None:
        w: Work = rec.state
        req, stats = w.req, w.stats
        if rec.closed:  # ended while it waited for a worker
            return
        w.worker = threading.current_thread()
        try:
            ref_codes = req.reference_codes
            if req.reference_audio is not None:
                w.step("encoding")
                ref_codes = self._call(ENCODER, self.down.encode, req.reference_audio, req.reference_sample_rate, rec.tag)
            history: list[tuple[str, np.ndarray]] = []  # earlier segments: (text, codes [frames, C])
            base = w.rid
            cut = False  # a segment hit max_new_tokens, or the context dropped earlier segments
            k = -1
            for k, (segment, last) in enumerate(self._segments(rec)):
                if k and rec.deadline is not None:  # the deadline is each segment's: a 100,000-character text is fine
                    rec.deadline = time.monotonic() + self.v["request_timeout_s"]
                prompt = self._prompt(segment, ref_codes, req, history)
                stats.prompt_tokens = max(stats.prompt_tokens or 0, len(prompt))
                if prompt.history_dropped:
                    cut = True
                    history = history[prompt.history_dropped:]
                w.rid = base if k == 0 else f"{base}.{k}"  # slow_ar's id of this segment
                w.segment = (k, segment)
                made, reason = self._segment(rec, prompt, first=k == 0, last=last)
                if reason is None:  # the request ended elsewhere (deadline, shutdown, a dead model) or its client left
                    break
                cut = cut or reason == "length"
                if reason == "cancelled" or last:
                    stats.finish_reason = overall_finish_reason(reason, cut)
                    break
                stats.finish_reason = overall_finish_reason(reason, cut)  # a session may end after any segment
                history.append((segment, np.concatenate(made) if made else np.zeros((0, self.s2.num_codebooks), np.int64)))
            if k < 0 and w.session is not None and not rec.closed:  # a session that ended before any text
                stats.finish_reason = "end"
                w.stream_done = True
            if w.stream_done and not rec.closed:
                reason = stats.finish_reason
                self._close_decoder(w)
                w.step("done")
                if reason == "cancelled":
                    log.info("%s: request cancelled by the client (%s, after %d frames)", self.name, rec.tag, stats.frames)
                if rec.finish(lambda: self.make_final(stats, w.seq), "ok"):
                    log.info("%s: request %s done: %d frames in %d segment(s), finish reason %s, first audio after %s s",
                             self.name, rec.tag, stats.frames, k + 1, reason,
                             None if stats.first_audio is None else round(stats.first_audio - stats.started, 3))
        except Cancelled:
            stats.finish_reason = "cancelled"
            self._free_downstream(w)  # cancel generation before answering
            log.info("%s: request cancelled by the client (%s, after %d frames)", self.name, rec.tag, stats.frames)
            rec.finish(lambda: self.make_final(stats, w.seq), "cancelled")
        except Exception as e:  # noqa: BLE001 - every other exit: one final error, downstream released
            err = errors.from_exception(e, self.name)
            if rec.fail(err):
                (log.info if err.code == "invalid_argument" else log.warning)(
                    "%s: request %s failed in %s: %s", self.name, rec.tag, w.phase, err.wire())
        finally:
            self._free_downstream(w)
            w.worker = None
            self._publish_load()
            if w.session is not None:
                w.session.end()
                with self._lock:
                    if self.sessions.get(req.session_id) is rec:
                        del self.sessions[req.session_id]
                        if self.relay is not None:
                            self.relay.release(req.session_id)

    def _segments(self, rec: Tracked):
        """(segment, last) in order: a text's batches (`segment.batches`: long text, dialogue), or a session's as its
        text comes (`session.TextSession`), waiting in phase `waiting_text` (no deadline, no stall check; the session
        ends after `session_idle_timeout_s` without text)."""
        w: Work = rec.state
        if w.session is None:
            segments = batches(w.req.text, w.req.chunk_length) or [w.req.text]
            for k, seg in enumerate(segments):
                if rec.closed:  # ended elsewhere between segments
                    return
                yield seg, k == len(segments) - 1
            return
        while not rec.closed:
            seg, last = w.session.take(0.1)
            if seg is None and not last:
                if w.phase != "waiting_text":
                    w.step("waiting_text")
                    rec.deadline = None
                if time.monotonic() - w.session.last_text > self.v["session_idle_timeout_s"]:
                    log.info("%s: text session of %s idle for %g s: ended", self.name, rec.tag,
                             self.v["session_idle_timeout_s"])
                    w.session.end()
                continue
            if seg is None:  # ended, nothing left: the codec stream is closed after the loop
                return
            try:
                seg = clean_text(seg)  # markup split across pieces is refused here, as in a whole text
            except ValueError as e:
                raise errors.invalid(str(e), "text") from None
            rec.deadline = time.monotonic() + self.v["request_timeout_s"]
            yield seg, last

    def _segment(self, rec: Tracked, prompt, first: bool, last: bool) -> tuple[list[np.ndarray], str | None]:
        """One text segment: its generation in slow_ar, each chunk decoded in the request's codec stream (one for
        every segment: opened by the first chunk, ended by the last segment's last) and sent. -> (its frames, its
        finish reason; None when the request ended elsewhere or the client left). Raises Cancelled or S2Error."""
        w: Work = rec.state
        stats = w.stats
        w.step("generating")
        w.generation_open, w.stream_done = True, False
        if first:
            stats.to_engine_s = round(time.monotonic() - stats.started, 4)
        w.stream = self._call(w.engine, self.down.generate, w.engine, w.rid, prompt, w.req, (w.sid, w.seq == 0, last),
                              rec.client_id)
        made: list[np.ndarray] = []
        while not rec.closed:  # closed elsewhere: a deadline, shutdown, a dead model
            try:
                frames, audio, reason, gstats = self._call(w.engine, next, w.stream)
            except StopIteration:
                w.generation_open, w.stream_done = False, True
                raise errors.internal("slow_ar ended the stream without a final response") from None
            except S2Error:
                w.generation_open, w.stream_done = False, True  # an error response is slow_ar's final one
                raise
            if reason:
                w.generation_open, w.stream_done = False, True
                if gstats and first:
                    stats.queue_s = gstats.get("queue_s")
                    stats.engine_first_frame_s = gstats.get("first_frame_s")
                    stats.engine_first_audio_s = gstats.get("first_audio_s")
            w.step("generating")
            if rec.closed:
                return made, None
            if rec.responder.is_cancelled():
                raise Cancelled()
            if frames.shape[0]:
                made.append(frames)
                where = {"segment": w.segment[0], "text": w.segment[1], "frame": stats.frames,
                         "frames": int(frames.shape[0])}
                stats.frames += frames.shape[0]
                if audio is not None:  # slow_ar decoded it (codec_in_engine); it ends the codec stream with `last`
                    w.engine_codec_open = not (reason and last)
                else:
                    w.step("decoding")
                    audio = self._call(w.decoder, self.down.decode, w.decoder, w.sid, frames, w.seq == 0,
                                       bool(reason) and last, rec.client_id)
                    w.decoder_open = not (reason and last)
                    w.step("generating")
                if not rec.send(lambda: self._chunk(stats, audio, frames, w.seq, where)):
                    return made, None
                now = time.monotonic()
                if w.seq and audio.size and not reason:  # not the first (prefill) nor the last (a remainder)
                    self.pace_meter.observe(now - w.last_sent, audio.size / self.s2.sample_rate)
                w.last_sent = now
                w.seq += 1
            if reason:
                if last or reason == "cancelled":  # slow_ar closed its codec stream, if it decodes
                    w.engine_codec_open = False
                return made, reason
        return made, None

    def _chunk(self, stats: Stats, audio: np.ndarray, frames: np.ndarray, seq: int, where: dict):
        """Build an audio chunk's response (only for a chunk that will be sent: what it counts is sent)."""
        stats.audio_sent(audio.size)
        return self.make_chunk(audio, frames, seq, where)

    def _prompt(self, segment: str, ref_codes, req: TTSRequest, history: list):
        """A segment's prompt beside the frames it may generate in slow_ar's sequence (the smaller of max_seq_len
        and the checkpoint's)."""
        room = min(self.v["max_seq_len"], self.s2.text.max_seq_len) - req.params.max_new_tokens - 1
        return self.prompts.build_segment(segment, ref_codes, req.reference_text, history, room)

    @property
    def pace(self) -> float | None:
        return self.pace_meter.pace

    def _report_pace(self) -> None:
        """Measurements since the last report (none while idle: slow_ar then drops the old value after a while); the
        calls run off the supervisor's thread, one report at a time."""
        when, samples = self._pace_reported
        r, n = self.pace, self.pace_meter.samples
        if r is None or n == samples or time.monotonic() - when < self.pace_report_s or self._pace_busy:
            return
        self._pace_reported, self._pace_busy = (time.monotonic(), n), True
        self._off_thread("pace", self._send_pace, r)

    def _send_pace(self, r: float) -> None:
        try:
            for i in range(self.layout.replicas):
                try:
                    self.down.control(self.layout.engine(i), self.prefix, f"pace={r:.4f}")  # this process's
                except Exception as e:  # noqa: BLE001 - chunks then follow slow_ar's own pace
                    log.info("%s: pace not reported to %s (%s)", self.name, self.layout.engine(i), e)
        finally:
            self._pace_busy = False

    def _free_downstream(self, w: Work) -> None:
        """Whatever the request still holds downstream: its codec stream, and its generation (cancelled, and its
        stream read to the end so that no BLS stream stays open; if slow_ar died this thread waits there for good,
        holding nothing)."""
        self._close_decoder(w)
        self._end_generation(w)
        if w.stream is not None and not w.stream_done:
            w.stream_done = True
            self._drain(w.stream)

    def _drain(self, stream) -> None:
        """Read a cancelled slow_ar stream to its final response, so that no BLS stream stays open here."""
        try:
            for _frames, _audio, reason, _stats in stream:
                if reason:
                    return
        except Exception:  # noqa: BLE001 - an error response also ends it
            return

    def _call(self, model: str, fn, *args):
        """A downstream call; its failure is an S2Error, and a model that died starts a recovery."""
        try:
            return fn(*args)
        except StopIteration:
            raise
        except S2Error as e:
            if e.code == "unavailable":
                self._model_failed(model, e.message, param=e.param)
            raise
        except Exception as e:  # noqa: BLE001
            raise errors.from_exception(e, model) from None

    def _end_generation(self, w: Work) -> bool:
        """Cancel the request in slow_ar unless it already ended there; True if a cancel was delivered."""
        if not w.generation_open:
            return False
        w.generation_open = False
        try:
            self.down.control(w.engine, w.rid, "cancel")
            return True
        except Exception as e:  # noqa: BLE001 - slow_ar is gone: nothing left to cancel
            log.info("%s: cancel of %s not delivered to %s (%s)", self.name, w.rid, w.engine, e)
            return False

    def _close_decoder(self, w: Work) -> None:
        if w.engine_codec_open:  # slow_ar keeps the stream open for a next segment that will not come
            w.engine_codec_open = False
            try:
                self.down.control(w.engine, w.sid, "close_codec")
            except Exception as e:  # noqa: BLE001 - its state is dropped when idle anyway
                log.info("%s: codec stream %s not closed in %s (%s)", self.name, w.sid, w.engine, e)
        if not w.decoder_open:
            return
        w.decoder_open = False
        try:
            self.down.decode(w.decoder, w.sid, np.zeros((0, self.s2.num_codebooks), np.int32), False, True)
        except Exception as e:  # noqa: BLE001 - its state is dropped when idle anyway
            log.info("%s: codec stream %s not closed (%s)", self.name, w.sid, e)

    # ---- supervision ------------------------------------------------------------------------
    def _supervise(self) -> None:
        self.stop.wait(self.supervise_s)
        if self.on_tick is not None:
            self.on_tick(self)
        self._publish_load()
        self._report_pace()
        now = time.monotonic()
        self._give_up_stuck_workers(now)
        for rec in self.table.live():
            w: Work = rec.state
            if rec.closed:
                continue
            if w.phase == "queued" and now - w.progress > self.v["stall_timeout_s"]:
                self._abort(rec, errors.unavailable(
                    f"{self.name} had no free worker for {now - w.progress:.0f} s ({self.pool.size} workers, "
                    f"{self.pool.queued} requests waiting for one); retry"))
                continue
            if rec.deadline is not None and now >= rec.deadline:
                self._abort(rec, S2Error("deadline_exceeded", f"the request (or its current text segment) ran longer "
                                         f"than request_timeout_s={self.v['request_timeout_s']:g} s (in {w.phase}); "
                                         "lower max_new_tokens or chunk_length, or raise the setting"))
                continue
            if now - w.progress > self.cancel_check_s and now - w.last_cancel_check > self.cancel_check_s:
                w.last_cancel_check = now  # its worker waits on a model: it would see a cancel only after that
                if rec.responder.is_cancelled():
                    self._end_cancelled(rec)
                    continue
            if w.phase == "waiting_text":  # a session waiting for its client's text: nothing of ours is late
                continue
            if now - w.progress > self.v["stall_timeout_s"] and now - w.last_check > self.v["stall_timeout_s"] \
                    and not w.checking:
                w.last_check, w.checking = now, True
                self._off_thread("check", self._check_stalled, rec)

    def _off_thread(self, what: str, fn, *args) -> None:
        """Work that calls a model, run off the supervisor's thread: a model that does not answer never stops the
        supervision of the other requests."""
        threading.Thread(target=fn, args=args, name=f"s2tts-{self.name}-{what}", daemon=True).start()

    def _bounded(self, timeout_s: float, fn, *args):
        """fn(*args), waited for at most `timeout_s` (then `unavailable`; the call itself is left to its thread)."""
        box: dict = {}
        done = threading.Event()

        def run():
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name=f"s2tts-{self.name}-call", daemon=True).start()
        if not done.wait(timeout_s):
            raise errors.unavailable(f"no answer in {timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _give_up_stuck_workers(self, now: float) -> None:
        """A request ended elsewhere whose worker is still in a model's call `give_up_s` later: that call may never
        return (the model died), so another worker may start in its place."""
        keep = []
        with self._ended_lock:
            ended, self._ended_elsewhere = self._ended_elsewhere, []
        for when, w in ended:
            worker = w.worker
            if worker is None:
                continue  # it came back
            if now - when < self.give_up_s:
                keep.append((when, w))
            elif self.pool.give_up(worker):
                log.warning("%s: a worker still waits in %s's call %.0f s after its request ended; another takes its "
                            "place", self.name, w.engine if w.phase != "encoding" else ENCODER, now - when)
        with self._ended_lock:
            self._ended_elsewhere[:0] = keep

    def _end_cancelled(self, rec: Tracked) -> None:
        """A client cancelled while the request's worker waits on a model: its final response now (so its admission
        slot is free at once), its generation cancelled; the worker finds the request closed when its call returns."""
        w: Work = rec.state
        w.stats.finish_reason = "cancelled"
        if not rec.finish(lambda: self.make_final(w.stats, w.seq), "cancelled"):
            return
        log.info("%s: request cancelled by the client (%s, after %d frames, while %s)", self.name, rec.tag,
                 w.stats.frames, w.phase)
        self._ended_outside(w)

    def _ended_outside(self, w: Work) -> None:
        """A request was ended from outside its worker: release what it holds downstream (off this thread), and
        watch whether its worker comes back."""
        with self._ended_lock:
            self._ended_elsewhere.append((time.monotonic(), w))
        self._off_thread("release", self._free_from_outside, w)

    def _free_from_outside(self, w: Work) -> None:
        """What a request ended from outside its worker holds downstream: its generation (cancelled) and, unless its
        worker is inside a codec call now, its codec stream."""
        self._end_generation(w)
        getattr(self.down, "abandon", lambda engine, rid: None)(w.engine, w.rid)  # (an engine that lost it sends
        # nothing more: its worker would wait for good)
        if w.phase != "decoding":  # its worker may never come back (a dead slow_ar): release the codec stream here
            self._close_decoder(w)

    def _check_stalled(self, rec: Tracked) -> None:
        """Is the model a silent request waits on alive (off the supervisor's thread)? A model that does not answer
        within `check_timeout_s`, or lost the request, ends it with `unavailable`."""
        w: Work = rec.state
        try:
            self._check_model(rec, w)
        finally:
            w.checking = False

    def _check_model(self, rec: Tracked, w: Work) -> None:
        model = {"encoding": ENCODER, "decoding": w.decoder}.get(w.phase, w.engine)
        if model == w.engine and w.generation_open:
            try:
                status = self._bounded(self.check_timeout_s, self.down.control, w.engine, w.rid, "status")
            except Exception as e:  # noqa: BLE001
                err = errors.from_exception(e, w.engine)
                self._model_failed(w.engine, err.message, force=True)
                self._abort(rec, errors.unavailable(f"{w.engine} stopped answering ({err.message})"))
                return
            if status.get("request") == "unknown":
                self._abort(rec, errors.unavailable(f"{w.engine} lost the request (it was restarted); retry"))
            else:
                log.info("%s: request %s silent for %.0f s but %s in %s", self.name, rec.tag,
                         time.monotonic() - w.progress, status.get("request"), w.engine)
        elif not self.down.is_ready(model):
            self._model_failed(model, f"{model} is not ready", force=True)
            self._abort(rec, errors.unavailable(f"{model} stopped answering"))

    def _abort(self, rec: Tracked, err: S2Error) -> None:
        """End a request from outside its worker (which may be blocked on a dead model)."""
        w: Work = rec.state
        if not rec.fail(err):
            return
        log.warning("%s: request %s ended in %s: %s", self.name, rec.tag, w.phase, err.wire())
        self._ended_outside(w)

    def _model_failed(self, model: str, reason: str, force: bool = False, param: str | None = None) -> None:
        """A model answered `unavailable`: if it died or unloaded itself, end the requests that wait on it and
        (auto_recover) reload it. Not when it is being shut down (param "shutdown"), nor while this one is."""
        if self.stop.is_set() or param == errors.SHUTDOWN:
            return
        if getattr(self.down, "holds", lambda m: False)(model):  # its requests end with its own fault, and its
            return  # fault unloads this model (on_unhealthy): nothing to reload from here
        if not force and not (errors.model_is_dead(reason) or not self.down.is_ready(model)):
            return  # busy: that request alone failed
        with self._lock:
            if model in self.recovering:
                return
            if not self.v["auto_recover"] or time.monotonic() - self.last_reload.get(model, -1e9) < self.reload_backoff_s:
                log.error("%s: %s is unavailable (%s); not reloading it (auto_recover=%s)", self.name, model, reason,
                          self.v["auto_recover"])
                return
            self.recovering[model] = self.last_reload[model] = time.monotonic()
        log.error("%s: %s failed (%s): ending the requests that wait on it and reloading it", self.name, model, reason)
        # the other instances see the reload before any request here ends (and would be placed on the model again)
        gated = threading.Event()
        threading.Thread(target=self._reload, args=(model, gated), name=f"s2tts-reload-{model}", daemon=True).start()
        if self.reload_gate is not None:
            gated.wait(RELOAD_GATE_WAIT_S)
        getattr(self.down, "failed", lambda m: None)(model)
        role = role_of(model)
        phases = {ENGINE: ("generating",), DECODER: ("generating", "decoding"), ENCODER: ("encoding",)}[role]
        for rec in self.table.live():
            w: Work = rec.state
            if w.phase in phases and model in (w.engine, w.decoder, ENCODER):
                self._abort(rec, errors.unavailable(f"{model} failed while serving this request ({reason}); retry"))

    def _reload(self, model: str, gated: threading.Event) -> None:
        t0, noticed = time.monotonic(), time.time()
        try:
            if self.reload_gate is None:
                self.down.reload(model)
            elif not self.reload_gate.run(model, lambda: self.down.reload(model), noticed, gated):
                log.warning("%s: %s was reloaded by another %s instance", self.name, model, self.name)
                return
            log.warning("%s: %s reloaded in %.1f s", self.name, model, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001
            log.error("%s: reloading %s failed (%s): it stays unavailable; restart the server", self.name, model, e)
        finally:
            with self._lock:
                self.recovering.pop(model, None)

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> int:
        """Every request in flight gets a final `unavailable` error; their generation is cancelled."""
        self.stop.set()
        self.supervisor.join(5)
        n = 0
        for rec in self.table.live():
            if rec.fail(errors.shutting_down(self.name)):
                n += 1
            self._end_generation(rec.state)
        self.pool.shutdown()
        if self.relay is not None:
            self.relay.close()
        if self.shared_load is not None:
            self.shared_load.close()
        return n

    def status(self) -> dict:
        with self._lock:
            recovering = sorted(self.recovering)
        load = self.load()
        return {**self.table.stats(), "recovering": recovering, "worker_threads": self.pool.size,
                "workers_given_up": self.pool.given_up,
                "replicas": {self.layout.engine(i): load[i] for i in range(self.layout.replicas)}}
