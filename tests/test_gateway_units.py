"""Gateway parts that need no server: time-stretch, encoders, request validation, voice names, the voice store."""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
import soundfile as sf

from s2tts.gateway.encoders import FORMATS, make_encoder, wav_header
from s2tts.gateway.error_bodies import APIError
from s2tts.gateway.options import GatewayConfig
from s2tts.gateway.protocol import parse_speech
from s2tts.gateway.tempo import TimeStretch, time_stretch
from s2tts.gateway.voices import (
    MIGRATIONS,
    PostgresVoiceStore,
    VoiceStore,
    open_store,
    validate_name,
)

av = pytest.importorskip("av")
SR = 44100


def tone(seconds=1.0, f=220.0, sr=SR):
    t = np.arange(int(sr * seconds)) / sr
    return (0.5 * np.sin(2 * np.pi * f * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def peak_hz(x, sr=SR):
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return np.argmax(spec) * sr / len(x)


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.5, 2.0, 4.0])
def test_time_stretch_keeps_pitch_and_scales_length(speed):
    x = tone(2.0)
    y = time_stretch(x, speed)
    assert len(y) == round(len(x) / speed)
    mid = y[len(y) // 4: 3 * len(y) // 4]
    assert abs(peak_hz(mid) - 220.0) < max(3.0, 1.5 * SR / len(mid))  # pitch kept (within the FFT resolution)
    assert 0.8 < np.sqrt(np.mean(mid ** 2)) / np.sqrt(np.mean(x ** 2)) < 1.25  # no fading or doubling
    # no clicks: sample-to-sample steps stay like the input's
    assert np.abs(np.diff(mid)).max() < 3 * np.abs(np.diff(x)).max()


def test_time_stretch_is_chunking_invariant():
    x = np.random.default_rng(0).standard_normal(30000).astype(np.float32) * 0.1
    whole = time_stretch(x, 1.7)
    ts = TimeStretch(1.7)
    rng = np.random.default_rng(1)
    parts, i = [], 0
    while i < len(x):
        n = int(rng.integers(1, 4000))
        parts.append(ts.push(x[i:i + n]))
        i += n
    parts.append(ts.flush())
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def _decode(data, fmt):
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, SR
    if fmt == "wav" and data[4:8] != b"\xff\xff\xff\xff":
        x, sr = sf.read(io.BytesIO(data), dtype="float32")
        return x, sr
    with av.open(io.BytesIO(data)) as c:
        sr = c.streams.audio[0].rate
        x = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    return (x.astype(np.float32) / 32768 if x.dtype == np.int16 else x.astype(np.float32)), sr


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_encoders_round_trip(fmt, streaming):
    x = tone(1.0, 300.0)
    enc = make_encoder(fmt, SR, streaming)
    parts = [enc.encode(x[i:i + 4096]) for i in range(0, len(x), 4096)]
    parts.append(enc.finish())
    if streaming:  # bytes come out as the audio goes in, not at the end
        assert sum(map(len, parts[:-1])) > 0.7 * sum(map(len, parts)) and sum(1 for q in parts if q) > 6
    else:
        assert not any(parts[:-1])
    y, sr = _decode(b"".join(parts), fmt)
    assert sr == (48000 if fmt == "opus" else SR)
    expected = len(x) * sr // SR
    if fmt in ("pcm", "wav", "flac"):
        np.testing.assert_array_equal(np.round(y * 32768), np.round(np.clip(x, -1, 1) * 32767))  # int16 kept
    else:
        assert abs(len(y) - expected) <= 3000
        assert abs(peak_hz(y[len(y) // 4: 3 * len(y) // 4], sr) - 300.0) < 5


def test_wav_header_streaming_and_whole():
    h = wav_header(SR, None)
    assert h[4:8] == b"\xff\xff\xff\xff" and h[40:44] == b"\xff\xff\xff\xff" and len(h) == 44
    x = (np.arange(100) - 50).astype("<i2")
    y, sr = sf.read(io.BytesIO(wav_header(SR, 100) + x.tobytes()), dtype="int16")
    assert sr == SR and np.array_equal(y, x)
    y, sr = sf.read(io.BytesIO(h + x.tobytes()), dtype="int16")  # a reader copes with the open-ended header
    assert np.array_equal(y, x)


CFG = GatewayConfig()


def test_parse_speech_defaults_and_voice_forms():
    p = parse_speech({"model": "s2-pro", "input": "hi", "voice": "alloy"}, CFG)
    assert p.voice == "alloy" and p.response_format == "mp3" and p.speed == 1.0
    assert p.stream_format == "audio"  # as OpenAI's: streamed by default
    for v in (None, "default", "DEFAULT", "none", ""):
        assert parse_speech({"input": "hi", "voice": v}, CFG).voice is None
    assert parse_speech({"input": "hi", "voice": {"id": "bob"}}, CFG).voice == "bob"
    assert parse_speech({"input": "hi", "stream": True}, CFG).stream_format == "audio"
    assert parse_speech({"input": "hi", "stream_format": "sse", "stream": True}, CFG).stream_format == "sse"
    assert parse_speech({"input": "hi", "stream": False}, CFG).stream_format is None  # the whole file
    p = parse_speech({"input": "hi", "seed": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 50.0},
                     CFG)
    assert p.fields == {"seed": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 50}
    assert type(p.fields["max_new_tokens"]) is int  # as the schema declares it
    assert len(parse_speech({"input": "A long book. " * 7000}, CFG).input) > 90000  # long-form text is one request
    two = parse_speech({"input": "hi", "ref_audio": ["data:a", "data:b"], "ref_text": ["one", "two"]}, CFG)
    assert (two.ref_audio, two.ref_text, two.voice) == (["data:a", "data:b"], ["one", "two"], None)
    one = parse_speech({"input": "hi", "ref_audio": ["data:a"], "ref_text": ["one"]}, CFG)
    assert (one.ref_audio, one.ref_text) == ("data:a", "one")  # as a one-name voice list: one voice, no speaker tag


@pytest.mark.parametrize("body,status,param", [
    ([], 400, None),
    ({"input": "  "}, 400, "input"),
    ({"input": "x" * 100001}, 400, "input"),  # max_text_chars (100,000 by default)
    ({"input": "hi", "model": "tts-2"}, 404, "model"),  # (OpenAI's tts-1 is an alias: GatewayConfig.openai_models)
    ({"input": "hi", "voice": 3}, 400, "voice"),
    ({"input": "hi", "voice": {"name": "x"}}, 400, "voice"),
    ({"input": "hi", "speed": "fast"}, 400, "speed"),
    ({"input": "hi", "speed": True}, 400, "speed"),
    ({"input": "hi", "top_k": 2.5}, 400, "top_k"),
    ({"input": "hi", "seed": 2 ** 63}, 400, "seed"),
    ({"input": "hi", "stream": "yes"}, 400, "stream"),
    ({"input": "hi", "stream": False, "stream_format": "sse"}, 400, "stream"),
    ({"input": "hi", "voice": "bob", "ref_audio": "data:audio/wav;base64,AAAA", "ref_text": "t"}, 400, "voice"),
    ({"input": "hi", "extra_thing": 1}, 400, "extra_thing"),
    ({"input": "hi", "ref_audio": ["data:audio/wav;base64,AAAA"], "ref_text": "t"}, 400, "ref_text"),
    ({"input": "hi", "ref_audio": ["data:audio/wav;base64,AAAA"] * 2, "ref_text": ["t"]}, 400, "ref_text"),
    ({"input": "hi", "ref_audio": ["data:audio/wav;base64,AAAA", " "], "ref_text": ["t", "u"]}, 400, "ref_audio"),
    ({"input": "hi", "ref_audio": ["data:audio/wav;base64,AAAA"] * 2, "ref_text": ["t", ""]}, 400, "ref_text"),
    ({"input": "hi", "ref_audio": ["data:audio/wav;base64,AAAA"] * 9, "ref_text": ["t"] * 9}, 400, "ref_audio"),
    ({"input": "hi", "voice": "bob", "ref_audio": ["data:audio/wav;base64,AAAA"], "ref_text": ["t"]}, 400, "voice"),
])
def test_parse_speech_rejects(body, status, param):
    with pytest.raises(APIError) as ei:
        parse_speech(body, CFG)
    assert ei.value.status == status and ei.value.param == param
    b = ei.value.body()["error"]
    assert set(b) == {"message", "type", "param", "code"} and b["message"]


@pytest.mark.parametrize("name", ["bob", "Voice_1", "a.b-c", "x" * 64, "9lives"])
def test_voice_names_ok(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", " ", "../x", "a/b", "a\\b", "..", "a..b", ".x", "-x", "x" * 65, "a b",
                                  "default", "None", "ünï", "a\x00b", None])
def test_voice_names_rejected(name):
    with pytest.raises(APIError) as ei:
        validate_name(name)
    assert ei.value.status == 400


@pytest.fixture(params=["sqlite", "postgres"])
def store_spec(request, tmp_path):
    """Where a voice store lives: an SQLite file, or a new database on the test PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path / "v.sqlite3")
    return request.getfixturevalue("postgres").new_database()


def test_voice_store_persists(store_spec):
    db = store_spec
    s = open_store(str(db))
    codes = np.arange(30, dtype=np.int32).reshape(10, 3)
    s.add("bob", "hello there", b"RIFFdata", "audio/wav", 24000, 36000, codes, consent="c1")
    with pytest.raises(APIError) as ei:
        s.add("bob", "again", b"x", "audio/wav", 24000, 1, codes)
    assert ei.value.status == 409
    s.close()
    s = open_store(str(db))
    v = s.get("bob")
    assert v.ref_text == "hello there" and v.sample_rate == 24000 and np.array_equal(v.codes, codes)
    assert v.public()["codes_shape"] == [10, 3] and v.public()["duration_s"] == 1.5
    assert s.get_audio("bob") == (b"RIFFdata", "audio/wav")
    assert [x.name for x in s.list()] == ["bob"] and s.list()[0].codes is None
    assert s.delete("bob") and not s.delete("bob") and s.get("bob") is None
    s.close()


def test_voice_store_update_and_rename(store_spec):
    """Fish Audio's title and description are kept; `update` changes what it is given (a new clip with its codes, or
    the transcript alone), `rename` moves a voice to a free name (409 onto a taken one)."""
    s = open_store(store_spec)
    codes = np.arange(30, dtype=np.int32).reshape(10, 3)
    s.add("a", "first", b"RIFF1", "audio/wav", 24000, 100, codes, title="A voice", description="the first")
    s.add("b", "second", b"RIFF2", "audio/wav", 24000, 100, codes)
    v = s.get("a")
    assert (v.title, v.description, v.updated_at) == ("A voice", "the first", None)
    assert s.update("a", title="Renamed title", description="") and s.get("a").description == ""
    new = np.ones((10, 5), np.int32)
    assert s.update("a", ref_text="new words", clip=(b"RIFF3", "audio/flac", 16000, 80, new))
    v = s.get("a")
    assert (v.ref_text, v.title, v.frames, v.sample_rate) == ("new words", "Renamed title", 5, 16000)
    assert np.array_equal(v.codes, new) and s.get_audio("a") == (b"RIFF3", "audio/flac") and v.updated_at >= v.created_at
    assert not s.update("nobody", title="x")
    with pytest.raises(APIError) as ei:
        s.rename("a", "b")
    assert ei.value.status == 409
    assert s.rename("a", "c") and not s.rename("a", "d") and s.get("c").ref_text == "new words"
    assert sorted(x.name for x in s.list()) == ["b", "c"]
    s.close()


def test_data_url_decoding():
    from s2tts.gateway.audio_io import decode_audio, decode_data_url

    buf = io.BytesIO()
    sf.write(buf, tone(0.5), SR, format="WAV", subtype="PCM_16")
    raw = buf.getvalue()
    assert decode_data_url("data:audio/wav;base64," + base64.b64encode(raw).decode()) == raw
    assert decode_data_url(base64.b64encode(raw).decode()) == raw  # bare base64 is accepted
    x, sr = decode_audio(raw, "ref_audio")
    assert sr == SR and x.dtype == np.float32 and x.ndim == 1 and len(x) == SR // 2
    for bad in ("http://x/a.wav", "file:///etc/passwd", "data:audio/wav,notbase64", "data:audio/wav;base64,@@@"):
        with pytest.raises(APIError):
            decode_data_url(bad)


def test_a_long_reference_is_decoded_only_up_to_the_limit():
    """A few kilobytes can hold minutes of silence: a reference clip is decoded only until it passes the longest
    allowed (then refused as too long), never whole, through libsndfile (FLAC) and through FFmpeg (AAC) alike."""
    import av

    from s2tts.gateway.audio_io import decode_audio

    sr, seconds = 8000, 120
    flac = io.BytesIO()
    sf.write(flac, np.zeros(sr * seconds, np.float32), sr, format="FLAC")
    aac = io.BytesIO()
    with av.open(aac, "w", format="adts") as c:
        s = c.add_stream("aac", rate=sr)
        s.layout = "mono"
        for i in range(seconds * sr // 1024):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = sr, i * 1024
            for packet in s.encode(frame):
                c.mux(packet)
        for packet in s.encode(None):
            c.mux(packet)
    for raw in (flac.getvalue(), aac.getvalue()):
        assert len(raw) < 100_000
        whole, r = decode_audio(raw, "ref_audio")
        assert r == sr and len(whole) >= (seconds - 1) * sr
        x, r = decode_audio(raw, "ref_audio", max_seconds=10)
        assert r == sr and 10 * sr < len(x) <= 10 * sr + 1  # just over the limit: refused as too long


def test_voice_store_same_name_at_once(store_spec):
    """Eight writers (eight gateways: one store each) register one name at the same moment: exactly one wins, the
    rest get 409; then each registers a name of its own, and every store sees all of them."""
    stores = [open_store(store_spec) for _ in range(8)]
    codes = np.ones((10, 4), np.int32)
    go = threading.Barrier(len(stores))
    results = [None] * len(stores)

    def register(i):
        go.wait()
        try:
            stores[i].add("shared", f"from {i}", b"x", "audio/wav", 24000, 100, codes * i)
            results[i] = "ok"
        except APIError as e:
            results[i] = e.status

    threads = [threading.Thread(target=register, args=(i,)) for i in range(len(stores))]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert sorted(results, key=str) == [409] * 7 + ["ok"], results
    winner = results.index("ok")
    assert all(s.get("shared").ref_text == f"from {winner}" for s in stores)
    for i, s in enumerate(stores):
        s.add(f"own{i}", "mine", b"y", "audio/wav", 24000, 100, codes)
    assert all(len(s.list()) == 9 for s in stores)
    for s in stores:
        s.close()


def test_voice_store_schema_versions(store_spec):
    """A new store is at the current schema version; a store migrated by a newer gateway is refused with a message
    that says what to do; an SQLite file from before versioning is brought up to date, its voices kept."""
    s = open_store(store_spec)
    s.close()
    if store_spec.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(store_spec, autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM s2tts_schema").fetchone()[0] == len(MIGRATIONS)
            c.execute("INSERT INTO s2tts_schema VALUES (%s, 0)", (len(MIGRATIONS) + 1,))
    else:
        import sqlite3

        c = sqlite3.connect(store_spec)
        assert c.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        c.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
        c.close()
    with pytest.raises(RuntimeError, match="newer than this gateway's .* upgrade the gateway"):
        open_store(store_spec)


def test_sqlite_store_from_before_versioning(tmp_path):
    import sqlite3

    db = tmp_path / "old.sqlite3"
    c = sqlite3.connect(db)
    c.execute(MIGRATIONS[0].format(real="REAL", blob="BLOB"))
    c.execute("INSERT INTO voices VALUES ('old', 't', 1.0, x'00', 'audio/wav', 24000, 10, x'01000000', 1, 1, NULL)")
    c.commit()
    c.close()
    s = VoiceStore(str(db))
    assert s.get("old").codes.tolist() == [[1]]
    s.close()
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


def test_postgres_store_errors_say_what_to_do(postgres):
    with pytest.raises(RuntimeError, match="cannot reach the voice store postgresql://s2tts:\\*\\*\\*@127.0.0.1:1/x"):
        PostgresVoiceStore("postgresql://s2tts:secret@127.0.0.1:1/x")


def test_parse_speech_chunk_length():
    """`chunk_length` (UTF-8 bytes of text per segment) is passed on as given and checked against the one range."""
    assert parse_speech({"input": "hi", "chunk_length": 64}, CFG).fields == {"chunk_length": 64}
    assert parse_speech({"input": "hi"}, CFG).fields == {}  # the server's defaults
    for bad in (4, 10**6, "64", 1.5):
        with pytest.raises(APIError) as ei:
            parse_speech({"input": "hi", "chunk_length": bad}, CFG)
        assert ei.value.status == 400 and ei.value.param == "chunk_length"


def test_a_silent_stream_is_cancelled_after_the_answer_timeout():
    """The gateway waits at most `idle_s` for each response of an s2pro stream (never for the stream's whole length):
    a stream that sends nothing for that long is cancelled and answered 504."""
    import asyncio

    from s2tts.gateway.triton import SpeechStream

    class Silent:
        cancelled = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.Event().wait()  # nothing ever comes

        def cancel(self):
            self.cancelled = True

    async def run():
        s = SpeechStream("127.0.0.1:1", "quiet", idle_s=0.2)
        s._call = Silent()
        with pytest.raises(APIError) as ei:
            await s.next()
        return ei.value, s._call

    err, call = asyncio.run(run())
    assert err.status == 504 and err.code == "upstream_timeout" and call.cancelled


def test_the_sample_rate_comes_from_each_s2pro_answer_and_one_without_it_is_an_upstream_error():
    """The gateway restates no sample rate: a chunk's is s2pro's `sample_rate` output (what every answer of s2pro
    carries), and an answer without it (a repository that does not match the gateway) ends the stream with 502."""
    import asyncio

    from tritonclient.grpc import InferResult, service_pb2

    from s2tts.gateway.triton import SpeechStream

    def answer(rate):
        r = service_pb2.ModelInferResponse(model_name="s2pro", id="r")
        out = r.outputs.add(name="audio", datatype="FP32", shape=[4])
        r.raw_output_contents.append(np.arange(4, dtype=np.float32).tobytes())
        if rate is not None:
            out = r.outputs.add(name="sample_rate", datatype="INT32", shape=[1])
            r.raw_output_contents.append(np.array([rate], np.int32).tobytes())
        return InferResult(r)

    class Answers:
        def __init__(self, *results):
            self.results = list(results)

        def __aiter__(self):
            return self

        async def __anext__(self):
            return self.results.pop(0), None

        def cancel(self):
            pass

    async def run():
        s = SpeechStream("127.0.0.1:1", "r", idle_s=5.0)
        s._call = Answers(answer(16000), answer(None))
        chunk = await s.next()
        with pytest.raises(APIError) as ei:
            await s.next()
        return chunk, ei.value, await s.next()

    chunk, err, after = asyncio.run(run())
    assert chunk.sample_rate == 16000 and chunk.audio.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert err.status == 502 and err.code == "upstream_error" and "sample_rate" in err.message, err.message
    assert after is None  # the stream ended with the error


def test_reference_clip_limits_are_the_stricter_of_server_and_gateway():
    """A reference clip (inline or uploaded) is held to s2pro's limits, made stricter by the gateway's own
    --max-reference-seconds where set."""
    from s2tts.gateway.app import _check_reference_length
    from s2tts.gateway.protocol import DEFAULT_LIMITS

    served = dict(DEFAULT_LIMITS)  # 30 s longest, 0.2 s shortest
    clip = np.zeros(2 * SR, np.float32)
    _check_reference_length(clip, SR, GatewayConfig(), "ref_audio", served)  # 2 s: fine by the server's limits
    with pytest.raises(APIError) as ei:
        _check_reference_length(clip, SR, GatewayConfig(max_reference_seconds=1.0), "ref_audio", served)
    assert ei.value.status == 400 and ei.value.code == "reference_too_long" and "limit is 1 s" in ei.value.message
    with pytest.raises(APIError) as ei:
        _check_reference_length(clip[: SR // 10], SR, GatewayConfig(), "audio_sample", served)
    assert ei.value.code == "reference_too_short" and "at least 0.2 s" in ei.value.message


def test_locate_finds_each_segment_in_the_clients_text():
    from s2tts.frontend.segment import batches, clean_text, locate

    text = "  Hi there, you.\n\n<speaker:2>A legacy tag, then   more words. Last!"
    cursor, found = 0, []
    for seg in batches(clean_text(text), 30):
        a, b = locate(text, seg, cursor)
        found.append(text[a:b])
        cursor = b
    assert found == ["Hi there, you.", "A legacy tag,", "then   more", "words. Last!"]
    assert locate(text, "Hi there, yes.", 0) is None  # not the client's text
    assert locate(text, "Hi", 5) is None  # not from there
    assert locate("Hi.", "<|speaker:0|>") is None  # nothing spoken


def test_timeline_segments_are_exact_and_scaled_by_speed():
    from s2tts.gateway.alignment import Timeline

    hop, sr = 2048, 44100
    tl = Timeline("One. Two.", sr, speed=2.0)
    chunk = lambda frames: np.zeros(frames * hop, np.float32)  # noqa: E731
    assert tl.push(chunk(2), {"segment": 0, "text": "One.", "frame": 0, "frames": 2}) is None
    assert tl.push(chunk(3), {"segment": 0, "text": "One.", "frame": 2, "frames": 3}) is None
    first = tl.push(chunk(4), {"segment": 1, "text": "Two.", "frame": 5, "frames": 4})
    assert (first.index, first.text, first.chars) == (0, "One.", (0, 4))
    assert first.start == 0.0 and first.end == 5 * hop / sr / 2  # at double speed, half the time
    assert tl.push(np.zeros(0, np.float32), None) is None  # a response with no audio changes nothing
    tl.add_text(" Three?")
    second = tl.finish()
    assert second.public() == {"segment": 1, "text": "Two.", "chars": [5, 9], "start": round(5 * hop / sr / 2, 6),
                               "end": round(9 * hop / sr / 2, 6)}
    assert tl.finish() is None


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 48000])
def test_resampler_keeps_a_tone_and_does_not_depend_on_the_cuts(rate):
    """A 1 kHz tone at 44.1 kHz comes out a 1 kHz tone at `rate`, of the same level and length, in step with the
    input (no delay); pushed in uneven pieces it gives the same samples as pushed whole."""
    from s2tts.gateway.encoders import Resampler

    t = np.arange(44100) / 44100
    tone = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    r = Resampler(44100, rate)
    whole = np.concatenate([r.push(tone), r.flush()])
    r = Resampler(44100, rate)
    cuts = [0, 1, 2048, 2049, 9000, 30000, 44100]
    pieces = np.concatenate([r.push(tone[a:b]) for a, b in zip(cuts, cuts[1:])] + [r.flush()])
    np.testing.assert_allclose(pieces, whole, atol=1e-6)
    assert abs(len(whole) - rate) <= 1
    expect = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(len(whole)) / rate)
    mid = slice(rate // 10, -rate // 10)  # away from the filter's start and end
    assert np.abs(whole[mid] - expect[mid]).max() < 0.01


def test_openai_names_can_be_turned_off():
    """With openai_models=() and openai_voice=None the gateway answers OpenAI's names as any unknown model or voice
    (404), before any call to Triton."""
    import tempfile

    from fastapi.testclient import TestClient

    from s2tts.gateway import create_app

    cfg = GatewayConfig(triton_url="127.0.0.1:1", db_path=tempfile.mktemp(suffix=".sqlite3"), openai_models=(),
                        openai_voice=None)
    with TestClient(create_app(cfg)) as c:
        r = c.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = c.post("/v1/audio/speech", json={"model": "s2-pro", "input": "hi", "voice": "alloy"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"


def test_fish_speech_fields_on_v1_tts():
    """fish-speech's `streaming` (the whole file when false), `use_memory_cache` (accepted), and `max_new_tokens: 0`
    (its "no limit": the server's largest)."""
    from s2tts.gateway.fish import parse_fish_tts
    from s2tts.gateway.protocol import DEFAULT_LIMITS

    assert parse_fish_tts({"text": "hi"}, None, CFG).stream  # Fish Audio's SDK sends none: streamed
    f = parse_fish_tts({"text": "hi", "streaming": False, "use_memory_cache": "on", "max_new_tokens": 0}, None, CFG)
    assert not f.stream and f.fields["max_new_tokens"] == DEFAULT_LIMITS["max_new_tokens_limit"]
    for bad in ({"streaming": 1}, {"use_memory_cache": True}, {"max_new_tokens": -1}):
        with pytest.raises(APIError) as ei:
            parse_fish_tts({"text": "hi", **bad}, None, CFG)
        assert ei.value.status == 400 and ei.value.param == next(iter(bad))


def test_ref_audio_hosts_entries_and_the_address_check():
    """Entries: host names (with a port or not), addresses and networks, URL prefixes (a path ends at a '/'); a listed
    name that resolves to a loopback address is refused until that address is listed too."""
    import asyncio

    from s2tts.gateway.remote_audio import RemoteAudio, parse_rule

    r = RemoteAudio(GatewayConfig(ref_audio_hosts=("https://cdn.example.com/voices", "10.0.0.0/8", "localhost:99")))
    for url, ok in (("https://cdn.example.com/voices/a.wav", True), ("https://cdn.example.com/voices", True),
                    ("https://cdn.example.com/voicesX/a.wav", False), ("http://cdn.example.com/voices/a.wav", False),
                    ("https://cdn.example.com.evil.org/voices/a.wav", False), ("http://10.1.2.3:8/a", True),
                    ("http://11.1.2.3/a", False), ("http://localhost:99/a", True), ("http://localhost/a", False)):
        try:
            r._check_url(url)
            assert ok, url
        except APIError as e:
            assert not ok and e.code == "ref_audio_not_allowed" and "--ref-audio-hosts" in e.message, (url, e.message)
    with pytest.raises(APIError) as ei:
        asyncio.run(r._address("localhost", 99, None))
    assert "loopback" in ei.value.message and "--ref-audio-hosts" in ei.value.message
    listed = RemoteAudio(GatewayConfig(ref_audio_hosts=("localhost", "127.0.0.0/8", "::1")))
    assert str(asyncio.run(listed._address("localhost", 80, None))) in ("127.0.0.1", "::1")
    for bad in ("ftp://x/", "example.com/path", "host:notaport", "http://user:pw@x/"):
        with pytest.raises(ValueError):
            parse_rule(bad)


class _LiveSocket:
    """A live WebSocket's far side: the client's frames in order, then it waits; what the server sent."""

    def __init__(self, frames):
        self.frames, self.sent, self.closed, self.headers = list(frames), [], False, {}

    async def receive(self):
        import anyio

        if not self.frames:
            await anyio.sleep_forever()
        return self.frames.pop(0)

    async def send_bytes(self, data):
        import ormsgpack

        self.sent.append(ormsgpack.unpackb(data))

    async def close(self, code=1000, reason=""):
        self.closed = True


def _live_run(frames, s2pro_ends_alone: bool):
    """A live connection over `frames` against an s2pro whose session answers one final chunk: once the client's
    stop reached it, or (`s2pro_ends_alone`, its idle timeout) at once. -> the events the server sent."""
    import types

    import anyio
    import ormsgpack

    from s2tts.gateway.live import LiveConnection

    class Stream:
        def __init__(self, main, stop):
            self.main, self.stop, self.done = main, stop, False

        async def next(self):
            if not self.main or self.done:
                return None
            if not s2pro_ends_alone:
                await self.stop.wait()
            self.done = True
            return types.SimpleNamespace(sample_rate=SR, audio=np.zeros(2048, np.float32), segment=None, final=True)

        def cancel(self):
            pass

    async def main():
        stop = anyio.Event()

        def open_stream(req):
            if req.text_event == "end":
                stop.set()
            return Stream(req.text_event == "open", stop)

        async def prepare(request, model, sid):
            f = types.SimpleNamespace(text="", speed=1.0, format="pcm", gain=0.0, bit_rate=128, sample_rate=None)
            return f, types.SimpleNamespace(text_event="open")

        limiter = types.SimpleNamespace(try_acquire=lambda: True, release=lambda: None, limit=8)
        state = types.SimpleNamespace(limiter=limiter, metrics=types.SimpleNamespace(overload_refusals=0))
        ws = _LiveSocket(e[1] if isinstance(e, tuple) else {"type": "websocket.receive", "bytes": ormsgpack.packb(e)}
                         for e in frames)  # (("raw", a frame as it came) or an event)
        await LiveConnection(ws, GatewayConfig(live_idle_timeout_s=0.2), state, types.SimpleNamespace(open_stream=open_stream), prepare,
                             False).run()
        return ws.sent

    return anyio.run(main)


def test_a_live_session_s2pro_ends_before_the_clients_stop_finishes_with_an_error():
    """Fish's `finish stop` answers the client's stop: a session that s2pro ended first (no text for its
    session_idle_timeout_s) finishes with an error that says so, so that a client whose later text would be lost
    learns it; one that the client stopped finishes with stop. An event in a text frame is refused by name."""
    start = {"event": "start", "request": {"text": ""}}
    events = [start, {"event": "text", "text": "Hello there. "}, {"event": "stop"}]
    stopped = _live_run(events, s2pro_ends_alone=False)
    assert stopped[-1] == {"event": "finish", "reason": "stop"} and stopped[0]["event"] == "audio"
    idle = _live_run(events[:2], s2pro_ends_alone=True)
    assert idle[-1]["event"] == "finish" and idle[-1]["reason"] == "error", idle
    assert "session_idle_timeout_s" in idle[-1]["message"]
    text = _live_run([("raw", {"type": "websocket.receive", "text": '{"event": "start"}'})], s2pro_ends_alone=False)
    assert text[-1]["reason"] == "error" and "binary frame of msgpack" in text[-1]["message"], text
