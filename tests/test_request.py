"""Transport-free logic of the s2pro/slow_ar models: chunk planning and request validation."""

import re

import numpy as np
import pytest

from s2tts.engine.chunking import Chunker, PaceMeter
from s2tts.frontend.request import Limits, TTSRequest
from s2tts.ar.sampling import SamplingParams
from s2tts.serving.call_times import CallTimes


def frames(n, start=0):
    return np.arange(start, start + n)[:, None].repeat(10, 1)


def test_chunker_first_then_fixed_sizes():
    c = Chunker(4, 6)
    got = [ch.shape[0] for i in range(20) for ch in c.add(frames(1, i))]
    assert got == [4, 6, 6] and c.flush().shape[0] == 4


def _play(first, size, r, n_frames=400, adaptive=True, decode=0.0, jitter=0.0, fixed_first=False, uniform_from=0.5,
          load_frames=0):
    """Frames come one every r frame-durations; a chunk of n frames reaches the client `decode` x n frame-durations
    after its last frame (the codec's time), and every chunk after the first `jitter` steps later still (a slow
    step: a prefill, a big codec call); the client plays from the first chunk.
    -> (chunk sizes, worst lateness in frame-durations)."""
    c = Chunker(first, size, (lambda: r) if adaptive else None, uniform_from=uniform_from, load_frames=load_frames)
    if fixed_first:  # the rule before the first chunk grew under load
        c.first_size = lambda: first
    sizes, arrivals = [], []
    for k in range(1, n_frames + 1):
        for ch in c.add(frames(1, k)):
            arrivals.append(k * r + decode * ch.shape[0] + (jitter * r if sizes else 0.0))
            sizes.append(ch.shape[0])
    start, late, sent = arrivals[0], 0.0, 0
    for n, t in zip(sizes, arrivals):
        late = max(late, t - (start + sent))  # needed when the audio sent before it has played
        sent += n
    return sizes, late


@pytest.mark.parametrize("r", [0.05, 0.3, 0.65, 0.75, 0.85])
def test_adaptive_chunks_never_underrun(r):
    sizes, late = _play(4, 16, r, jitter=2.0)
    assert late <= 0, (sizes, late)
    first = 4 if r <= 0.65 else 8 if r <= 0.8 else 16
    assert set(sizes) <= {4, 8, 16} and sizes[0] == first
    if r < 0.5:
        assert sizes == sorted(sizes) and sizes[-1] == 16  # they grow up to the cap at a constant pace
    else:
        assert set(sizes) == {first}  # under load every chunk keeps the first one's length
    # growing chunks (the rule below uniform_from) keep up at every pace as well, but with no margin left
    grown, late_grown = _play(4, 16, r, jitter=2.0, uniform_from=1.0)
    assert late_grown <= 0 and grown == sorted(grown) and grown[-1] == 16
    if r <= 0.2:
        assert sizes[1] == 16  # a fast engine goes straight to the largest chunk
    # fixed chunks after a small first one run dry at this pace: what streams did at c=64
    if r >= 0.3:
        assert _play(4, 16, r, adaptive=False)[1] > 0
    # and a first chunk of 4 under load runs dry at the second chunk when one step is slow (measured at c=64)
    if r >= 0.75:
        assert _play(4, 16, r, jitter=2.0, fixed_first=True)[1] > 0


def test_first_chunk_under_load_takes_load_frames():
    """load_frames: from a pace of load_from (0.35) the first chunk is at least that long, and from uniform_from
    (0.5) so is every later one; below load_from the rule is unchanged."""
    for r, want in ((0.3, [4, 8, 16, 16]), (0.4, [16, 16, 16, 16]), (0.6, [16, 16, 16, 16])):
        c = Chunker(4, 16, lambda: r, load_frames=16)
        got = [ch.shape[0] for i in range(64) for ch in c.add(frames(1, i))]
        assert got[:4] == want, (r, got)
    # the server's default (8 frames): growing chunks after it at c=64's pace, equal ones from 0.5
    for r, want in ((0.34, [4, 8, 16, 16]), (0.4, [8, 8, 16, 16]), (0.55, [8, 8, 8, 8])):
        c = Chunker(4, 16, lambda: r, load_frames=8, lag=1)
        got = [ch.shape[0] for i in range(64) for ch in c.add(frames(1, i))]
        assert got[:4] == want, (r, got)
    # a client playing from the first chunk never runs dry with them, a slow step (2 steps late) included
    for r in (0.36, 0.45, 0.55):
        c_sizes, late = _play(4, 16, r, jitter=2.0, load_frames=8)
        assert late <= 0 and c_sizes[0] == 8, (r, c_sizes, late)
    assert _play(4, 16, 0.6, jitter=2.0)[1] <= 0


def test_pace_of_unequal_chunks_at_equal_intervals_is_their_average():
    """s2pro's pace meter: a stream whose chunks come every 0.1 s with 4 and 12 frames of audio in turn (slow_ar
    releasing chunks together after held codec calls) is paced at 0.2 s per 16 frames (0.27), not at the mean of the
    two ratios (0.36), which would read as load that is not there."""
    frame = 2048 / 44100
    m = PaceMeter()
    assert m.pace is None
    for k in range(200):
        m.observe(0.1, (4 if k % 2 else 12) * frame)
    assert m.pace == pytest.approx(0.2 / (16 * frame), rel=0.03)
    steady = PaceMeter()
    steady.observe(0.05, 0.25)  # the first observation is taken whole
    assert steady.pace == pytest.approx(0.2)


def test_call_times_log_each_name_once_a_period(monkeypatch):
    """s2pro's account of its calls out of the process: one line a period, each name with its count and p50 / p99 /
    max in ms, from whichever thread's call ends the period; then a fresh period. Every call also goes to `observe`
    (s2pro's histogram)."""
    import s2tts.serving.call_times as sv

    clock, lines, seen = [50.0], [], []
    monkeypatch.setattr(sv.time, "monotonic", lambda: clock[0])
    t = CallTimes("s2pro", lines.append, every_s=10.0, observe=lambda what, s: seen.append((what, s)))
    for i in range(100):
        t.add("send", 0.001 * (i + 1))  # 1 .. 100 ms
    t.add("slow_ar next chunk", 0.25)
    assert lines == []
    clock[0] += 10.0
    t.add("send", 0.002)
    assert len(lines) == 1
    assert lines[0].startswith("s2pro, last 10 s: send 101 x, 50.0 ms p50 / 99.0 p99 / 100.0 max; ")
    assert lines[0].endswith("slow_ar next chunk 1 x, 250.0 ms p50 / 250.0 p99 / 250.0 max")
    clock[0] += 3.0
    with t.timed("dac_decoder"):
        pass
    assert len(lines) == 1  # a new period: 3 s of it so far
    clock[0] += 7.0
    t.add("send", 0.004)
    assert len(lines) == 2 and lines[1].startswith("s2pro, last 10 s: dac_decoder 1 x, ") and "send 1 x, 4.0 ms p50" in lines[1]
    assert "slow_ar" not in lines[1]
    assert len(seen) == 104 and seen[0] == ("send", 0.001) and seen[100] == ("slow_ar next chunk", 0.25)  # every call


def test_adaptive_chunks_follow_the_pace_and_keep_slack_for_the_codec():
    pace = [0.2]
    c = Chunker(4, 32, lambda: pace[0])
    got = [ch.shape[0] for i in range(20) for ch in c.add(frames(1, i))]
    assert got == [4, 16]  # after 4 frames at r = 0.2 the next may end by 4 + 0.8 * 4 / 0.2 = 20: 16 frames, not 32
    pace[0] = 0.7  # slower: growth slows (4 + 0.8 * 20 / 0.7 - 20 = 6.9 -> 4)
    got = [ch.shape[0] for i in range(20, 28) for ch in c.add(frames(1, i))]
    assert got == [4, 4]
    pace[0] = 2.0  # slower than real time: no cadence keeps up; the largest chunks, for throughput
    got = [ch.shape[0] for i in range(28, 92) for ch in c.add(frames(1, i))]
    assert got == [32, 32]
    # the codec's time for the bigger chunks (here 10% of real time) is covered by the safety margin
    assert _play(4, 16, 0.65, decode=0.1)[1] <= 0


@pytest.mark.parametrize("kw,msg", [
    (dict(text=" "), "text is empty"),
    (dict(first_chunk_frames=0), "first_chunk_frames=0 is out of range"),
    (dict(reference_codes=np.zeros((10, 3)), reference_audio=np.zeros(16000, np.float32), reference_sample_rate=16000,
          reference_text="x"), "either reference_audio or reference_codes"),
    (dict(reference_audio=np.zeros(10, np.float32), reference_sample_rate=16000, reference_text="x"), "at least 0.2 s"),
    (dict(reference_audio=np.full(16000, 1e6, np.float32), reference_sample_rate=16000, reference_text="x"),
     "peaks at 1e+06: send float PCM in [-1, 1]"),
    (dict(reference_audio=np.zeros(16000, np.float32), reference_sample_rate=4000, reference_text="x"),
     "reference_sample_rate=4000 is out of range: use an integer in [8000, 192000]"),
])
def test_request_validation(kw, msg):
    base = dict(text="Hello.", params=SamplingParams(), first_chunk_frames=4, chunk_frames=16)
    with pytest.raises(ValueError, match=re.escape(msg)):
        TTSRequest(**{**base, **kw}).validate(Limits(), 10)
