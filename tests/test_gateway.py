"""The OpenAI-compatible gateway end to end: real tritonserver (tiny checkpoint, CPU), real gateway
processes, the official `openai` SDK, real audio decoded back and checked."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from servers import Gateway, cancelled_counts, cancelled_since, free_port, log_showing

av = pytest.importorskip("av")

ROOT = Path(__file__).resolve().parents[1]
SR = 44100
FRAME = 2048  # samples per codec frame at 44.1 kHz
MODEL = "s2-pro"
FRAMES = 12  # max_new_tokens for the format checks
STREAM_FRAMES = 60  # frames of the streamed answers
TEXT = "Hello from the gateway."


@pytest.fixture(scope="module")
def triton(triton_server):
    return triton_server


@pytest.fixture(scope="module")
def gw_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway")


@pytest.fixture(scope="module")
def gw(triton, gw_dir):
    g = Gateway(triton.grpc_url, gw_dir / "voices.sqlite3", gw_dir / "gateway.log", "--max-upload-mb", "1")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def client(gw):
    return gw.client()


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int, int]:
    """(float32 samples of channel 0, sample rate, channels) of an encoded answer."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0, SR, 1
    if fmt == "wav" and data[4:8] != b"\xff\xff\xff\xff":
        x, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return x[:, 0], sr, x.shape[1]
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.audio[0]
        frames = [f.to_ndarray() for f in c.decode(audio=0)]
        sr, channels = s.rate, s.codec_context.layout.nb_channels
    x = np.concatenate([f.reshape(channels, -1) if f.shape[0] == channels else f.reshape(-1, channels).T
                        for f in frames], axis=1)[0]
    if x.dtype == np.int16:
        x = x.astype(np.float32) / 32768.0
    return x.astype(np.float32), sr, channels


def decoded_prefix_samples(data: bytes) -> int:
    """Samples an FFmpeg decoder gets from the start of a stream that was cut anywhere."""
    n = 0
    with av.open(io.BytesIO(data)) as c:
        try:
            for packet in c.demux(audio=0):
                for frame in packet.decode():
                    n += frame.samples
        except av.error.FFmpegError:  # the cut packet at the end
            pass
    return n


def pcm16(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, -1, 1) * 32768).astype(np.int16)


def assert_same_pcm(a: np.ndarray, b: np.ndarray) -> None:
    """Two takes of one seeded request: the same 16-bit samples to 1 LSB. Chunk boundaries follow the measured
    pace (`adaptive_chunks`), and the streaming codec gives the same audio for any chunking up to float rounding,
    which can move a sample across a 16-bit step."""
    assert a.shape == b.shape, (a.shape, b.shape)
    d = np.abs(a.astype(np.int32) - b.astype(np.int32))
    assert d.max() <= 1 and (d > 0).mean() < 0.05, (d.max(), (d > 0).mean())


def speech_raw(client, **kw):
    """Whole-file call through the SDK (`stream: false`, with the stats headers); returns (bytes, headers)."""
    kw.setdefault("stream", False)
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("input", "voice", "response_format", "speed", "model")}
    kw.setdefault("model", MODEL)
    kw.setdefault("voice", "default")
    kw.setdefault("input", TEXT)
    raw = client.audio.speech.with_raw_response.create(**kw, extra_body=extra or None)
    return raw.content, raw.headers


def assert_error(exc_info, status: int, code: str | None = None, param: str | None = None, contains: str = ""):
    e = exc_info.value
    assert e.status_code == status, (e.status_code, e.body)
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    if code:
        assert err["code"] == code, err
    if param:
        assert err["param"] == param, err
    assert contains.lower() in err["message"].lower(), err
    return err


@pytest.fixture(scope="module")
def reference_wav(tmp_path_factory) -> Path:
    """1.5 s of a hummed tone at 24 kHz (the encoder resamples)."""
    t = np.arange(int(24000 * 1.5)) / 24000
    x = (0.3 * np.sin(2 * np.pi * 180 * t + 2 * np.sin(2 * np.pi * 4 * t)) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)))
    p = tmp_path_factory.mktemp("ref") / "ref.wav"
    sf.write(p, x.astype(np.float32), 24000, subtype="PCM_16")
    return p


REF_TEXT = "A hummed tone for the reference voice."


# ---------------------------------------------------------------------------------------------------------------------
# models, health


def test_health_and_models(gw, client):
    h = gw.health()
    assert h["status"] == "ok" and h["triton_ready"] and h["model_ready"] and h["in_flight"] == 0
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve("tts-1").id == MODEL  # OpenAI's names: aliases (GatewayConfig.openai_models)
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("tts-2")
    assert_error(ei, 404, "model_not_found")


# ---------------------------------------------------------------------------------------------------------------------
# response formats (whole file)


@pytest.fixture(scope="module")
def long_take(client):
    """A seed whose answer to TEXT runs all STREAM_FRAMES frames (the tiny random model may also stop early),
    and that whole answer as pcm."""
    for seed in (21, 7, 3, 11, 5, 13, 17, 19, 23, 29):
        data, headers = speech_raw(client, response_format="pcm", seed=seed, max_new_tokens=STREAM_FRAMES,
                                   first_chunk_frames=2, chunk_frames=4)
        if int(headers["x-s2-frames"]) == STREAM_FRAMES:
            assert headers["x-s2-finish-reason"] == "length" and len(data) == STREAM_FRAMES * FRAME * 2
            return seed, data, headers
    pytest.fail(f"none of 10 seeds ran {STREAM_FRAMES} frames without stopping")


@pytest.fixture(scope="module")
def reference_audio(client, long_take):
    """The wav answer of FRAMES frames: what every other format must match."""
    data, headers = speech_raw(client, response_format="wav", seed=long_take[0], max_new_tokens=FRAMES)
    x, sr, ch = decode(data, "wav")
    return x, headers


EXPECT_RATE = {"mp3": SR, "aac": SR, "flac": SR, "wav": SR, "pcm": SR, "opus": 48000}


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_response_format(client, long_take, reference_audio, fmt):
    seed = long_take[0]
    ref, ref_headers = reference_audio
    frames = int(ref_headers["x-s2-frames"])
    assert frames == FRAMES and ref.size == frames * FRAME  # the wav itself: exactly the frames generated
    # the plain SDK call, as an application would make it (streamed, as OpenAI's endpoint answers by default)
    res = client.audio.speech.create(model=MODEL, voice="default", input=TEXT, response_format=fmt,
                                     extra_body={"seed": seed, "max_new_tokens": FRAMES})
    data = res.content
    assert res.response.headers["content-type"].startswith(
        {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
         "pcm": "audio/pcm"}[fmt])
    assert res.response.headers["x-s2-seed"] == str(seed) and "content-length" not in res.response.headers
    x, sr, channels = decode(data, fmt)
    assert sr == EXPECT_RATE[fmt] and channels == 1
    assert float(np.sqrt(np.mean(x ** 2))) > 1e-3, "silent"
    expected = frames * FRAME * sr / SR
    if fmt in ("wav", "pcm", "flac"):
        assert x.size == expected
        assert_same_pcm(pcm16(x), pcm16(ref))  # lossless: the same 16-bit samples
    else:
        # Lossy codecs add encoder delay/padding of at most a few codec frames.
        assert abs(x.size - expected) <= 3000, (x.size, expected)
        assert 0.5 < np.sqrt(np.mean(x ** 2)) / np.sqrt(np.mean(ref ** 2)) < 2.0


def test_sample_rate_for_players_that_assume_openais(client, long_take, reference_audio):
    """`sample_rate` (an extension, through the SDK's extra_body): pcm at OpenAI's 24 kHz for a player that assumes it,
    and wav at 16 kHz, resampled as the audio streams: the model's audio (the same seed) taken to that rate whole;
    a rate the format cannot be written at is refused by name."""
    import openai

    from s2tts.gateway.encoders import Resampler

    seed = long_take[0]
    ref, _ = reference_audio
    for fmt, rate in (("pcm", 24000), ("wav", 16000)):
        res = client.audio.speech.create(model=MODEL, voice="default", input=TEXT, response_format=fmt,
                                         extra_body={"seed": seed, "max_new_tokens": FRAMES, "sample_rate": rate})
        assert res.response.headers["x-s2-sample-rate"] == str(rate)
        x, got, _ = decode(res.content, fmt) if fmt == "wav" else (np.frombuffer(res.content, "<i2") / 32768, rate, 1)
        r = Resampler(SR, rate)
        whole = np.concatenate([r.push(ref.astype(np.float32)), r.flush()])
        assert got == rate and len(x) == len(whole) and np.abs(whole - x).max() <= 1.5 / 32768, fmt
    with pytest.raises(openai.BadRequestError) as ei:
        client.audio.speech.create(model=MODEL, voice="default", input=TEXT, response_format="opus",
                                   extra_body={"sample_rate": 24000})
    assert "sample_rate" in str(ei.value) and "48000" in str(ei.value)


def test_speed_time_stretch(client, long_take, reference_audio):
    seed = long_take[0]
    ref, _ = reference_audio
    fast, _ = speech_raw(client, response_format="wav", seed=seed, max_new_tokens=FRAMES, speed=2.0)
    slow, _ = speech_raw(client, response_format="wav", seed=seed, max_new_tokens=FRAMES, speed=0.5)
    f, _, _ = decode(fast, "wav")
    s, _, _ = decode(slow, "wav")
    assert f.size == round(ref.size / 2.0) and s.size == round(ref.size / 0.5)
    for y in (f, s):
        assert 0.5 < np.sqrt(np.mean(y ** 2)) / np.sqrt(np.mean(ref ** 2)) < 2.0
    # streamed with a time-stretch: the same samples as the whole file
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input=TEXT, response_format="pcm", speed=2.0, stream_format="audio",
            extra_body={"seed": seed, "max_new_tokens": FRAMES}) as r:
        streamed = b"".join(r.iter_bytes())
    assert_same_pcm(np.frombuffer(streamed, "<i2"), pcm16(f))


# ---------------------------------------------------------------------------------------------------------------------
# streaming


def _stream(client, fmt, stream_format, seed, frames=STREAM_FRAMES, at_first=None):
    """Streams through the SDK -> (its non-empty chunks in order, `at_first()`'s answer when the first chunk came,
    the response headers)."""
    got, seen = [], None
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input=TEXT, response_format=fmt, stream_format=stream_format,
            extra_body={"seed": seed, "max_new_tokens": frames, "first_chunk_frames": 2, "chunk_frames": 4}) as r:
        assert r.status_code == 200
        headers = r.headers
        iterator = r.iter_lines() if stream_format == "sse" else r.iter_bytes()
        for chunk in iterator:
            if chunk:
                if not got and at_first is not None:
                    seen = at_first()
                got.append(chunk)
    return got, seen, headers


def test_stream_audio_starts_early_and_matches_whole_file(client, gw, long_take):
    seed, whole, headers = long_take
    got, in_flight, sheaders = _stream(client, "wav", "audio", seed, at_first=lambda: gw.health()["in_flight"])
    data = b"".join(got)
    # The first bytes come before the end: the request was still in flight when they arrived, and more chunks
    # followed them.
    assert len(got) >= 3, len(got)
    assert in_flight == 1
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"  # open-ended WAV header, as OpenAI streams it
    x, sr, ch = decode(data, "wav")
    assert sr == SR and ch == 1 and x.size == STREAM_FRAMES * FRAME
    assert_same_pcm(pcm16(x), np.frombuffer(whole, "<i2"))  # the same audio as the whole file


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "opus", "aac", "flac"])
def test_stream_audio_formats_decode_as_they_arrive(client, long_take, fmt):
    got, _, _ = _stream(client, fmt, "audio", long_take[0], frames=16)
    data = b"".join(got)
    assert len(got) >= 2
    x, sr, ch = decode(data, fmt)
    assert sr == EXPECT_RATE[fmt] and ch == 1 and float(np.sqrt(np.mean(x ** 2))) > 1e-3
    expected = 16 * FRAME * sr / SR
    assert abs(x.size - expected) <= (0 if fmt in ("pcm", "flac") else 3000), (x.size, expected)
    # A decoder fed only what had arrived half-way already gets audio (no index or trailer needed).
    if fmt != "pcm":
        head = b"".join(got[: max(2, len(got) // 2)])
        assert 0 < decoded_prefix_samples(head) < x.size


def test_sdk_streams_by_default(client, gw, long_take):
    """The unmodified SDK as OpenAI's docs use it (no stream_format): bytes arrive while the audio is made, over
    chunked transfer; `stream: false` gets the whole file with its length."""
    seed, whole, headers = long_take
    assert int(headers["content-length"]) == len(whole)  # long_take is a stream=false answer
    got, in_flight = [], None
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input=TEXT, response_format="pcm",
            extra_body={"seed": seed, "max_new_tokens": STREAM_FRAMES, "first_chunk_frames": 2, "chunk_frames": 4}) as r:
        assert "content-length" not in r.headers and r.headers.get("transfer-encoding") == "chunked"
        for c in r.iter_bytes():
            if not got:
                in_flight = gw.health()["in_flight"]  # the request is still running when its first bytes come
            got.append(c)
    assert len(got) >= 3 and in_flight == 1
    assert_same_pcm(np.frombuffer(b"".join(got), "<i2"), np.frombuffer(whole, "<i2"))


def test_non_json_body_is_415(gw):
    body = json.dumps({"model": MODEL, "input": "hi", "voice": "default", "max_new_tokens": 4})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):  # None: no Content-Type at all
        r = httpx.post(f"{gw.url}/v1/audio/speech", content=body, timeout=30,
                       headers={"content-type": ctype} if ctype else {})
        assert r.status_code == 415, (ctype, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "unsupported_media" and "Content-Type: application/json" in err["message"], err
    r = httpx.post(f"{gw.url}/v1/audio/speech", content=body, timeout=60,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and len(r.content) > 0


def gateway_metrics(g) -> dict[str, float]:
    r = httpx.get(f"{g.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_gateway_metrics_move_with_requests(gw, client):
    before = gateway_metrics(gw)
    speech_raw(client, response_format="pcm", seed=3, max_new_tokens=4)
    with pytest.raises(openai.BadRequestError):
        speech_raw(client, input="")
    httpx.get(f"{gw.url}/v1/audio/voices/nobody", timeout=10)
    after = gateway_metrics(gw)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    assert delta('s2tts_gateway_requests_total{route="/v1/audio/speech",method="POST",status="200"}') == 1
    assert delta('s2tts_gateway_requests_total{route="/v1/audio/speech",method="POST",status="400"}') == 1
    assert delta('s2tts_gateway_requests_total{route="/v1/audio/voices/{name}",method="GET",status="404"}') == 1
    assert delta('s2tts_gateway_request_seconds_count{route="/v1/audio/speech"}') == 2
    assert delta('s2tts_gateway_request_seconds_sum{route="/v1/audio/speech"}') > 0
    assert after['s2tts_gateway_request_seconds_bucket{route="/v1/audio/speech",le="+Inf"}'] == \
        after['s2tts_gateway_request_seconds_count{route="/v1/audio/speech"}']
    assert after["s2tts_gateway_speech_in_flight"] == 0
    assert not any("nobody" in k for k in after)  # route templates, not raw paths


def test_sse_events(client, gw, long_take):
    seed, whole, headers = long_take
    got, in_flight, sheaders = _stream(client, "pcm", "sse", seed, at_first=lambda: gw.health()["in_flight"])
    assert sheaders["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in got if line.startswith("data: ")]
    assert len(events) == len(got)  # every non-empty line is a data line
    types = [e["type"] for e in events]
    assert types[-1] == "speech.audio.done" and set(types[:-1]) == {"speech.audio.delta"} and len(types) >= 4
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert_same_pcm(np.frombuffer(audio, "<i2"), np.frombuffer(whole, "<i2"))  # the deltas: the same audio
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == STREAM_FRAMES and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + STREAM_FRAMES
    stats = events[-1]["stats"]
    assert stats["frames"] == STREAM_FRAMES and stats["finish_reason"] == "length"
    assert in_flight == 1  # the first delta came while the request was still in flight


def test_sse_timestamps_place_each_segment_exactly(client):
    """timestamps=true: after the audio that ends each text segment, a speech.audio.segment event with its characters
    in the input (leading spaces, speaker tags and the gaps between segments not counted) and its start and end,
    exact to the frame: contiguous from 0 to the end of the audio, each as long as the frames it made."""
    from s2tts.frontend.segment import batches, clean_text

    text = "  First part is here.  <|speaker:1|>Second part follows.  And a third one!"
    spoken = batches(clean_text(text), 40)
    assert len(spoken) == 3
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input=text, response_format="pcm", stream_format="sse",
            extra_body={"seed": 3, "temperature": 0, "max_new_tokens": 6, "chunk_length": 40, "first_chunk_frames": 2,
                        "chunk_frames": 2, "timestamps": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    samples, segments = 0, []
    for e in events:
        if e["type"] == "speech.audio.delta":
            samples += len(base64.b64decode(e["audio"])) // 2
        elif e["type"] == "speech.audio.segment":
            assert samples >= round(e["end"] * SR), "a segment's event came before its audio"
            segments.append(e)
    assert events[-1]["type"] == "speech.audio.done"
    assert [s["segment"] for s in segments] == [0, 1, 2]
    assert [text[a:b] for a, b in (s["chars"] for s in segments)] == [
        "First part is here.", "Second part follows.", "And a third one!"]
    assert [s["text"] for s in segments] == [text[a:b] for a, b in (s["chars"] for s in segments)]
    bounds = [0.0] + [s["end"] for s in segments]
    assert [s["start"] for s in segments] == bounds[:-1] and round(bounds[-1] * SR) == samples
    frames = [(s["end"] - s["start"]) * SR / FRAME for s in segments]  # whole frames (times are to the us)
    assert all(abs(f - round(f)) < 1e-3 and 1 <= round(f) <= 6 for f in frames), frames
    assert sum(round(f) for f in frames) == events[-1]["stats"]["frames"]
    # timestamps ride on SSE only
    with pytest.raises(openai.BadRequestError, match="stream_format"):
        client.audio.speech.create(model=MODEL, voice="default", input=text, response_format="pcm",
                                   extra_body={"timestamps": True})


# ---------------------------------------------------------------------------------------------------------------------
# voices


def _upload(gw, name, path, ref_text=REF_TEXT, **kw):
    with open(path, "rb") as f:
        return httpx.post(f"{gw.url}/v1/audio/voices", data={"name": name, "ref_text": ref_text},
                          files={"audio_sample": (Path(path).name, f, "audio/wav")}, timeout=120, **kw)


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_voices_lifecycle_and_restart(triton, gw_dir, reference_wav, store, request):
    db = gw_dir / "voices-restart.sqlite3" if store == "sqlite" else request.getfixturevalue("postgres").new_database()
    g = Gateway(triton.grpc_url, db, gw_dir / "gateway-restart.log")
    try:
        c = g.client()
        # upload through the official SDK (audio_sample + consent; the transcript as an extra form field)
        with open(reference_wav, "rb") as f:
            v = c.audio.voices.create(audio_sample=("ref.wav", f, "audio/wav"), consent="cons_test", name="hummer",
                                      extra_body={"ref_text": REF_TEXT})
        assert v.id == "hummer" and v.name == "hummer" and v.object == "audio.voice"
        listed = httpx.get(f"{g.url}/v1/audio/voices", timeout=10).json()
        [entry] = [x for x in listed["data"] if x["name"] == "hummer"]
        assert entry["ref_text"] == REF_TEXT and entry["codes_shape"][0] == 10
        assert entry["codes_shape"][1] == int(np.ceil(1.5 * SR / FRAME))
        assert httpx.get(f"{g.url}/v1/audio/voices/hummer/audio", timeout=10).content == reference_wav.read_bytes()
        # the same name again: conflict
        r = _upload(g, "hummer", reference_wav)
        assert r.status_code == 409 and r.json()["error"]["code"] == "voice_exists"

        # using it == passing the same reference inline (same seed)
        named, _ = speech_raw(c, voice="hummer", response_format="pcm", seed=31, max_new_tokens=10)
        data_url = "data:audio/wav;base64," + base64.b64encode(reference_wav.read_bytes()).decode()
        inline, _ = speech_raw(c, voice="default", response_format="pcm", seed=31, max_new_tokens=10,
                               ref_audio=data_url, ref_text=REF_TEXT)
        plain, _ = speech_raw(c, voice="default", response_format="pcm", seed=31, max_new_tokens=10)
        assert_same_pcm(np.frombuffer(named, "<i2"), np.frombuffer(inline, "<i2"))  # 1 LSB: chunking follows the pace
        assert named != plain  # the reference changes the output
        # voice as an object {"id": name} works too
        obj, _ = speech_raw(c, voice={"id": "hummer"}, response_format="pcm", seed=31, max_new_tokens=10)
        assert_same_pcm(np.frombuffer(obj, "<i2"), np.frombuffer(named, "<i2"))

        # restart the gateway on the same database: the voice is still there, and gives the same audio
        g.stop()
        g = Gateway(triton.grpc_url, db, gw_dir / "gateway-restart.log")
        c = g.client()
        names = [x["name"] for x in httpx.get(f"{g.url}/v1/audio/voices", timeout=10).json()["data"]]
        assert names == ["hummer"]
        again, _ = speech_raw(c, voice="hummer", response_format="pcm", seed=31, max_new_tokens=10)
        assert_same_pcm(np.frombuffer(again, "<i2"), np.frombuffer(named, "<i2"))

        # delete (SDK), then it is gone: 404 on use and on a second delete
        d = c.audio.voices.delete("hummer")
        assert d.id == "hummer" and d.deleted
        assert httpx.get(f"{g.url}/v1/audio/voices", timeout=10).json()["data"] == []
        with pytest.raises(openai.NotFoundError) as ei:
            speech_raw(c, voice="hummer", response_format="pcm", seed=31, max_new_tokens=10)
        assert_error(ei, 404, "voice_not_found", "voice")
        with pytest.raises(openai.NotFoundError) as ei:
            c.audio.voices.delete("hummer")
        assert_error(ei, 404, "voice_not_found")
    finally:
        g.stop()


def test_several_voices_one_per_speaker(gw, triton, gw_dir, reference_wav, tmp_path):
    """voice as a list of registered names: one voice per speaker, in upstream's format (transcripts tagged
    <|speaker:i|>, codes concatenated in one system turn): the same audio as a gRPC request with those voices, and
    not the audio of the first voice alone."""
    from s2tts.client import S2ProClient, TTSInput
    from s2tts.gateway.voices import VoiceStore

    t = np.arange(int(24000 * 1.5)) / 24000
    second = tmp_path / "second.wav"
    sf.write(second, (0.25 * np.sign(np.sin(2 * np.pi * 310 * t))).astype(np.float32), 24000, subtype="PCM_16")
    assert _upload(gw, "alice", reference_wav).status_code == 200
    assert _upload(gw, "bob", second, ref_text="A buzzing second voice.").status_code == 200
    try:
        text = "<|speaker:0|>Hello, this is the first voice.<|speaker:1|>And the second voice answers."
        kw = dict(input=text, response_format="pcm", seed=3, max_new_tokens=8)
        both, _ = speech_raw(gw.client(), voice=["alice", {"id": "bob"}], **kw)
        one, _ = speech_raw(gw.client(), voice="alice", **kw)
        assert both != one
        store = VoiceStore(str(gw_dir / "voices.sqlite3"))
        a, b = store.get("alice"), store.get("bob")
        store.close()
        with S2ProClient(triton.grpc_url) as c:
            res = c.synthesize(TTSInput(text=text, voices=[(a.ref_text, a.codes), (b.ref_text, b.codes)], seed=3,
                                        max_new_tokens=8))
        got = np.frombuffer(both, "<i2").astype(np.float32) / 32768.0
        assert got.shape == res.audio.shape and np.abs(got - res.audio).max() <= 2 / 32768  # the same audio, as 16-bit
        # the same two voices as inline clips (ref_audio / ref_text lists, one per speaker): encoded by the gateway
        url = lambda p: "data:audio/wav;base64," + base64.b64encode(Path(p).read_bytes()).decode()  # noqa: E731
        inline, _ = speech_raw(gw.client(), ref_audio=[url(reference_wav), url(second)],
                               ref_text=[REF_TEXT, "A buzzing second voice."], **kw)
        inline = np.frombuffer(inline, "<i2").astype(np.float32) / 32768.0
        assert inline.shape == got.shape and np.abs(inline - got).max() <= 2 / 32768
        r = httpx.post(f"{gw.url}/v1/audio/speech", json={**kw, "model": MODEL, "voice": ["alice", "nobody"]}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found" and "nobody" in r.text
        r = httpx.post(f"{gw.url}/v1/audio/speech", json={**kw, "model": MODEL, "voice": ["alice", "default"]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "voice"
    finally:
        for name in ("alice", "bob"):
            httpx.delete(f"{gw.url}/v1/audio/voices/{name}", timeout=10)


def test_two_gateways_share_voices_in_postgres(triton, gw_dir, reference_wav, postgres):
    """Two gateway replicas on one PostgreSQL database: a voice registered on one is listed and spoken on the other
    (the same audio as on the first), one name registered on both at the same moment is created once (200 + 409),
    a delete on one is seen by the other, and the voices outlive both gateways and the database server's restart."""
    url = postgres.new_database()
    a = Gateway(triton.grpc_url, url, gw_dir / "gateway-pg-a.log")
    b = Gateway(triton.grpc_url, url, gw_dir / "gateway-pg-b.log")
    try:
        assert _upload(a, "shared", reference_wav).status_code == 200
        assert [x["name"] for x in httpx.get(f"{b.url}/v1/audio/voices", timeout=10).json()["data"]] == ["shared"]
        on_a, _ = speech_raw(a.client(), voice="shared", response_format="pcm", seed=5, max_new_tokens=10)
        on_b, _ = speech_raw(b.client(), voice="shared", response_format="pcm", seed=5, max_new_tokens=10)
        assert len(on_a) > 0
        assert_same_pcm(np.frombuffer(on_a, "<i2"), np.frombuffer(on_b, "<i2"))  # chunking follows the pace: 1 LSB

        go = threading.Barrier(2)
        codes = {}

        def register(g):
            go.wait()
            codes[g.port] = _upload(g, "raced", reference_wav).status_code

        ts = [threading.Thread(target=register, args=(g,)) for g in (a, b)]
        [t.start() for t in ts]
        [t.join(120) for t in ts]
        assert sorted(codes.values()) == [200, 409], codes

        assert httpx.delete(f"{b.url}/v1/audio/voices/shared", timeout=10).status_code == 200
        assert httpx.get(f"{a.url}/v1/audio/voices/shared/audio", timeout=10).status_code == 404

        a.stop(), b.stop()
        postgres.stop()
        postgres.start()
        c = Gateway(triton.grpc_url, url, gw_dir / "gateway-pg-c.log")
        try:
            assert [x["name"] for x in httpx.get(f"{c.url}/v1/audio/voices", timeout=10).json()["data"]] == ["raced"]
            again, _ = speech_raw(c.client(), voice="raced", response_format="pcm", seed=5, max_new_tokens=10)
            assert_same_pcm(np.frombuffer(again, "<i2"), np.frombuffer(on_a, "<i2"))  # the same voice, seeded
        finally:
            c.stop()
    finally:
        a.stop(), b.stop()


@pytest.mark.parametrize("name", ["../etc", "a/b", "..", ".hidden", "default", "x" * 65, "bad name", "a\\b", ""])
def test_voice_names_validated(gw, reference_wav, name):
    r = _upload(gw, name, reference_wav)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "name" and err["type"] == "invalid_request_error"


def test_voice_upload_errors(gw, reference_wav, tmp_path):
    r = _upload(gw, "notext", reference_wav, ref_text="")
    assert r.status_code == 400 and r.json()["error"]["param"] == "ref_text"
    r = _upload(gw, "longtext", reference_wav, ref_text="x" * 100001)  # s2pro's max_text_chars: no request could use it
    assert r.status_code == 400 and r.json()["error"]["param"] == "ref_text", r.text
    assert "100001 characters; the limit is 100000" in r.json()["error"]["message"]
    bogus = tmp_path / "bogus.wav"
    bogus.write_bytes(b"not audio at all" * 100)
    r = _upload(gw, "bogus", bogus)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media"
    # too large (this gateway allows 1 MiB): with a Content-Length ...
    big = tmp_path / "big.wav"
    t = np.arange(SR * 15) / SR
    sf.write(big, (0.1 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), SR, subtype="PCM_16")  # ~1.3 MB
    r = _upload(gw, "big", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    # ... and chunked, without one
    boundary = "XyZbOuNdArY"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nbig\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"ref_text\"\r\n\r\nhi\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"audio_sample\"; filename=\"b.wav\"\r\n"
            f"Content-Type: audio/wav\r\n\r\n").encode() + big.read_bytes() + f"\r\n--{boundary}--\r\n".encode()

    def gen():
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    r = httpx.post(f"{gw.url}/v1/audio/voices", content=gen(),
                   headers={"content-type": f"multipart/form-data; boundary={boundary}"}, timeout=60)
    assert r.status_code == 413, r.text
    # an inline reference over the limit is refused the same way
    data_url = "data:audio/wav;base64," + base64.b64encode(big.read_bytes()).decode()
    r = httpx.post(f"{gw.url}/v1/audio/speech", json={"model": MODEL, "input": "hi", "voice": "default",
                                                      "ref_audio": data_url, "ref_text": "hi"}, timeout=60)
    assert r.status_code == 413
    assert httpx.get(f"{gw.url}/v1/audio/voices", timeout=10).json()["data"] == []


def test_inline_reference_at_a_sample_rate_the_model_refuses_is_a_400(gw, tmp_path):
    """A clip the gateway decodes but s2pro refuses (4 kHz: below its 8 kHz floor) is the model's 400, naming
    ref_audio and the range, never a 500 from a check of the gateway's own on the way."""
    low = tmp_path / "low.wav"
    t = np.arange(4000 * 2) / 4000
    sf.write(low, (0.2 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 4000, subtype="PCM_16")
    data_url = "data:audio/wav;base64," + base64.b64encode(low.read_bytes()).decode()
    r = httpx.post(f"{gw.url}/v1/audio/speech", json={"model": MODEL, "input": "hi", "voice": "default",
                                                      "ref_audio": data_url, "ref_text": "hi",
                                                      "response_format": "pcm"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "ref_audio" and "[8000, 192000]" in err["message"], err


# ---------------------------------------------------------------------------------------------------------------------
# errors


BAD_REQUESTS = [
    (dict(input=""), "input", "input is required"),
    (dict(input=5), "input", "input must be a string, the text to speak (got int)"),
    (dict(response_format="ogg"), "response_format", "use one of"),
    (dict(speed=5.0), "speed", "[0.25, 4.0]"),
    (dict(stream_format="chunks"), "stream_format", "'audio' (the default) or 'sse'"),
    (dict(temperature=-0.5), "temperature", "out of range"),
    (dict(top_p=1.5), "top_p", "out of range"),
    (dict(top_k=5000), "top_k", "out of range"),
    (dict(max_new_tokens=0), "max_new_tokens", "out of range"),
    (dict(max_new_tokens=100000), "max_new_tokens", "[1, 3000]"),  # the served limit (conftest), read from s2pro
    (dict(seed=-1), "seed", "seed=-1 is out of range"),
    (dict(sample_rate=12345), "sample_rate", "is written at 8000, 16000"),
    (dict(unknown_field=1), "unknown_field", "Unrecognized request argument"),
    (dict(instructions="speak softly"), "instructions", "inline tags"),
    (dict(ref_audio="data:audio/wav;base64,UklGRg=="), "ref_text", "ref_text is required"),
    (dict(ref_audio="https://example.com/a.wav", ref_text="hi"), "ref_audio", "data URL"),
    (dict(ref_audio="data:audio/wav;base64,%%%", ref_text="hi"), "ref_audio", "not valid base64"),
    (dict(ref_text="hi"), "ref_text", "without ref_audio"),
]


@pytest.mark.parametrize("kw,param,msg", BAD_REQUESTS, ids=[f"{p}:{m}" for _, p, m in BAD_REQUESTS])
def test_bad_request(client, kw, param, msg):
    with pytest.raises(openai.BadRequestError) as ei:
        speech_raw(client, **{"max_new_tokens": 4, **kw})
    assert_error(ei, 400, param=param, contains=msg)


def test_half_a_surrogate_pair_is_400(gw):
    """JSON may escape half of a UTF-16 pair ("\\ud800"), which is no character (the openai SDK cannot even send
    one; other clients can): a 400 naming the field, not a 500 from encoding it for the server. A whole pair is
    the character it makes."""
    for raw, status in ((b'{"input": "\\ud800 alone", "max_new_tokens": 2, "response_format": "pcm"}', 400),
                        (b'{"input": "\\ud83d\\ude00 hi", "max_new_tokens": 2, "response_format": "pcm"}', 200)):
        r = httpx.post(f"{gw.url}/v1/audio/speech", content=raw, timeout=120,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
    r = httpx.post(f"{gw.url}/v1/audio/speech", content=b'{"input": "\\udc00"}', timeout=60,
                   headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input" and "lone UTF-16 surrogate" in err["message"], err


def test_request_id_end_to_end(gw, triton):
    """The caller's X-Request-Id names the request in the gateway's log and in every model's log lines."""
    rid = "trace-e2e-42"
    r = httpx.post(f"{gw.url}/v1/audio/speech", headers={"X-Request-Id": rid}, timeout=120,
                   json={"model": MODEL, "input": TEXT, "voice": "default", "response_format": "pcm", "seed": 4,
                         "max_new_tokens": 6})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    lines = [ln for ln in log_showing(triton, f"s2pro: request {rid}#", 10, 2000).splitlines() if rid in ln]
    assert any("[s2tts:s2pro]" in ln and "done" in ln for ln in lines), lines
    assert any("[s2tts:slow_ar]" in ln and "admitted" in ln for ln in lines), lines
    assert rid in log_showing(gw, rid, 10)  # the gateway logs a request after its last byte is sent
    bad = httpx.post(f"{gw.url}/v1/audio/speech", headers={"X-Request-Id": "no spaces allowed"}, timeout=120,
                     json={"model": MODEL, "input": TEXT, "voice": "default", "response_format": "pcm", "seed": 4,
                           "max_new_tokens": 2})
    assert bad.headers["x-request-id"].startswith("speech-")  # not a plain token: a fresh id


def test_undecodable_audio_is_415(client):
    with pytest.raises(openai.APIStatusError) as ei:
        speech_raw(client, max_new_tokens=4, ref_text="hi",
                   ref_audio="data:audio/wav;base64," + base64.b64encode(b"junk" * 50).decode())
    assert_error(ei, 415, "unsupported_media", "ref_audio", contains="could not be decoded")


def test_model_side_validation_passes_through_as_400(client):
    # s2pro refuses special tokens in the text; its error class and input come through, named as the HTTP
    # caller knows them (text -> input), never guessed from the words.
    with pytest.raises(openai.BadRequestError) as ei:
        speech_raw(client, input="hi <|im_end|>", max_new_tokens=4)
    err = assert_error(ei, 400, "invalid_argument", "input", contains="special token")
    assert err["message"].startswith("input contains")


def test_unknown_voice_is_404_not_a_default(client):
    with pytest.raises(openai.NotFoundError) as ei:
        speech_raw(client, voice="nobody", max_new_tokens=4)
    assert_error(ei, 404, "voice_not_found", "voice", contains="POST /v1/audio/voices")
    with pytest.raises(openai.NotFoundError) as ei:
        speech_raw(client, model="tts-2", max_new_tokens=4)
    assert_error(ei, 404, "model_not_found", "model")


def test_an_app_written_for_openai_works_by_its_base_url(client):
    """OpenAI's model names and built-in voices, as every app written for OpenAI sends them, through the unmodified
    SDK: the model, and (by default) the default voice: the same seeded audio as model s2-pro, voice "default"."""
    want, _ = speech_raw(client, response_format="pcm", seed=12, max_new_tokens=8)
    for model, voice in (("tts-1", "alloy"), ("tts-1-hd", "nova"), ("gpt-4o-mini-tts", "Coral")):
        got = client.audio.speech.create(model=model, voice=voice, input=TEXT, response_format="pcm",
                                         extra_body={"seed": 12, "max_new_tokens": 8}).content
        assert_same_pcm(np.frombuffer(got, "<i2"), np.frombuffer(want, "<i2"))


def test_triton_unreachable_is_502(gw_dir):
    g = Gateway(f"127.0.0.1:{free_port()}", gw_dir / "dead.sqlite3", gw_dir / "gateway-dead.log",
                wait_healthy=False)
    try:
        r = httpx.get(f"{g.url}/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        with pytest.raises(openai.APIStatusError) as ei:
            speech_raw(g.client(), max_new_tokens=4)
        assert_error(ei, 502, "upstream_unreachable", contains="unreachable")
        with pytest.raises(openai.APIStatusError) as ei:
            g.client().audio.speech.with_streaming_response.create(
                model=MODEL, voice="default", input="hi", stream_format="sse").__enter__()
        assert ei.value.status_code == 502
    finally:
        g.stop()


def test_api_key_overload_and_disconnect(triton, gw_dir, long_take):
    """One gateway with an API key and --max-in-flight 1: auth, the overload answer, and a client that
    disconnects mid-stream cancelling its Triton request and freeing the slots."""
    key = "sk-test-123"
    g = Gateway(triton.grpc_url, gw_dir / "keyed.sqlite3", gw_dir / "gateway-keyed.log",
                "--api-key", key, "--max-in-flight", "1", "--retry-after", "2")
    try:
        # auth: health is open; everything else needs the key
        assert httpx.get(f"{g.url}/health", timeout=10).status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/audio/voices"), ("POST", "/v1/audio/speech"),
                             ("DELETE", "/v1/audio/voices/x")):
            r = httpx.request(method, f"{g.url}{path}", timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        with pytest.raises(openai.AuthenticationError):
            g.client(api_key="wrong").models.list()
        c = g.client(api_key=key)
        assert [m.id for m in c.models.list()] == [MODEL]

        cancels_before = cancelled_counts(triton)
        # a long stream holds the only slot (this seed runs at least STREAM_FRAMES frames) ...
        seed, big = long_take[0], 2000
        with c.audio.speech.with_streaming_response.create(
                model=MODEL, voice="default", input=TEXT, response_format="pcm",
                stream_format="audio", extra_body={"seed": seed, "max_new_tokens": big, "first_chunk_frames": 2,
                                                   "chunk_frames": 2}) as r:
            it = r.iter_bytes()
            first = next(it)
            assert first
            assert g.health()["in_flight"] == 1
            # ... so the next request is refused at once with 503 + Retry-After (the SDK would retry it)
            with pytest.raises(openai.APIStatusError) as ei:
                speech_raw(c, max_new_tokens=4)
            assert g.health()["in_flight"] == 1  # refused while the stream held the slot: not queued behind it
            err = assert_error(ei, 503, "server_overloaded", contains="busy")
            assert ei.value.response.headers["retry-after"] == "2" and err["type"] == "server_error"
            # /metrics needs no key (as /health) and counts the refusal, the 401s and the stream in flight
            m = gateway_metrics(g)
            assert m["s2tts_gateway_overload_refusals_total"] == 1 and m["s2tts_gateway_speech_in_flight"] == 1
            assert m['s2tts_gateway_requests_total{route="/v1/audio/speech",method="POST",status="503"}'] == 1
            assert m['s2tts_gateway_requests_total{route="/v1/audio/voices/{name}",method="DELETE",status="401"}'] == 1
            # the client goes away mid-stream
        t_close = time.monotonic()
        deadline = t_close + 30
        while time.monotonic() < deadline and g.health()["in_flight"]:
            time.sleep(0.1)
        assert g.health()["in_flight"] == 0
        # Triton saw the cancel, and the engine stopped the request (cancelled, not after its 2000 frames)
        assert cancelled_since(triton, cancels_before) == (1, 1)
        after = cancelled_counts(triton)
        # the same while a whole file is being made (nothing sent yet): the client gives up after 0.5 s
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{g.url}/v1/audio/speech", headers={"Authorization": f"Bearer {key}"}, timeout=0.5,
                       json={"model": MODEL, "input": TEXT, "response_format": "wav", "seed": seed,
                             "max_new_tokens": big, "stream": False})
        assert cancelled_since(triton, after) == (1, 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and g.health()["in_flight"]:
            time.sleep(0.2)
        assert g.health()["in_flight"] == 0
        # the slot is free again: a new request goes through
        data, headers = speech_raw(c, response_format="pcm", seed=6, max_new_tokens=6)
        assert len(data) == 6 * FRAME * 2 and headers["x-s2-finish-reason"] in ("end", "length")
    finally:
        g.stop()


def test_concurrent_requests_under_the_limit(client):
    """Two at once (the default limit is 8) both succeed and equal their sequential answers: the same samples to 1 LSB
    (under load the first audio chunk may be longer, adaptive_chunks, and a different chunk split rounds a few
    samples the other way)."""
    seq = [speech_raw(client, response_format="pcm", seed=s, max_new_tokens=8)[0] for s in (41, 42)]
    out = [None, None]

    def run(i, s):
        out[i] = speech_raw(client, response_format="pcm", seed=s, max_new_tokens=8)[0]

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate((41, 42))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for got, want in zip(out, seq):
        got, want = np.frombuffer(got, "<i2").astype(int), np.frombuffer(want, "<i2").astype(int)
        assert got.shape == want.shape and np.abs(got - want).max() <= 1
    assert seq[0] != seq[1]


def test_gateway_admits_what_s2pro_admits(gw, triton):
    """Without --max-in-flight the gateway admits as many speech requests at once as s2pro does (its
    max_concurrent_requests, read from the server): 12 calls of the SDK at once, no retries, none refused."""
    from s2tts.settings import SCHEMA

    speech_raw(gw.client(), response_format="pcm", seed=1, max_new_tokens=2)  # the gateway reads s2pro's limits
    assert gw.health()["max_in_flight"] == SCHEMA["max_concurrent_requests"].default  # as the server is configured
    c = gw.client()
    out, errs = [], []

    def run(s):
        try:
            out.append(speech_raw(c, response_format="pcm", seed=s, max_new_tokens=3)[0])
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errs and len(out) == 12 and all(len(d) == 3 * FRAME * 2 for d in out), errs


def test_a_stream_may_run_longer_than_the_answer_timeout(triton):
    """The gateway's timeout bounds each wait for s2pro's next response, not a whole stream: a request whose chunks
    keep coming runs to its end however long it takes in all (here several times the timeout)."""
    import asyncio

    from s2tts.gateway.triton import SynthesisRequest, TritonBackend

    timeout = 1.0

    async def run():
        backend = TritonBackend(triton.grpc_url, timeout_s=timeout)
        try:
            t0 = time.monotonic()
            s = backend.open_stream(SynthesisRequest(text=TEXT, request_id="long-stream", seed=3, max_new_tokens=LONG,
                                                     ignore_eos=True, first_chunk_frames=2, chunk_frames=4))
            samples, last = 0, None
            while True:
                chunk = await s.next()
                if chunk is None:
                    break
                samples, last = samples + chunk.audio.size, chunk
            return samples, last, time.monotonic() - t0
        finally:
            await backend.close()

    samples, last, took = asyncio.run(run())
    assert last.final and last.stats["frames"] == LONG and samples == LONG * FRAME
    if took < 1.5 * timeout:  # a machine several times faster than this one: the stream proved nothing
        pytest.skip(f"the request took {took:.1f} s in all, not much over the {timeout:g} s timeout: raise LONG")


LONG = 300  # frames: a few seconds of the tiny model's work on a CPU (about 80 frames a second here)
