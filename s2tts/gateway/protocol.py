"""`POST /v1/audio/speech` request fields: parsing and validation (400s that say what to change)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from ..errors import S2Error
from ..settings import HTTP_NUMBERS, REQUEST_FIELDS, SCHEMA, check_field
from .encoders import FORMATS, out_rates
from .error_bodies import APIError, bad_request
from .options import GatewayConfig

# the s2pro limits the gateway checks itself (the server's values replace these; see GatewayConfig.limits)
# (and how many requests it admits at once, how long one of its text segments may run)
DEFAULT_LIMITS = {k: SCHEMA[k].default for k in ("max_text_chars", "max_new_tokens_limit", "max_chunk_frames",
                                                 "max_reference_seconds", "min_reference_seconds",
                                                 "max_concurrent_requests", "request_timeout_s")}

DEFAULT_VOICES = {"default", "none", ""}  # mean: no reference voice
# OpenAI's built-in voice names (tts-1's and gpt-4o-mini-tts's): what GatewayConfig.openai_voice maps them to, unless a
# voice of that name is registered
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                           "shimmer", "verse"})

_FIELDS = {
    # OpenAI
    "model", "input", "voice", "response_format", "speed", "stream_format", "instructions",
    # an extension: stream=false asks for the whole file in one response (true, as vllm-omni: streamed audio)
    "stream",
    # an extension: timestamps=true (with stream_format "sse") adds a speech.audio.segment event per text segment
    "timestamps",
    # an extension (as vllm-omni's): sample_rate, the rate to write (OpenAI's is 24 kHz; the model's 44.1 kHz)
    "sample_rate",
    # S2 Pro extensions: the reference clip, and the numeric request fields of the schema
    "ref_audio", "ref_text", *HTTP_NUMBERS,
}


@dataclass
class SpeechParams:
    input: str
    model: str
    voice: str | list[str] | None  # a registered voice's name, or several (one per speaker); None: no reference
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str | None = None  # None: whole file; "audio" | "sse": streamed
    ref_audio: str | None = None
    ref_text: str | None = None  # (ref_audio, ref_text as lists: one inline voice per speaker)
    # the numeric request fields by s2pro's name (settings.HTTP_NUMBERS: seed, sampling, chunk sizes, chunk_length),
    # the ones the request gave, checked against the schema's ranges and the server's limits
    fields: dict = field(default_factory=dict)
    gain: float = 1.0  # a factor on the audio (Fish's prosody.volume)
    bit_rate: int | None = None  # compressed formats' bits per second (Fish's mp3_bitrate / opus_bitrate)
    sample_rate: int | None = None  # the rate to write (Fish's sample_rate); None: the format's own
    timestamps: bool = False  # SSE: each text segment's characters and time (s2tts/gateway/alignment.py)


MAX_VOICES = 8  # voices in one request (one per speaker)


def _voice_name(v):
    if isinstance(v, dict):
        if set(v) != {"id"} or not isinstance(v.get("id"), str):
            raise bad_request('voice as an object must be {"id": "<voice name>"}', "voice")
        v = v["id"]
    if not isinstance(v, str):
        raise bad_request('voice must be a string (a registered voice name or "default"), {"id": name}, or a list '
                          "of names (one voice per speaker: the first is <|speaker:0|>)", "voice")
    return v


def _voice(voice):
    """None (no reference), a registered voice's name, or a list of names: one voice per speaker, in order."""
    if voice is None:
        return None
    if isinstance(voice, list):
        names = [_voice_name(v) for v in voice]
        if not 1 <= len(names) <= MAX_VOICES:
            raise bad_request(f"voice as a list needs 1 to {MAX_VOICES} registered voice names (one per speaker), "
                              f"got {len(names)}", "voice")
        if any(n.strip().lower() in DEFAULT_VOICES for n in names):
            raise bad_request('"default" means no voice: a list of voices holds registered names only', "voice")
        return names if len(names) > 1 else names[0]
    voice = _voice_name(voice)
    return None if voice.strip().lower() in DEFAULT_VOICES else voice


def _inline_voices(ref_audio, ref_text) -> tuple[list[str] | str, list[str] | str]:
    """ref_audio and ref_text as lists: clip i (a base64 data URL) and its transcript are speaker i's voice. One of
    each is the single-clip form (as a one-name voice list is one voice: no speaker tag added)."""
    if not isinstance(ref_audio, list) or not isinstance(ref_text, list) or len(ref_audio) != len(ref_text):
        raise bad_request("several inline voices (one per speaker) need ref_audio and ref_text as lists of the same "
                          "length: clip i and its transcript are <|speaker:i|>'s voice", "ref_text"
                          if isinstance(ref_audio, list) else "ref_audio")
    if not 1 <= len(ref_audio) <= MAX_VOICES:
        raise bad_request(f"ref_audio as a list needs 1 to {MAX_VOICES} clips (one per speaker), got {len(ref_audio)}",
                          "ref_audio")
    for i, (a, t) in enumerate(zip(ref_audio, ref_text)):
        if not isinstance(a, str) or not a.strip():
            raise bad_request(f"ref_audio[{i}] must be a string: a base64 data URL (data:audio/wav;base64,...) or a URL "
                              "the server may fetch", "ref_audio")
        if not isinstance(t, str) or not t.strip():
            raise bad_request(f"ref_text[{i}] must be the transcript of ref_audio[{i}], a non-empty string", "ref_text",
                              code="missing_ref_text")
    return (ref_audio, ref_text) if len(ref_audio) > 1 else (ref_audio[0], ref_text[0])


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _num(body, key, lo, hi, *, lo_open=False, integer=False):
    v = body.get(key)
    if v is None:
        return None
    kind = "an integer" if integer else "a number"
    if not _is_num(v) or (integer and not _is_int(v)):
        raise bad_request(f"{key} must be {kind}, got {v!r}", key)
    ok = (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise bad_request(f"{key}={v} is out of range: use {kind} in {rng}", key)
    return int(v) if integer else float(v)


def _field(body, name: str, limits: dict):
    """A numeric request field by its s2pro name, read from its HTTP name and checked against the one range
    both share (s2tts.settings.REQUEST_FIELDS)."""
    f = REQUEST_FIELDS[name]
    v = body.get(f.http)
    if v is None:
        return None
    integer = f.type is int
    if not _is_num(v) or (integer and not _is_int(v)):
        raise bad_request(f"{f.http} must be {'an integer' if integer else 'a number'}, got {v!r}", f.http)
    v = int(v) if integer else float(v)
    try:
        return check_field(name, v, limits, http=True)
    except S2Error as e:
        raise bad_request(e.message, f.http) from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _encodable(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def load_json(raw: bytes):
    """A JSON request body -> its value (400 invalid_json when it is not JSON). JSON may escape a lone UTF-16
    surrogate ("\\ud800"), which is no character and cannot be encoded as UTF-8 for the server: refused here,
    naming the top-level field that holds one."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request("the request body is not valid JSON", None, code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw) and not _encodable(body):
        key = next((k for k, v in body.items() if not (_encodable(k) and _encodable(v))), None) \
            if isinstance(body, dict) else None
        key = key if key is not None and _encodable(key) else None
        raise bad_request(f"{key or 'the request body'} holds a lone UTF-16 surrogate (an escape such as \\ud800 "
                          "without its pair), which is no character: send valid Unicode text", key,
                          code="invalid_value")
    return body


def parse_speech(body, cfg: GatewayConfig, limits: dict | None = None) -> SpeechParams:
    """The fields of POST /v1/audio/speech, checked. `limits`: the server's (setting name -> value)."""
    limits = cfg.limits(limits or DEFAULT_LIMITS)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, code="invalid_json")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}. Known fields: "
                          f"{', '.join(sorted(_FIELDS))}", unknown[0], code="unknown_parameter")

    text = body.get("input")
    if text is not None and not isinstance(text, str):
        raise bad_request(f"input must be a string, the text to speak (got {type(text).__name__})", "input",
                          code="invalid_type")
    if not isinstance(text, str) or not text.strip():
        raise bad_request("input is required: the text to speak, a non-empty string", "input", code="missing_input")
    if len(text) > limits["max_text_chars"]:
        raise bad_request(f"input has {len(text)} characters; the limit is {limits['max_text_chars']}: split the text "
                          "into several requests", "input", code="input_too_long")

    model = body.get("model", cfg.served_model_name)
    if model is None:
        model = cfg.served_model_name
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model not in cfg.model_names:
        raise APIError(404, f"The model '{model}' does not exist: use '{cfg.served_model_name}' (GET /v1/models)",
                       param="model", code="model_not_found")

    voice = _voice(body.get("voice"))

    fmt = body.get("response_format")
    fmt = "mp3" if fmt is None else fmt
    if fmt not in FORMATS:
        raise bad_request(f"response_format {fmt!r} is not supported: use one of {', '.join(FORMATS)}",
                          "response_format")

    speed = _num(body, "speed", 0.25, 4.0)
    speed = 1.0 if speed is None else speed
    rate = _sample_rate(body, fmt)

    # As OpenAI's endpoint: audio streams as it is made unless asked otherwise (stream_format "audio", the
    # default, or "sse"); `stream: false` (an extension) asks for the whole file in one response, with its length
    # and the request's stats as headers.
    stream_format = body.get("stream_format")
    if stream_format is not None and stream_format not in ("audio", "sse"):
        raise bad_request(f"stream_format {stream_format!r} is not supported: use 'audio' (the default) or 'sse' "
                          "(or send stream=false for the whole file in one response)", "stream_format")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    if stream is False and stream_format is not None:
        raise bad_request("stream=false asks for the whole file; stream_format asks for a stream: send one of them",
                          "stream")
    if stream_format is None and stream is not False:
        stream_format = "audio"

    timestamps = body.get("timestamps", False)
    if not isinstance(timestamps, bool):
        raise bad_request("timestamps must be true or false", "timestamps")
    if timestamps and stream_format != "sse":
        raise bad_request("timestamps come as events of an SSE stream: send stream_format \"sse\" with them",
                          "timestamps")

    instructions = body.get("instructions")
    if instructions not in (None, ""):
        raise bad_request("instructions are not supported by S2 Pro: put inline tags such as [laughing] or "
                          "[whispering] in input instead", "instructions", code="unsupported_parameter")

    ref_audio = body.get("ref_audio")
    ref_text = body.get("ref_text")
    if isinstance(ref_audio, list) or isinstance(ref_text, list):  # inline clips, one per speaker
        ref_audio, ref_text = _inline_voices(ref_audio, ref_text)
    elif ref_audio is not None and (not isinstance(ref_audio, str) or not ref_audio.strip()):
        raise bad_request("ref_audio must be a string: a base64 data URL (data:audio/wav;base64,...) or a URL the "
                          "server may fetch", "ref_audio")
    if ref_text is not None and not isinstance(ref_text, (str, list)):
        raise bad_request("ref_text must be a string: the transcript of ref_audio", "ref_text")
    if isinstance(ref_audio, str) and not (ref_text or "").strip():
        raise bad_request("ref_text is required with ref_audio: send the transcript of the reference audio",
                          "ref_text", code="missing_ref_text")
    if ref_audio is None and ref_text is not None:
        raise bad_request("ref_text was given without ref_audio: send ref_audio too, or register the voice "
                          "(POST /v1/audio/voices) and pass its name as voice", "ref_text")
    if ref_audio is not None and voice is not None:
        raise bad_request(f"both a registered voice ({voice!r}) and ref_audio were given: send one of them "
                          "(with ref_audio, set voice to \"default\")", "voice")

    values = {name: _field(body, name, limits) for name in HTTP_NUMBERS}
    return SpeechParams(input=text, model=model, voice=voice, response_format=fmt, speed=speed,
                        stream_format=stream_format, ref_audio=ref_audio, ref_text=ref_text, timestamps=timestamps,
                        sample_rate=rate, fields={k: v for k, v in values.items() if v is not None})


def _sample_rate(body: dict, fmt: str) -> int | None:
    """A request's `sample_rate` for format `fmt`, checked (None: the format's own rate)."""
    rate = body.get("sample_rate")
    if rate is not None and (isinstance(rate, bool) or rate not in out_rates(fmt)):
        raise bad_request(f"sample_rate={rate!r}: {fmt} is written at {', '.join(map(str, out_rates(fmt)))} Hz here; "
                          "leave sample_rate out for the model's own", "sample_rate")
    return None if rate is None else int(rate)
