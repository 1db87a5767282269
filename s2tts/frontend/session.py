"""A text session: text that arrives in pieces (an LLM's answer as it is written), spoken segment after segment as it
becomes speakable, in one audio stream.

`TextSession` holds the text not yet spoken. A segment is ready when
- the text holds a sentence end followed by whitespace (`.!?` and `。！？；…`): every whole sentence up to
  `chunk_length` UTF-8 bytes goes (the rest waits for more text);
- the text has reached `chunk_length` bytes: it is cut at the strongest boundary that fits (`segment.split_text`);
- a flush asks for everything there is now, or the end has come (then the last segment is marked `last`).
Each segment is then spoken exactly as a segment of a long text: with the earlier ones and their codes in its prompt,
through the request's one codec stream (`orchestrator.TTSService`).

Thread-safe: `push` / `flush` / `end` from the model's request threads, `take` from the session's worker.
"""

from __future__ import annotations

import re
import threading
import time

from .segment import nbytes, split_text

# a sentence end followed by whitespace: what came before it can be spoken without waiting for more text
_SENTENCE_END = re.compile(r"[.!?。！？；…]+[\"'”’)\]]*\s+")


class SessionEnded(Exception):
    """Text for a session that has ended (or is ending)."""


class TextSession:
    def __init__(self, chunk_length: int):
        self.chunk_length = chunk_length
        self._text = ""
        self._flush = False
        self._ended = False
        self._cond = threading.Condition()
        self.last_text = time.monotonic()  # when text last came (the idle timeout counts from here)
        self.received = 0  # characters received in all

    def push(self, text: str, event: str = "text") -> int:
        """Text appended (`event` "text"), with a flush ("flush": speak what there is now) or as the last ("end").
        -> characters not yet spoken. Raises SessionEnded after the end."""
        with self._cond:
            if self._ended:
                raise SessionEnded("the session has ended: open a new one")
            self._text += text
            self.received += len(text)
            if text:
                self.last_text = time.monotonic()
            if event == "flush":
                self._flush = True
            elif event == "end":
                self._ended = True
            self._cond.notify_all()
            return len(self._text)

    @property
    def pending(self) -> int:
        """Characters received and not yet taken."""
        with self._cond:
            return len(self._text)

    def end(self) -> None:
        """No more text (the idle timeout, the request's end): what is buffered is still spoken."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    @property
    def ended(self) -> bool:
        with self._cond:
            return self._ended

    def take(self, timeout: float) -> tuple[str | None, bool]:
        """The next segment to speak and whether it is the last, waiting at most `timeout` s for one. (None, False):
        nothing ready yet; (None, True): the session has ended with nothing left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                seg = self._ready()
                if seg is not None:
                    return seg, self._ended and not self._text.strip()
                if self._ended:
                    return None, True
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, False
                self._cond.wait(left)

    def _ready(self) -> str | None:  # with the lock held
        text = self._text
        if not text.strip():
            if self._flush or self._ended:
                self._text, self._flush = "", False
            return None
        if self._flush or self._ended or nbytes(text) >= self.chunk_length:
            cut = len(split_text(text, self.chunk_length)[0])  # all of it when it fits
        else:
            ends = [m.end() for m in _SENTENCE_END.finditer(text)]
            if not ends:
                return None
            cut = ends[-1]
        seg, self._text = text[:cut], text[cut:]
        if not self._text.strip():
            self._flush = False
        return seg.strip() or None
