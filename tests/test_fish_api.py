"""Fish Audio's own API on the gateway (`POST /v1/tts`, s2tts/gateway/fish.py), through its official Python SDK,
unmodified (`fish-audio-sdk`: the current `fishaudio` client and the older `fish_audio_sdk` session), against the
real tritonserver on the tiny checkpoint: every format, inline references, a registered voice by `reference_id`,
prosody, and Fish's error shape; the same seeded request gives the same audio as the OpenAI route."""

import io
import json
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import ormsgpack
import pytest
import soundfile as sf

from servers import gateway_in

FRAME = 2048
LIVEKIT = Path(__file__).resolve().parents[1] / ".venv" / "livekit" / "bin" / "python"
KEY = "fish-test-key"
TEXT = "Fish says hello."


@pytest.fixture(scope="module")
def gw(triton_server, tmp_path_factory):
    with gateway_in(triton_server.grpc_url, tmp_path_factory.mktemp("fish_gateway"), "--api-key", KEY) as g:
        yield g


@pytest.fixture(scope="module")
def sdk(gw):
    from fishaudio import FishAudio

    return FishAudio(api_key=KEY, base_url=gw.url)


def _tts(gw, body: dict, model="s2-pro", ctype="application/msgpack", raw: bytes | None = None) -> httpx.Response:
    """POST /v1/tts as the SDK sends it (msgpack, the `model` header), with fields the SDK has no parameter for."""
    content = raw if raw is not None else ormsgpack.packb(body) if ctype == "application/msgpack" else \
        __import__("json").dumps(body).encode()
    return httpx.post(f"{gw.url}/v1/tts", content=content, timeout=120,
                      headers={"Content-Type": ctype, "model": model, "Authorization": f"Bearer {KEY}"})


def _openai_pcm(gw, **fields) -> bytes:
    r = httpx.post(f"{gw.url}/v1/audio/speech", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "s2-pro", "input": TEXT, "voice": "default", "response_format": "pcm",
                         "stream": False, **fields})
    assert r.status_code == 200, r.text
    return r.content


def _same_pcm(a: bytes, b: bytes) -> bool:
    """The same seeded audio as 16-bit PCM: equal lengths, samples within one step (the codec's float sums differ in
    the last bits with where chunks end, which follows the measured pace)."""
    x, y = np.frombuffer(a, np.int16).astype(np.int32), np.frombuffer(b, np.int16).astype(np.int32)
    return len(x) == len(y) > 0 and int(np.abs(x - y).max()) <= 1


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    """Any container the encoders write (wav, mp3, ogg/opus) -> float samples, rate (PyAV)."""
    import av

    with av.open(io.BytesIO(data)) as c:
        frames = [f.to_ndarray().reshape(-1) for f in c.decode(audio=0)]
        rate = c.streams.audio[0].rate
    return np.concatenate(frames).astype(np.float32), rate


SEEDED = {"seed": 5, "temperature": 0.7, "top_p": 0.7, "max_new_tokens": 12}
# The SDK's TTSConfig has no seed: its calls here have temperature 0, so their first frame is the argmax (not the tiny
# model's end token: they are never empty; later frames may still vary, through the repetition-aware resampling).
# Sampled, the tiny model meets its end token at the first frame in about 1 call of 60 (an empty answer, rightly).
GREEDY = {"temperature": 0.0}


def test_the_sdk_speaks_every_format(sdk):
    from fishaudio.types import TTSConfig

    config = TTSConfig(max_new_tokens=12, chunk_length=200, **GREEDY)
    out = {fmt: sdk.tts.convert(text=TEXT, format=fmt, config=config) for fmt in ("wav", "pcm", "mp3", "opus")}
    wav, sr = sf.read(io.BytesIO(out["wav"]), dtype="float32")
    assert sr == 44100 and 0 < len(wav) <= 12 * FRAME and len(wav) % FRAME == 0 and np.abs(wav).max() > 1e-4
    pcm = np.frombuffer(out["pcm"], np.int16)
    assert 0 < len(pcm) <= 12 * FRAME and len(pcm) % FRAME == 0
    for fmt, rate in (("mp3", 44100), ("opus", 48000)):
        x, got_rate = _decode(out[fmt])
        assert got_rate == rate and len(x) > 0.5 * FRAME * rate / 44100, fmt
    streamed = b"".join(sdk.tts.stream(text=TEXT, format="wav", config=config))  # the stream form of the same call
    assert streamed[:4] == b"RIFF" and sf.read(io.BytesIO(streamed))[1] == 44100


def test_seeded_fish_request_equals_the_openai_route(gw):
    r = _tts(gw, {"text": TEXT, "format": "pcm", **SEEDED, "repetition_penalty": 1.2, "normalize": True,
                  "latency": "balanced", "min_chunk_length": 50, "condition_on_previous_chunks": True,
                  "early_stop_threshold": 1.0, "mp3_bitrate": 128, "opus_bitrate": 32})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/pcm" and _same_pcm(r.content, _openai_pcm(gw, **SEEDED))
    as_json = _tts(gw, {"text": TEXT, "format": "pcm", **SEEDED}, ctype="application/json")
    assert as_json.status_code == 200 and _same_pcm(as_json.content, r.content)


def test_prosody_volume_and_speed(gw):
    base = np.frombuffer(_tts(gw, {"text": TEXT, "format": "pcm", **SEEDED}).content, np.int16) / 32768
    quiet = np.frombuffer(_tts(gw, {"text": TEXT, "format": "pcm", **SEEDED, "prosody": {"volume": -6}}).content,
                          np.int16) / 32768
    np.testing.assert_allclose(quiet, base * 10 ** (-6 / 20), atol=2 / 32768)
    fast = _tts(gw, {"text": TEXT, "format": "pcm", **SEEDED, "prosody": {"speed": 2.0}}).content
    # normalize_loudness (LiveKit's plugin may send it) is accepted with no effect; not a boolean, a 400
    same = _tts(gw, {"text": TEXT, "format": "pcm", **SEEDED, "prosody": {"normalize_loudness": True}}).content
    assert np.abs(np.frombuffer(same, np.int16) / 32768 - base).max() <= 1 / 32768
    bad = _tts(gw, {"text": TEXT, "format": "pcm", **SEEDED, "prosody": {"normalize_loudness": "yes"}})
    assert bad.status_code == 400 and "normalize_loudness" in bad.json()["message"]
    assert abs(len(fast) / 2 / len(base) - 0.5) < 0.05


def test_inline_references_and_a_registered_voice(gw, sdk, hum_wav):
    from fishaudio.exceptions import NotFoundError
    from fishaudio.types import ReferenceAudio, TTSConfig

    config = TTSConfig(max_new_tokens=8, **GREEDY)
    cloned = sdk.tts.convert(text=TEXT, format="pcm", config=config,
                             references=[ReferenceAudio(audio=hum_wav, text="A hummed tone.")])
    assert len(cloned) > 0 and len(cloned) % (2 * FRAME) == 0
    # the same clip, seeded, through Fish's route and OpenAI's inline form: the same audio
    import base64

    fish = _tts(gw, {"text": TEXT, "format": "pcm", **SEEDED,
                     "references": [{"audio": hum_wav, "text": "A hummed tone."}]})
    url = "data:audio/wav;base64," + base64.b64encode(hum_wav).decode()
    inline = _openai_pcm(gw, ref_audio=url, ref_text="A hummed tone.", **SEEDED)
    assert fish.status_code == 200 and _same_pcm(fish.content, inline)
    # registered once (OpenAI's voices route), used by id
    up = httpx.post(f"{gw.url}/v1/audio/voices", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                    data={"name": "hum", "ref_text": "A hummed tone."},
                    files={"audio_sample": ("ref.wav", hum_wav, "audio/wav")})
    assert up.status_code == 200, up.text
    by_id = _tts(gw, {"text": TEXT, "format": "pcm", **SEEDED, "reference_id": "hum"})
    assert by_id.status_code == 200 and _same_pcm(by_id.content, _openai_pcm(gw, voice="hum", **SEEDED))
    assert len(sdk.tts.convert(text=TEXT, format="pcm", reference_id="hum", config=config)) > 0
    with pytest.raises(NotFoundError) as ei:
        sdk.tts.convert(text=TEXT, reference_id="nobody", config=config)
    assert "nobody" in str(ei.value)


def test_voices_through_the_sdk_are_the_gateways_voices(gw, sdk, hum_wav):
    """The SDK's voices methods on `/model`: created there, listed, used by id, the same voice on the OpenAI route
    (and one registered there listed here), deleted."""
    from fishaudio.exceptions import APIError, NotFoundError
    from fishaudio.types import TTSConfig

    made = sdk.voices.create(title="Hum voice", voices=[hum_wav], texts=["A hummed tone."],
                             description="a test voice", tags=["test"])
    again = sdk.voices.create(title="Hum voice", voices=[hum_wav], texts=["A hummed tone."])
    assert made.id == "Hum-voice" and again.id == "Hum-voice-2" and made.title == "Hum voice"
    got = sdk.voices.get(made.id)
    assert got.samples[0].text == "A hummed tone." and got.state == "trained"
    assert got.title == "Hum voice" and got.description == "a test voice"  # kept as given
    listed = sdk.voices.list(page_size=100)
    assert {made.id, again.id} <= {v.id for v in listed.items} and listed.total == len(listed.items)
    assert [v.id for v in sdk.voices.list(page_size=1, page_number=2).items] == [listed.items[1].id]
    # the same voice by id on Fish's route and by name on OpenAI's: the same seeded audio
    fish = _tts(gw, {"text": TEXT, "format": "pcm", **SEEDED, "reference_id": made.id})
    assert fish.status_code == 200 and _same_pcm(fish.content, _openai_pcm(gw, voice=made.id, **SEEDED))
    assert len(sdk.tts.convert(text=TEXT, format="pcm", reference_id=made.id, config=TTSConfig(max_new_tokens=6, **GREEDY)))
    names = [v["id"] for v in httpx.get(f"{gw.url}/v1/audio/voices", headers={"Authorization": f"Bearer {KEY}"},
                                        timeout=30).json()["data"]]
    assert made.id in names
    sdk.voices.delete(again.id)
    with pytest.raises(NotFoundError):
        sdk.voices.get(again.id)
    with pytest.raises(NotFoundError):
        sdk.voices.delete(again.id)
    with pytest.raises(APIError) as ei:  # no transcript: this server cannot transcribe the clip
        sdk.voices.create(title="Silent", voices=[hum_wav])
    assert ei.value.status == 400 and "texts" in str(ei.value)
    with pytest.raises(APIError) as ei:  # a transcript longer than any request may be (max_text_chars)
        sdk.voices.create(title="Long", voices=[hum_wav], texts=["x" * 100001])
    assert ei.value.status == 400 and "texts has 100001 characters" in str(ei.value)
    with pytest.raises(APIError) as ei:  # not audio
        sdk.voices.create(title="Noise", voices=[b"not an audio file"], texts=["Words."])
    assert ei.value.status == 415
    sdk.voices.delete(made.id)
    assert made.id not in {v.id for v in sdk.voices.list(page_size=100).items}


def test_the_sdk_updates_a_voice(gw, sdk, hum_wav):
    """`voices.update` (PATCH /model/{id}, a form): title and description change, the id and the codes stay; a new
    transcript (`texts`) or a new clip with its transcript (`voices` + `texts`) is taken as Fish Audio's API takes them;
    an unknown id is the SDK's NotFoundError."""
    from fishaudio.exceptions import APIError, NotFoundError

    made = sdk.voices.create(title="To change", voices=[hum_wav], texts=["A hummed tone."])
    before = httpx.get(f"{gw.url}/v1/audio/voices/{made.id}", headers={"Authorization": f"Bearer {KEY}"}).json()
    sdk.voices.update(made.id, title="Changed", description="now described", visibility="private", tags=["x", "y"])
    got = sdk.voices.get(made.id)
    assert (got.id, got.title, got.description) == (made.id, "Changed", "now described")
    assert got.updated_at > got.created_at and got.samples[0].text == "A hummed tone."
    assert [v.id for v in sdk.voices.list(title="Changed", page_size=100).items] == [made.id]
    auth = {"Authorization": f"Bearer {KEY}"}
    t = np.arange(24000) / 24000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 24000, format="WAV", subtype="PCM_16")
    r = httpx.patch(f"{gw.url}/model/{made.id}", headers=auth, timeout=120, data={"texts": "A higher tone."},
                    files={"voices": ("new.wav", buf.getvalue(), "audio/wav")})
    assert r.status_code == 200 and r.json()["samples"][0]["text"] == "A higher tone.", r.text
    after = httpx.get(f"{gw.url}/v1/audio/voices/{made.id}", headers=auth).json()
    assert after["ref_text"] == "A higher tone." and after["duration_s"] == 1.0 != before["duration_s"]
    r = httpx.patch(f"{gw.url}/model/{made.id}", headers=auth, timeout=30, data={"texts": "Only the words."})
    assert r.status_code == 200 and httpx.get(f"{gw.url}/v1/audio/voices/{made.id}", headers=auth).json()[
        "codes_shape"] == after["codes_shape"]
    r = httpx.patch(f"{gw.url}/model/{made.id}", headers=auth, timeout=30,
                    files={"voices": ("new.wav", buf.getvalue(), "audio/wav")})  # a clip without its transcript
    assert r.status_code == 400 and "texts" in r.json()["message"]
    with pytest.raises(NotFoundError):
        sdk.voices.update("nobody", title="x")
    with pytest.raises(APIError) as ei:
        sdk.voices.update(made.id, title=" ")
    assert ei.value.status == 400
    sdk.voices.delete(made.id)


def test_the_older_sdk_session_reads_fish_errors(gw):
    """`fish_audio_sdk.Session` (the SDK's first generation) raises `HttpCodeErr(**body)` from an error body, or
    reads `body["detail"]`: Fish's error shape gives it the status and the message. Its default model (`backend`
    speech-1.5) is one of Fish's names served as aliases (`--fish-models`): it speaks without naming s2-pro."""
    from fish_audio_sdk import HttpCodeErr, Session, TTSRequest

    s = Session(KEY, base_url=gw.url)
    # its default model header, as it sends it (its request has no length field to keep this one short)
    r = _tts(gw, {"text": TEXT, "format": "pcm", "max_new_tokens": 4}, model="speech-1.5")
    assert r.status_code == 200 and 0 < len(r.content) <= 4 * FRAME * 2, r.text
    with pytest.raises(HttpCodeErr) as ei:  # a model this server does not run
        b"".join(s.tts(TTSRequest(text=TEXT), backend="not-a-model"))
    assert ei.value.status == 400
    with pytest.raises(HttpCodeErr) as ei:
        b"".join(s.tts(TTSRequest(text=TEXT, reference_id="nobody"), backend="s2-pro"))
    assert ei.value.status == 404


@pytest.mark.parametrize("case", ["malformed", "unknown_field", "sample_rate", "not_audio", "speed", "model",
                                  "no_text", "media_type", "no_key", "surrogate", "special_token"])
def test_bad_requests_get_fish_errors(gw, case):
    body, kw = {"text": TEXT, "format": "pcm", "max_new_tokens": 4}, {}
    param = {"unknown_field": "nope", "sample_rate": "sample_rate", "not_audio": "references", "speed": "prosody",
             "model": "model", "no_text": "text", "surrogate": "text", "special_token": "text"}.get(case)
    if case == "malformed":
        kw["raw"] = b"\xc1\xff not msgpack"
    elif case == "unknown_field":
        body["nope"] = 1
    elif case == "sample_rate":
        body["sample_rate"] = 12345
    elif case == "not_audio":
        body["references"] = [{"audio": b"this is not an audio file", "text": "Words."}]
    elif case == "speed":
        body["prosody"] = {"speed": 3.0}
    elif case == "model":
        kw["model"] = "not-a-model"
    elif case == "no_text":
        body["text"] = "  "
    elif case == "media_type":
        kw["ctype"] = "text/plain"
    elif case == "special_token":  # refused by s2pro, and named as Fish's field (not OpenAI's `input`)
        body["text"] = "hi <|im_end|>"
    elif case == "surrogate":  # JSON may escape half of a UTF-16 pair: no character (it was a 500)
        body["text"] = "\ud800 alone"
        kw["ctype"] = "application/json"
    if case == "no_key":
        r = httpx.post(f"{gw.url}/v1/tts", content=ormsgpack.packb(body), timeout=30,
                       headers={"Content-Type": "application/msgpack"})
    else:
        r = _tts(gw, body, **kw)
    expect = {"media_type": 415, "not_audio": 415, "no_key": 401}.get(case, 400)
    assert r.status_code == expect, r.text
    err = r.json()
    assert err["status"] == expect and err["detail"] == err["message"] and err["message"], err
    if param:
        assert param in err["message"] or param == "prosody" and "speed" in err["message"], err
    if case == "special_token":
        assert err["message"].startswith("text contains the special token"), err
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200  # the server still ready


def _live(gw, events: list, model="s2-pro", path="/v1/tts/live"):
    """A /v1/tts/live session as Fish's SDK speaks it (httpx-ws, msgpack events): the events sent in order, then
    every event the server sent until it closed."""
    from httpx_ws import WebSocketDisconnect, connect_ws

    got = []
    with httpx.Client(base_url=gw.url, timeout=60) as c, \
            connect_ws(path, c, headers={"Authorization": f"Bearer {KEY}", "model": model}) as ws:
        for e in events:
            ws.send_bytes(e if isinstance(e, bytes) else ormsgpack.packb(e))
        try:
            while True:
                got.append(ormsgpack.unpackb(ws.receive_bytes(timeout=60)))
                if got[-1]["event"] == "finish":
                    break
        except WebSocketDisconnect:
            pass
    return got


def test_live_session_through_the_sdk_and_seeded(gw, sdk):
    """Text fed word by word over the live WebSocket: through the SDK's `stream_websocket` (audio as it comes), and
    seeded, the same audio as the whole text on /v1/tts (the same two segments, the same context)."""
    from fishaudio.types import TTSConfig

    words = ["First ", "sentence ", "here. ", "Second ", "one ", "follows."]
    audio = b"".join(sdk.tts.stream_websocket(iter(words), format="pcm",
                                              config=TTSConfig(max_new_tokens=6, chunk_length=100, **GREEDY)))
    assert 0 < len(audio) <= 2 * 6 * FRAME * 2 and len(audio) % (2 * FRAME) == 0
    request = {"text": "", "format": "pcm", "chunk_length": 24, **SEEDED}
    got = _live(gw, [{"event": "start", "request": request}, *({"event": "text", "text": w} for w in words),
                     {"event": "stop"}])
    assert got[-1] == {"event": "finish", "reason": "stop"}
    live = b"".join(e["audio"] for e in got if e["event"] == "audio")
    whole = _tts(gw, {"text": "".join(words), "format": "pcm", "chunk_length": 24, **SEEDED})
    assert whole.status_code == 200 and _same_pcm(live, whole.content)


def test_live_with_timestamps_places_each_segment(gw):
    """/v1/tts/live/with-timestamp: each audio event says which text segment it speaks (`content`, `chunk_seq`),
    where that segment starts in the audio and how long it is so far; the last snapshot of each equals the audio
    actually sent for it, to the sample."""
    words = ["  First ", "sentence ", "here. ", "Second ", "one ", "follows."]
    request = {"text": "", "format": "pcm", "chunk_length": 100, **SEEDED, "temperature": 0.0}
    got = _live(gw, [{"event": "start", "request": request}, *({"event": "text", "text": w} for w in words),
                     {"event": "stop"}], path="/v1/tts/live/with-timestamp")
    assert got[-1] == {"event": "finish", "reason": "stop"}
    audio = [e for e in got if e["event"] == "audio"]
    assert [e["chunk_seq"] for e in audio] == sorted(e["chunk_seq"] for e in audio) and audio[-1]["chunk_seq"] == 1
    assert {e["chunk_seq"]: e["content"] for e in audio} == {0: "First sentence here.", 1: "Second one follows."}
    times = [e["time"] for e in audio]
    assert times == sorted(times) and all(isinstance(t, int) for t in times)
    last = {e["chunk_seq"]: e for e in audio}  # each segment's final snapshot
    sent = {k: sum(len(e["audio"]) for e in audio if e["chunk_seq"] == k) // 2 for k in (0, 1)}
    for k in (0, 1):
        a = last[k]["alignment"]
        assert a["segments"] == [{"text": last[k]["content"], "start": 0.0, "end": a["audio_duration"]}]
        assert round(a["audio_duration"] * 44100) == sent[k] > 0 and sent[k] % FRAME == 0
    assert last[0]["chunk_audio_offset_sec"] == 0.0 and round(last[1]["chunk_audio_offset_sec"] * 44100) == sent[0]


def test_live_session_errors_and_a_disconnect(gw, triton_server):
    start = {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": 4}}
    for events, words in (([{"event": "text", "text": "Hi."}], "a session begins with"),
                          ([start, {"event": "shout"}], "unknown event"),
                          ([{"event": "start", "request": {"format": "aac"}}], "format"),
                          ([start, {"event": "text", "text": "Hi."}, {"event": "stop"},
                            {"event": "text", "text": "More."}], "after stop"),
                          ([start, {"event": "text", "text": "x" * 10_000_000}], "max_text_chars"),
                          ([{**start, "request": {**start["request"], "reference_id": "nobody"}}], "nobody"),
                          ([{**start, "request": {**start["request"], "references": [
                              {"audio": b"not an audio file", "text": "Words."}]}}], "references"),
                          ([start, "not a map"], "map with an `event`"),
                          ([start, b"\xc1 not msgpack"], "not valid msgpack")):
        got = _live(gw, events)
        assert got[-1]["event"] == "finish" and got[-1]["reason"] == "error" and words in got[-1]["message"], got
        assert httpx.get(f"{gw.url}/health", timeout=10).json()["status"] == "ok"
    # a client that leaves mid-session: its session ends, nothing stays in flight
    from httpx_ws import connect_ws

    with httpx.Client(base_url=gw.url, timeout=60) as c, \
            connect_ws("/v1/tts/live", c, headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send_bytes(ormsgpack.packb({**start, "request": {**start["request"], "max_new_tokens": 200}}))
        ws.send_bytes(ormsgpack.packb({"event": "text", "text": "A sentence to speak now. "}))
        assert ormsgpack.unpackb(ws.receive_bytes(timeout=60))["event"] == "audio"
    deadline = time.time() + 30
    while time.time() < deadline:
        h = httpx.get(f"{gw.url}/health", timeout=10).json()
        if h["in_flight"] == 0:
            break
        time.sleep(0.1)
    assert h["in_flight"] == 0, h
    from s2tts.client import read_metrics

    key = 's2tts_requests_in_flight{model="s2pro"}'
    while read_metrics(triton_server.metrics_url).get(key) != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert read_metrics(triton_server.metrics_url).get(key) == 0  # s2pro ended the session too


def test_two_sessions_on_one_connection_and_other_sample_rates(gw):
    """A live connection carries one session after another (LiveKit's plugin pools its sockets); `sample_rate` asks
    for other rates, resampled as the audio streams: the same audio as the model's rate, at the rate asked."""
    from httpx_ws import connect_ws

    greedy = {"format": "pcm", "max_new_tokens": 6, "top_k": 0}  # fully greedy: the same codes every time
    with httpx.Client(base_url=gw.url, timeout=60) as c, \
            connect_ws("/v1/tts/live", c, headers={"Authorization": f"Bearer {KEY}"}) as ws:
        sizes = []
        for text, rate in (("One session here.", 44100), ("And another one.", 16000)):
            ws.send_bytes(ormsgpack.packb({"event": "start", "request": {**greedy, "sample_rate": rate}}))
            ws.send_bytes(ormsgpack.packb({"event": "text", "text": text}))
            ws.send_bytes(ormsgpack.packb({"event": "stop"}))
            audio = b""
            while (e := ormsgpack.unpackb(ws.receive_bytes(timeout=60)))["event"] == "audio":
                audio += e["audio"]
            assert e == {"event": "finish", "reason": "stop"}
            sizes.append(len(audio) // 2)
    assert sizes[0] == 6 * FRAME and abs(sizes[1] - 6 * FRAME * 16000 / 44100) <= 2, sizes

    base = np.frombuffer(_tts(gw, {"text": TEXT, **greedy}).content, np.int16) / 32768
    for fmt, rate in (("pcm", 24000), ("wav", 16000), ("mp3", 22050)):
        r = _tts(gw, {"text": TEXT, **greedy, "format": fmt, "sample_rate": rate})
        assert r.status_code == 200, r.text
        x, got_rate = (np.frombuffer(r.content, np.int16) / 32768, rate) if fmt == "pcm" else \
            sf.read(io.BytesIO(r.content), dtype="float32") if fmt == "wav" else _decode(r.content)
        assert got_rate == rate and abs(len(x) - len(base) * rate / 44100) < (2400 if fmt == "mp3" else 2), fmt  # mp3: delay, padding
        if fmt != "mp3":  # the model's audio (the same codes) taken to that rate whole: the same to a 16-bit step
            from s2tts.gateway.encoders import Resampler

            r = Resampler(44100, rate)
            whole = np.concatenate([r.push(base.astype(np.float32)), r.flush()])
            assert len(whole) == len(x) and np.abs(whole - x).max() <= 1.5 / 32768, fmt


@pytest.mark.skipif(not LIVEKIT.exists(), reason="scripts/test.sh installs LiveKit's plugin in .venv/livekit")
def test_livekit_plugin_speaks_through_the_gateway(gw, tmp_path):
    """LiveKit's Fish Audio plugin (livekit-plugins-fishaudio, unmodified, its own environment): its one-shot
    synthesis (POST /v1/tts, pcm at 24 kHz, the plugin's default rate) begins with the same audio as the gateway's own
    request (at temperature 0 the first frame is the argmax; the plugin cannot send a seed or top_k); its streams (the live WebSocket, sentence by sentence) speak every sentence, two sessions on its
    pooled connection."""
    out = tmp_path / "livekit.pcm"
    r = subprocess.run([str(LIVEKIT), str(Path(__file__).with_name("livekit_client.py")), gw.url, KEY, str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    frame, one = FRAME * 24000 / 44100, 8 * FRAME * 24000 / 44100  # a frame, 8 frames at 24 kHz
    assert got["chunked"]["rate"] == 24000 and got["streams"][0]["rate"] == 24000
    # two sentences, then one: each at least its first frame (the argmax: not the end token), at most 8 frames;
    # LiveKit hands audio on in 10 ms frames (240 samples), the last one padded
    for s, k in zip(got["streams"], (2, 1)):
        assert k * frame - 241 <= s["samples"] <= k * one + 241, got
    ours = np.frombuffer(_tts(gw, {"text": "Hello from LiveKit.", "format": "pcm", "sample_rate": 24000,
                                   "max_new_tokens": 8, "temperature": 0.0}).content, np.int16)
    theirs = np.fromfile(out, np.int16)
    assert frame <= len(theirs) <= one + 241 and np.abs(theirs).max() > 30
    first = int(frame) - 64  # the first frame's audio, short of what the resampler's filter shares
    assert len(theirs[:first]) == first and _same_pcm(theirs[:first].tobytes(), ours[:first].tobytes())


def test_live_sessions_over_the_limit_get_fishs_concurrency_error(triton_server, tmp_path):
    """With --max-in-flight 1, a second live session while one runs: Fish's error event naming the limit, then finish
    error; the first session is unharmed and the second can start once it has finished. A connection left with no
    session is closed after --live-idle-timeout."""
    from httpx_ws import connect_ws

    start = {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": 4, "temperature": 0.0}}
    with gateway_in(triton_server.grpc_url, tmp_path, "--max-in-flight", "1", "--live-idle-timeout", "1.5") as g, \
            httpx.Client(base_url=g.url, timeout=60) as c, connect_ws("/v1/tts/live", c) as first:
        first.send_bytes(ormsgpack.packb(start))
        first.send_bytes(ormsgpack.packb({"event": "text", "text": "The first session holds the slot. "}))
        assert ormsgpack.unpackb(first.receive_bytes(timeout=60))["event"] == "audio"
        got = _live(g, [start])  # refused at its start: the server closes (more events would race the close)
        assert got[0] == {"event": "error", "error": "Concurrency limit exceeded", "max_concurrency": 1}, got
        assert got[-1]["event"] == "finish" and got[-1]["reason"] == "error" and "busy" in got[-1]["message"]
        first.send_bytes(ormsgpack.packb({"event": "stop"}))
        while (e := ormsgpack.unpackb(first.receive_bytes(timeout=60)))["event"] == "audio":
            pass
        assert e == {"event": "finish", "reason": "stop"}
        got = _live(g, [start, {"event": "text", "text": "Now it may."}, {"event": "stop"}])
        assert got[-1] == {"event": "finish", "reason": "stop"} and got[0]["event"] == "audio"
        from httpx_ws import WebSocketDisconnect

        with pytest.raises(WebSocketDisconnect) as ei:  # the first connection, idle since its session finished
            first.receive_bytes(timeout=30)
        assert ei.value.code == 1000 and "no session" in ei.value.reason  # closed by the server, not the timeout
