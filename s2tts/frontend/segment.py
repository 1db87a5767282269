"""A request's text as the segments S2 Pro speaks one after another (long-form speech and dialogue).

Upstream fish-speech (`generate_long`) splits dialogue on `<|speaker:N|>` tags into turns, strips each turn, and
groups turns into batches of at most 5 turns whose UTF-8 bytes (each turn with its tag, not counting the `\\n` that
joins them) add up to at most `chunk_length`; each batch is one user turn. Here, the same (so a batch of several
turns may run a few bytes past `chunk_length`, as upstream's does), and beyond it:
- text before the first tag is kept as a turn without a tag (upstream drops it silently);
- a turn (or untagged text) longer than a batch is cut into pieces at the strongest boundary that fits: a sentence
  end (also `。！？；` and `…`), else a clause mark, else whitespace, else any grapheme boundary (text without
  spaces or punctuation). A cut never falls inside a grapheme (`regex`'s `\\X`: accents, emoji sequences, Hangul)
  or a speaker tag, and the pieces of one turn concatenate to exactly its text: the text's own whitespace is
  kept. Each batch line of a cut turn carries the turn's tag again, so its voice goes on.

    batches("<|speaker:0|>Hi there.<|speaker:1|>Hello!", chunk_length=200)
    -> ["<|speaker:0|>Hi there.\\n<|speaker:1|>Hello!"]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import regex

from ..settings import SCHEMA

SPEAKER_TAG = re.compile(r"<\|speaker:(\d+)\|>")
MAX_TURNS = 5  # upstream's turns per batch
DEFAULT_CHUNK_LENGTH = SCHEMA["chunk_length"].default  # bytes (upstream's API: 200)

# boundaries, strongest first: where a cut may go, as the end of a match
_SENTENCE = regex.compile(r"(?:[.!?…]+[\"'”’)\]]*\s+|[。！？；]+[」』”’）]*\s*|\n\s*)")
_CLAUSE = regex.compile(r"(?:[,;:]\s+|[、，：]\s*)")
_SPACE = regex.compile(r"\s+")
_GRAPHEME = regex.compile(r"\X")
_MARGIN = 64  # characters past a cut's window, so that the grapheme at its edge is seen whole


_LEGACY_SPEAKER = re.compile(r"<speaker:(\d+)>")
_SPECIAL = re.compile(r"<\|[^|<>]*\|>")


def clean_text(text: str, what: str = "text") -> str:
    """Normalise speaker tags; refuse other special-token markup (it would steer the model)."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string")
    text = _LEGACY_SPEAKER.sub(r"<|speaker:\1|>", text).strip()
    if not text:
        raise ValueError(f"{what} is empty: give the words to speak")
    bad = [m for m in _SPECIAL.findall(text) if not SPEAKER_TAG.fullmatch(m)]
    if bad:
        raise ValueError(f"{what} contains the special token {bad[0]}: only <|speaker:N|> tags are allowed")
    return text


_TAGS = re.compile(f"{SPEAKER_TAG.pattern}|{_LEGACY_SPEAKER.pattern}")  # either spelling of a speaker tag


def _visible(text: str, start: int = 0):
    """(index, character) of `text` from `start` that are spoken: no whitespace, no speaker tag."""
    tags = _TAGS.finditer(text, start)
    tag = next(tags, None)
    for i in range(start, len(text)):
        while tag is not None and tag.end() <= i:
            tag = next(tags, None)
        if (tag is not None and tag.start() <= i) or text[i].isspace():
            continue
        yield i, text[i]


def locate(text: str, segment: str, start: int = 0) -> tuple[int, int] | None:
    """Where a segment s2pro spoke lies in the client's `text`: [a, b) from its first spoken character to its last,
    searching from `start` (the end of the segment before). Whitespace and speaker tags do not count (s2pro cuts,
    strips and tags segments); None when the next characters of `text` are not the segment's (the text changed
    on the way, e.g. normalised by a client)."""
    want = [c for _, c in _visible(segment)]
    if not want:
        return None
    got = []
    for i, c in _visible(text, start):
        if c != want[len(got)]:
            return None
        got.append(i)
        if len(got) == len(want):
            return got[0], got[-1] + 1
    return None


def combine_voices(voices) -> tuple[str, np.ndarray]:
    """Several reference voices, one per speaker, as upstream puts them in one system turn: each transcript tagged
    `<|speaker:i|>` (i its position; kept as it is when it has a tag already), joined with `\n`, and the codes
    [num_codebooks, frames] of each concatenated in time. -> (reference_text, reference_codes); the prefix cache
    then keys on the whole set."""
    voices = list(voices)
    if not voices:
        raise ValueError("no voices to combine")
    texts, codes = [], []
    for i, (text, c) in enumerate(voices):
        text = clean_text(text, f"reference_text of voice {i}")
        texts.append(text if SPEAKER_TAG.search(text) else f"<|speaker:{i}|>{text}")
        c = np.asarray(c)
        if c.ndim != 2 or (codes and c.shape[0] != codes[0].shape[0]):
            raise ValueError(f"voice {i}: codes must be [num_codebooks, frames] like the others, got {list(c.shape)}")
        codes.append(c)
    return "\n".join(texts), np.concatenate(codes, axis=1)


@dataclass(frozen=True)
class Turn:
    speaker: int | None  # None: text before the first speaker tag
    text: str

    def render(self) -> str:
        return self.text if self.speaker is None else f"<|speaker:{self.speaker}|>{self.text}"


def nbytes(s: str) -> int:
    return len(s.encode("utf-8"))


def split_turns(text: str) -> list[Turn]:
    """Turns in order; each stripped as upstream does; empty ones dropped; text before the first tag kept."""
    parts = SPEAKER_TAG.split(text)
    turns = [Turn(None, parts[0].strip())] if parts[0].strip() else []
    for n, body in zip(parts[1::2], parts[2::2]):
        if body.strip():
            turns.append(Turn(int(n), body.strip()))
    return turns


def split_text(text: str, max_bytes: int) -> list[str]:
    """Pieces of `text`, each at most `max_bytes` UTF-8 bytes (a single grapheme longer than that stays whole),
    whose concatenation is `text`; cut at the strongest boundary that fits (see the module's doc). Linear in the
    text's length: each cut looks only at the next `max_bytes` characters (a piece of at most `max_bytes` bytes has
    no more characters than that), plus a margin so that the grapheme at the window's edge is seen whole."""
    if max_bytes < 1:
        raise ValueError("max_bytes must be at least 1")
    pieces = []
    start = 0
    while nbytes(text[start:]) > max_bytes:  # one C-level encode per cut: cheap even for 100,000 characters
        window = text[start : start + max_bytes + _MARGIN]
        whole = start + len(window) >= len(text)
        ends = [m.end() for m in _GRAPHEME.finditer(window)]
        if not whole and len(ends) > 1:
            ends.pop()  # the last grapheme may go on past the window
        # the longest prefix that fits, on a grapheme boundary
        fit, size, prev = 0, 0, 0
        for e in ends:
            size += nbytes(window[prev:e])
            prev = e
            if size > max_bytes:
                break
            fit = e
        if fit == 0:  # one grapheme is bigger than the budget: it goes alone
            fit = _GRAPHEME.match(text, start).end() - start
        cut = fit
        legal = set(ends)
        for pattern in (_SENTENCE, _CLAUSE, _SPACE):
            best = max((m.end() for m in pattern.finditer(window, 0, fit) if 0 < m.end() <= fit and m.end() in legal),
                       default=0)
            if best:
                cut = best
                break
        pieces.append(text[start : start + cut])
        start += cut
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def batches(text: str, chunk_length: int = DEFAULT_CHUNK_LENGTH, max_turns: int = MAX_TURNS) -> list[str]:
    """The user-turn texts to generate one after another, as upstream's `group_turns_into_batches`: at most
    `max_turns` turns, whose lines (a turn's tag included) add up to at most `chunk_length` UTF-8 bytes without the
    `\\n` joining them (a single grapheme longer than that is the only exception), one speaker tag per turn."""
    if chunk_length < 16:
        raise ValueError(f"chunk_length={chunk_length} is too small: at least 16 bytes (upstream's API uses 200)")
    units: list[tuple[int, Turn]] = []  # (index of the original turn, a piece of it)
    for i, turn in enumerate(split_turns(text)):
        tag = nbytes(Turn(turn.speaker, "").render())
        for piece in split_text(turn.text, max(1, chunk_length - tag)):
            if piece.strip():
                units.append((i, Turn(turn.speaker, piece)))
    out: list[str] = []
    group: list[tuple[int, Turn]] = []
    for unit in units:
        candidate = group + [unit]
        if group and (len({i for i, _ in candidate}) > max_turns or _line_bytes(candidate) > chunk_length):
            out.append(_render(group))
            group = [unit]
        else:
            group = candidate
    if group:
        out.append(_render(group))
    return out


def overall_finish_reason(last: str, cut: bool) -> str:
    """A segmented request's finish reason: its last segment's, but `length` when anything was cut on the way (a
    segment hit max_new_tokens, or the context dropped earlier segments); a cancel stays `cancelled`."""
    return "length" if cut and last != "cancelled" else last


def _line_bytes(group: list[tuple[int, Turn]]) -> int:
    """A batch's size as upstream counts it: its lines' UTF-8 bytes, not the newlines between them."""
    return sum(nbytes(line) for line in _lines(group))


def _render(group: list[tuple[int, Turn]]) -> str:
    """One batch's text: its lines joined with `\\n`."""
    return "\n".join(_lines(group))


def _lines(group: list[tuple[int, Turn]]) -> list[str]:
    """A batch's lines: consecutive pieces of one turn make one line (with their own whitespace), each line with its
    turn's tag."""
    lines: list[tuple[int, Turn]] = []
    for i, t in group:
        if lines and lines[-1][0] == i:
            lines[-1] = (i, Turn(t.speaker, lines[-1][1].text + t.text))
        else:
            lines.append((i, t))
    return [Turn(t.speaker, t.text.strip()).render() for _, t in lines]
