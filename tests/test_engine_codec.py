"""The codec in the engine's loop (`EngineService(codec=...)`, what slow_ar runs with codec_in_engine), on the tiny
checkpoint, fp32, CPU, without Triton: each chunk's audio leaves with its codes, decoded in one call per step for
all streams; the audio joins into one seamless decode of the request's codes, also when a stream spans two
requests; streams close on every way a request can end; a codec failure ends only the requests it touched."""

import threading
import time

from collections import defaultdict

import numpy as np
import pytest

from s2tts.codec.loading import codec_codebook_sizes, codec_frame_seconds, load_codec_from_dir
from s2tts.codec.stream import StreamDecoder
from s2tts.engine import Engine, EngineConfig
from s2tts.engine.chunking import LoadMeter
from s2tts.engine.service import CodecStream, EngineService
from s2tts.ar.sampling import SamplingParams


@pytest.fixture(scope="module")
def codec(tiny_ckpt):
    return load_codec_from_dir(tiny_ckpt, "cpu", "fp32")


class _Responder:
    def __init__(self):
        self.sent, self.finals, self.cancelled = [], 0, False
        self.done = threading.Event()

    def send(self, response, final):
        self.sent.append(response)
        if final:
            self.finals += 1
            self.done.set()

    def is_cancelled(self):
        return self.cancelled


def _service(model, tiny_ckpt, decoder, max_batch=4, frame_seconds=None, **config):
    eng = Engine(model, codec_codebook_sizes(tiny_ckpt)[1],
                 EngineConfig(max_batch=max_batch, max_seq_len=512, prefix_cache_mb=0, **config))
    return EngineService(eng, lambda codes, reason, stats, audio: ("ok", codes, reason, audio),
                         lambda e: ("error", e), codec=decoder, frame_seconds=frame_seconds)


def _whole(codec, codes: np.ndarray) -> np.ndarray:
    """One decode of all of a stream's codes [frames, C], in a fresh decoder."""
    return StreamDecoder(codec).decode_many([("k", "s", codes, True, True)], now=0.0)["k"]


def _wait(responders, timeout=120):
    deadline = time.monotonic() + timeout
    for r in responders:
        assert r.done.wait(max(0.0, deadline - time.monotonic())), "no final response"


def _serve_all(svc, prompts, lengths, seed, name, first_chunk_frames, chunk_frames) -> list[_Responder]:
    """Submit one request per length (seed + i, prompt "{name} i."), wait for all, shut the service down."""
    rs = [_Responder() for _ in lengths]
    try:
        for i, (r, n) in enumerate(zip(rs, lengths)):
            sp = SamplingParams(seed=seed + i, max_new_tokens=n, ignore_end=True)
            svc.submit(f"{name}{i}", r, prompts.build(f"{name} {i}."), sp, first_chunk_frames=first_chunk_frames,
                       chunk_frames=chunk_frames)
        _wait(rs)
    finally:
        svc.shutdown()
    return rs


@pytest.mark.parametrize("concurrent", [False, True])
def test_chunks_carry_audio_that_joins_seamlessly(model, prompts, tiny_ckpt, codec, concurrent):
    """Three requests at once: every chunk's audio is its own frames (2048 samples each), decoded in batches of
    several streams, and each request's audio is one whole decode of its codes; also with the codec's calls made
    by a thread of their own (`codec_concurrent`)."""
    decoder = StreamDecoder(codec, pool_size=8)
    svc = _service(model, tiny_ckpt, decoder, codec_concurrent=concurrent)
    rs = [_Responder() for _ in range(3)]
    try:
        for i, r in enumerate(rs):
            sp = SamplingParams(seed=40 + i, max_new_tokens=9 + 4 * i, ignore_end=True)
            assert svc.submit(f"c{i}", r, prompts.build(f"Request number {i}."), sp, first_chunk_frames=2,
                              chunk_frames=4) is not None
        _wait(rs)
    finally:
        svc.shutdown()
    for i, r in enumerate(rs):
        assert r.finals == 1 and all(kind == "ok" for kind, *_ in r.sent)
        codes = np.concatenate([c for _, c, _, _ in r.sent])
        audio = np.concatenate([a for _, _, _, a in r.sent])
        assert codes.shape[0] == 9 + 4 * i and r.sent[-1][2] == "length"
        assert [a.size for _, c, _, a in r.sent] == [c.shape[0] * 2048 for _, c, _, _ in r.sent]
        assert r.sent[0][1].shape[0] == 2  # the first chunk is first_chunk_frames
        np.testing.assert_allclose(audio, _whole(codec, codes.astype(np.int64)), atol=1e-5, rtol=0)
    assert max(decoder.batches) > 1  # streams were decoded together
    assert decoder.states == {}  # every stream closed with its last chunk


@pytest.mark.parametrize("load,first", [(8, 8), (0, 4)])
def test_first_chunk_grows_under_load(model, prompts, tiny_ckpt, codec, load, first):
    """`load_chunk_frames` (slow_ar's setting): at a pace of 0.45 s of work a second of audio (under load) a
    stream's first chunk is 8 frames, not first_chunk_frames' 4; later chunks still grow, and the audio is still one
    seamless decode of the codes."""
    svc = _service(model, tiny_ckpt, StreamDecoder(codec, pool_size=4), frame_seconds=codec_frame_seconds(tiny_ckpt),
                   load_chunk_frames=load, codec_batch_steps=1)  # chunks decoded each step: no held calls' lag
    svc.load.pace = lambda: 0.45  # the pace the chunker reads (measured from the steps otherwise)
    (r,) = _serve_all(svc, prompts, [30], 7, "load", first_chunk_frames=4, chunk_frames=16)
    sizes = [c.shape[0] for _, c, _, _ in r.sent]
    assert sizes[0] == first and sum(sizes) == 30 and max(sizes) > first, sizes
    codes = np.concatenate([c for _, c, _, _ in r.sent]).astype(np.int64)
    np.testing.assert_allclose(np.concatenate([a for *_, a in r.sent]), _whole(codec, codes), atol=1e-5, rtol=0)


@pytest.mark.parametrize("streams,first", [(3, 8), (2, 4)])
def test_a_full_batch_is_load_at_any_pace(model, prompts, tiny_ckpt, codec, streams, first):
    """At a light pace (0.1: a fast engine) three requests in a batch of four are still load: their first chunks
    grow to `load_chunk_frames` (8); two requests at the same pace are not (first_chunk_frames' 4)."""
    svc = _service(model, tiny_ckpt, StreamDecoder(codec, pool_size=4), frame_seconds=codec_frame_seconds(tiny_ckpt),
                   load_chunk_frames=8, codec_batch_steps=1)
    svc.load.pace = lambda: 0.1
    rs = _serve_all(svc, prompts, [20] * streams, 31, "Full", first_chunk_frames=4, chunk_frames=16)
    assert [r.sent[0][1].shape[0] for r in rs] == [first] * streams
    assert all(sum(c.shape[0] for _, c, _, _ in r.sent) == 20 for r in rs)
    assert (svc.loop.loaded > 0) == (first == 8)


def test_one_codec_stream_across_two_requests(model, prompts, tiny_ckpt, codec):
    """A text spoken in two segments (two engine requests) continues one codec stream: the second request's audio
    picks up where the first's stopped, and the stream stays open in between and closes after the second."""
    decoder = StreamDecoder(codec, pool_size=4)
    svc = _service(model, tiny_ckpt, decoder)
    a, b = _Responder(), _Responder()
    try:
        svc.submit("seg0", a, prompts.build("First segment."), SamplingParams(seed=1, max_new_tokens=7, ignore_end=True),
                   3, 4, CodecStream("talk", start=True, final=False))
        _wait([a])
        time.sleep(0.2)
        assert EngineService.caller_stream("talk") in decoder.states  # kept for the next segment
        svc.submit("seg1", b, prompts.build("Second segment."), SamplingParams(seed=2, max_new_tokens=6, ignore_end=True),
                   3, 4, CodecStream("talk", start=False, final=True))
        _wait([b])
        time.sleep(0.2)
    finally:
        svc.shutdown()
    sent = a.sent + b.sent
    assert all(kind == "ok" for kind, *_ in sent)
    codes = np.concatenate([c for _, c, _, _ in sent]).astype(np.int64)
    audio = np.concatenate([x for _, _, _, x in sent])
    assert codes.shape[0] == 13
    np.testing.assert_allclose(audio, _whole(codec, codes), atol=1e-5, rtol=0)
    assert decoder.states == {}


def test_streams_close_on_cancel_and_on_request(model, prompts, tiny_ckpt, codec):
    """A cancelled request's codec stream is closed (its last codes are not decoded); so is a stream its caller
    closes with close_codec (a next segment that will not come)."""
    decoder = StreamDecoder(codec, pool_size=4)
    svc = _service(model, tiny_ckpt, decoder)
    r = _Responder()
    kept = _Responder()
    try:
        svc.submit("long", r, prompts.build("Cancel me."), SamplingParams(seed=3, max_new_tokens=300, ignore_end=True), 2, 2)
        svc.submit("kept", kept, prompts.build("Keep my stream."), SamplingParams(seed=4, max_new_tokens=3, ignore_end=True),
                   2, 2, CodecStream("left-open", start=True, final=False))
        deadline = time.monotonic() + 60
        while len(r.sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(decoder.states) >= 1
        r.cancelled = True
        _wait([r, kept])
        time.sleep(0.3)
        assert r.sent[-1][2] == "cancelled" and r.sent[-1][3].size == 0
        assert set(decoder.states) == {EngineService.caller_stream("left-open")}
        svc.close_codec("left-open")
        deadline = time.monotonic() + 10
        while decoder.states and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decoder.states == {}
    finally:
        svc.shutdown()


def test_closing_the_stream_of_a_running_request_cancels_it(model, prompts, tiny_ckpt, codec, s2_log):
    """close_codec for the stream of a request still decoding (s2pro dropped it: its client went away): the request
    ends `cancelled`, no chunk is decoded into the closed stream (no "audio decode failed"), nothing stays open, and
    a neighbour goes on."""
    decoder = StreamDecoder(codec, pool_size=4)
    svc = _service(model, tiny_ckpt, decoder)
    r, other = _Responder(), _Responder()
    try:
        svc.submit("dropped", r, prompts.build("Drop my stream."), SamplingParams(seed=3, max_new_tokens=300,
                   ignore_end=True), 2, 2, CodecStream("gone", start=True, final=True))
        svc.submit("other", other, prompts.build("Go on."), SamplingParams(seed=4, max_new_tokens=30, ignore_end=True),
                   2, 2)
        deadline = time.monotonic() + 60
        while len(r.sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert EngineService.caller_stream("gone") in decoder.states
        svc.close_codec("gone")
        _wait([r, other])
        time.sleep(0.3)
    finally:
        svc.shutdown()
    assert r.sent[-1][0] == "ok" and r.sent[-1][2] == "cancelled"
    assert len(r.sent) < 150  # stopped long before its 300 frames
    assert "audio decode failed" not in s2_log.text
    assert other.sent[-1][2] == "length" and sum(a.size for *_, a in other.sent) == 30 * 2048
    assert decoder.states == {}


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_codec_failure_ends_only_its_requests(model, prompts, tiny_ckpt, codec, concurrent):
    """The codec raising on a call: the requests in that call end with an error naming the decode, the service
    stays healthy, and the next request gets its audio (also when the codec's thread made the call)."""
    from injection import fail_on_call

    decoder = StreamDecoder(codec, pool_size=4)
    decoder.decode_many = fail_on_call(decoder.decode_many, 2, "codec kernel failed")
    svc = _service(model, tiny_ckpt, decoder, codec_concurrent=concurrent)
    bad, good = _Responder(), _Responder()
    try:
        svc.submit("bad", bad, prompts.build("Fails."), SamplingParams(seed=5, max_new_tokens=40, ignore_end=True), 2, 2)
        _wait([bad])
        svc.submit("good", good, prompts.build("Works."), SamplingParams(seed=6, max_new_tokens=5, ignore_end=True), 2, 2)
        _wait([good])
    finally:
        svc.shutdown()
    assert bad.sent[-1][0] == "error" and "codec kernel failed" in bad.sent[-1][1].message
    assert svc.health.ok
    assert good.sent[-1][0] == "ok" and sum(a.size for *_, a in good.sent) == 5 * 2048


def _recording(decoder):
    """Record each codec call's jobs as [(stream id, frames, final)]."""
    calls, inner = [], decoder.decode_many

    def decode_many(jobs, now, **kw):
        calls.append([(sid, codes.shape[0], final) for _, sid, codes, _, final in jobs])
        return inner(jobs, now, **kw)

    decoder.decode_many = decode_many
    return calls


def _boundaries(calls, sid):
    """Where a stream's decoded slices ended (cumulative frames)."""
    out, at = [], 0
    for call in calls:
        for s, n, _ in call:
            if s == sid and n:
                at += n
                out.append(at)
    return out


@pytest.mark.parametrize("pace", [0.45, 0.2])
def test_under_load_all_streams_decode_together_in_slices(model, prompts, tiny_ckpt, codec, pace):
    """codec_batch_steps=4 under load (a pace of 0.45): every fourth step the codec decodes the frames every stream
    made since, in slices of 4 frames (until a stream has sent 4 frames of audio, at least what its chunks need, for
    time to first audio and a client holding little audio; its last frames padded), whatever the chunks; a chunk
    leaves once its frames are decoded, chunks ready together as one response. At a light pace (0.2) the codec
    decodes each chunk as it completes, as with codec_batch_steps=1. Either way each request's audio is one
    seamless decode of its codes, and every response's audio is its own frames. (A batch of 8: four requests in
    a batch of four would be load at any pace.)"""
    decoder = StreamDecoder(codec, pool_size=8)
    calls = _recording(decoder)
    svc = _service(model, tiny_ckpt, decoder, max_batch=8, codec_batch_steps=4,
                   frame_seconds=codec_frame_seconds(tiny_ckpt))
    svc.load.pace = lambda: pace
    rs = _serve_all(svc, prompts, [17, 22, 26, 30], 80, "Slice me", first_chunk_frames=2, chunk_frames=3)
    sids = [f"own/{rec}" for rec in sorted({sid.split("/")[1] for call in calls for sid, *_ in call}, key=int)]
    for r, n in zip(rs, [17, 22, 26, 30]):
        assert all(kind == "ok" for kind, *_ in r.sent) and r.sent[-1][2] == "length"
        codes = np.concatenate([c for _, c, _, _ in r.sent]).astype(np.int64)
        assert codes.shape[0] == n
        assert [a.size for _, c, _, a in r.sent] == [c.shape[0] * 2048 for _, c, _, _ in r.sent]
        np.testing.assert_allclose(np.concatenate([a for *_, a in r.sent]), _whole(codec, codes), atol=1e-5, rtol=0)
    assert len(sids) == 4 and decoder.states == {}
    assert svc.loop.loaded == (svc.loop.steps if pace > 0.35 else 0)  # under load from the first step on
    if pace > 0.35:
        for sid, n in zip(sids, [17, 22, 26, 30]):
            b = _boundaries(calls, sid)
            # slices of 4 once a stream has sent 4 frames of audio (before, its chunks as they complete: a first
            # chunk of 2 is followed at once)
            i = next(k for k, x in enumerate(b) if x >= 4)
            assert b[-1] == n and all((y - x) % 4 == 0 for x, y in zip(b[i:], b[i + 1 : -1])), b
        assert max(len(call) for call in calls) == 4  # all four streams in one call
        sizes = [c.shape[0] for r in rs for _, c, _, _ in r.sent[:-1]]
        assert any(k > 3 for k in sizes), sizes  # chunks of 2 and 3 frames that left together, as one
    else:
        chunk_ends = {n: set(np.cumsum([c.shape[0] for _, c, _, _ in r.sent]).tolist()) for r, n in
                      zip(rs, [17, 22, 26, 30])}
        for sid, n in zip(sids, [17, 22, 26, 30]):
            assert set(_boundaries(calls, sid)) <= chunk_ends[n]  # each slice ended where a chunk did


def test_a_finished_request_waits_at_most_codec_final_steps_for_its_last_audio(model, prompts, tiny_ckpt, codec):
    """Under load with held calls (codec_batch_steps=8), a finished request's final item waits for the next held
    call: up to 8 passes (`codec_final_steps=8`). With 1 its last frames go in a call of the finished requests alone
    the pass after, with 0 in the pass it ended: every final is handed out within that many passes, in calls that
    carry only final jobs besides the held ones, and each request's audio is still one seamless decode of its
    codes."""

    def run(early):
        decoder = StreamDecoder(codec, pool_size=8)
        calls = _recording(decoder)
        svc = _service(model, tiny_ckpt, decoder, max_batch=8, codec_batch_steps=8,
                       frame_seconds=codec_frame_seconds(tiny_ckpt))
        svc.codec_final_steps = early
        svc.load.pace = lambda: 0.45
        lengths = [19, 26, 33, 37]
        rs = _serve_all(svc, prompts, lengths, 70, "Finish early", first_chunk_frames=2, chunk_frames=4)
        for r, n in zip(rs, lengths):
            assert all(kind == "ok" for kind, *_ in r.sent) and r.finals == 1
            codes = np.concatenate([c for _, c, _, _ in r.sent]).astype(np.int64)
            assert codes.shape[0] == n
            np.testing.assert_allclose(np.concatenate([a for *_, a in r.sent]), _whole(codec, codes), atol=1e-5,
                                       rtol=0)
        assert len(svc.loop.final_waits) == len(lengths) and decoder.states == {}
        return svc.loop.final_waits, calls

    held, _ = run(8)
    for early in (1, 0):
        waits, calls = run(early)
        assert max(waits) <= early < max(held), (early, waits, held)  # lengths off the 8-step cadence: some waited
        # the early calls: every job in them a final one (a held call has every live stream's slice)
        assert any(all(final for *_, final in call) for call in calls), calls


def test_a_first_chunk_waits_at_most_codec_first_steps_for_its_audio(model, prompts, tiny_ckpt, codec):
    """Under load with held calls (codec_batch_steps=8), a stream's first chunk (3 frames: complete off the held
    cadence) waits for the next held call with `codec_first_steps=8`; with 2 it waits at most 2 passes, with 0 none
    (a call between the held ones). Each request's audio is still one seamless decode of its codes."""

    def run(first_steps):
        decoder = StreamDecoder(codec, pool_size=8)
        svc = _service(model, tiny_ckpt, decoder, max_batch=8, codec_batch_steps=8, load_chunk_frames=0,
                       codec_first_steps=first_steps, frame_seconds=codec_frame_seconds(tiny_ckpt))
        svc.load.pace = lambda: 0.45
        lengths = [19, 26, 33, 37]
        rs = _serve_all(svc, prompts, lengths, 90, "First early", first_chunk_frames=3, chunk_frames=4)
        for r, n in zip(rs, lengths):
            assert all(kind == "ok" for kind, *_ in r.sent) and r.finals == 1 and r.sent[0][1].shape[0] == 3
            codes = np.concatenate([c for _, c, _, _ in r.sent]).astype(np.int64)
            assert codes.shape[0] == n
            np.testing.assert_allclose(np.concatenate([a for *_, a in r.sent]), _whole(codec, codes), atol=1e-5,
                                       rtol=0)
        assert len(svc.loop.first_waits) == len(lengths) and svc.loop.loaded > 0 and decoder.states == {}
        return svc.loop.first_waits

    held = run(8)
    assert max(held) > 2, held  # the held cadence is 8 passes: a chunk complete off it waited
    for early in (2, 0):
        waits = run(early)
        assert max(waits) <= early, (early, waits, held)


def test_a_first_chunk_decoded_between_held_calls_is_followed_by_its_second_once_complete(model, prompts, tiny_ckpt,
                                                                                           codec):
    """With `codec_first_steps=0` under load (held calls of 8-frame slices, 8-frame first chunks), each stream's
    first chunk is decoded the pass it is complete, and its second in the pass that completes it: 8 passes later,
    not at the next held call (up to 15 passes after the first, longer than the first chunk's audio lasts at a
    pace near 0.5). Later slices follow the held cadence. The audio is one seamless decode."""
    decoder = StreamDecoder(codec, pool_size=8)
    svc = _service(model, tiny_ckpt, decoder, max_batch=8, codec_batch_steps=8, codec_first_steps=0,
                   max_prefill_tokens=16, frame_seconds=codec_frame_seconds(tiny_ckpt))  # prompts a few passes apart
    svc.load.pace = lambda: 0.45
    at, inner = defaultdict(list), decoder.decode_many

    def decode_many(jobs, now, **kw):  # the pass each stream's slices were decoded in
        for _, sid, codes, _, _ in jobs:
            if codes.shape[0]:
                at[sid].append((svc.loop.passes, codes.shape[0]))
        return inner(jobs, now, **kw)

    decoder.decode_many = decode_many
    lengths = [30, 34, 38, 42]
    rs = _serve_all(svc, prompts, lengths, 110, "Second soon", first_chunk_frames=8, chunk_frames=8)
    assert len(at) == 4 and svc.loop.loaded > 0
    for sid, slices in at.items():
        (p1, n1), (p2, n2), (p3, _) = slices[:3]
        assert n1 == n2 == 8 and p2 - p1 == 8, slices  # one frame a pass: complete 8 passes after the first
        assert p3 % 8 == 0, slices  # the third: a held call's
    for r, n in zip(rs, lengths):
        assert all(kind == "ok" for kind, *_ in r.sent) and r.sent[0][1].shape[0] == 8
        codes = np.concatenate([c for _, c, _, _ in r.sent]).astype(np.int64)
        assert codes.shape[0] == n
        np.testing.assert_allclose(np.concatenate([a for *_, a in r.sent]), _whole(codec, codes), atol=1e-5, rtol=0)


def test_a_short_first_chunk_is_followed_at_once_when_load_comes(model, prompts, tiny_ckpt, codec):
    """A stream whose first chunk (2 frames) was decoded before the load came: under load (held calls of 4-frame
    slices) its next chunk is still decoded as soon as it is complete, not when a whole slice is (its client holds
    only 2 frames of audio), until it has sent 4 frames; then slices of 4. The audio is one seamless decode."""
    decoder = StreamDecoder(codec, pool_size=4)
    calls = _recording(decoder)
    svc = _service(model, tiny_ckpt, decoder, codec_batch_steps=4, frame_seconds=codec_frame_seconds(tiny_ckpt))
    svc.load.pace = lambda: 0.45 if calls else 0.2  # light until the first chunk is decoded, then under load
    (r,) = _serve_all(svc, prompts, [21], 90, "Load comes", first_chunk_frames=2, chunk_frames=4)
    sizes = [c.shape[0] for _, c, _, _ in r.sent]
    (sid,) = {s for call in calls for s, *_ in call}
    b = _boundaries(calls, sid)
    assert sizes[:2] == [2, 2] and b[:2] == [2, 4], (sizes, b)  # without the rule: [2, 6], a slice of 4 waited for
    assert all((y - x) % 4 == 0 for x, y in zip(b[1:], b[2:-1])), b  # then slices of 4 (the last padded)
    assert svc.loop.loaded > 0
    codes = np.concatenate([c for _, c, _, _ in r.sent]).astype(np.int64)
    assert codes.shape[0] == 21
    np.testing.assert_allclose(np.concatenate([a for *_, a in r.sent]), _whole(codec, codes), atol=1e-5, rtol=0)


def test_held_slices_decode_fewer_times_with_the_same_audio(model, prompts, tiny_ckpt, codec):
    """codec_batch_steps=4 under load against 1: fewer codec calls, the same audio; and the same again with the
    engine launching each step before the loop routes the last one's frames (`launch_ahead`, a GPU's default),
    which it does under load with held slices, and with exactly one final response a request; with it, the next
    step launched while a held codec call is queued (`codec_overlap`) or not. The count compares held calls only
    (`codec_final_steps=4`: a request's last frames wait for the held call too); the other runs decode them in the
    step their request ends (the default, 0)."""
    from injection import fail_on_call

    def run(steps, ahead=None, overlap=True, fail_launch=False, final_steps=0):
        decoder = StreamDecoder(codec, pool_size=8)
        svc = _service(model, tiny_ckpt, decoder, codec_batch_steps=steps, frame_seconds=codec_frame_seconds(tiny_ckpt),
                       launch_ahead=ahead, codec_final_steps=final_steps)
        svc.codec_overlap = overlap
        svc.load.pace = lambda: 0.45
        launched, early = [], []
        step_ahead, launch_next = svc.engine.step_ahead, svc.engine.launch_next
        svc.engine.step_ahead = lambda: launched.append(1) or step_ahead()

        def counted():  # a step launched during a codec call: two in flight after it
            out = launch_next()
            early.append(len(svc.engine._inflight))
            return out

        # a launch that raises during a codec call: the next pass raises it (logged), the call's streams get audio
        svc.engine.launch_next = fail_on_call(counted, 1, "launch failed") if fail_launch else counted
        rs = _serve_all(svc, prompts, [25, 30, 35, 40], 60, "Batch me", first_chunk_frames=1, chunk_frames=1)
        assert all(kind == "ok" for r in rs for kind, *_ in r.sent) and all(r.finals == 1 for r in rs)
        assert bool(launched) == bool(ahead)
        assert (2 in early) == bool(ahead and overlap), early
        return [np.concatenate([a for *_, a in r.sent]) for r in rs], svc.loop.codec_calls, decoder

    every, calls_every, _ = run(1)
    batched, calls_batched, decoder = run(4, final_steps=4)
    ahead, _, decoder_ahead = run(4, ahead=True)
    apart, _, decoder_apart = run(4, ahead=True, overlap=False)
    failed, _, _ = run(4, ahead=True, fail_launch=True)
    for a, b, c, d, f in zip(every, batched, ahead, apart, failed):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        np.testing.assert_allclose(c, b, atol=1e-5, rtol=0)
        np.testing.assert_allclose(d, b, atol=1e-5, rtol=0)
        np.testing.assert_allclose(f, b, atol=1e-5, rtol=0)
    assert calls_batched < 0.4 * calls_every, (calls_batched, calls_every)
    assert decoder.states == {} and decoder_ahead.states == {} and decoder_apart.states == {}


@pytest.mark.parametrize("concurrent", [False, True])
def test_light_load_launches_ahead_once_every_request_sounds(model, prompts, tiny_ckpt, codec, concurrent):
    """At a light load (each chunk decoded as it completes) with `light_ahead`, the engine launches steps ahead only
    while every request in flight has sent audio (a first chunk is never decoded behind a launched step), and the
    audio is that of one step at a time; also with the codec's calls made by its own thread (the engine thread
    launching the next step while the call runs)."""
    def run(light):
        decoder = StreamDecoder(codec, pool_size=8)
        svc = _service(model, tiny_ckpt, decoder, frame_seconds=codec_frame_seconds(tiny_ckpt), launch_ahead=True,
                       codec_concurrent=concurrent)
        svc.light_ahead = light
        svc.load.pace = lambda: 0.1  # a GPU's pace at one stream (this CPU's would count as load)
        ahead, step_ahead = [], svc.engine.step_ahead

        def checked():
            ahead.append(svc._all_sounding())
            return step_ahead()

        svc.engine.step_ahead = checked
        behind, launch_next = [], svc.engine.launch_next  # steps launched during a codec call
        svc.engine.launch_next = lambda: behind.append(threading.current_thread()) or launch_next()
        rs = _serve_all(svc, prompts, [9, 12], 80, "Light", first_chunk_frames=2, chunk_frames=3)
        assert all(kind == "ok" for r in rs for kind, *_ in r.sent) and all(r.finals == 1 for r in rs)
        assert not svc.under_load()
        assert all(t.name == "s2tts-engine" for t in behind), behind  # only the engine thread touches the engine
        return [np.concatenate([a for *_, a in r.sent]) for r in rs], ahead, behind

    alone, never, none_behind = run(False)
    light, ahead, behind = run(True)
    assert not never and ahead and all(ahead), ahead
    assert not none_behind and behind
    for a, b in zip(alone, light):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_slices_follow_the_lengths_the_codec_prepared(codec):
    """With CUDA graphs for some chunk lengths, a stream's frames decode in those lengths (a last piece padded to
    one); lengths without a graph would run eagerly. Checked on a CPU with the pool told it has graphs."""
    decoder = StreamDecoder(codec, pool_size=2)
    assert decoder.slices(13) == [13]  # no graphs: any length at once
    decoder.pool.use_graphs, decoder.pool.lengths = True, [4, 8]
    assert decoder.slices(8) == [8] and decoder.slices(12) == [8, 4] and decoder.slices(13) == [8, 4, 1]
    assert decoder.slices(5, final=True) == [5] and decoder.slices(13, final=True) == [8, 5]
    codes = np.random.default_rng(0).integers(0, 8, (13, decoder.C))
    parts = [decoder.decode_many([("k", "s", codes[:8], True, False)], 0.0)["k"],
             decoder.decode_many([("k", "s", codes[8:], False, True)], 0.0)["k"]]  # 5 frames padded to 8
    np.testing.assert_allclose(np.concatenate(parts), _whole(codec, codes), atol=1e-5, rtol=0)


def test_loop_windows_count_the_frames_of_its_steps(model, prompts, tiny_ckpt, codec):
    """slow_ar's loop windows (`LoopStats.windows`, what it publishes as metrics and logs) say how many frames a step
    made on average (how many slots decoded): over the windows and what is left in the last one, the frames the
    requests received, but for those of steps that only prefilled (not the streams' pace: at most a request's first
    frame each); and where the slots and the time went."""
    decoder = StreamDecoder(codec, pool_size=8)
    svc = _service(model, tiny_ckpt, decoder)
    svc.loop.every_s = 0.0  # a window after every step that called the codec
    svc.sends.every_s = 0.0  # and after every response sent
    rs = _serve_all(svc, prompts, [9, 13, 17], 70, "Count my frames", first_chunk_frames=2, chunk_frames=4)
    got = sum(codes.shape[0] for r in rs for kind, codes, *_ in r.sent if kind == "ok")
    assert got == 9 + 13 + 17
    windows = list(svc.loop.windows)
    assert windows and svc.loop.last is windows[-1]
    made = sum(w.steps * w.frames_per_step for w in windows)
    assert got - len(rs) <= round(made + svc.loop.frames) <= got
    assert all(0 < w.frames_per_step <= 3 for w in windows)  # never more frames a step than live requests
    # the engine thread's time in the codec's calls, part of the routing and decoding after the steps
    assert any(w.codec_wait_ms > 0 for w in windows) and all(w.codec_wait_ms <= w.rest_ms + 1e-9 for w in windows)
    assert all(w.under_load == 0 for w in windows)
    sent = list(svc.sends.windows)
    assert sent and all(w.responses >= 1 and w.wait_p50_ms >= 0 for w in sent)
    # where the slots went: held at each step's start (decoding or prefilling: never more than the 3 requests), none
    # waiting (3 slots free), and each request's final response timed once from its last frame
    assert all(0 < w.slots_held <= 3 and w.waiting == 0 and 0 <= w.firsts <= 1 for w in windows)
    # the engine calls split into launching and waiting (within each kind of step's time); here a step runs as it
    # is launched (no launch ahead on a CPU), so none behind a codec call
    for w in windows:
        assert w.firsts_launch_ms + w.firsts_wait_ms <= w.firsts_ms + 1e-6
        assert w.others_launch_ms + w.others_wait_ms <= w.others_ms + 1e-6
        assert w.firsts_launch_ms + w.others_launch_ms > 0 and w.firsts_behind_codec == 0
    assert sum(w.finals for w in windows) + len(svc.loop.tails) == len(rs)


def test_load_turns_on_at_once_and_off_after_a_second_of_light_steps(monkeypatch):
    """`under_load` (what grows first chunks and holds codec calls): on from the first pass at a pace of 0.35 (a
    wave of arrivals), kept while the pace averaged over about a second stays above 0.28 (a held call's own
    saving, single light steps), off once that average falls below it; and whenever three quarters of the batch's
    slots are wanted, whatever the pace, counted when asked. Without a measured pace: never."""
    import s2tts.engine.chunking as chunking

    clock = [100.0]
    monkeypatch.setattr(chunking.time, "monotonic", lambda: clock[0])
    wanted = [0]
    meter = LoadMeter(frame_seconds=2048 / 44100, max_batch=4, slots_wanted=lambda: wanted[0])
    pace = [0.2]
    meter.pace = lambda: pace[0]

    def passes(r, seconds, every=0.01):
        pace[0] = r
        for _ in range(int(seconds / every)):
            clock[0] += every
            meter.observe(every)
        return meter.under_load()

    assert not passes(0.2, 1.0)
    assert passes(0.36, 0.01)  # one pass at the load pace
    assert passes(0.3, 3.0) and passes(0.2, 0.05)  # a light stretch shorter than the average's second
    assert not passes(0.2, 2.0)
    # three quarters of the batch's slots wanted (held or waiting): under load at any pace, at once; off again as
    # soon as fewer are wanted and the pace is light
    wanted[0] = 2
    assert not passes(0.1, 1.0)
    wanted[0] = 3
    assert passes(0.1, 0.01) and passes(0.1, 3.0)
    wanted[0] = 2
    assert not passes(0.1, 0.01)
    wanted[0] = 3  # counted when asked, not at the last pass: requests back after a wave of finals
    assert meter.under_load()
    wanted[0] = 2
    assert not meter.under_load()
    wanted[0] = 5  # more waiting than slots
    assert passes(0.1, 0.01)
    # a batch sized to a large GPU's memory: LOAD_STREAMS streams are load however many slots are free
    many = LoadMeter(frame_seconds=2048 / 44100, max_batch=4 * chunking.LOAD_STREAMS, slots_wanted=lambda: wanted[0])
    many.pace = lambda: 0.1
    wanted[0] = chunking.LOAD_STREAMS - 1
    many.observe(0.01)
    assert not many.under_load()
    wanted[0] = chunking.LOAD_STREAMS
    assert many.under_load()
    fixed = LoadMeter(frame_seconds=None, max_batch=4, slots_wanted=lambda: 0)
    fixed.pace = lambda: 0.9
    fixed.observe(0.5)
    assert not fixed.under_load()


class _PoolStream:
    """Stands in for torch.cuda.Stream on a CPU machine: PyTorch's pool hands out 32 streams per priority in turn."""
    handed = {0: 0, -1: 0}

    def __init__(self, device=None, priority=0):
        self.device_index, self.priority = 0, priority
        self.stream_id = (priority, self.handed[priority] % 32)
        self.handed[priority] += 1


def test_graph_owners_get_streams_no_other_owner_has(monkeypatch):
    """The engine's and the codec's graphs are captured, and the service's steps and codec calls replayed, each on a
    stream no other of them holds (a graph keeps the cuBLAS workspace of its capture stream; two graphs of one stream
    replayed at once race in it), however many streams other code draws from the pool between them; a stream whose
    owner is gone goes to the next one."""
    import gc

    from s2tts.gpu import cuda_graphs as graphs

    monkeypatch.setattr(graphs, "_taken", {})
    monkeypatch.setattr(graphs.torch.cuda, "Stream", _PoolStream)
    held = []  # the owners keep their streams
    for k in range(40):
        held.append(graphs.own_stream("cuda", priority=-1 if k % 5 == 0 else 0))
        for _ in range(k):  # other code's streams from the same pool
            _PoolStream()
    ids = [s.stream_id for s in held]
    assert len(ids) == len(set(ids)) == 40, ids  # 32 of priority 0 and 8 of -1: all distinct
    with pytest.raises(RuntimeError, match="no CUDA stream left"):
        graphs.own_stream("cuda")  # a 33rd of priority 0: every one is held
    assert graphs.own_stream("cuda", priority=-1).stream_id[0] == -1
    gone = held.pop(3).stream_id  # an owner gone (an engine let go): its stream is free again
    gc.collect()
    assert graphs.own_stream("cuda").stream_id == gone


def test_a_cancel_during_admission_reaches_the_engine(model, prompts, tiny_ckpt, codec):
    """A cancel that comes while the request is being admitted (in the service's table, its engine request still
    being made) reaches the engine: the request ends `cancelled`, not after its 200 frames (an abort the engine
    took before the request it names was lost)."""
    from s2tts.ar.sampling import SamplingParams

    svc = _service(model, tiny_ckpt, StreamDecoder(codec))
    sch, entered = svc.engine.scheduler, threading.Event()
    real = sch.make_request

    def slow(*a):  # (the window between the table and the engine, held open)
        entered.set()
        time.sleep(0.3)
        return real(*a)

    sch.make_request = slow
    r = _Responder()
    sp = SamplingParams(seed=1, max_new_tokens=200, ignore_end=True)
    t = threading.Thread(target=svc.submit, args=("x", r, prompts.build("Cancelled as it comes."), sp, 2, 2))
    try:
        t.start()
        assert entered.wait(30) and svc.cancel("x")
        t.join(30)
        _wait([r])
    finally:
        svc.shutdown()
    assert r.finals == 1 and r.sent[-1][2] == "cancelled"
    assert sum(s[1].shape[0] for s in r.sent) < 200


def test_a_stream_closed_after_its_request_ended_still_ends_it(model, prompts, tiny_ckpt, codec, monkeypatch):
    """The caller closes a request's codec stream after the engine made the request's last frame but before its
    audio was decoded (its client went away while its final waited for a held call): the request ends at once,
    its last items without audio, instead of waiting for a decode that never comes."""
    from s2tts.ar.sampling import SamplingParams
    from s2tts.engine import service as service_module
    from s2tts.engine.codec_plan import CodecPlan

    real = service_module.plan_codec
    monkeypatch.setattr(service_module, "plan_codec", lambda views, **kw: CodecPlan() if hold else real(views, **kw))
    hold = True  # nothing is decoded: the final waits
    svc = _service(model, tiny_ckpt, StreamDecoder(codec))
    r = _Responder()
    try:
        rec = svc.submit("a", r, prompts.build("Ended, then dropped."), SamplingParams(seed=2, max_new_tokens=6,
                         ignore_end=True), 2, 2, codec_stream=CodecStream("S", True, True))
        deadline = time.monotonic() + 60
        while rec.state.counts.ended_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rec.state.counts.ended_at is not None and not r.done.is_set()
        svc.close_codec("S")
        _wait([r], timeout=30)
    finally:
        svc.shutdown()
    assert r.finals == 1 and r.sent[-1][2] == "length"


def test_a_segment_of_no_frames_opens_the_stream_the_next_continues(model, prompts, tiny_ckpt, codec):
    """A request that opens a codec stream for a later one (start, not final) and ends at its first token, with no
    frames: its stream is opened all the same, so the request that continues it (not start) is served, not refused
    for a stream that was never started."""
    from s2tts.ar.sampling import SamplingParams

    svc = _service(model, tiny_ckpt, StreamDecoder(codec))
    sch, first = svc.engine.scheduler, []
    real = sch.complete

    def complete(plan, result):  # the first request samples its end token at once
        ended = result.ended.copy()
        for i, r in enumerate(plan.sampled):
            first.append(r.id) if not first else None
            if r.id == first[0]:
                ended[i] = True
        return real(plan, type(result)(result.frames, ended))

    sch.complete = complete
    a, b = _Responder(), _Responder()
    try:
        svc.submit("seg1", a, prompts.build("One."), SamplingParams(seed=1, max_new_tokens=10), 2, 2,
                   codec_stream=CodecStream("S", True, False))
        _wait([a])
        svc.submit("seg2", b, prompts.build("Two."), SamplingParams(seed=2, max_new_tokens=6, ignore_end=True), 2, 2,
                   codec_stream=CodecStream("S", False, True))
        _wait([b])
    finally:
        svc.shutdown()
    assert a.finals == 1 and sum(s[1].shape[0] for s in a.sent) == 0 and a.sent[-1][2] == "end"
    assert b.finals == 1 and b.sent[-1][0] == "ok" and b.sent[-1][2] == "length"
    assert sum(s[3].size for s in b.sent) == 6 * 2048
