"""Streaming gRPC client for the `s2pro` model (used by client/, perf/ and tests).

    with S2ProClient("localhost:8001") as c:
        for event in c.stream(TTSInput(text="Hello.", seed=1)):
            ...   # AudioChunk(seq, audio) ... then Final(stats); leaving the loop early cancels the request
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field, replace

import numpy as np
import tritonclient.grpc as g
from tritonclient.utils import triton_to_np_dtype

from .errors import RETRYABLE, S2Error, parse
from .frontend.segment import combine_voices
from .settings import REQUEST_FIELDS, check_field

MODEL = "s2pro"


def wire_type(field) -> str:
    """tritonclient's name of a request field's config.pbtxt data type (`TYPE_STRING` travels as BYTES)."""
    return "BYTES" if field.triton == "TYPE_STRING" else field.triton.removeprefix("TYPE_")


@dataclass
class TTSInput:
    text: str
    reference_audio: np.ndarray | None = None  # float32 mono samples
    reference_sample_rate: int | None = None
    reference_text: str | None = None
    reference_codes: np.ndarray | None = None  # [num_codebooks, frames]
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    first_chunk_frames: int | None = None
    chunk_frames: int | None = None
    ignore_eos: bool | None = None  # benchmarks: generate exactly max_new_tokens frames
    chunk_length: int | None = None  # UTF-8 bytes of text per segment (long text, dialogue); max_new_tokens is per segment
    voices: list | None = None  # several reference voices, one per speaker: [(transcript, codes [C, frames]), ...]
    session_id: str | None = None  # a text session: text_event open (this request streams its audio) ...
    text_event: str | None = None  # ... then text / flush / end with the same session_id (answered at once)

    def check(self) -> "TTSInput":
        """Refuse here what the server would refuse (a negative or too large seed, out-of-range sampling), with the
        same message; raises TTSError."""
        server_bounds = {f.max_setting: None for f in REQUEST_FIELDS.values() if f.max_setting}  # the server checks
        try:
            for f in REQUEST_FIELDS.values():
                if f.type in (int, float) and f.dims == "[ 1 ]":
                    check_field(f.name, getattr(self, f.name), server_bounds)
        except S2Error as e:
            raise TTSError(e.message, e.code, e.param) from None
        if not isinstance(self.text, str):
            raise TTSError("text must be a string", "invalid_argument", "text")
        return self

    def to_inputs(self, check: bool = True):
        if check:
            self.check()
        if self.voices:  # upstream's format for several voices: one reference (s2tts.frontend.segment.combine_voices)

            if self.reference_codes is not None or self.reference_audio is not None or self.reference_text is not None:
                raise TTSError("give voices or one reference (reference_audio / reference_codes + reference_text), "
                               "not both", "invalid_argument", "voices")
            try:
                text, codes = combine_voices(self.voices)
            except ValueError as e:
                raise TTSError(str(e), "invalid_argument", "voices") from None
            return replace(self, voices=None, reference_text=text, reference_codes=codes).to_inputs(check=False)


        inputs = []
        for f in REQUEST_FIELDS.values():  # s2pro's inputs: names, types and shapes from the one schema
            v = getattr(self, f.name)
            if "s2pro" not in f.stages or v is None:
                continue
            dtype = wire_type(f)
            np_t = triton_to_np_dtype(dtype)
            if dtype == "BYTES":
                try:
                    arr = np.array([v.encode("utf-8")], dtype=object)
                except UnicodeEncodeError:  # half of a UTF-16 pair ("\ud800"): no character
                    raise TTSError(f"{f.name} holds a lone UTF-16 surrogate, which is no character: send valid "
                                   "Unicode text", "invalid_argument", f.name) from None
            elif f.dims == "[ 1 ]":
                arr = np.array([v], np_t)
            else:
                arr = np.asarray(v, dtype=np_t)
                arr = arr.reshape(-1) if f.dims == "[ -1 ]" else arr
            t = g.InferInput(f.name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        return inputs


def json_output(result, name: str) -> dict | None:
    """A STRING output holding JSON; None where the response has none (or it is empty)."""
    x = result.as_numpy(name)
    if x is None or not x.size:
        return None
    s = x.reshape(-1)[0]
    s = s.decode() if isinstance(s, bytes) else str(s)
    return json.loads(s) if s else None


@dataclass
class AudioChunk:
    sequence: int
    audio: np.ndarray  # float32
    sample_rate: int
    t: float  # seconds since the request was sent, when this generator read it
    codes: np.ndarray | None = None  # [frames, num_codebooks] behind this chunk
    segment: dict | None = None  # where it is: {segment, text, frame, frames} (s2tts.frontend.orchestrator)
    arrived: float | None = None  # seconds since the request was sent, when it reached this process (tritonclient's
    # stream thread), before a thread of the caller's read it: `t - arrived` is the client's own delay


@dataclass
class Final:
    stats: dict
    t: float


class TTSError(RuntimeError):
    """A failed request: `code` is its class (s2tts.errors.CODES: invalid_argument, unavailable, ...), `param` the
    input it concerns, the message what to change."""

    def __init__(self, message: str, code: str = "internal", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param

    @classmethod
    def from_message(cls, message: str) -> "TTSError":
        e = parse(message)
        return cls(e.message, e.code, e.param)

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


@dataclass
class Result:
    audio: np.ndarray
    sample_rate: int
    stats: dict
    chunks: list[AudioChunk] = field(default_factory=list)
    ttfa_s: float | None = None
    total_s: float = 0.0

    @property
    def codes(self) -> np.ndarray:
        """[num_codebooks, frames] of the whole request."""
        return np.concatenate([c.codes for c in self.chunks]).T if self.chunks else np.zeros((0, 0), np.int32)


class S2ProClient:
    """One gRPC stream; requests on it are sent one after another by `stream()`."""

    def __init__(self, url: str, model: str = MODEL, check_inputs: bool = True):
        """`check_inputs`: refuse out-of-range inputs here, before sending (False: let the server judge them)."""
        self.url, self.model, self.check_inputs = url, model, check_inputs
        self.client = g.InferenceServerClient(url)
        self._q: queue.Queue = queue.Queue()
        self._open = False
        self._in_flight = False  # a request was sent on the stream and has not ended (no final stats or flag yet)
        self._lock = threading.Lock()

    def _callback(self, result, error):
        self._q.put((time.perf_counter(), result, error))

    def _ensure_stream(self):
        if not self._open:
            self.client.start_stream(callback=self._callback)
            self._open = True

    def stream(self, req: TTSInput, timeout: float = 300.0, cancel_after_chunks: int | None = None,
               request_id: str | None = None):
        """Yield AudioChunk events, then one Final. Raises TTSError for an error response.

        `cancel_after_chunks`: close the stream (cancelling the request) after that many chunks (0: at once).
        The generator closed before the request's end cancels the request too (a `for` loop over `stream(...)` left
        by `break` or an exception does that, as does `close()`): the server stops generating it, and closing the
        client does not wait for its end. Closed after the Final event, it sends no cancel.
        `request_id`: the id the server logs the request under (default: a new one); `timeout`: the longest wait for
        the next response (the request is cancelled then).
        """
        with self._lock:
            try:
                yield from self._stream(req, timeout, cancel_after_chunks, request_id)
            except GeneratorExit:  # the caller left before the final response
                if self._in_flight:
                    self.close(cancel=True)
                raise

    def _stream(self, req: TTSInput, timeout: float, cancel_after_chunks: int | None, request_id: str | None):
        inputs = req.to_inputs(self.check_inputs)
        self._ensure_stream()
        rid = request_id or uuid.uuid4().hex
        t0 = time.perf_counter()
        self.client.async_stream_infer(self.model, inputs, request_id=rid, enable_empty_final_response=True)
        self._in_flight = True
        if cancel_after_chunks == 0:
            self.close(cancel=True)
            return
        n = 0
        while True:
            try:
                arrived, result, error = self._q.get(timeout=timeout)
            except queue.Empty:
                self.close(cancel=True)  # the request is abandoned: cancel it on the server
                raise TTSError(f"no response within {timeout} s", "deadline_exceeded") from None
            t = time.perf_counter() - t0
            if error is not None:  # tritonclient reports an error response without its final flag: it ends the request
                self._in_flight = False
                msg = error.message() if hasattr(error, "message") else str(error)
                raise TTSError.from_message(msg)
            resp = result.get_response()
            final = resp.parameters.get("triton_final_response")
            is_final = bool(final and final.bool_param)
            audio = result.as_numpy("audio")
            stats = json_output(result, "stats")
            if audio is not None and audio.size:
                sr = int(result.as_numpy("sample_rate").reshape(-1)[0])
                yield AudioChunk(int(result.as_numpy("sequence").reshape(-1)[0]), audio.astype(np.float32), sr, t,
                                 result.as_numpy("codes"), json_output(result, "segment"), arrived - t0)
                n += 1
                if cancel_after_chunks is not None and n >= cancel_after_chunks:
                    self.close(cancel=True)
                    return
            if stats is not None:  # the request has ended: at most its final flag follows, which no cancel may race
                self._in_flight = False
                yield Final(stats, t)
            if is_final:
                self._in_flight = False
                return

    def synthesize(self, req: TTSInput, timeout: float = 300.0, request_id: str | None = None) -> Result:
        chunks, stats, sr, t_end = [], {}, 0, 0.0
        for ev in self.stream(req, timeout, request_id=request_id):
            if isinstance(ev, AudioChunk):
                chunks.append(ev)
                sr = ev.sample_rate
            else:
                stats, t_end = ev.stats, ev.t
        audio = np.concatenate([c.audio for c in chunks]) if chunks else np.zeros(0, np.float32)
        return Result(audio, sr, stats, chunks, chunks[0].t if chunks else None, t_end)

    def close(self, cancel: bool = False):
        """Close the stream; `cancel`: cancel the request on it if it has not ended (a cancel for a request that has
        ended is never sent: on Triton 24.10 one that races the end can leave the model unable to unload, and a
        server stop then waits its whole grace)."""
        if self._open:
            self.client.stop_stream(cancel_requests=cancel and self._in_flight)
            self._open = False
            self._in_flight = False
            self._q = queue.Queue()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.client.close()


def read_metrics(url: str, prefix: str = "s2tts_", instances: bool = False) -> dict[str, float]:
    """The server's metrics whose names start with `prefix`, from its Prometheus endpoint (e.g.
    http://127.0.0.1:8002/metrics), keyed 'name{labels}'. The series of a model's several instances (label
    `instance`: s2pro with `s2pro_instances` > 1) are folded into the model's, unless `instances`: summed, but for
    `s2tts_model_healthy`, the least (a model is healthy when all its instances are)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^({re.escape(prefix)}[a-z_]+)(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m:
            labels = m.group(2) or ""
            if not instances and "instance=" in labels:
                labels = re.sub(r'instance="[^"]*",?', "", labels).replace(",}", "}").replace("{}", "")
            key, value = m.group(1) + labels, float(m.group(3))
            if key not in out:
                out[key] = value
            else:
                out[key] = min(out[key], value) if m.group(1) == "s2tts_model_healthy" else out[key] + value
    return out
