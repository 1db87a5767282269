"""The codec in the engine's loop (`EngineService(codec=...)`, what slow_ar runs with codec_in_engine), on the tiny
checkpoint, fp32, CPU, without Triton: each chunk's audio leaves with its codes, decoded in one call per step for
all streams; the audio joins into one seamless decode of the request's codes, also when a stream spans two
requests; streams close on every way a request can end; a codec failure ends only the requests it touched."""

import threading
import time

import numpy as np
import pytest

from s2tts.checkpoint import codec_codebook_sizes, load_codec_from_dir
from s2tts.codec_stream import StreamDecoder
from s2tts.engine import Engine
from s2tts.engine_service import CodecStream, EngineService
from s2tts.sampling import SamplingParams


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


def _service(model, tiny_ckpt, decoder, **kw):
    eng = Engine(model, residual_size=codec_codebook_sizes(tiny_ckpt)[1], max_batch=4, max_seq_len=512,
                 prefix_cache_bytes=0)
    return EngineService(eng, lambda codes, reason, stats, audio: ("ok", codes, reason, audio),
                         lambda e: ("error", e), codec=decoder, **kw)


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


def test_chunks_carry_audio_that_joins_seamlessly(model, prompts, tiny_ckpt, codec):
    """Three requests at once: every chunk's audio is its own frames (2048 samples each), decoded in batches of
    several streams, and each request's audio is one whole decode of its codes."""
    decoder = StreamDecoder(codec, pool_size=8)
    svc = _service(model, tiny_ckpt, decoder)
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
    """`load_chunk_frames` (slow_ar's setting): at a pace of 0.45 s of work a second of audio (c=64 on one H100) a
    stream's first chunk is 8 frames, not first_chunk_frames' 4; later chunks still grow, and the audio is still one
    seamless decode of the codes."""
    from s2tts.checkpoint import codec_frame_seconds

    svc = _service(model, tiny_ckpt, StreamDecoder(codec, pool_size=4), frame_seconds=codec_frame_seconds(tiny_ckpt),
                   load_chunk_frames=load)
    svc.pace = lambda: 0.45  # the pace the chunker reads (measured from the steps otherwise)
    (r,) = _serve_all(svc, prompts, [30], 7, "load", first_chunk_frames=4, chunk_frames=16)
    sizes = [c.shape[0] for _, c, _, _ in r.sent]
    assert sizes[0] == first and sum(sizes) == 30 and max(sizes) > first, sizes
    codes = np.concatenate([c for _, c, _, _ in r.sent]).astype(np.int64)
    np.testing.assert_allclose(np.concatenate([a for *_, a in r.sent]), _whole(codec, codes), atol=1e-5, rtol=0)


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
        assert "talk" in decoder.states  # kept for the next segment
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
        assert set(decoder.states) == {"left-open"}
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
        assert "gone" in decoder.states
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


def test_a_codec_failure_ends_only_its_requests(model, prompts, tiny_ckpt, codec):
    """The codec raising on a call: the requests in that call end with an error naming the decode, the service
    stays healthy, and the next request gets its audio."""
    from injection import fail_on_call

    decoder = StreamDecoder(codec, pool_size=4)
    decoder.decode_many = fail_on_call(decoder.decode_many, 2, "codec kernel failed")
    svc = _service(model, tiny_ckpt, decoder)
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


def test_later_chunks_wait_to_be_decoded_together(model, prompts, tiny_ckpt, codec):
    """codec_batch_steps=4: chunks after a request's first wait for every fourth step, so the codec makes fewer,
    larger calls; each request's audio is the same as with a call in every step."""
    def run(steps):
        decoder = StreamDecoder(codec, pool_size=8)
        svc = _service(model, tiny_ckpt, decoder, codec_batch_steps=steps)
        rs = _serve_all(svc, prompts, [15, 18, 21, 24], 60, "Batch me", first_chunk_frames=1, chunk_frames=2)
        assert all(kind == "ok" for r in rs for kind, *_ in r.sent)
        return [np.concatenate([a for *_, a in r.sent]) for r in rs], svc.loop.codec_calls, decoder

    every, calls_every, _ = run(1)
    batched, calls_batched, decoder = run(4)
    for a, b in zip(every, batched):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert calls_batched < 0.8 * calls_every, (calls_batched, calls_every)
    assert decoder.states == {}


def test_loop_log_counts_the_frames_of_its_steps(model, prompts, tiny_ckpt, codec, s2_log):
    """slow_ar's loop line says how many frames a step made on average (how many slots decoded): over the logged
    windows and what is left in the last one, the frames the requests received, but for those of steps that only
    prefilled (not the streams' pace: at most a request's first frame each)."""
    import re

    decoder = StreamDecoder(codec, pool_size=8)
    svc = _service(model, tiny_ckpt, decoder)
    svc.loop.every_s = 0.0  # a line after every step that called the codec
    rs = _serve_all(svc, prompts, [9, 13, 17], 70, "Count my frames", first_chunk_frames=2, chunk_frames=4)
    got = sum(codes.shape[0] for r in rs for kind, codes, *_ in r.sent if kind == "ok")
    assert got == 9 + 13 + 17
    lines = re.findall(r"(\d+) steps of [\d.]+ ms making ([\d.]+) frames each", s2_log.text)
    assert lines
    logged = sum(int(steps) * float(each) for steps, each in lines)
    assert got - len(rs) <= round(logged + svc.loop.frames) <= got
    assert all(0 < float(each) <= 3 for _, each in lines)  # never more frames a step than live requests
