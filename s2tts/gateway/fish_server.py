"""fish-speech's own server API (its `tools/api_server.py`, what `tools/api_client.py` and the scripts written for it
call) on the gateway, beside its `/v1/tts` (fish.py), over the gateway's voices and Triton models:

| route | here |
|---|---|
| `GET` / `POST /v1/health` | `{"status": "ok"}` when Triton and s2pro are ready; else 503 `{"status": "unavailable", "error"}` |
| `POST /v1/references/add` | form (or msgpack / JSON) `id`, `audio` (the file), `text` (its transcript): a voice of the gateway's store, so also a `reference_id` on `/v1/tts`, a `voice` on `/v1/audio/speech`, a `/model` voice |
| `GET /v1/references/list` | `{success, reference_ids, message}`: every voice's id, sorted |
| `DELETE /v1/references/delete` | body `{reference_id}` |
| `POST /v1/references/update` | body `{old_reference_id, new_reference_id}`: the voice renamed, as fish-speech renames a reference |
| `POST /v1/vqgan/encode` | msgpack (or JSON, base64) `{audios: [file bytes]}` -> msgpack `{tokens: [[codebook][frame]]}`: each file's codes from `dac_encoder`, checked as a reference clip is (`--max-upload-mb`, the reference length limits) |
| `POST /v1/vqgan/decode` | msgpack / JSON `{tokens: [...]}` -> msgpack `{audios: [float16 PCM bytes]}` at the codec's rate (44.1 kHz for S2 Pro; frames x 2048 samples), from `dac_decoder`; at most `--max-decode-frames` frames a call; out-of-range codes are refused (the codec would clamp them) |

Ids are voice names here: 1-64 letters, digits, `_`, `-`, `.` (fish-speech allows spaces and 255 characters; a name
with a space is refused with the rule). At most `MAX_ITEMS` files or token arrays per vqgan call.

Answers and errors as fish-speech's server sends them: the reference routes answer msgpack unless the client asks for
JSON (`?format=json`, or `Accept: application/json` without msgpack), errors as the route's own answer with
`success: false` and the status (400, 404, 409, 413, 415, 5xx); the vqgan and health routes' errors in the shape of
fish.FishError (fish-speech's `{statusCode, message, error}` with Fish Audio's keys).
"""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Awaitable, Callable
from urllib.parse import parse_qs

import anyio
import numpy as np
import ormsgpack
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from .error_bodies import APIError, bad_request
from .fish import decode_body
from .voices import validate_name

MAX_ITEMS = 8  # files (encode) or token arrays (decode) in one vqgan call
REFERENCE_PATHS = "/v1/references/"
# what each reference route's answer holds besides success and message (its error answers too, empty)
_IDS = {"add": {"reference_id": ""}, "delete": {"reference_id": ""}, "list": {"reference_ids": []},
        "update": {"old_reference_id": "", "new_reference_id": ""}}

# (name, transcript, file bytes, its media type, the form field of the file, of the transcript) -> the stored voice
Register = Callable[..., Awaitable[object]]


def wants_json(scope) -> bool:
    """fish-speech's choice of answer: JSON when `?format=json` (or application/json), or when `Accept` names JSON and
    not msgpack; msgpack otherwise."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("format", [""])[0].strip().lower()
    if query in ("json", "application/json", "msgpack", "application/msgpack"):
        return query in ("json", "application/json")
    accept = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"accept"), "").lower()
    return "application/json" in accept and "application/msgpack" not in accept


def answer(scope, body: dict, status: int = 200) -> Response:
    if wants_json(scope):
        return JSONResponse(body, status_code=status)
    return Response(ormsgpack.packb(body), status_code=status, media_type="application/msgpack")


class ReferenceError(APIError):
    """An error of /v1/references/*: the route's answer with `success: false`, in msgpack or JSON as the client asks."""

    def __init__(self, e: APIError, scope, ids: dict | None = None):
        super().__init__(e.status, e.message, param=e.param, code=e.code, headers=e.headers)
        self.scope = scope
        route = scope.get("path", "")[len(REFERENCE_PATHS):].strip("/")
        self.ids = {**_IDS.get(route, {}), **(ids or {})}

    @classmethod
    def of(cls, e: APIError, scope, ids: dict | None = None) -> "ReferenceError":
        return e if isinstance(e, ReferenceError) else cls(e, scope, ids)

    def body(self) -> dict:
        return {"success": False, "message": self.message, **self.ids}

    def response(self) -> Response:
        r = answer(self.scope, self.body(), self.status)
        r.headers.update(self.headers)
        return r


async def _fields(request: Request) -> dict:
    """A body as fish-speech's server reads one: msgpack, JSON, or a form (files as (bytes, media type))."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        async with request.form(max_files=2, max_fields=16) as form:
            out = {}
            for k, v in form.multi_items():
                out[k] = (await v.read(), v.content_type or "application/octet-stream") \
                    if isinstance(v, UploadFile) else v
            return out
    return decode_body(await request.body(), ctype)


def _text(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v.strip():
        raise bad_request(f"{key} is required: a non-empty string", key)
    return v


def _file(value, param: str) -> tuple[bytes, str]:
    """A file field: form upload, msgpack bytes or JSON base64 -> (bytes, media type)."""
    if isinstance(value, tuple):
        data, mime = value
    elif isinstance(value, str):
        try:
            data, mime = base64.b64decode(value, validate=True), "application/octet-stream"
        except (binascii.Error, ValueError):
            raise bad_request(f"{param}: in JSON, send the file's bytes as base64", param) from None
    elif isinstance(value, (bytes, bytearray)):
        data, mime = bytes(value), "application/octet-stream"
    else:
        raise bad_request(f"{param} is required: the bytes of an audio file (wav, mp3, flac, ...)", param)
    if not data:
        raise bad_request(f"{param} is empty: send the bytes of an audio file", param, code="missing_audio")
    return data, mime


def _items(body: dict, key: str, known: set) -> list:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}: send {{{key}: [...]}}", unknown[0], code="unknown_parameter")
    items = body.get(key)
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_ITEMS:
        raise bad_request(f"{key} must be a list of 1 to {MAX_ITEMS} items", key)
    return items


def _tokens(value, i: int) -> np.ndarray:
    """One token array of /v1/vqgan/decode: [num_codebooks][frames] integers -> int32."""
    param = f"tokens[{i}]"
    try:
        a = np.asarray(value)
    except (ValueError, TypeError):
        a = None
    if a is None or a.ndim != 2 or a.shape[1] == 0 or a.dtype.kind not in "iu":
        raise bad_request(f"{param} must be the codes of one clip: a list of codebooks, each a list of integers (one "
                          "per frame, all of one length), as /v1/vqgan/encode gives them", "tokens")
    if a.min() < 0 or a.max() >= 2**31:
        raise bad_request(f"{param}: codes out of range (a code is 0 or more, below its codebook's size)", "tokens")
    return a.astype(np.int32)


def add_routes(app: FastAPI, state, register: Register, served_limits: Callable[[], Awaitable[dict]],
               decoded_clip: Callable[[bytes, str, dict], Awaitable[tuple]]) -> None:
    """fish-speech's routes on `app`. `state`: the gateway's (cfg, backend, store); `register` stores a voice
    (app.py, as every voice route does); `await decoded_clip(data, param, limits)` decodes a reference clip's file
    and checks its length -> (audio, sample rate); `served_limits()` gives s2pro's limits in force."""
    cfg, backend, store = state.cfg, state.backend, state.store

    async def health(request: Request):
        h = await backend.health()
        if h["triton"] and h["model"]:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": h.get("error") or f"{cfg.triton_model} is not ready"},
                            status_code=503)

    app.add_api_route("/v1/health", health, methods=["GET", "POST"])

    # ---- references: the gateway's voices under fish-speech's names ---------------------------------------------
    def reference_route(path: str, method: str, act: Callable[[dict], Awaitable[dict]], echo: dict) -> None:
        """A reference route: `act(body)` -> the answer's fields; an APIError becomes the route's answer with success
        false and the ids the request gave (`echo`: answer field -> body field), as fish-speech answers."""
        async def endpoint(request: Request):
            body = {}
            try:
                body = await _fields(request)
                return answer(request.scope, {"success": True, **await act(body)})
            except APIError as e:
                ids = {k: str(body.get(v) or "") for k, v in echo.items()}
                raise ReferenceError.of(e, request.scope, ids) from None

        app.add_api_route(path, endpoint, methods=[method])

    async def add(body: dict) -> dict:
        name = validate_name(body.get("id"), "id")
        text = _text(body, "text")
        data, mime = _file(body.get("audio"), "audio")
        if await anyio.to_thread.run_sync(store.get, name, False) is not None:
            raise APIError(409, f"Reference ID '{name}' already exists: delete it first (DELETE /v1/references/delete) "
                                "or choose another id", param="id", code="voice_exists")
        await register(name, text, data, mime, "audio", "text")  # the size, the audio and its length checked
        return {"message": f"Reference voice '{name}' added successfully", "reference_id": name}

    async def delete(body: dict) -> dict:
        name = validate_name(body.get("reference_id"), "reference_id")
        if not await anyio.to_thread.run_sync(store.delete, name):
            raise APIError(404, f"Reference ID '{name}' not found", param="reference_id", code="voice_not_found")
        return {"message": f"Reference voice '{name}' deleted successfully", "reference_id": name}

    async def rename(body: dict) -> dict:
        old = validate_name(body.get("old_reference_id"), "old_reference_id")
        new = validate_name(body.get("new_reference_id"), "new_reference_id")
        if old == new:
            raise bad_request("New reference ID must be different from old reference ID", "new_reference_id")
        if not await anyio.to_thread.run_sync(store.rename, old, new):
            raise APIError(404, f"Reference ID '{old}' not found", param="old_reference_id", code="voice_not_found")
        return {"message": f"Reference voice renamed from '{old}' to '{new}' successfully", "old_reference_id": old,
                "new_reference_id": new}

    reference_route("/v1/references/add", "POST", add, {"reference_id": "id"})
    reference_route("/v1/references/delete", "DELETE", delete, {"reference_id": "reference_id"})
    reference_route("/v1/references/update", "POST", rename, {k: k for k in _IDS["update"]})

    @app.get("/v1/references/list")
    async def list_references(request: Request):
        ids = sorted(v.name for v in await anyio.to_thread.run_sync(store.list))
        return answer(request.scope, {"success": True, "reference_ids": ids,
                                      "message": f"Found {len(ids)} reference voices"})

    # ---- the codec ------------------------------------------------------------------------------------------------
    @app.post("/v1/vqgan/encode")
    async def vqgan_encode(request: Request):
        body = decode_body(await request.body(), request.headers.get("content-type", ""))
        audios = _items(body, "audios", {"audios"})
        limits = await served_limits()
        tokens = []
        for i, value in enumerate(audios):
            param = f"audios[{i}]"
            data, _ = _file(value, param)
            state.check_upload_size(data, param)
            x, sr = await decoded_clip(data, param, limits)
            tokens.append((await backend.encode_reference(x, sr)).tolist())
        return Response(ormsgpack.packb({"tokens": tokens}), media_type="application/msgpack")

    @app.post("/v1/vqgan/decode")
    async def vqgan_decode(request: Request):
        body = decode_body(await request.body(), request.headers.get("content-type", ""))
        arrays = [_tokens(t, i) for i, t in enumerate(_items(body, "tokens", {"tokens"}))]
        frames = sum(a.shape[1] for a in arrays)
        if frames > cfg.max_decode_frames:
            raise APIError(413, f"tokens hold {frames} frames; one call decodes at most {cfg.max_decode_frames} (the "
                                "gateway's --max-decode-frames): send fewer or shorter token arrays per call",
                           param="tokens", code="payload_too_large")
        audios = []
        for i, a in enumerate(arrays):
            try:
                audio = await backend.decode_codes(a, f"vqgan-{uuid.uuid4().hex[:16]}-{i}")
            except APIError as e:
                raise APIError(e.status, f"tokens[{i}]: {e.message}", param="tokens", code=e.code,
                               headers=e.headers) from None
            audios.append(audio.astype(np.float16).tobytes())
        return Response(ormsgpack.packb({"audios": audios}), media_type="application/msgpack")
