"""Audio encoders for the six OpenAI `response_format`s, fed chunk by chunk.

Every encoder takes float32 mono chunks and returns the bytes that are ready.
In streaming mode the bytes can be decoded as they arrive:

- `pcm`: raw 16-bit little-endian mono samples.
- `wav`: a RIFF header whose sizes are 0xFFFFFFFF (unknown length, as OpenAI streams WAV), then 16-bit samples.
- `flac`: native FLAC frames after a STREAMINFO whose total length is 0 (unknown).
- `mp3`: MPEG-1 layer III frames (LAME).
- `aac`: AAC-LC in ADTS frames.
- `opus`: Ogg pages (one page per 20 ms packet) at 48 kHz, Opus's own rate.

In whole-file mode the same samples are written to a seekable buffer, so the
containers carry their real lengths (WAV sizes, FLAC STREAMINFO, MP3 Xing/LAME
header with the encoder delay).

`AudioPipeline` is what every route sends the model's audio through: gain, time-stretch (`speed`), another sample
rate where asked (`Resampler`), the encoder.
"""

from __future__ import annotations

import io
import struct

import numpy as np

from .tempo import TimeStretch

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
OUT_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)  # the rates a request may ask for (resampled as it streams)


def out_rates(fmt: str) -> tuple[int, ...]:
    """The rates format `fmt` is written at on request (`sample_rate`): Opus at 48 kHz alone."""
    return (48000,) if fmt == "opus" else OUT_RATES

MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}

# PyAV muxer, codec, output sample rate (None: the input's), bit rate.
_AV = {
    "mp3": ("mp3", "libmp3lame", None, 128_000),
    "aac": ("adts", "aac", None, 128_000),
    "opus": ("ogg", "libopus", 48_000, 64_000),
    "flac": ("flac", "flac", None, None),
}


def to_int16(x: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16, rounded, clipped."""
    return np.round(np.clip(np.asarray(x, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")


def wav_header(sample_rate: int, num_samples: int | None) -> bytes:
    """16-bit mono PCM WAV header; `num_samples=None` writes 0xFFFFFFFF sizes (streaming)."""
    if num_samples is None:
        riff = data = 0xFFFFFFFF
    else:
        data = num_samples * 2
        riff = 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


class Encoder:
    """Base: `encode(chunk) -> bytes`, `finish() -> bytes`."""

    def __init__(self, fmt: str, sample_rate: int, streaming: bool):
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.streaming = streaming
        self.samples_in = 0

    @property
    def output_sample_rate(self) -> int:
        return self.sample_rate

    def encode(self, x: np.ndarray) -> bytes:
        raise NotImplementedError

    def finish(self) -> bytes:
        raise NotImplementedError


class PcmEncoder(Encoder):
    def __init__(self, fmt, sample_rate, streaming):
        super().__init__(fmt, sample_rate, streaming)
        self._parts: list[bytes] = []
        self._header_sent = False

    def encode(self, x):
        b = to_int16(x).tobytes()
        self.samples_in += len(b) // 2
        if not self.streaming:
            self._parts.append(b)
            return b""
        if self.fmt == "wav" and not self._header_sent:
            self._header_sent = True
            b = wav_header(self.sample_rate, None) + b
        return b

    def finish(self):
        if self.streaming:
            if self.fmt == "wav" and not self._header_sent:
                self._header_sent = True
                return wav_header(self.sample_rate, None)
            return b""
        body = b"".join(self._parts)
        self._parts = []
        if self.fmt == "wav":
            return wav_header(self.sample_rate, len(body) // 2) + body
        return body


class Resampler:
    """A streaming change of sample rate (libswresample through PyAV): float32 mono in, float32 mono out; what comes
    out over all the pushes and the flush does not depend on how the input was cut."""

    def __init__(self, rate_in: int, rate_out: int):
        import av  # noqa: PLC0415 - only when another rate is asked for

        self._av = av
        self.rate_in = rate_in
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=rate_out)
        self._pts = 0

    @staticmethod
    def _samples(frames) -> np.ndarray:
        parts = [f.to_ndarray().reshape(-1) for f in frames]
        return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)

    def push(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(np.asarray(x, np.float32).reshape(1, -1))
        if not x.size:
            return np.zeros(0, np.float32)
        frame = self._av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
        frame.sample_rate, frame.pts = self.rate_in, self._pts
        self._pts += x.shape[1]
        return self._samples(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        return self._samples(self._resampler.resample(None))


class ResampledEncoder(Encoder):
    """An encoder fed at another rate than the model's: the samples are resampled first (`Resampler`)."""

    def __init__(self, inner: Encoder, sample_rate: int):
        super().__init__(inner.fmt, sample_rate, inner.streaming)
        self.inner = inner
        self._resampler = Resampler(sample_rate, inner.sample_rate)

    @property
    def output_sample_rate(self) -> int:
        return self.inner.output_sample_rate

    def encode(self, x):
        self.samples_in += len(x)
        return self.inner.encode(self._resampler.push(x))

    def finish(self):
        return self.inner.encode(self._resampler.flush()) + self.inner.finish()


class _StreamSink:
    """A write-only, non-seekable file for PyAV: collects what the muxer writes."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, b) -> int:
        self._parts.append(bytes(b))
        return len(b)

    def seekable(self) -> bool:
        return False

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts = []
        return out


class AvEncoder(Encoder):
    """mp3 / aac / opus / flac through PyAV (FFmpeg's encoders and muxers, bundled in the wheel); `bit_rate` (bits per
    second) replaces the format's default."""

    def __init__(self, fmt, sample_rate, streaming, bit_rate: int | None = None, out_rate: int | None = None):
        super().__init__(fmt, sample_rate, streaming)
        import av  # noqa: PLC0415 - optional heavy import, only when a compressed format is asked for

        self._av = av
        muxer, codec, rate, default_bit_rate = _AV[fmt]
        bit_rate = bit_rate or default_bit_rate
        self._rate = rate or out_rate or sample_rate
        self._sink = _StreamSink() if streaming else io.BytesIO()
        options = {"flush_packets": "1"}
        if fmt == "opus":
            options["page_duration"] = "20000"  # one Ogg page per 20 ms packet: pages leave at once
        self._container = av.open(self._sink, "w", format=muxer, options=options)
        self._stream = self._container.add_stream(codec, rate=self._rate, layout="mono")
        if bit_rate:
            self._stream.bit_rate = bit_rate
        # FLAC gets exact 16-bit samples (lossless: decodes to the same int16 as wav/pcm).
        self._in_format = "s16" if fmt == "flac" else "flt"
        self._resampler = av.AudioResampler(format=self._stream.codec_context.format.name if fmt != "flac" else "s16",
                                            layout="mono", rate=self._rate)
        self._pts = 0

    @property
    def output_sample_rate(self) -> int:
        return self._rate

    def _mux(self, frames) -> None:
        for f in frames:
            for p in self._stream.encode(f):
                self._container.mux(p)

    def _take(self) -> bytes:
        return self._sink.take() if self.streaming else b""

    def encode(self, x):
        x = np.asarray(x, np.float32).reshape(-1)
        if len(x) == 0:
            return self._take()
        self.samples_in += len(x)
        data = to_int16(x)[None, :] if self._in_format == "s16" else x[None, :]
        frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=self._in_format, layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += len(x)
        self._mux(self._resampler.resample(frame))
        return self._take()

    def finish(self):
        self._mux(self._resampler.resample(None))
        for p in self._stream.encode(None):
            self._container.mux(p)
        self._container.close()
        if self.streaming:
            return self._sink.take()
        return self._sink.getvalue()


def make_encoder(fmt: str, sample_rate: int, streaming: bool, bit_rate: int | None = None,
                 out_rate: int | None = None) -> Encoder:
    """`sample_rate`: the samples' rate; `out_rate`: the rate to write (None: the format's own, else the samples')."""
    if fmt in ("pcm", "wav"):
        if out_rate and out_rate != sample_rate:
            return ResampledEncoder(PcmEncoder(fmt, out_rate, streaming), sample_rate)
        return PcmEncoder(fmt, sample_rate, streaming)
    if fmt in _AV:
        return AvEncoder(fmt, sample_rate, streaming, bit_rate, out_rate)
    raise ValueError(f"unknown format {fmt!r}")


class AudioPipeline:
    """float32 chunks -> (gain) -> (time-stretch) -> encoder -> bytes. Same bytes whatever the chunking."""

    def __init__(self, fmt: str, sample_rate: int, speed: float, streaming: bool, gain: float = 1.0,
                 bit_rate: int | None = None, out_rate: int | None = None):
        self.stretch = TimeStretch(speed, sample_rate) if speed != 1.0 else None
        self.encoder = make_encoder(fmt, sample_rate, streaming, bit_rate, out_rate)
        self.gain = gain
        self.samples_out = 0

    def push(self, x: np.ndarray) -> bytes:
        if self.gain != 1.0:
            x = np.clip(x * self.gain, -1.0, 1.0)
        if self.stretch is not None:
            x = self.stretch.push(x)
        self.samples_out += len(x)
        return self.encoder.encode(x)

    def finish(self) -> bytes:
        out = b""
        if self.stretch is not None:
            tail = self.stretch.flush()
            self.samples_out += len(tail)
            out = self.encoder.encode(tail)
        return out + self.encoder.finish()
