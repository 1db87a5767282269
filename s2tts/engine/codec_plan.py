"""What the engine's loop decodes after a step, with the codec in it: a pure function of the streams' counts.

`plan_codec` is to the codec what `Scheduler.schedule` is to the AR: plain Python, no device, no model, tested by
itself (tests/test_codec_plan.py). It sees each request waiting for audio as a `StreamView` and returns a
`CodecPlan`: how many frames of each to decode now (`Take`) and how they go through the codec, as calls of one
slice per stream (`Slice`). The service applies it (cuts the frames, runs the calls, releases the chunks whose audio
is there).

When to decode:
- light load (or `batch_steps` 1): after every step, what the waiting chunks need;
- under load with `batch_steps` = K > 1: every K passes (or when the engine runs out of work), whole slices of K
  frames of every stream, so that one call of one length decodes all streams (a call's cost on a GPU is mostly per
  length, not per frame); between those passes, only the last frames of requests that ended `final_steps` passes
  before (their clients' next requests wait for them) and the first chunks complete `first_steps` passes before
  (their clients wait for their first audio), each followed by its second once complete; and at once when a stream
  that has sent fewer than K frames of audio has a chunk complete (its client could run dry before the next held
  call).
A request's last frames are always decoded whole once its final item is routed; a stream it leaves open (a later
request continues it) is not closed, and is opened (empty) by one that made no frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple


@dataclass(slots=True)
class StreamView:
    """A request's counts as the planner sees them. The serving loop's state of the request holds one and keeps it
    up to date as frames, audio and items come and go, so that a pass hands the planner what is there, making none."""

    key: int  # the request's internal id
    undecoded: int = 0  # frames made and not yet decoded
    waiting: int = 0  # frames of its chunks waiting for their audio
    audio: int = 0  # frames of decoded audio not yet sent
    released: int = 0  # frames whose audio was sent
    closes: bool = True  # its codec stream closes with it (no later request continues it)
    open: bool = False  # the codec holds state for its stream (opened, or continued from an earlier request)
    ended_at: int | None = None  # the pass that routed its final item (the engine made its last frame)
    first_at: int | None = None  # the pass that routed its first chunk (complete: its frames made)

    @property
    def need(self) -> int:
        """Frames its waiting chunks need decoded beyond the audio it holds."""
        return self.waiting - self.audio

    @property
    def ended(self) -> bool:
        return self.ended_at is not None


class Take(NamedTuple):
    """One request's frames decoded in this plan: its next `frames` undecoded frames."""

    key: int
    frames: int
    opens: bool  # the first slice opens its stream
    closes: bool  # the last slice closes its stream


class Slice(NamedTuple):
    """One stream's part of one codec call: `frames` of its take, from `offset`."""

    key: int
    offset: int
    frames: int
    start: bool
    final: bool


class CodecPlan(NamedTuple):
    takes: tuple[Take, ...] = ()
    calls: tuple[tuple[Slice, ...], ...] = ()  # in order; a stream at most once a call, its slices in order
    held: bool = False  # under load: the slices of a held call (or finals between them), not per chunk


def plan_codec(streams: list[StreamView], *, passes: int, batch_steps: int, under_load: bool, engine_idle: bool,
               final_steps: int, first_steps: int, slices: Callable[[int, bool], list[int]]) -> CodecPlan:
    """The decoding of this pass (`passes`: the count of passes so far, this one included) -> `CodecPlan`.
    `slices(n, final)`: the codec's lengths for n frames of a stream (`StreamDecoder.slices`)."""
    K = max(1, batch_steps)
    held = K > 1 and under_load
    if not held or passes % K == 0 or engine_idle or _short_of_audio(streams, K):
        takes = [t for s in streams if (t := _take(s, K if held else 0))]
    else:  # between held calls: the requests that ended final_steps passes ago and the first chunks due, alone
        takes = [t for s in streams if (_due(s.ended_at, passes, final_steps, K) or _early(s, passes, first_steps, K))
                 and (t := _take(s, K))]
    return CodecPlan(tuple(takes), _calls(takes, slices), held)


def _due(at: int | None, passes: int, steps: int, K: int) -> bool:
    """Whether what came at pass `at` has waited its `steps` for a held call (`steps` >= K: it always waits)."""
    return at is not None and steps < K and passes - at >= steps


def _early(s: StreamView, passes: int, first_steps: int, K: int) -> bool:
    """Whether a stream's chunk goes between held calls: its first, complete `first_steps` passes ago; and while
    it has sent no more than K frames, its next one once complete (the first one's audio, decoded off the held
    cadence, could run out before a held call up to 2 K - 1 passes away decodes the next)."""
    return s.need > 0 and s.released <= K and _due(s.first_at, passes, first_steps, K)


def _short_of_audio(streams: list[StreamView], K: int) -> bool:
    """Whether a stream that has sent fewer than K frames of audio (a first chunk made before the load came, shorter
    than the load's first chunks) has a chunk complete: its client may run dry before a held call (up to 2 K - 1
    passes away) would decode it."""
    return any(0 < s.released < K and s.need > 0 for s in streams)


def _take(s: StreamView, K: int) -> Take | None:
    """One request's frames to decode now. All of them once it ended; else without K (per chunk) the frames its
    waiting chunks need; with K (held calls) as many whole slices of K as it has made, and until it has sent K
    frames of audio at least what its chunks need."""
    if s.ended:
        n = s.undecoded
    elif not K:
        n = s.need
    else:
        n = K * (s.undecoded // K)
        if s.released < K:
            n = max(n, s.need)
    closes = s.ended and s.closes
    # nothing to decode, and no open stream to close; but a stream a later request continues is opened even empty
    # (a request that made no frames), so that the later request finds it
    if n <= 0 and not (closes and s.open) and not (s.ended and not s.open and not s.closes):
        return None
    return Take(s.key, max(0, n), not s.open, closes)


def _calls(takes: list[Take], slices: Callable[[int, bool], list[int]]) -> tuple[tuple[Slice, ...], ...]:
    """Each take cut into the codec's lengths; every stream's first slice in the first call, its second (rare: a
    length the codec has no graph for) in the next..."""
    per = []
    for t in takes:
        pieces = slices(t.frames, t.closes) if t.frames else [0]
        out, at = [], 0
        for k, n in enumerate(pieces):
            out.append(Slice(t.key, at, n, t.opens and k == 0, t.closes and k == len(pieces) - 1))
            at += n
        per.append(out)
    rounds = max((len(p) for p in per), default=0)
    return tuple(tuple(p[r] for p in per if len(p) > r) for r in range(rounds))
