"""fish-speech's own server API on the gateway (s2tts/gateway/fish_server.py, fish.py), and `ref_audio` as a URL
(s2tts/gateway/remote_audio.py), against the real tritonserver on the tiny checkpoint: requests written the way
fish-speech's `tools/api_client.py` writes them (msgpack of `ServeTTSRequest`'s fields), its reference and codec
routes, their errors in that server's own shapes; vLLM-Omni's voice-cloning request with a URL served on loopback,
allowed and refused; OpenAI's voice names mapped to a configured voice."""

import base64
import http.server
import io
import threading

import httpx
import numpy as np
import ormsgpack
import pytest
import soundfile as sf

from servers import gateway_in

FRAME = 2048
KEY = "fish-server-key"
TEXT = "Fish speech says hello."
SEED = 7
MAPPED = "mapped-voice"  # what this gateway's --openai-voice names (registered by a test)
MAX_FRAMES = 400  # this gateway's --max-decode-frames


class Files(http.server.BaseHTTPRequestHandler):
    """A loopback HTTP server's routes: the clip, a large file (with and without Content-Length), one that stalls,
    redirects inside and outside the allowed hosts."""

    clip: bytes = b""
    port: int = 0
    release = threading.Event()  # the stalled answer ends when the server does

    def log_message(self, *args):
        pass

    def _send(self, status, body=b"", headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        big = b"\0" * (2 * 2**20)  # the gateway allows 1 MiB
        if self.path == "/ref.wav":
            self._send(200, self.clip, [("Content-Length", str(len(self.clip))), ("Content-Type", "audio/wav")])
        elif self.path == "/big.wav":
            self._send(200, big, [("Content-Length", str(len(big)))])
        elif self.path == "/big-unsized.wav":  # no length: the gateway counts the bytes as they come
            self.close_connection = True
            self._send(200, big)
        elif self.path == "/stall.wav":  # the headers and a few bytes, then nothing
            self._send(200, self.clip[:64], [("Content-Length", str(len(self.clip)))])
            self.wfile.flush()
            self.release.wait()
        elif self.path == "/moved":
            self._send(302, headers=[("Location", "/ref.wav"), ("Content-Length", "0")])
        elif self.path == "/away":
            self._send(302, headers=[("Location", f"http://localhost:{self.port}/ref.wav"), ("Content-Length", "0")])
        else:
            self._send(404, b"no", [("Content-Length", "2")])


@pytest.fixture(scope="module")
def files(hum_wav):
    """The loopback file server: its base URL."""
    Files.clip = hum_wav
    Files.release.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    server.daemon_threads = True
    Files.port = server.server_address[1]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{Files.port}"
    Files.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory, hum_wav):
    d = tmp_path_factory.mktemp("refs")
    (d / "ref.wav").write_bytes(hum_wav)
    outside = tmp_path_factory.mktemp("elsewhere") / "secret.wav"
    outside.write_bytes(hum_wav)
    (d / "link.wav").symlink_to(outside)
    return d, outside


@pytest.fixture(scope="module")
def gw(triton_server, tmp_path_factory, files, ref_dir):
    with gateway_in(triton_server.grpc_url, tmp_path_factory.mktemp("fish_server"), "--api-key", KEY,
                    "--max-upload-mb", "1", "--ref-audio-hosts", "127.0.0.1", "--ref-audio-dir", str(ref_dir[0]),
                    "--ref-audio-timeout", "1", "--max-decode-frames", str(MAX_FRAMES),
                    "--openai-voice", MAPPED) as g:
        yield g


def _headers(**extra):
    return {"authorization": f"Bearer {KEY}", **extra}


def _serve_tts(text=TEXT, **fields) -> dict:
    """A request as fish-speech's client sends it: every field of its `ServeTTSRequest` (HEAD), defaults as its
    schema has them, the client's own choices where it has them (its CLI's chunk_length 300), then `fields`."""
    return {"text": text, "chunk_length": 300, "format": "wav", "latency": "normal", "references": [],
            "reference_id": None, "seed": SEED, "use_memory_cache": "off", "normalize": True, "streaming": False,
            "max_new_tokens": 12, "top_p": 0.8, "repetition_penalty": 1.1, "temperature": 0.8, **fields}


def _post_tts(gw, body: dict, stream: bool = False):
    """POST /v1/tts as fish-speech's client does (msgpack, `?format=msgpack`, its headers) -> (status, headers, body,
    pieces the body came in)."""
    with httpx.stream("POST", f"{gw.url}/v1/tts", params={"format": "msgpack"}, content=ormsgpack.packb(body),
                      headers=_headers(**{"content-type": "application/msgpack"}), timeout=120) as r:
        pieces = [p for p in r.iter_bytes() if p] if stream else [r.read()]
        return r.status_code, r.headers, b"".join(pieces), len(pieces)


def _pcm(wav: bytes) -> np.ndarray:
    """The 16-bit samples of a WAV, whole (exact sizes) or streamed (sizes unknown: the samples follow the header)."""
    if wav[4:8] == b"\xff\xff\xff\xff":
        return np.frombuffer(wav[44:], "<i2")
    x, sr = sf.read(io.BytesIO(wav), dtype="int16")
    assert sr == 44100
    return x


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """One seeded take twice: the same 16-bit samples to a step (chunk ends follow the measured pace)."""
    return a.shape == b.shape and a.size > 0 and int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max()) <= 1


def _msgpack(r) -> dict:
    assert r.headers["content-type"] == "application/msgpack", r.headers
    return ormsgpack.unpackb(r.content)


def test_fish_speech_client_speaks_whole_and_streamed(gw, hum_wav):
    """`streaming: false`: the whole WAV with its exact sizes and length; `true`: chunks as they are made, the same
    samples; references inline and by a voice added on /v1/references/add give the same audio (seeded), unlike no
    reference; `use_memory_cache` and fish-speech's other fields accepted."""
    status, headers, whole, _ = _post_tts(gw, _serve_tts())
    assert status == 200 and headers["content-type"] == "audio/wav" and int(headers["content-length"]) == len(whole)
    info = sf.info(io.BytesIO(whole))
    assert info.samplerate == 44100 and info.frames * 2 + 44 == len(whole) and 0 < info.frames <= 12 * FRAME
    status, headers, streamed, pieces = _post_tts(gw, _serve_tts(streaming=True), stream=True)
    assert status == 200 and "content-length" not in headers and streamed[:4] == b"RIFF"
    assert _same(_pcm(streamed), _pcm(whole))

    ref = {"audio": hum_wav, "text": "A hummed tone."}
    status, _, inline, _ = _post_tts(gw, _serve_tts(references=[ref], use_memory_cache="on"))
    assert status == 200
    r = httpx.post(f"{gw.url}/v1/references/add", headers=_headers(), timeout=120,
                   data={"id": "hum", "text": "A hummed tone."}, files={"audio": ("ref.wav", hum_wav)})
    assert r.status_code == 200 and _msgpack(r) == {"success": True, "reference_id": "hum",
                                                    "message": "Reference voice 'hum' added successfully"}
    status, _, by_id, _ = _post_tts(gw, _serve_tts(reference_id="hum"))
    assert status == 200 and _same(_pcm(by_id), _pcm(inline)) and not _same(_pcm(by_id), _pcm(whole))
    # the same voice on the other routes: OpenAI's voice, Fish Audio's /model
    voices = httpx.get(f"{gw.url}/v1/audio/voices", headers=_headers(), timeout=30).json()["data"]
    assert [v["id"] for v in voices] == ["hum"] and voices[0]["ref_text"] == "A hummed tone."
    assert [m["_id"] for m in httpx.get(f"{gw.url}/model", headers=_headers(), timeout=30).json()["items"]] == ["hum"]


def test_references_list_rename_delete(gw, hum_wav):
    """list (msgpack, or JSON when asked), update (a rename: the voice keeps its codes), delete: fish-speech's
    answers; a voice registered on /v1/audio/voices is a reference too."""
    up = httpx.post(f"{gw.url}/v1/audio/voices", headers=_headers(), timeout=120,
                    data={"name": "openai-made", "ref_text": "A hummed tone."},
                    files={"audio_sample": ("ref.wav", hum_wav, "audio/wav")})
    assert up.status_code == 200, up.text
    listed = _msgpack(httpx.get(f"{gw.url}/v1/references/list", headers=_headers(), timeout=30))
    assert listed["success"] and "openai-made" in listed["reference_ids"]
    assert listed["reference_ids"] == sorted(listed["reference_ids"])
    as_json = httpx.get(f"{gw.url}/v1/references/list", params={"format": "json"}, headers=_headers(), timeout=30)
    assert as_json.headers["content-type"] == "application/json" and as_json.json() == listed
    r = httpx.post(f"{gw.url}/v1/references/update", headers=_headers(), timeout=30,
                   json={"old_reference_id": "openai-made", "new_reference_id": "renamed"})
    assert r.status_code == 200 and _msgpack(r)["new_reference_id"] == "renamed", r.content
    codes = httpx.get(f"{gw.url}/v1/audio/voices/renamed", headers=_headers(), timeout=30).json()["codes_shape"]
    assert codes == up.json()["codes_shape"]
    r = httpx.request("DELETE", f"{gw.url}/v1/references/delete", headers=_headers(Accept="application/json"),
                      json={"reference_id": "renamed"}, timeout=30)
    assert r.status_code == 200 and r.json()["success"] and r.json()["reference_id"] == "renamed"
    assert "renamed" not in _msgpack(httpx.get(f"{gw.url}/v1/references/list", headers=_headers()))["reference_ids"]


def test_vqgan_encode_then_decode(gw, hum_wav, tiny_ckpt):
    """/v1/vqgan/encode: a clip's codes, those dac_encoder stores for the same clip as a voice; /v1/vqgan/decode of
    them and of a longer run of codes (several dac_decoder chunks of one stream): float16 audio of frames x 2048
    samples, the codec's own decode of the whole."""
    import torch

    from s2tts.codec.loading import load_codec_from_dir

    r = httpx.post(f"{gw.url}/v1/vqgan/encode", content=ormsgpack.packb({"audios": [hum_wav]}),
                   headers=_headers(**{"content-type": "application/msgpack"}), timeout=120)
    assert r.status_code == 200, r.content
    tokens = np.array(_msgpack(r)["tokens"][0])
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    cfg = codec.config
    assert tokens.shape == (cfg.num_codebooks, int(np.ceil(1.5 * 44100 / FRAME)))
    rng = np.random.default_rng(1)
    long = np.concatenate([rng.integers(0, cfg.semantic_codebook_size, (1, 300)),
                           rng.integers(0, cfg.codebook_size, (cfg.n_codebooks, 300))])
    r = httpx.post(f"{gw.url}/v1/vqgan/decode", json={"tokens": [tokens.tolist(), long.tolist()]},
                   headers=_headers(), timeout=120)
    assert r.status_code == 200, r.content
    audios = [np.frombuffer(a, np.float16).astype(np.float32) for a in _msgpack(r)["audios"]]
    for got, codes in zip(audios, (tokens, long)):
        with torch.inference_mode():
            want = codec.decode(torch.as_tensor(codes[None], dtype=torch.int64))[0, 0].numpy()
        assert got.shape == want.shape == (codes.shape[1] * FRAME,) and np.abs(got).max() > 1e-3
        assert np.abs(got - want).max() < 2e-3 * max(1.0, np.abs(want).max())  # float16's rounding


def _wav_of(seconds: float, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(rate * seconds), np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def bad_cases(hum_wav) -> dict:
    """name -> (method, path, httpx arguments, status, words of the message)."""
    big = b"RIFF" + b"\0" * (20 * 2**20)  # a 20 MB upload
    add, form = "/v1/references/add", {"id": "fine", "text": "Words."}
    clip = {"audio": ("a.wav", hum_wav)}
    mp = ormsgpack.packb
    return {
        "add_slash_id": ("post", add, dict(data={**form, "id": "a/b"}, files=clip), 400, "invalid voice name"),
        "add_space_id": ("post", add, dict(data={**form, "id": "my voice"}, files=clip), 400, "or spaces"),
        "add_empty_audio": ("post", add, dict(data=form, files={"audio": ("a.wav", b"")}), 400, "audio is empty"),
        "add_no_text": ("post", add, dict(data={"id": "fine"}, files=clip), 400, "text is required"),
        "add_not_audio": ("post", add, dict(data=form, files={"audio": ("a.wav", b"not audio" * 20)}), 415,
                          "could not be decoded"),
        "add_20mb": ("post", add, dict(data=form, files={"audio": ("a.wav", big)}), 413, "MiB"),
        "add_taken": ("post", add, dict(data={**form, "id": "taken"}, files=clip), 409, "already exists"),
        "delete_unknown": ("delete", "/v1/references/delete", dict(json={"reference_id": "nobody"}), 404, "not found"),
        "delete_slash": ("delete", "/v1/references/delete", dict(json={"reference_id": "../x"}), 400, "invalid"),
        "update_same": ("post", "/v1/references/update",
                        dict(json={"old_reference_id": "taken", "new_reference_id": "taken"}), 400, "different"),
        "update_unknown": ("post", "/v1/references/update",
                           dict(json={"old_reference_id": "nobody", "new_reference_id": "x"}), 404, "not found"),
        "update_onto_taken": ("post", "/v1/references/update",
                              dict(json={"old_reference_id": "taken2", "new_reference_id": "taken"}), 409, "exists"),
        "encode_empty": ("post", "/v1/vqgan/encode", dict(content=mp({"audios": [b""]})), 400, "audios[0] is empty"),
        "encode_none": ("post", "/v1/vqgan/encode", dict(content=mp({"audios": []})), 400, "1 to 8"),
        "encode_not_audio": ("post", "/v1/vqgan/encode", dict(content=mp({"audios": [b"junk" * 50]})), 415,
                             "could not be decoded"),
        "encode_too_long": ("post", "/v1/vqgan/encode", dict(content=mp({"audios": [_wav_of(31)]})), 400, "limit is"),
        "encode_20mb": ("post", "/v1/vqgan/encode", dict(content=mp({"audios": [big]})), 413, "MiB"),
        "decode_out_of_range": ("post", "/v1/vqgan/decode", dict(json={"tokens": [[[5] * 4] + [[99999] * 4] * 9]}),
                                400, "out of range"),
        "decode_negative": ("post", "/v1/vqgan/decode", dict(json={"tokens": [[[-1] * 4] * 10]}), 400, "out of range"),
        "decode_ragged": ("post", "/v1/vqgan/decode", dict(json={"tokens": [[[1, 2], [3]]]}), 400, "one length"),
        "decode_codebooks": ("post", "/v1/vqgan/decode", dict(json={"tokens": [[[1] * 4] * 3]}), 400, "codes must be"),
        "decode_too_many_frames": ("post", "/v1/vqgan/decode", dict(json={"tokens": [[[1] * (MAX_FRAMES + 1)] * 10]}),
                                   413, "--max-decode-frames"),
        "tts_streaming_not_bool": ("post", "/v1/tts", dict(content=mp(_serve_tts(streaming="yes"))), 400, "streaming"),
        "tts_memory_cache": ("post", "/v1/tts", dict(content=mp(_serve_tts(use_memory_cache="maybe"))), 400,
                             "use_memory_cache"),
    }


CASES = ["add_slash_id", "add_space_id", "add_empty_audio", "add_no_text", "add_not_audio", "add_20mb", "add_taken",
         "delete_unknown", "delete_slash", "update_same", "update_unknown", "update_onto_taken", "encode_empty",
         "encode_none", "encode_not_audio", "encode_too_long", "encode_20mb", "decode_out_of_range", "decode_negative",
         "decode_ragged", "decode_codebooks", "decode_too_many_frames", "tts_streaming_not_bool", "tts_memory_cache"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_that_apis_error(gw, hum_wav, bad_cases, case):
    """Bad input on each new route: 4xx in fish-speech's own form (a reference route's answer with success false, in
    msgpack as its client reads it; the codec and tts routes' {statusCode, message, error}), and the server still
    ready."""
    if case in ("add_taken", "update_same", "update_onto_taken"):
        for name in ("taken", "taken2"):
            if name not in _msgpack(httpx.get(f"{gw.url}/v1/references/list", headers=_headers()))["reference_ids"]:
                assert httpx.post(f"{gw.url}/v1/references/add", headers=_headers(), timeout=120,
                                  data={"id": name, "text": "Words."},
                                  files={"audio": ("a.wav", hum_wav)}).status_code == 200
    method, path, kw, status, words = bad_cases[case]
    headers = _headers(**({"content-type": "application/msgpack"} if "content" in kw else {}))
    r = httpx.request(method.upper(), f"{gw.url}{path}", headers=headers, timeout=120, **kw)
    assert r.status_code == status, (r.status_code, r.content[:300])
    if path.startswith("/v1/references/"):
        body = _msgpack(r)
        assert body["success"] is False and words.lower() in body["message"].lower(), body
        assert ("reference_id" in body) or ("old_reference_id" in body and "new_reference_id" in body), body
    else:
        body = r.json()
        assert body["statusCode"] == status and body["error"] and words.lower() in body["message"].lower(), body
    assert httpx.get(f"{gw.url}/v1/health", headers=_headers(), timeout=10).json() == {"status": "ok"}


# ---- ref_audio as a URL (vLLM-Omni's S2 Pro guide's voice-cloning request) --------------------------------------
def _clone(gw, ref_audio, **extra) -> httpx.Response:
    """The guide's request: `ref_audio` a URL, `ref_text` its transcript; seeded and short here."""
    return httpx.post(f"{gw.url}/v1/audio/speech", headers=_headers(), timeout=120,
                      json={"model": "fishaudio/s2-pro", "input": TEXT, "ref_audio": ref_audio,
                            "ref_text": "A hummed tone.", "response_format": "pcm", "stream": False, "seed": SEED,
                            "max_new_tokens": 8, **extra})


def test_ref_audio_urls_allowed(gw, files, ref_dir, hum_wav):
    """A URL on a listed host, one redirected within the list, a file:// path under --ref-audio-dir: each the same
    audio as the clip sent inline."""
    inline = _clone(gw, "data:audio/wav;base64," + base64.b64encode(hum_wav).decode())
    assert inline.status_code == 200, inline.text
    want = np.frombuffer(inline.content, np.int16)
    for url in (f"{files}/ref.wav", f"{files}/moved", f"file://{ref_dir[0] / 'ref.wav'}"):
        r = _clone(gw, url)
        assert r.status_code == 200 and _same(np.frombuffer(r.content, np.int16), want), (url, r.text)


@pytest.mark.parametrize("where,status,words", [
    ("host_not_listed", 400, "--ref-audio-hosts"), ("too_large", 413, "--max-upload-mb"),
    ("too_large_unsized", 413, "--max-upload-mb"), ("too_slow", 400, "longer than 1 s (the limit, --ref-audio-timeout)"),
    ("redirected_away", 400, "--ref-audio-hosts"), ("not_found", 400, "answered 404"),
    ("file_outside", 400, "--ref-audio-dir"), ("file_symlink_out", 400, "--ref-audio-dir"),
    ("file_dotdot", 400, "--ref-audio-dir"), ("other_scheme", 400, "other URLs are not fetched")])
def test_ref_audio_urls_refused(gw, files, ref_dir, where, status, words):
    """Refused, with the setting that would allow it named: a host not listed (the server is on loopback as
    `localhost`, which is not), a file over the upload limit (with or without Content-Length), a server that stalls
    past --ref-audio-timeout (asserted on the error, never on time), a redirect out of the list, a file outside the
    directory (directly, by a symlink, by `..`)."""
    port = files.rsplit(":", 1)[1]
    url = {"host_not_listed": f"http://localhost:{port}/ref.wav", "too_large": f"{files}/big.wav",
           "too_large_unsized": f"{files}/big-unsized.wav", "too_slow": f"{files}/stall.wav",
           "redirected_away": f"{files}/away", "not_found": f"{files}/nothing.wav",
           "file_outside": f"file://{ref_dir[1]}", "file_symlink_out": f"file://{ref_dir[0] / 'link.wav'}",
           "file_dotdot": f"file://{ref_dir[0]}/../{ref_dir[1].parent.name}/{ref_dir[1].name}",
           "other_scheme": "ftp://127.0.0.1/ref.wav"}[where]
    r = _clone(gw, url)
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == "ref_audio" and words in err["message"], (r.status_code, err)
    assert httpx.get(f"{gw.url}/health", timeout=10).json()["status"] == "ok"


def test_openai_voice_names_speak_with_the_configured_voice(gw, hum_wav):
    """With --openai-voice naming a voice: the unmodified openai SDK's voice="alloy" (model "tts-1") speaks with it,
    the same audio as naming it; before it is registered, a 404 that names the setting."""
    import openai

    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    kw = dict(model="tts-1", input=TEXT, response_format="pcm", extra_body={"seed": SEED, "max_new_tokens": 8})
    with pytest.raises(openai.NotFoundError) as ei:
        client.audio.speech.create(voice="alloy", **kw)
    assert "--openai-voice" in ei.value.response.json()["error"]["message"]
    assert httpx.post(f"{gw.url}/v1/references/add", headers=_headers(), timeout=120,
                      data={"id": MAPPED, "text": "A hummed tone."},
                      files={"audio": ("a.wav", hum_wav)}).status_code == 200
    alloy = client.audio.speech.create(voice="alloy", **kw).content
    named = client.audio.speech.create(voice=MAPPED, **kw).content
    assert _same(np.frombuffer(alloy, np.int16), np.frombuffer(named, np.int16))
