"""The OpenAI-compatible HTTP gateway: FastAPI routes in front of Triton's gRPC API.

It holds no model weights. Speech requests become one `s2pro` gRPC stream each;
voices are encoded once by `dac_encoder` and kept in SQLite.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import re
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

import anyio
import numpy as np
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..frontend.segment import combine_voices
from .alignment import Segment, Timeline
from .audio_io import decode_audio
from .encoders import MEDIA_TYPES, AudioPipeline
from .error_bodies import APIError, bad_request
from .fish import (
    FISH_PATHS,
    FishError,
    FishTTS,
    decode_body,
    fish_voice,
    fish_voice_id,
    page as fish_page,
    parse_fish_tts,
)
from .fish_server import (
    REFERENCE_PATHS,
    ReferenceError,
    add_routes as add_fish_server_routes,
)
from .http_metrics import HTTPMetrics, MetricsMiddleware
from .live import LiveConnection
from .options import GatewayConfig
from .protocol import (
    DEFAULT_LIMITS,
    DEFAULT_VOICES,
    OPENAI_VOICES,
    SpeechParams,
    load_json,
    parse_speech,
)
from .remote_audio import RemoteAudio
from .triton import SynthesisRequest, TritonBackend
from .voices import VoiceStore, open_store, validate_name

log = logging.getLogger("s2tts.gateway")


class Limiter:
    """Counts speech requests in flight; refuses (never queues) above the limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    def try_acquire(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        self.limit = limit


def _too_large(limit: int, upload_limit: int | None = None) -> APIError:
    msg = f"the request body is larger than {limit} bytes ({limit / 2**20:.1f} MiB)"
    if upload_limit is not None:
        msg += (f": audio files are limited to {upload_limit / 2**20:.1f} MiB (base64 in a JSON body takes a third "
                "more); send a shorter or smaller file")
    return APIError(413, msg, code="payload_too_large")


def _key_ok(headers, cfg: GatewayConfig) -> bool:
    """The request carries the gateway's API key (`Authorization: Bearer <key>`), or the gateway has none."""
    if not cfg.api_key:
        return True
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), cfg.api_key.encode())


WS_PROTOCOL = "s2tts"  # a browser's WebSocket cannot send headers: it offers [s2tts, s2tts.bearer.<base64url key>]


def _ws_key(headers, cfg: GatewayConfig) -> tuple[bool, str | None]:
    """A WebSocket's API key check -> (allowed, the subprotocol to accept). The key comes as the `Authorization`
    header (the SDKs), or, from a browser, as the offered subprotocol `s2tts.bearer.<the key in base64url>` (the
    way Kubernetes' API server takes a bearer token over WebSocket); the accepted subprotocol is then `s2tts`."""
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    chosen = WS_PROTOCOL if WS_PROTOCOL in offered else None
    if _key_ok(headers, cfg):
        return True, chosen
    bearer = WS_PROTOCOL + ".bearer."
    for p in offered:
        if p.startswith(bearer):
            b64 = p[len(bearer):]
            try:
                key = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).decode()
            except (ValueError, UnicodeDecodeError):
                return False, None
            return _key_ok({"authorization": f"Bearer {key}"}, cfg), chosen
    return False, None


def _shaped(scope, e: APIError) -> APIError:
    """An error in the form of the API its path belongs to: Fish Audio's (and fish-speech's) on their routes, OpenAI's
    elsewhere."""
    path = scope.get("path", "")
    if path.startswith(REFERENCE_PATHS):
        return ReferenceError.of(e, scope)
    return FishError.of(e) if path.startswith(FISH_PATHS) else e


class GuardMiddleware:
    """Pure ASGI (does not buffer streams): API key check and request body size limits."""

    def __init__(self, app, cfg: GatewayConfig):
        self.app = app
        self.cfg = cfg

    def _limit(self, scope) -> int:
        if scope["path"].rstrip("/") in ("/v1/audio/voices", "/model", "/v1/references/add"):
            return self.cfg.max_form_body_bytes
        return self.cfg.max_json_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope["path"] not in ("/health", "/metrics", "/"):  # the page asks for the key itself
            if not _key_ok(headers, self.cfg):
                err = APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await _shaped(scope, err).response()(scope, receive, send)
        limit = self._limit(scope)
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            length = 0
        if length > limit:
            return await _shaped(scope, _too_large(limit, self.cfg.max_upload_bytes)).response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return msg

        await self.app(scope, limited_receive, send)


def _stats_headers(stats: dict | None) -> dict[str, str]:
    out = {}
    for k, v in (stats or {}).items():
        if isinstance(v, (int, float, str)) and not isinstance(v, bool):
            out[f"x-s2-{k.replace('_', '-')}"] = str(v)
    return out


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SpeechResponse(Response):
    """Owns one speech request from the in-flight slot to the last byte.

    Everything that holds a resource (the limiter slot, the Triton stream) lives
    inside `__call__` under try/finally, and a task watching for
    `http.disconnect` cancels the work, so a client that goes away cancels its
    Triton stream whether it leaves before the first byte or mid-stream.
    """

    def __init__(self, state: "GatewayState", params: SpeechParams, req: SynthesisRequest,
                 error_shape: Callable[[APIError], APIError] = lambda e: e):
        """`error_shape`: the route's form of an error (OpenAI's by default; Fish's on /v1/tts)."""
        super().__init__()
        self.state = state
        self.params = params
        self.req = req
        self.error_shape = error_shape

    async def __call__(self, scope, receive, send):
        state, p = self.state, self.params
        if not state.limiter.try_acquire():
            state.metrics.overload_refusals += 1
            err = APIError(503, f"the server is busy: {state.limiter.limit} requests are in flight; "
                                f"retry after {state.cfg.retry_after_s} s",
                           code="server_overloaded", headers={"Retry-After": str(state.cfg.retry_after_s)})
            return await self.error_shape(err).response()(scope, receive, send)
        self._stream = None
        self._started = False  # response headers sent
        self._completed = False  # last byte handed to the server: a disconnect after it is the normal end
        self._outcome = "cancelled"
        t0 = time.monotonic()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
                await self._serve(scope, receive, send)
                tg.cancel_scope.cancel()
        except Exception:
            if self._started:
                log.exception("speech request %s failed mid-stream: cutting the connection", self.req.request_id)
                raise
            log.exception("speech request %s failed", self.req.request_id)
            self._outcome = "error 500"
            try:
                await self.error_shape(APIError(500, "internal error in the gateway", code="internal_error")).response()(
                    scope, receive, send)
            except Exception:  # noqa: BLE001 - the client may be gone too
                pass
        finally:
            if self._stream is not None:
                self._stream.cancel()  # no-op after the final response
            state.limiter.release()
            log.info("speech %s voice=%s format=%s stream=%s: %s in %.2f s", self.req.request_id,
                     p.voice or ("inline" if p.ref_audio else "default"), p.response_format, p.stream_format,
                     self._outcome, time.monotonic() - t0)

    async def _watch_disconnect(self, receive, cancel_scope) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not self._completed:
                    log.info("client disconnected: request %s", self.req.request_id)
                cancel_scope.cancel()
                return

    async def _send_error(self, e: APIError, scope, receive, send) -> None:
        self._outcome = f"error {e.status}"
        self._completed = True
        await self.error_shape(e).response()(scope, receive, send)

    async def _start(self, send, headers: dict[str, str]) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
        self._started = True

    async def _serve(self, scope, receive, send) -> None:
        p = self.params
        try:
            self._stream = self.state.backend.open_stream(self.req)
            first = await self._stream.next()
        except APIError as e:  # refused before any audio: a normal HTTP error
            return await self._send_error(e, scope, receive, send)
        pipeline = AudioPipeline(p.response_format, first.sample_rate, p.speed, p.stream_format is not None,
                                 p.gain, p.bit_rate, p.sample_rate)
        headers = {"x-request-id": self.req.request_id, "x-s2-seed": str(self.req.seed),
                   "x-s2-sample-rate": str(pipeline.encoder.output_sample_rate)}
        if p.stream_format is None:
            last = await self._send_whole(first, pipeline, headers, scope, receive, send)
        else:
            last = await self._send_streamed(first, pipeline, headers, send)
        if last is not None:
            s = last.stats or {}
            self._outcome = (f"ok frames={s.get('frames')} finish={s.get('finish_reason')} "
                             f"samples={pipeline.samples_out}")

    async def _chunks(self, first):
        """The chunks of the request, from the first one to the final one (APIError on a failure)."""
        chunk = first
        while True:
            yield chunk
            if chunk.final:
                return
            chunk = await self._stream.next()

    async def _send_whole(self, first, pipeline, headers, scope, receive, send):
        parts = []
        try:
            async for chunk in self._chunks(first):
                parts.append(await anyio.to_thread.run_sync(pipeline.push, chunk.audio))
                last = chunk
        except APIError as e:
            return await self._send_error(e, scope, receive, send)
        parts.append(await anyio.to_thread.run_sync(pipeline.finish))
        body = b"".join(parts)
        headers.update(_stats_headers(last.stats))
        headers["content-type"] = MEDIA_TYPES[self.params.response_format]
        headers["content-length"] = str(len(body))
        await self._start(send, headers)
        self._completed = True
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return last

    async def _send_streamed(self, first, pipeline, headers, send):
        sse = self.params.stream_format == "sse"
        headers["content-type"] = "text/event-stream" if sse else MEDIA_TYPES[self.params.response_format]
        headers["cache-control"] = "no-cache"
        await self._start(send, headers)

        async def emit(data: bytes, ended: Segment | None = None):
            if data:
                if sse:
                    data = _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if ended is not None:  # after the audio that ends it
                await send({"type": "http.response.body", "more_body": True,
                            "body": _sse({"type": "speech.audio.segment", **ended.public()})})

        timeline = Timeline(self.req.text, first.sample_rate, self.params.speed) \
            if self.params.timestamps else None
        try:
            async for chunk in self._chunks(first):
                ended = timeline.push(chunk.audio, chunk.segment) if timeline else None
                await emit(await anyio.to_thread.run_sync(pipeline.push, chunk.audio), ended)
                last = chunk
            await emit(await anyio.to_thread.run_sync(pipeline.finish), timeline.finish() if timeline else None)
        except APIError as e:
            if not sse:
                raise  # raw audio has no way to say it: the connection is cut and the client sees it
            self._outcome = f"error {e.status} mid-stream"
            self._completed = True
            await send({"type": "http.response.body", "body": _sse({"type": "error", **e.body()}), "more_body": False})
            return None
        tail = b""
        if sse:
            stats = last.stats or {}
            inp, out = int(stats.get("prompt_tokens", 0)), int(stats.get("frames", 0))
            tail = _sse({"type": "speech.audio.done",
                         "usage": {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out},
                         "stats": stats})
        self._completed = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return last


class GatewayState:
    def __init__(self, cfg: GatewayConfig, backend: TritonBackend, store: VoiceStore, remote: RemoteAudio):
        self.cfg = cfg
        self.backend = backend
        self.store = store
        self.remote = remote  # ref_audio given as a URL
        self.limiter = Limiter(cfg.max_in_flight or DEFAULT_LIMITS["max_concurrent_requests"])
        self.metrics = HTTPMetrics()
        self.metrics.in_flight = lambda: self.limiter.in_flight
        self.started_at = int(time.time())

    def check_upload_size(self, data: bytes, param: str) -> None:
        """An audio file (an upload, an inline or fetched reference) within --max-upload-mb."""
        if len(data) > self.cfg.max_upload_bytes:
            raise APIError(413, f"{param} is {len(data) / 2**20:.1f} MiB; audio files are limited to "
                                f"{self.cfg.max_upload_bytes / 2**20:.1f} MiB: send a shorter or smaller file",
                           param=param, code="payload_too_large")


def _check_reference_length(x: np.ndarray, sr: int, cfg: GatewayConfig, param: str, limits: dict) -> None:
    """A reference clip's length against the limits in force: s2pro's (`limits`, as served), each made stricter by
    this gateway's own setting where one is set (`GatewayConfig.limits`). (A clip decoded up to the longest
    allowed, `decode_audio(max_seconds=)`, is just over it when it is longer.)"""
    limits = cfg.limits(limits)
    dur = len(x) / sr
    limit = limits["max_reference_seconds"]
    if dur > limit:
        raise bad_request(f"the reference audio is too long; the limit is {limit:g} s: trim it (5-15 s of clean "
                          "speech is best)", param, code="reference_too_long")
    if dur < limits["min_reference_seconds"]:
        raise bad_request(f"the reference audio is {dur:.2f} s long; send at least {limits['min_reference_seconds']:g} s",
                          param, code="reference_too_short")


def _check_transcript(ref_text: str, param: str, limits: dict) -> None:
    """A voice's transcript within s2pro's max_text_chars (s2pro would refuse every request that uses the voice)."""
    if len(ref_text) > limits["max_text_chars"]:
        raise bad_request(f"{param} has {len(ref_text)} characters; the limit is {limits['max_text_chars']}: "
                          "send the transcript of the clip alone", param, code="invalid_value")


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _request_id(request: Request) -> str:
    """The caller's X-Request-Id when it is a plain token, else a new one: it names the request in every log line of
    the gateway and of every model that serves it."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else f"speech-{uuid.uuid4().hex[:16]}"


def create_app(cfg: GatewayConfig, backend: TritonBackend | None = None, store: VoiceStore | None = None) -> FastAPI:
    backend = backend or TritonBackend(cfg.triton_url, cfg.triton_model, cfg.encoder_model, cfg.triton_timeout_s,
                                       cfg.decoder_model)
    remote = RemoteAudio(cfg)  # first: a setting it cannot use stops the start before the store is opened
    store = store or open_store(cfg.db_path)
    state = GatewayState(cfg, backend, store, remote)

    @asynccontextmanager
    async def lifespan(app):
        log.info("gateway: Triton at %s (model %s), voices in %s, max %s in flight, API key %s",
                 cfg.triton_url, cfg.triton_model, cfg.db_path, cfg.max_in_flight or f"{cfg.triton_model}'s",
                 "on" if cfg.api_key else "off")
        yield
        await backend.close()
        store.close()

    app = FastAPI(title="S2 Pro TTS gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = state
    app.add_middleware(GuardMiddleware, cfg=cfg)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)  # added last: the outermost, counts refusals too

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _shaped(request.scope, exc).response()

    @app.exception_handler(BodyTooLarge)
    async def _body_too_large(request, exc: BodyTooLarge):
        return _shaped(request.scope, _too_large(exc.limit, cfg.max_upload_bytes)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        msg = {404: f"unknown endpoint {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return _shaped(request.scope, APIError(exc.status_code, msg, code="not_found" if exc.status_code == 404
                                               else None)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        e = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in e.get("loc", []) if x not in ("body", "query", "path")]
        return _shaped(request.scope, bad_request(f"{'.'.join(loc) or 'request'}: {e.get('msg', 'invalid')}",
                                                  ".".join(loc) or None)).response()

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _shaped(request.scope, APIError(500, "internal error in the gateway", code="internal_error")).response()

    # ---- health and models -------------------------------------------------------------------
    page = (Path(__file__).with_name("page.html")).read_bytes()

    @app.get("/")
    async def web_page():
        """A page to hear it: text, voice, sampling; audio plays as it streams (no build step, no CDN)."""
        return Response(page, media_type="text/html; charset=utf-8", headers={"cache-control": "no-cache"})

    @app.get("/metrics")
    async def metrics():
        """The gateway's Prometheus metrics (s2tts/gateway/http_metrics.py); the models' are on Triton's metrics port."""
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health():
        h = await backend.health()
        ready = h["triton"] and h["model"]
        body = {"status": "ok" if ready else "unavailable", "triton_ready": h["triton"], "model_ready": h["model"],
                "model": cfg.triton_model, "in_flight": state.limiter.in_flight,
                "max_in_flight": state.limiter.limit}
        if not ready:
            body["error"] = h.get("error") or f"Triton is up but {cfg.triton_model} is not ready"
        return JSONResponse(body, status_code=200 if ready else 503)

    def _model_card():
        return {"id": cfg.served_model_name, "object": "model", "created": state.started_at, "owned_by": "s2tts",
                "root": cfg.triton_model}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in cfg.model_names:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return _model_card()

    # ---- speech ------------------------------------------------------------------------------
    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise APIError(415, f"the request body must be JSON, sent with Content-Type: application/json (got "
                                f"{ctype or 'no Content-Type'})", code="unsupported_media")
        body = load_json(await request.body())
        limits = await _served_limits()
        p = parse_speech(body, cfg, limits)
        req = _synthesis(p.input, _request_id(request), p.fields)
        names = [] if p.voice is None else p.voice if isinstance(p.voice, list) else [p.voice]
        inline = [] if p.ref_audio is None else list(zip(p.ref_audio, p.ref_text)) if isinstance(p.ref_audio, list) \
            else [(p.ref_audio, p.ref_text)]
        clips = []  # a data URL, or a URL fetched or a file read where the operator allows (remote_audio.py)
        for i, (value, text) in enumerate(inline):
            what = f"ref_audio[{i}]" if isinstance(p.ref_audio, list) else "ref_audio"
            clips.append((await state.remote.read(value, what), text, what))
        await _reference(req, names, "voice", clips, "ref_audio", limits)
        return SpeechResponse(state, p, req)

    async def _served_limits() -> dict:
        """s2pro's limits as served (cached `limits_ttl_s`); its admission limit is the gateway's too, unless set."""
        limits = await backend.served_limits(cfg.limits_ttl_s)
        state.limiter.limit = cfg.max_in_flight or limits["max_concurrent_requests"]
        return limits

    def _synthesis(text: str, request_id: str, fields: dict, **extra) -> SynthesisRequest:
        """s2pro's request: the text, the numeric fields given, and a seed always (it is reported)."""
        return SynthesisRequest(text=text, request_id=request_id, **{"seed": secrets.randbelow(2**63), **fields},
                                **extra)

    async def _reference(req: SynthesisRequest, names: list[str], names_param: str,
                         clips: list[tuple[bytes, str, str]], clips_param: str, limits: dict) -> None:
        """The request's voice: registered voices by name, or inline clips (file bytes, transcript, name): one clip
        goes to s2pro as it is (s2pro encodes it), several are encoded here, one voice per speaker."""
        if names:
            await _registered_voices(req, names, names_param)
        elif len(clips) > 1:
            await _inline_voices(req, clips, clips_param, limits)
        elif clips:
            (data, text, what), = clips
            x, sr = await _inline_clip(data, what, clips_param, limits)
            req.reference_audio, req.reference_sample_rate, req.reference_text = x, sr, text

    async def _registered_voices(req: SynthesisRequest, names: list[str], param: str) -> None:
        """Registered voices as the request's reference: one, or one per speaker in upstream's format. On the OpenAI
        route a name of OpenAI's built-in voices that is not registered speaks with `openai_voice`."""
        found = []
        for name in names:
            voice = await anyio.to_thread.run_sync(store.get, name)
            mapped = cfg.openai_voice if voice is None and param == "voice" and name.lower() in OPENAI_VOICES else None
            if mapped is not None and mapped.lower() in DEFAULT_VOICES:
                if len(names) == 1:
                    return  # no reference voice
                raise bad_request(f"{name!r} is one of OpenAI's voices, which speak with no reference voice here "
                                  "(--openai-voice default): a list of voices holds registered names only", param)
            if mapped is not None:
                voice = await anyio.to_thread.run_sync(store.get, mapped)
                if voice is None:
                    raise APIError(404, f"voice {name!r} (one of OpenAI's voices) speaks with the voice {mapped!r} "
                                        "(the gateway's --openai-voice), which is not registered: register it with "
                                        "POST /v1/audio/voices", param=param, code="voice_not_found")
            if voice is None:
                raise APIError(404, f"voice {name!r} not found. S2 Pro has no built-in voices: register one with "
                                    "POST /v1/audio/voices (GET /v1/audio/voices lists them), or leave it out / "
                                    "set it to \"default\" for no reference voice", param=param,
                               code="voice_not_found")
            found.append(voice)
        if len(found) == 1:
            req.reference_codes, req.reference_text = found[0].codes, found[0].ref_text
        else:  # one voice per speaker, in upstream's format
            req.reference_text, req.reference_codes = combine_voices([(v.ref_text, v.codes) for v in found])

    async def _inline_voices(req: SynthesisRequest, clips: list[tuple[bytes, str, str]], param: str,
                             limits: dict) -> None:
        """Clips (file bytes, transcript, name) as one voice per speaker: each encoded here (dac_encoder), combined as
        registered voices are."""
        voices = []
        for data, text, what in clips:
            x, sr = await _inline_clip(data, what, param, limits)
            voices.append((text, await backend.encode_reference(x, sr)))
        req.reference_text, req.reference_codes = combine_voices(voices)

    async def _inline_clip(data: bytes, what: str, param: str, limits: dict):
        state.check_upload_size(data, what)
        return await _decoded_clip(data, param, limits)

    async def _decoded_clip(data: bytes, param: str, limits: dict):
        """A reference clip's audio, decoded (no further than the longest allowed) and its length checked."""
        longest = cfg.limits(limits)["max_reference_seconds"]  # (`_check_reference_length`'s limit)
        x, sr = await anyio.to_thread.run_sync(decode_audio, data, param, longest)
        _check_reference_length(x, sr, cfg, param, limits)
        return x, sr

    # ---- Fish Audio's API (its official SDK; s2tts/gateway/fish.py) ---------------------------
    async def _fish_reference(req: SynthesisRequest, f, limits: dict) -> None:
        clips = [(a, t, f"references[{i}]") for i, (a, t) in enumerate(f.references)]
        await _reference(req, f.reference_id, "reference_id", clips, "references", limits)

    @app.post("/v1/tts")
    async def fish_tts(request: Request):
        body = decode_body(await request.body(), request.headers.get("content-type", ""))
        limits = await _served_limits()
        f = parse_fish_tts(body, request.headers.get("model"), cfg, limits)
        p = SpeechParams(input=f.text, model=cfg.served_model_name, voice=f.reference_id or None,
                         response_format=f.format, speed=f.speed, stream_format="audio" if f.stream else None,
                         fields=f.fields, gain=f.gain, bit_rate=f.bit_rate, sample_rate=f.sample_rate)
        req = _synthesis(f.text, _request_id(request), f.fields)
        await _fish_reference(req, f, limits)
        return SpeechResponse(state, p, req, error_shape=FishError.of)

    # ---- voices ------------------------------------------------------------------------------
    @app.post("/v1/audio/voices")
    async def create_voice(request: Request):
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise bad_request("send multipart/form-data with the fields name, audio_sample (the file) and ref_text "
                              "(its transcript)", None, code="invalid_content_type")
        async with request.form(max_files=4, max_fields=32) as form:
            name = form.get("name")
            if isinstance(name, UploadFile):
                raise bad_request("name must be a text field", "name")
            name = validate_name(name)
            ref_text = next((form.get(k) for k in ("ref_text", "transcript", "text") if form.get(k) is not None), None)
            if not isinstance(ref_text, str) or not ref_text.strip():
                raise bad_request("ref_text is required: the transcript of the uploaded audio", "ref_text",
                                  code="missing_ref_text")
            upload = next((form.get(k) for k in ("audio_sample", "audio", "file") if form.get(k) is not None), None)
            if not isinstance(upload, UploadFile):
                raise bad_request("the audio file is required as the multipart file field audio_sample",
                                  "audio_sample", code="missing_audio")
            consent = form.get("consent")
            consent = consent if isinstance(consent, str) else None
            data = await upload.read()
            mime = upload.content_type or "application/octet-stream"
        state.check_upload_size(data, "audio_sample")
        if not data:
            raise bad_request("the uploaded audio file is empty", "audio_sample", code="missing_audio")
        if await anyio.to_thread.run_sync(store.get, name, False) is not None:
            raise APIError(409, f"a voice named {name!r} already exists: delete it first "
                                f"(DELETE /v1/audio/voices/{name}) or choose another name", param="name",
                           code="voice_exists")
        return (await _register(name, ref_text, data, mime, "audio_sample", consent=consent)).public()

    async def _encode_clip(ref_text: str, data: bytes, param: str, text_param: str):
        """A voice's clip and transcript checked (size, transcript length, the audio, its length) and encoded once
        (dac_encoder) -> (sample rate, samples, codes)."""
        state.check_upload_size(data, param)
        limits = await backend.served_limits(cfg.limits_ttl_s)
        _check_transcript(ref_text, text_param, limits)
        x, sr = await _decoded_clip(data, param, limits)
        return sr, len(x), await backend.encode_reference(x, sr)

    async def _register(name: str, ref_text: str, data: bytes, mime: str, param: str, text_param: str = "ref_text",
                        consent: str | None = None, title: str | None = None, description: str = ""):
        """A clip and its transcript encoded once (dac_encoder) and stored as the voice `name`."""
        sr, n, codes = await _encode_clip(ref_text, data, param, text_param)
        voice = await anyio.to_thread.run_sync(
            lambda: store.add(name, ref_text.strip(), data, mime, sr, n, codes, consent, title, description))
        log.info("voice %r registered: %.2f s at %d Hz -> codes %s", name, n / sr, sr, list(codes.shape))
        return voice

    @app.get("/v1/audio/voices")
    async def list_voices():
        voices = [v.public() for v in await anyio.to_thread.run_sync(store.list)]
        return {"object": "list", "data": voices, "uploaded_voices": voices}

    def _voice_or_404(name: str):
        validate_name(name, "voice_id")
        return name

    def _no_voice(name: str) -> APIError:
        return APIError(404, f"voice {name!r} not found", param="voice_id", code="voice_not_found")

    @app.get("/v1/audio/voices/{name}")
    async def get_voice(name: str):
        v = await anyio.to_thread.run_sync(store.get, _voice_or_404(name), False)
        if v is None:
            raise _no_voice(name)
        return v.public()

    @app.get("/v1/audio/voices/{name}/audio")
    async def get_voice_audio(name: str):
        got = await anyio.to_thread.run_sync(store.get_audio, _voice_or_404(name))
        if got is None:
            raise _no_voice(name)
        return Response(got[0], media_type=got[1])

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str):
        if not await anyio.to_thread.run_sync(store.delete, _voice_or_404(name)):
            raise _no_voice(name)
        log.info("voice %r deleted", name)
        return {"id": name, "object": "audio.voice.deleted", "deleted": True}

    # ---- Fish Audio's live session: text in as it is written, audio out as it is made (live.py) ----
    async def _live_request(body: dict, model: str | None, sid: str) -> tuple[FishTTS, SynthesisRequest]:
        """A live session's start request, checked, with its voice: s2pro's request that opens the session."""
        limits = await _served_limits()
        f = parse_fish_tts(body, model, cfg, limits, live=True)
        req = _synthesis(f.text, sid, f.fields, session_id=sid, text_event="open")
        await _fish_reference(req, f, limits)  # one clip as on /v1/tts: s2pro encodes it, untagged
        return f, req

    async def _live(ws: WebSocket, timestamps: bool) -> None:
        allowed, subprotocol = _ws_key(ws.headers, cfg)
        if not allowed:
            await ws.close(code=1008, reason="missing or invalid API key: send 'Authorization: Bearer <key>'")
            return
        await ws.accept(subprotocol=subprotocol)
        await LiveConnection(ws, cfg, state, backend, _live_request, timestamps).run()

    @app.websocket("/v1/tts/live")
    async def fish_live(ws: WebSocket):
        """Fish Audio's live session (s2tts/gateway/live.py)."""
        await _live(ws, timestamps=False)

    @app.websocket("/v1/tts/live/with-timestamp")
    async def fish_live_timed(ws: WebSocket):
        """/v1/tts/live whose audio events also say where they are, as Fish's service does: `content` (the text
        segment the audio speaks), `alignment` {segments: [{text, start, end}], audio_duration} (times from the
        segment's start, the snapshot so far: a later event for the same `chunk_seq` replaces it),
        `chunk_seq` (the segment's number), `chunk_audio_offset_sec` (where the segment starts in the audio),
        `time` (ms since the session started). One entry per text segment: s2tts/gateway/alignment.py."""
        await _live(ws, timestamps=True)

    # ---- Fish Audio's voices: the same store (s2tts/gateway/fish.py) ----------------------------
    async def _fish_voice_form(request: Request, create: bool) -> dict:
        """POST /model's and PATCH /model/{id}'s form: title, description, and the clip (`voices`) with its transcript
        (`texts`): one of each (POST: both required; PATCH: `texts` alone replaces the transcript). The SDK's other
        fields (visibility, tags, cover_image, train_mode, enhance_audio_quality) are taken with no effect."""
        ctype = request.headers.get("content-type", "")
        forms = ("multipart/form-data",) if create else ("multipart/form-data", "application/x-www-form-urlencoded")
        if not ctype.startswith(forms):
            raise bad_request(f"send {' or '.join(forms)}: title, voices (the clip) and texts (its transcript)", None,
                              code="invalid_content_type")
        async with request.form(max_files=4, max_fields=64) as form:
            clips = [f for f in form.getlist("voices") if isinstance(f, UploadFile)]
            texts = [t for t in form.getlist("texts") if isinstance(t, str) and t.strip()]
            out = {k: form.get(k) for k in ("title", "description")}
            kind = form.get("type")
            if len(clips) > 1 or (create and not clips):
                raise bad_request(f"send one clip in voices (got {len(clips)}): 5-15 s of one person speaking; several "
                                  "samples for one voice are not supported here", "voices")
            if len(texts) > 1 or ((create or clips) and not texts):
                raise bad_request("texts must hold the transcript of the clip: this server does no speech "
                                  "recognition, and S2 Pro clones from the clip and its words", "texts")
            if kind not in (None, "tts"):
                raise bad_request(f"type={kind!r}: this server makes tts voices only", "type")
            for k, v in out.items():
                if v is not None and not isinstance(v, str):
                    raise bad_request(f"{k} must be a text field", k)
            if out["title"] is not None and not out["title"].strip():
                raise bad_request("title must not be empty: the voice's name", "title")
            out["text"] = texts[0] if texts else None
            out["clip"] = (await clips[0].read(), clips[0].content_type or "application/octet-stream") if clips else None
        return out

    @app.post("/model")
    async def fish_create_voice(request: Request):
        f = await _fish_voice_form(request, create=True)
        name = await anyio.to_thread.run_sync(lambda: fish_voice_id(f["title"],
                                                                    lambda n: store.get(n, False) is not None))
        return fish_voice(await _register(name, f["text"], *f["clip"], "voices", "texts", title=f["title"].strip(),
                                          description=f["description"] or ""))

    @app.get("/model")
    async def fish_list_voices(request: Request):
        title = request.query_params.get("title")
        voices = [fish_voice(v) for v in await anyio.to_thread.run_sync(store.list)
                  if not title or title.lower() in (v.title or v.name).lower()]
        return fish_page(voices, request.query_params)

    @app.get("/model/{voice_id}")
    async def fish_get_voice(voice_id: str):
        v = await anyio.to_thread.run_sync(store.get, _voice_or_404(voice_id), False)
        if v is None:
            raise _no_voice(voice_id)
        return fish_voice(v)

    @app.patch("/model/{voice_id}")
    async def fish_update_voice(voice_id: str, request: Request):
        """The SDK's `voices.update`: title and description; also the transcript (`texts`) or the clip with its
        transcript (`voices` + `texts`: encoded again). The id stays."""
        name = _voice_or_404(voice_id)
        f = await _fish_voice_form(request, create=False)
        if await anyio.to_thread.run_sync(store.get, name, False) is None:
            raise _no_voice(voice_id)
        clip = None
        if f["clip"] is not None:
            sr, n, codes = await _encode_clip(f["text"], f["clip"][0], "voices", "texts")
            clip = (*f["clip"], sr, n, codes)
        elif f["text"] is not None:
            _check_transcript(f["text"], "texts", await backend.served_limits(cfg.limits_ttl_s))
        title = f["title"].strip() if f["title"] is not None else None
        if not await anyio.to_thread.run_sync(lambda: store.update(
                name, title=title, description=f["description"], clip=clip,
                ref_text=f["text"].strip() if f["text"] is not None else None)):
            raise _no_voice(voice_id)
        log.info("voice %r updated%s", name, " (a new clip)" if clip else "")
        return fish_voice(await anyio.to_thread.run_sync(store.get, name, False))

    @app.delete("/model/{voice_id}")
    async def fish_delete_voice(voice_id: str):
        if not await anyio.to_thread.run_sync(store.delete, _voice_or_404(voice_id)):
            raise _no_voice(voice_id)
        log.info("voice %r deleted", voice_id)
        return Response(status_code=200)

    # ---- fish-speech's own server API (s2tts/gateway/fish_server.py) --------------------------------------------
    add_fish_server_routes(app, state, _register, _served_limits, _decoded_clip)

    return app
