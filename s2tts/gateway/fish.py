"""Fish Audio's own API on the gateway (what its official SDK, `fish-audio-sdk`, and fish-speech's server speak):
`POST /v1/tts` with a msgpack or JSON body and the `model` header. This module reads and checks the body; the audio is
made and streamed as on the OpenAI route (`app.SpeechResponse`).

Fields (Fish Audio's names and ranges; the numeric ones are checked against the same schema as every other route,
`s2tts.settings.REQUEST_FIELDS`, and the server's limits):

| field | here |
|---|---|
| `text` | the text to speak (required) |
| `format` | `wav`, `pcm`, `mp3` (default, as Fish's), `opus`; streamed as it is made |
| `sample_rate` | wav / pcm / mp3: 8000, 16000, 22050, 24000, 32000, 44100 (the model's, the default) or 48000, resampled as the audio streams (libswresample); opus: 48000 only |
| `mp3_bitrate`, `opus_bitrate` | 64 / 128 / 192 kbps; 24 / 32 / 48 / 64 kbps (the SDK's unit) or 24000 ... 64000 bps (LiveKit's plugin's), -1000 = the encoder's choice |
| `references` | `[{audio, text}]`: clips (bytes; base64 in JSON) and their transcripts; several = one voice per speaker |
| `reference_id` | a registered voice (`/v1/audio/voices`), or a list of them (one per speaker) |
| `prosody` | `{speed: 0.5-2, volume: -20..20 dB, normalize_loudness}`: speed by time-stretching, volume as a gain; `normalize_loudness` (a boolean) is accepted with no effect: a loudness measure needs the whole take, and the audio streams as it is made |
| `chunk_length`, `top_p`, `temperature`, `max_new_tokens`, `seed` | as s2pro's fields (`max_new_tokens`: per segment; 0, fish-speech's "no limit", is the server's `max_new_tokens_limit`) |
| `streaming` | fish-speech's: `false` the whole file in one response (a WAV with its exact sizes, `content-length`); `true` chunks as they are made; absent (Fish Audio's SDK never sends it): streamed, as Fish Audio answers. Any format streams (fish-speech's own server streams WAV only) |
| `use_memory_cache` | fish-speech's (`on` / `off`): accepted with no effect; a registered voice's codes are always reused (encoded once at registration) and an inline clip is encoded for its request |
| `normalize`, `latency`, `repetition_penalty`, `min_chunk_length`, `condition_on_previous_chunks`, `early_stop_threshold`, `features` | accepted with no effect: the text is always normalized as upstream does, audio always streams at the lowest latency, every segment is conditioned on the earlier ones, S2 Pro's sampling has no repetition penalty, and Fish's server-side `features` (LiveKit's plugin sends `quality-guard`) are its service's own (the SDK and the plugins send these on every call) |

Voices (`/model`, the SDK's `voices` methods) are the gateway's voice store, the same voices as `/v1/audio/voices`: a
voice registered either way is a `reference_id` here and a `voice` there. `POST /model` (multipart, as the SDK sends
it) takes one clip (`voices`) and its transcript (`texts`: required, this server does no speech recognition) and a
`title`, kept as given and from which the voice's id is made (`fish_voice_id`), and a `description`, kept; `tags`,
`visibility`, `cover_image`, `train_mode` and `enhance_audio_quality` are accepted with no effect. `GET /model` lists
them (`page_size`, `page_number`, `title` filter), `GET` / `DELETE /model/{id}` one; `PATCH /model/{id}` (form or
multipart, as the SDK's `voices.update` sends it) changes its `title` and `description` (the id stays), its transcript
(`texts`), or its clip (`voices`, with its `texts`: encoded again), and accepts the other fields with no effect.

Ranges: fish-speech's own server (`ServeTTSRequest`) refuses `chunk_length` outside 100-1000, `top_p` and `temperature`
outside 0.1-1.0 and `repetition_penalty` outside 0.9-2.0; Fish Audio's API and this server take the schema's wider
ranges (`chunk_length` 16-100000, `temperature` 0-2 with 0 greedy, `top_p` (0, 1]), so every request fish-speech's
server takes is taken here.

Errors are one shape for both Fish APIs: `{"status", "message", "detail"}` as Fish Audio's service answers (both SDK
generations read one of the last two) with fish-speech's server's `statusCode` and `error` (the status's phrase) too.
fish-speech's other routes are fish_server.py's.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import math
import re
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi.responses import JSONResponse

from ..settings import REQUEST_FIELDS
from .error_bodies import APIError, bad_request
from .options import GatewayConfig
from .protocol import DEFAULT_LIMITS, DEFAULT_VOICES, MAX_VOICES, _field, _sample_rate, load_json

FISH_PATHS = ("/v1/tts", "/model", "/v1/vqgan/", "/v1/health")  # the routes that answer errors in Fish's shape
FISH_FORMATS = ("wav", "pcm", "mp3", "opus")
FISH_NUMBERS = ("chunk_length", "top_p", "temperature", "max_new_tokens", "seed", "top_k")  # s2pro's names
ADVISORY = ("normalize", "latency", "repetition_penalty", "min_chunk_length", "condition_on_previous_chunks",
            "early_stop_threshold", "features")
KNOWN = {"text", "format", "sample_rate", "mp3_bitrate", "opus_bitrate", "references", "reference_id", "prosody",
         "streaming", "use_memory_cache", *FISH_NUMBERS, *ADVISORY}
MP3_BITRATES = (64, 128, 192)
OPUS_BITRATES = (-1000, 24, 32, 48, 64, 24000, 32000, 48000, 64000)  # kbps (the SDK) or bps (LiveKit's plugin)


# the fields an error names on OpenAI's route (s2pro's inputs as `triton.HTTP_FIELD` renames them) -> Fish's
FISH_FIELD = {"input": "text", "ref_audio": "references", "ref_text": "references", "voice": "reference_id"}


class FishError(APIError):
    """An error in Fish Audio's shape: {"status", "message", "detail"}, naming Fish's fields."""

    @classmethod
    def of(cls, e: APIError) -> "FishError":
        if isinstance(e, FishError):
            return e
        param, message = FISH_FIELD.get(e.param, e.param), e.message
        if param != e.param:
            message = re.sub(rf"\b{re.escape(e.param)}\b", param, message)
        return cls(e.status, message, param=param, code=e.code, headers=e.headers)

    def body(self) -> dict:
        return {"status": self.status, "message": self.message, "detail": self.message, "statusCode": self.status,
                "error": HTTPStatus(self.status).phrase}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


@dataclass
class FishTTS:
    text: str
    format: str = "mp3"
    bit_rate: int | None = None  # bits per second for mp3 / opus; None: the encoder's default
    speed: float = 1.0
    gain: float = 1.0  # prosody.volume as a factor
    references: list[tuple[bytes, str]] = field(default_factory=list)
    reference_id: list[str] = field(default_factory=list)
    sample_rate: int | None = None  # the rate to write; None: the format's own
    fields: dict = field(default_factory=dict)  # s2pro's numeric fields the request gave, checked
    stream: bool = True  # False (fish-speech's streaming=false): the whole file in one response


def decode_body(raw: bytes, content_type: str) -> dict:
    """The body as msgpack (Content-Type: application/msgpack, as the SDK sends it) or JSON."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype in ("application/msgpack", "application/x-msgpack"):
        import ormsgpack

        try:
            body = ormsgpack.unpackb(raw)
        except (ormsgpack.MsgpackDecodeError, ValueError, TypeError):
            raise bad_request("the request body is not valid msgpack", None, code="invalid_body") from None
    elif ctype == "application/json" or ctype.endswith("+json"):
        body = load_json(raw)
    else:
        raise APIError(415, f"send the request body as msgpack (Content-Type: application/msgpack) or JSON "
                            f"(application/json); got {ctype or 'no Content-Type'}", code="unsupported_media")
    if not isinstance(body, dict):
        raise bad_request("the request body must be a map of the request's fields", None, code="invalid_body")
    return body


def _choice(body, key, allowed):
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or v not in allowed):
        raise bad_request(f"{key}={v!r} is not supported: use one of {', '.join(map(str, allowed))}", key)
    return v


def _number(body, key, lo, hi):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad_request(f"{key}={v!r}: use a number in [{lo:g}, {hi:g}]", key)
    return float(v)


def _references(refs) -> list[tuple[bytes, str]]:
    if refs is None:
        return []
    if not isinstance(refs, list) or len(refs) > MAX_VOICES:
        raise bad_request(f"references must be a list of at most {MAX_VOICES} {{audio, text}} maps", "references")
    out = []
    for i, r in enumerate(refs):
        if not isinstance(r, dict) or set(r) - {"audio", "text"}:
            raise bad_request(f"references[{i}] must be a map {{audio: the clip's bytes, text: its transcript}}",
                              "references")
        audio, text = r.get("audio"), r.get("text")
        if isinstance(audio, str):  # JSON has no bytes: base64
            try:
                audio = base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError):
                raise bad_request(f"references[{i}].audio: in JSON, send the clip's bytes as base64", "references") \
                    from None
        if not isinstance(audio, (bytes, bytearray)) or not audio:
            raise bad_request(f"references[{i}].audio must be the bytes of an audio file (wav, mp3, flac, ...)",
                              "references")
        if not isinstance(text, str) or not text.strip():
            raise bad_request(f"references[{i}].text must be the transcript of its audio, a non-empty string",
                              "references")
        out.append((bytes(audio), text))
    return out


def parse_fish_tts(body: dict, model: str | None, cfg: GatewayConfig, limits: dict | None = None,
                   live: bool = False) -> FishTTS:
    """The fields of POST /v1/tts, checked (APIError naming the field to change). `model`: the `model` header.
    `live`: the request of a `/v1/tts/live` session, whose `text` may be empty (its text comes as events)."""
    limits = cfg.limits(limits or DEFAULT_LIMITS)
    if model not in (None, "") and model not in cfg.model_names and model not in cfg.fish_models and model != "s2-pro":
        raise bad_request(f"model {model!r} is not served here: this server runs S2 Pro (send the header "
                          f"model: s2-pro)", "model", code="model_not_found")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}; the fields of /v1/tts are {', '.join(sorted(KNOWN))}",
                          unknown[0], code="unknown_parameter")
    text = body.get("text")
    if live and text is None:
        text = ""
    if not isinstance(text, str) or (not text.strip() and not live):
        raise bad_request("text is required: the words to speak, a non-empty string", "text", code="missing_input")
    if len(text) > limits["max_text_chars"]:
        raise bad_request(f"text has {len(text)} characters; the limit is {limits['max_text_chars']}: split it into "
                          "several requests", "text", code="input_too_long")
    fmt = _choice(body, "format", FISH_FORMATS) or "mp3"
    rate = _sample_rate(body, fmt)
    mp3 = _choice(body, "mp3_bitrate", MP3_BITRATES)
    opus = _choice(body, "opus_bitrate", OPUS_BITRATES)
    bit_rate = (mp3 * 1000 if fmt == "mp3" and mp3 else None) or \
        ((opus if opus >= 1000 else opus * 1000) if fmt == "opus" and opus and opus > 0 else None)
    prosody = body.get("prosody") or {}
    if not isinstance(prosody, dict) or set(prosody) - {"speed", "volume", "normalize_loudness"} \
            or not isinstance(prosody.get("normalize_loudness", False), bool):
        raise bad_request("prosody must be a map {speed: 0.5-2.0, volume: dB in -20..20, normalize_loudness: a "
                          "boolean}", "prosody")
    speed = _number(prosody, "speed", 0.5, 2.0)
    volume = _number(prosody, "volume", -20.0, 20.0)
    ref_id = body.get("reference_id")
    ids = [] if ref_id is None else ref_id if isinstance(ref_id, list) else [ref_id]
    if not all(isinstance(i, str) and i.strip() for i in ids) or len(ids) > MAX_VOICES:
        raise bad_request(f"reference_id must be a registered voice's id, or a list of at most {MAX_VOICES} (one per "
                          "speaker)", "reference_id")
    ids = [i for i in ids if i.strip().lower() not in DEFAULT_VOICES]
    refs = _references(body.get("references"))
    if refs and ids:
        raise bad_request("send references or reference_id, not both", "reference_id")
    streaming = body.get("streaming")
    if streaming is not None and not isinstance(streaming, bool):
        raise bad_request("streaming must be true (chunks as they are made) or false (the whole file)", "streaming")
    _choice(body, "use_memory_cache", ("on", "off"))
    values = {}
    for name in FISH_NUMBERS:
        given = body.get(name)
        if name == "max_new_tokens" and given == 0 and not isinstance(given, bool):  # fish-speech's "no limit"
            given = limits["max_new_tokens_limit"]
        v = _field({REQUEST_FIELDS[name].http: given}, name, limits)
        if v is not None:
            values[name] = v
    return FishTTS(text=text, format=fmt, bit_rate=bit_rate, speed=1.0 if speed is None else speed,
                   gain=1.0 if volume is None else 10 ** (volume / 20), references=refs, reference_id=ids,
                   sample_rate=rate, fields=values, stream=streaming is not False)


# ---- voices (/model) ------------------------------------------------------------------------------------------------
def fish_voice_id(title, taken) -> str:
    """A voice id (a valid store name) from a title: its letters, digits, '_', '-' and '.' ('My voice' -> 'My-voice'),
    with '-2', '-3', ... where `taken(id)` says the id is in use."""
    if not isinstance(title, str) or not title.strip():
        raise bad_request("title is required: the voice's name", "title")
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", title.strip()).strip("-.")[:56] or "voice"
    if not base[0].isalnum():
        base = "v" + base
    if base.lower() in ("default", "none"):
        base += "-voice"
    name, n = base, 1
    while taken(name):
        n += 1
        name = f"{base}-{n}"
    return name


def fish_voice(v) -> dict:
    """A stored voice (`voices.Voice`) as Fish Audio's voice model (what the SDK's `Voice` reads)."""
    def when(t):
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()

    return {"_id": v.name, "type": "tts", "title": v.title or v.name, "description": v.description,
            "cover_image": "", "train_mode": "fast", "state": "trained", "tags": [], "created_at": when(v.created_at),
            "updated_at": when(v.updated_at or v.created_at), "languages": [],
            "visibility": "private", "lock_visibility": False, "like_count": 0, "mark_count": 0, "shared_count": 0,
            "task_count": 0, "liked": False, "marked": False,
            "samples": [{"title": v.name, "text": v.ref_text, "task_id": "", "audio": f"/v1/audio/voices/{v.name}/audio"}],
            "author": {"_id": "s2tts", "nickname": "s2tts", "avatar": ""}}


def page(items: list, params) -> dict:
    """Fish's paginated list: `page_size` (1..100, default 10) items from `page_number` (1-based)."""
    def number(key, default, hi):
        raw = params.get(key)
        try:
            v = default if raw is None else int(raw)
        except ValueError:
            raise bad_request(f"{key} must be an integer", key) from None
        if not 1 <= v <= hi:
            raise bad_request(f"{key}={v} is out of range: use 1 to {hi}", key)
        return v

    size, number_ = number("page_size", 10, 100), number("page_number", 1, 10**6)
    return {"total": len(items), "items": items[(number_ - 1) * size: number_ * size]}


def alignment(seg) -> dict:
    """A live audio event's place, as Fish's /v1/tts/live/with-timestamp says it, from an `alignment.Segment` (the
    segment so far): one alignment entry, the whole segment (the granularity here: s2tts/gateway/alignment.py)."""
    duration = round(seg.end - seg.start, 6)
    return {"content": seg.text, "chunk_seq": seg.index, "chunk_audio_offset_sec": round(seg.start, 6),
            "alignment": {"segments": [{"text": seg.text, "start": 0.0, "end": duration}],
                          "audio_duration": duration}}
