"""Reading reference audio: uploaded files and base64 data URLs -> float32 mono + sample rate."""

from __future__ import annotations

import base64
import binascii
import io
import re

import numpy as np

from .error_bodies import APIError, bad_request

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,(?P<data>.*)$",
                       re.DOTALL)


def decode_data_url(value: str, param: str = "ref_audio") -> bytes:
    """A `data:<mime>;base64,<data>` URL (or bare base64) -> bytes. Other URLs are refused (http(s) and file URLs are
    remote_audio.py's, under the operator's settings)."""
    value = value.strip()
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", value):
        raise bad_request(f"{param} must be a base64 data URL (data:audio/wav;base64,...), or an http(s):// or "
                          "file:// URL where the operator allows them; other URLs are not fetched", param)
    m = _DATA_URL.match(value)
    if m:
        if not m.group("b64"):
            raise bad_request(f"{param} must be base64-encoded: use data:<mime>;base64,<data>", param)
        payload = m.group("data")
    else:
        payload = value
    try:
        raw = base64.b64decode(re.sub(r"\s+", "", payload), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param} is not valid base64: send data:audio/wav;base64,<base64 of the file>", param) from None
    if not raw:
        raise bad_request(f"{param} is empty", param)
    return raw


def decode_audio(data: bytes, param: str, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Audio file bytes (wav, flac, ogg, mp3, aac, m4a, webm, ...) -> (float32 mono, sample rate). With
    `max_seconds`, decoding stops once the audio is longer than that (what it returns is then just over it): a
    small file can hold hours of silence, which decoded whole would take gigabytes."""
    import soundfile as sf  # noqa: PLC0415

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            sr = f.samplerate
            cap = f.frames if max_seconds is None or f.frames <= 0 else min(f.frames, int(max_seconds * sr) + 1)
            x = f.read(frames=cap if cap > 0 else -1, dtype="float32", always_2d=True)
        x = x.mean(axis=1)
    except Exception:  # noqa: BLE001 - libsndfile does not know the format: try FFmpeg
        x, sr = _decode_with_av(data, param, max_seconds)
    if x.size == 0:
        raise bad_request(f"{param} holds no audio samples", param)
    if not np.all(np.isfinite(x)):
        raise bad_request(f"{param} holds NaN or infinite samples", param)
    return np.ascontiguousarray(x, np.float32), int(sr)


def _decode_with_av(data: bytes, param: str, max_seconds: float | None) -> tuple[np.ndarray, int]:
    try:
        import av  # noqa: PLC0415

        with av.open(io.BytesIO(data)) as c:
            if not c.streams.audio:
                raise ValueError("no audio stream")
            sr = c.streams.audio[0].rate
            cap = None if max_seconds is None else int(max_seconds * sr) + 1
            res = av.AudioResampler(format="flt", layout="mono", rate=sr)
            parts, n = [], 0
            for frame in c.decode(audio=0):
                for f in res.resample(frame):
                    parts.append(f.to_ndarray().reshape(-1))
                    n += parts[-1].size
                if cap is not None and n >= cap:
                    break
            else:
                for f in res.resample(None):
                    parts.append(f.to_ndarray().reshape(-1))
        x = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return (x if cap is None else x[:cap]), int(sr)
    except Exception:  # noqa: BLE001
        raise APIError(415, f"{param} could not be decoded as audio: send wav, flac, mp3, ogg/opus, aac or m4a",
                       param=param, code="unsupported_media") from None
