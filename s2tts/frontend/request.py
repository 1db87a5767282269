"""An s2pro request, transport-free: its fields checked against s2pro's limits (`TTSRequest.validate`, ranges from
`s2tts.settings`), and the numbers its final response reports (`Stats`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from ..ar.sampling import SamplingParams
from ..errors import invalid
from ..settings import SAMPLING_FIELDS, SCHEMA, TEXT_EVENTS, check_field
from .segment import clean_text


@dataclass
class Limits:
    """The request limits of s2pro: its settings (defaults from `s2tts.settings`). A request's defaults are not
    here: `settings.field_default`."""

    max_text_chars: int = SCHEMA["max_text_chars"].default
    max_reference_seconds: float = SCHEMA["max_reference_seconds"].default
    min_reference_seconds: float = SCHEMA["min_reference_seconds"].default
    max_new_tokens: int = SCHEMA["max_new_tokens_limit"].default
    max_chunk_frames: int = SCHEMA["max_chunk_frames"].default

    @classmethod
    def from_settings(cls, v: dict) -> "Limits":
        return cls(v["max_text_chars"], v["max_reference_seconds"], v["min_reference_seconds"], v["max_new_tokens_limit"],
                   v["max_chunk_frames"])

    def as_settings(self) -> dict:
        """The limits keyed by setting name (what `settings.check_field` takes)."""
        return {"max_text_chars": self.max_text_chars, "max_reference_seconds": self.max_reference_seconds,
                "min_reference_seconds": self.min_reference_seconds,
                "max_new_tokens_limit": self.max_new_tokens, "max_chunk_frames": self.max_chunk_frames}


# A reference clip's samples are float PCM in [-1, 1]; a peak above this is a clip sent in other units (16-bit
# integers as floats), not a loud one (resampling may overshoot 1 a little)
PCM_PEAK_LIMIT = 2.0


@dataclass
class TTSRequest:
    text: str
    params: SamplingParams
    first_chunk_frames: int
    chunk_frames: int
    reference_audio: np.ndarray | None = None
    reference_sample_rate: int | None = None
    reference_text: str | None = None
    reference_codes: np.ndarray | None = None
    chunk_length: int = SCHEMA["chunk_length"].default  # UTF-8 bytes of text per segment (`s2tts.frontend.segment`)
    session_id: str | None = None  # a text session (`s2tts.frontend.session`): its text comes in pieces
    text_event: str | None = None  # with session_id: open (default) | text | flush | end

    def validate(self, limits: Limits, num_codebooks: int) -> "TTSRequest":
        """Raises S2Error(invalid_argument) naming the input to change."""
        if self.session_id is not None:
            if not self.session_id.strip() or len(self.session_id) > 256:
                raise invalid("session_id must be a non-empty string of at most 256 characters", "session_id")
            self.text_event = self.text_event or "open"
            if self.text_event not in TEXT_EVENTS:
                raise invalid(f"text_event={self.text_event!r}: use one of {', '.join(TEXT_EVENTS)}", "text_event")
        elif self.text_event is not None:
            raise invalid("text_event needs a session_id (the text session it belongs to)", "text_event")
        session = self.session_id is not None
        if not isinstance(self.text, str) or (not self.text.strip() and not session):
            raise invalid("text is empty: give the words to speak", "text")
        if len(self.text) > limits.max_text_chars:
            raise invalid(f"text is {len(self.text)} characters, over the limit of {limits.max_text_chars} "
                          f"(max_text_chars): split it into several {'text events' if session else 'requests'}", "text")
        try:
            if not session:
                self.text = clean_text(self.text)
            elif self.text.strip():  # a piece of a session's text: checked, kept as it is (its spaces join words)
                clean_text(self.text)
        except ValueError as e:
            raise invalid(str(e), "text") from None
        if session and self.text_event != "open":  # text for an open session: nothing else of it is read
            return self
        lim = limits.as_settings()
        p = self.params
        for name in SAMPLING_FIELDS:
            check_field(name, getattr(p, name), lim)
        check_field("first_chunk_frames", self.first_chunk_frames, lim)
        check_field("chunk_frames", self.chunk_frames, lim)
        check_field("chunk_length", self.chunk_length, lim)
        has_audio = self.reference_audio is not None
        has_codes = self.reference_codes is not None
        if has_audio and has_codes:
            raise invalid("give either reference_audio or reference_codes, not both", "reference_codes")
        if has_audio or has_codes:
            if not self.reference_text or not self.reference_text.strip():
                raise invalid("a voice reference needs its transcript: give reference_text", "reference_text")
            if len(self.reference_text) > limits.max_text_chars:  # refused before its tokens are counted (seconds of CPU)
                raise invalid(f"reference_text is {len(self.reference_text)} characters, over the limit of "
                              f"{limits.max_text_chars} (max_text_chars): send the transcript of the reference clip "
                              "alone", "reference_text")
        elif self.reference_text:
            raise invalid("reference_text was given without reference_audio or reference_codes", "reference_text")
        if has_audio:
            a = self.reference_audio
            if self.reference_sample_rate is None:
                raise invalid("reference_audio needs reference_sample_rate", "reference_sample_rate")
            check_field("reference_sample_rate", self.reference_sample_rate, lim)
            if a.size == 0:
                raise invalid("reference_audio is empty: send the samples of the reference clip", "reference_audio")
            if not np.all(np.isfinite(a)):
                raise invalid("reference_audio holds NaN or infinite samples: send float PCM in [-1, 1]", "reference_audio")
            peak = float(np.abs(a).max())
            if peak > PCM_PEAK_LIMIT:
                raise invalid(f"reference_audio peaks at {peak:g}: send float PCM in [-1, 1] (16-bit samples divided by "
                              "32768)", "reference_audio")
            seconds = a.shape[-1] / self.reference_sample_rate
            if seconds > limits.max_reference_seconds:
                raise invalid(f"reference_audio is {seconds:.1f} s long, over the limit of {limits.max_reference_seconds:g} s: "
                              "trim it", "reference_audio")
            if seconds < limits.min_reference_seconds:
                raise invalid(f"reference_audio is {seconds:.2f} s long; send at least {limits.min_reference_seconds:g} s "
                              "(5-15 s of clean speech clone a voice best)", "reference_audio")
        if has_codes:
            c = self.reference_codes
            if c.ndim != 2 or c.shape[0] != num_codebooks or c.shape[1] == 0:
                raise invalid(f"reference_codes must have shape [{num_codebooks}, frames>0], got {list(c.shape)}",
                              "reference_codes")
        return self


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    first_audio: float | None = None
    frames: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    finish_reason: str = ""
    seed: int | None = None
    queue_s: float | None = None  # waited for a KV slot in slow_ar
    request_id: str = ""
    # where the time to first audio went: from arrival here to the first segment's call to slow_ar, and from its
    # arrival in slow_ar to its first frame and to its first chunk leaving slow_ar's engine thread
    to_engine_s: float | None = None
    engine_first_frame_s: float | None = None
    engine_first_audio_s: float | None = None

    def audio_sent(self, n_samples: int) -> None:
        if self.first_audio is None and n_samples:
            self.first_audio = time.monotonic()
        self.samples += n_samples

    def to_json(self, sample_rate: int) -> str:
        now = time.monotonic()
        return json.dumps({
            "frames": self.frames,
            "audio_seconds": round(self.samples / sample_rate, 4),
            "ttfa_s": None if self.first_audio is None else round(self.first_audio - self.started, 4),
            "total_s": round(now - self.started, 4),
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "seed": self.seed,
            "queue_s": self.queue_s,
            "to_engine_s": self.to_engine_s,
            "engine_first_frame_s": self.engine_first_frame_s,
            "engine_first_audio_s": self.engine_first_audio_s,
            "request_id": self.request_id,
        })
