"""The gateway's only link to the model: Triton's gRPC API (`s2pro` stream, `dac_encoder`, health)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from .. import errors
from ..client import TTSInput, json_output
from ..errors import S2Error
from ..settings import REQUEST_FIELDS, model_values
from .error_bodies import APIError
from .protocol import DEFAULT_LIMITS

log = logging.getLogger("s2tts.gateway")

@dataclass
class SynthesisRequest(TTSInput):
    """The s2pro inputs (one definition: s2tts.client.TTSInput) plus the gateway's id for the request."""

    request_id: str = ""


@dataclass
class Chunk:
    audio: np.ndarray
    sample_rate: int  # s2pro's, on every response (the model's rate: the gateway restates none)
    stats: dict | None = None  # on the final response
    final: bool = False
    segment: dict | None = None  # where an audio chunk is: {segment, text, frame, frames} (s2pro's `segment`)


# s2pro input -> the field of POST /v1/audio/speech that carries it
HTTP_FIELD = {f.name: f.http for f in REQUEST_FIELDS.values()}


def http_error(err: S2Error, what: str) -> APIError:
    """A model's error as the gateway answers it: the status from its class (s2tts.errors.HTTP_STATUS), never from
    the words of its message; the input it names renamed to the HTTP field the caller sent."""
    status = err.http_status if err.http_status != 499 else 400
    param = HTTP_FIELD.get(err.param, err.param) if err.param and err.param != errors.SHUTDOWN else None
    message = err.message
    if err.param and param and param != err.param:
        message = re.sub(rf"\b{re.escape(err.param)}\b", param, message)
    if status >= 500 and what not in message:
        message = f"{what}: {message}"
    headers = {"Retry-After": "1" if err.code == "unavailable" else "5"} if err.retryable else None
    return APIError(status, message, param=param, code=err.code, headers=headers)


def _unreachable(url: str, err: Exception) -> APIError:
    return APIError(502, f"the inference server at {url} is unreachable ({_short(err)}); retry later",
                    code="upstream_unreachable", type="server_error", headers={"Retry-After": "5"})


def _short(err: Exception) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    if isinstance(err, InferenceServerException):
        return f"{err.status() or ''} {err.message()}".strip()
    return str(err)


def _rpc_error(url: str, err: Exception, what: str) -> APIError:
    """A failed gRPC call: a model's tagged error keeps its class; a connection that failed is 502."""
    code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
    status = str(err.status()) if isinstance(err, InferenceServerException) else ""
    msg = (err.details() if code else err.message() if isinstance(err, InferenceServerException) else str(err)) or ""
    if errors.is_tagged(msg):
        return http_error(errors.parse(msg), what)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or "UNAVAILABLE" in status \
            or "DEADLINE_EXCEEDED" in status:
        return _unreachable(url, err)
    parsed = errors.parse(msg, "INVALID_ARG" if (code == grpc.StatusCode.INVALID_ARGUMENT or "INVALID_ARG" in status)
                          else None)
    if parsed.code == "internal":
        return APIError(502, f"{what} failed on the inference server: {_short(err)}", code="upstream_error")
    return http_error(parsed, what)


class SpeechStream:
    """One `s2pro` request streamed over gRPC `ModelStreamInfer`.

    `cancel()` cancels the gRPC call: Triton then marks the request cancelled and
    the model's loop (which polls `is_cancelled()`) frees its engine slot.
    """

    def __init__(self, url: str, request_id: str, idle_s: float):
        self.url = url
        self.request_id = request_id
        self.idle_s = idle_s  # the longest wait for the next response
        self._call = None
        self._done = asyncio.Event()  # set: the request iterator ends and the stream half-closes
        self._finished = False  # the final response (or an error) arrived: nothing left to cancel
        self._got_audio = False

    async def next(self) -> Chunk | None:
        """The next chunk; None after the final one. Raises APIError."""
        if self._finished:
            return None
        try:
            result, error = await asyncio.wait_for(self._call.__anext__(), self.idle_s)
        except asyncio.TimeoutError:
            self._finished = True
            self._call.cancel()
            raise APIError(504, f"s2pro sent nothing for {self.idle_s:g} s (the gateway's --triton-timeout): the "
                                "request was cancelled; retry, or raise --triton-timeout where requests may be silent "
                                "longer", code="upstream_timeout", type="server_error") from None
        except StopAsyncIteration:
            self._finished = True
            raise APIError(502, "the inference server closed the stream before the final response",
                           code="upstream_error") from None
        except (grpc.aio.AioRpcError, InferenceServerException) as e:
            self._finished = True
            raise _rpc_error(self.url, e, "s2pro") from None
        if error is not None:
            self._finished = True
            raise http_error(errors.parse(error.message()), "s2pro")
        resp = result.get_response()
        final = bool(resp.parameters["triton_final_response"].bool_param) if "triton_final_response" in resp.parameters else False
        names = {o.name for o in resp.outputs}
        audio = result.as_numpy("audio") if "audio" in names else None
        audio = np.zeros(0, np.float32) if audio is None else audio.reshape(-1).astype(np.float32, copy=False)
        sr = result.as_numpy("sample_rate") if "sample_rate" in names else None
        if sr is None or not sr.size:  # every answer of s2pro says it: the one place the gateway learns the rate
            self._finished = True
            raise APIError(502, "s2pro answered without its sample_rate output: the model repository does not match "
                           "this gateway; serve the repository of this version", code="upstream_error")
        sample_rate = int(sr.reshape(-1)[0])
        stats = None
        if "stats" in names:
            raw = result.as_numpy("stats")
            if raw is not None and raw.size:
                s = raw.reshape(-1)[0]
                s = s.decode() if isinstance(s, bytes) else str(s)
                if s:
                    try:
                        stats = json.loads(s)
                    except ValueError:
                        stats = {"raw": s}
        segment = json_output(result, "segment")
        if stats is not None:
            final = True
        if final:
            self._finished = True
            self._done.set()
        if audio.size:
            self._got_audio = True
        return Chunk(audio, sample_rate, stats, final, segment)

    def cancel(self) -> None:
        """Abandon the request unless it is complete: cancelling the gRPC call cancels the request in Triton."""
        if self._finished or self._call is None:
            self._done.set()  # complete: the request iterator ends and the stream half-closes normally
            return
        self._finished = True
        log.info("cancelling the s2pro stream of request %s", self.request_id)
        # No half-close first (as tritonclient's own stop_stream(cancel_requests=True)): the call's cancel also
        # stops the task that reads our request iterator.
        self._call.cancel()


class TritonBackend:
    DECODE_CHUNK_FRAMES = 256  # frames per dac_decoder call of `decode_codes` (its activations, not the whole take's)

    def __init__(self, url: str, model: str = "s2pro", encoder_model: str = "dac_encoder",
                 timeout_s: float | None = None, decoder_model: str = "dac_decoder"):
        """`timeout_s`: the longest wait for one answer of the server (a stream's next response, a codec call);
        None: s2pro's request_timeout_s (its deadline for each text segment) + 30 s."""
        self.url = url
        self.model = model
        self.encoder_model = encoder_model
        self.decoder_model = decoder_model
        self.timeout_s = timeout_s
        self._client: grpcclient.InferenceServerClient | None = None
        self._limits: tuple[float, dict] | None = None  # (when read, s2pro's limits)

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        if self._client is None:  # created lazily inside the running event loop
            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def health(self) -> dict:
        out = {"triton": False, "model": False}
        try:
            out["triton"] = bool(await asyncio.wait_for(self.client.is_server_ready(), 3.0))
            out["model"] = bool(await asyncio.wait_for(self.client.is_model_ready(self.model), 3.0))
        except Exception as e:  # noqa: BLE001
            out["error"] = _short(e)
        return out

    async def served_limits(self, ttl_s: float = 30.0) -> dict:
        """s2pro's request limits as served (its config.pbtxt parameters, read through Triton and checked by the one
        settings schema); the schema's defaults while the server cannot be asked."""
        now = time.monotonic()
        if self._limits is not None and now - self._limits[0] < ttl_s:
            return self._limits[1]
        try:
            cfg = await asyncio.wait_for(self.client.get_model_config(self.model, as_json=True), 3.0)
            v = model_values(cfg.get("config", cfg), "s2pro")
            limits = {k: v[k] for k in DEFAULT_LIMITS}
            self._limits = (now, limits)
            return limits
        except Exception as e:  # noqa: BLE001 - unreachable or not ready: check against the defaults meanwhile
            log.info("gateway: could not read %s's limits (%s); using the defaults", self.model, _short(e))
            return dict(DEFAULT_LIMITS)

    def answer_timeout_s(self) -> float:
        """How long to wait for one answer of the server (see __init__)."""
        if self.timeout_s is not None:
            return self.timeout_s
        limits = self._limits[1] if self._limits is not None else DEFAULT_LIMITS
        return limits["request_timeout_s"] + 30.0

    def open_stream(self, req: SynthesisRequest) -> SpeechStream:
        """The s2pro stream of `req`; no limit on its whole length, `answer_timeout_s` on each wait for its next
        response."""
        stream = SpeechStream(self.url, req.request_id, self.answer_timeout_s())
        done = stream._done
        item = {
            "model_name": self.model,
            # checked already: the HTTP fields by parse_speech (the same schema), the rest by s2pro, whose errors
            # map to HTTP statuses (a check here would turn one of those into a 500)
            "inputs": req.to_inputs(check=False),
            "request_id": req.request_id,
            "parameters": {"triton_enable_empty_final_response": True},
        }

        async def requests():
            yield item
            await done.wait()  # keep the stream open until the final response (or a cancel)

        try:
            stream._call = self.client.stream_infer(requests(), stream_timeout=None)
        except (grpc.aio.AioRpcError, InferenceServerException) as e:
            raise _rpc_error(self.url, e, "s2pro") from None
        return stream

    async def encode_reference(self, waveform: np.ndarray, sample_rate: int) -> np.ndarray:
        """`dac_encoder`: mono float32 waveform -> int32 codes [num_codebooks, frames]."""
        w = grpcclient.InferInput("waveform", [int(waveform.size)], "FP32")
        w.set_data_from_numpy(np.ascontiguousarray(waveform, np.float32).reshape(-1))
        s = grpcclient.InferInput("sample_rate", [1], "INT32")
        s.set_data_from_numpy(np.array([sample_rate], np.int32))
        try:
            res = await self.client.infer(self.encoder_model, [w, s],
                                          outputs=[grpcclient.InferRequestedOutput("codes")],
                                          client_timeout=self.answer_timeout_s())
        except (grpc.aio.AioRpcError, InferenceServerException) as e:
            raise _rpc_error(self.url, e, self.encoder_model) from None
        codes = res.as_numpy("codes")
        if codes is None or codes.ndim != 2:
            raise APIError(502, f"{self.encoder_model} returned no [num_codebooks, frames] codes", code="upstream_error")
        return codes.astype(np.int32)

    async def decode_codes(self, codes: np.ndarray, stream_id: str) -> np.ndarray:
        """`dac_decoder`: int32 codes [num_codebooks, frames] -> float32 audio (frames x the codec's hop). The codes go
        as one codec stream of `DECODE_CHUNK_FRAMES`-frame chunks (the decoder's state carries over: the audio is the
        whole take's); the model checks them (shape, range). A stream left open by a failed chunk is closed."""
        frames = codes.shape[1]
        parts, opened = [], False
        try:
            for at in range(0, frames, self.DECODE_CHUNK_FRAMES):
                piece = np.ascontiguousarray(codes[:, at: at + self.DECODE_CHUNK_FRAMES].T[None], np.int32)
                final = at + self.DECODE_CHUNK_FRAMES >= frames
                parts.append(await self._decode_chunk(piece, stream_id, not opened, final))
                opened = not final
        finally:
            if opened:  # a chunk failed after the stream was opened: end it (an empty final chunk)
                try:
                    await self._decode_chunk(np.zeros((1, 0, codes.shape[0]), np.int32), stream_id, False, True)
                except APIError:
                    pass
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    async def _decode_chunk(self, codes: np.ndarray, stream_id: str, start: bool, final: bool) -> np.ndarray:
        inputs = []
        for name, value, dtype in (("codes", codes, "INT32"), ("stream_id", np.array([[stream_id.encode()]], object),
                                   "BYTES"), ("start", np.array([[start]]), "BOOL"), ("final", np.array([[final]]), "BOOL")):
            t = grpcclient.InferInput(name, list(value.shape), dtype)
            t.set_data_from_numpy(value)
            inputs.append(t)
        try:
            res = await self.client.infer(self.decoder_model, inputs,
                                          outputs=[grpcclient.InferRequestedOutput("audio")],
                                          client_timeout=self.answer_timeout_s())
        except (grpc.aio.AioRpcError, InferenceServerException) as e:
            raise _rpc_error(self.url, e, self.decoder_model) from None
        audio = res.as_numpy("audio")
        if audio is None:
            raise APIError(502, f"{self.decoder_model} returned no audio", code="upstream_error")
        return audio.reshape(-1).astype(np.float32, copy=False)
