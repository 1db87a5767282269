"""Where the words are in the audio the gateway sends (issue 27): each text segment's time, exact to the frame.

s2pro's audio chunks each say which text segment they speak (its `segment` output: {segment, text, frame, frames},
s2tts.frontend.orchestrator). A segment's audio is the run of its chunks, so on the output's timeline it starts at
its first sample and ends after its last, over the sample rate, divided by the prosody speed (the tempo change keeps
time proportional). Its characters in the client's text come from `segment.locate`.

Granularity: the segment (a sentence, or a clause of a long one, up to `chunk_length` bytes; in a live session what
a flush released). S2 Pro has no alignment output and the gateway no aligner: word times spread by character count
would be guesses, so there are none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..frontend.segment import locate


@dataclass
class Segment:
    index: int  # s2pro's segment number, from 0
    text: str  # the client's text of it when found, else the text as s2pro spoke it (cleaned, tags included)
    chars: tuple[int, int] | None  # [a, b) in the client's text; None when it could not be found there
    start: float  # seconds on the output's timeline
    end: float

    def public(self) -> dict:
        return {"segment": self.index, "text": self.text, "chars": list(self.chars) if self.chars else None,
                "start": round(self.start, 6), "end": round(self.end, 6)}


class Timeline:
    """The segments of one request's audio, as its chunks come. `text`: the client's text (a live session adds to it
    with `add_text`); only what follows the last segment found is kept, so a long session holds what is still to be
    spoken."""

    def __init__(self, text: str, sample_rate: int | None, speed: float = 1.0):
        """`sample_rate`: s2pro's (None until its first chunk says it: set it before `push`)."""
        self._text = text  # the client's text from offset `_base` on: the segments found so far are dropped
        self._base = 0
        self.sample_rate = sample_rate
        self.speed = speed
        self.samples = 0  # s2pro's samples so far (before the tempo change)
        self.current: Segment | None = None

    def add_text(self, piece: str) -> None:
        self._text += piece

    def _at(self, samples: int) -> float:
        return samples / self.sample_rate / self.speed

    def push(self, audio: np.ndarray, where: dict | None) -> Segment | None:
        """One audio chunk (its samples, its `segment` output) -> the segment it ended: the one before, when this
        chunk begins another; else None. `current` is then this chunk's segment, its end this chunk's end."""
        start, self.samples = self.samples, self.samples + int(audio.size)
        if where is None:
            return None
        if self.current is not None and where["segment"] == self.current.index:
            self.current.end = self._at(self.samples)
            return None
        ended, found = self.current, locate(self._text, where["text"])
        text, chars = where["text"], None
        if found is not None:
            text, chars = self._text[found[0]:found[1]], (self._base + found[0], self._base + found[1])
            self._text, self._base = self._text[found[1]:], self._base + found[1]
        self.current = Segment(int(where["segment"]), text, chars, self._at(start), self._at(self.samples))
        return ended

    def finish(self) -> Segment | None:
        """The last segment, once the audio has ended."""
        ended, self.current = self.current, None
        return ended
