"""A GPU's default pipeline through a real tritonserver (tiny checkpoint, CPU): codec_in_engine, slow_ar decoding the
audio in its own loop, s2pro never calling dac_decoder: the streamed audio is the offline CLI's, a dialogue spoken in
several segments is one seamless decode through one codec stream, concurrent streams match their solo runs, and
every codec stream is closed after a cancel. Beside it the same with engine_in_s2pro (s2pro holds the engine, no
slow_ar model): a chunk crosses processes twice between the engine and the client, and a killed client frees its
request. Both servers must stop cleanly after all of it."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from s2tts.client import S2ProClient, TTSInput, read_metrics

ROOT = Path(__file__).resolve().parents[1]
FRAME = 2048


def _serve(tiny_ckpt, tmp_path_factory, **settings):
    from servers import tiny_server

    with tiny_server(tiny_ckpt, tmp_path_factory.mktemp("triton_codec_in_engine"), max_batch=8, max_seq_len=2048,
                     chunk_frames=8, codec_in_engine="true", **settings) as s:
        yield s
    # stopped: s2pro (and the engine, where it holds it) unloaded within the stop's grace, whatever the tests did
    log = s.log_path.read_text(errors="replace")
    assert "successfully unloaded 's2pro'" in log, log[-3000:]


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    yield from _serve(tiny_ckpt, tmp_path_factory)


@pytest.fixture(scope="module")
def in_s2pro(tiny_ckpt, tmp_path_factory):
    yield from _serve(tiny_ckpt, tmp_path_factory, engine_in_s2pro="true")


def synth(server, **kw):
    with S2ProClient(server.grpc_url) as c:
        return c.synthesize(TTSInput(**kw))


def _inferences(server, model: str) -> int:
    with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/stats", timeout=5) as r:
        return int(json.loads(r.read())["model_stats"][0]["inference_stats"]["success"]["count"])


def _gauge(server, name: str, model: str) -> float:
    return read_metrics(server.metrics_url).get(f'{name}{{model="{model}"}}', -1.0)


def test_audio_comes_from_slow_ar_and_equals_the_offline_cli(server, tiny_ckpt, tmp_path):
    assert "codec in the engine's loop" in server.log_tail(2000)
    before = _inferences(server, "dac_decoder")
    kw = dict(text="The same seed gives the same audio.", seed=1234, max_new_tokens=24, temperature=0.9, top_p=0.9,
              top_k=20)
    res = synth(server, first_chunk_frames=3, chunk_frames=6, **kw)
    assert _inferences(server, "dac_decoder") == before  # no chunk went to dac_decoder
    assert res.chunks[0].codes.shape[0] in (3, 6) and len(res.chunks) >= 3
    assert all(c.audio.size == c.codes.shape[0] * FRAME for c in res.chunks)
    out = tmp_path / "cli.wav"
    cmd = [sys.executable, "-m", "s2tts.cli", "--checkpoint", str(tiny_ckpt), "--text", kw["text"], "--out", str(out),
           "--seed", "1234", "--max-new-tokens", "24", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "20",
           "--device", "cpu", "--dtype", "fp32"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    offline, sr = sf.read(out, dtype="float32")
    assert sr == 44100 and offline.shape == res.audio.shape
    np.testing.assert_allclose(res.audio, offline, atol=2e-4, rtol=0)


def test_dialogue_segments_continue_one_codec_stream(server, tiny_ckpt):
    from s2tts.codec.loading import load_codec_from_dir
    from s2tts.codec.stream import StreamDecoder
    from s2tts.frontend.segment import batches

    text = "".join(f"<|speaker:{i % 2}|>Line {i} of the dialogue, spoken in turn. " for i in range(6))
    n = len(batches(text, 64))
    assert n >= 3
    res = synth(server, text=text, seed=2, max_new_tokens=4, ignore_eos=True, chunk_length=64)
    assert res.stats["frames"] == 4 * n == res.codes.shape[1]
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    whole = StreamDecoder(codec).decode_many([("k", "s", res.codes.T.astype(np.int64), True, True)], now=0.0)["k"]
    assert res.audio.shape == whole.shape
    np.testing.assert_allclose(res.audio, whole, atol=1e-4, rtol=0)
    deadline = time.monotonic() + 10
    while _gauge(server, "s2tts_codec_streams_open", "slow_ar") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gauge(server, "s2tts_codec_streams_open", "slow_ar") == 0


def test_concurrent_streams_match_alone(server):
    from servers import assert_together_as_alone

    assert_together_as_alone(server, ["First voice.", "Second, longer sentence here.", "Third one."], [5, 6, 7])


def test_cancel_closes_the_codec_stream(server):
    with S2ProClient(server.grpc_url) as c:
        got = list(c.stream(TTSInput(text="Cancel me part way through.", seed=3, max_new_tokens=400, temperature=0.0,
                                     first_chunk_frames=2, chunk_frames=2), cancel_after_chunks=2))
    assert len(got) == 2 and all(g.audio.size == g.codes.shape[0] * FRAME for g in got)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_gauge(server, "s2tts_codec_streams_open", "slow_ar") != 0
                                           or _gauge(server, "s2tts_engine_slots_used", "slow_ar") != 0):
        time.sleep(0.2)
    assert _gauge(server, "s2tts_codec_streams_open", "slow_ar") == 0
    res = synth(server, text="A following request completes.", seed=4, max_new_tokens=10)
    assert res.stats["finish_reason"] in ("end", "length") and res.audio.size == res.stats["frames"] * FRAME


def test_voice_clone_decodes_in_the_engine(server):
    """A clone from reference audio: dac_encoder encodes it, slow_ar speaks and decodes; dac_decoder stays idle and
    the audio is as long as the frames."""
    t = np.arange(int(44100 * 1.5)) / 44100
    ref = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    before = _inferences(server, "dac_decoder")
    res = synth(server, text="Cloned voice.", reference_audio=ref, reference_sample_rate=44100,
                reference_text="A humming tone.", seed=9, max_new_tokens=12, ignore_eos=True)
    assert res.stats["frames"] == 12 and res.audio.size == 12 * FRAME and np.isfinite(res.audio).all()
    assert _inferences(server, "dac_encoder") >= 1 and _inferences(server, "dac_decoder") == before


def test_dac_decoder_loads_its_codec_on_the_first_direct_request(server, tiny_ckpt):
    """With codec_in_engine, dac_decoder serves direct callers only and holds no codec until one comes (on a GPU that
    is S2 Pro's fp16 decoder and its fp32 fallback, ~2 GB); the first direct chunk loads it and decodes as the codec
    does offline, and the next one continues the stream."""
    import tritonclient.grpc as grpcclient

    from s2tts.codec.loading import load_codec_from_dir

    log = server.log_path.read_text(errors="replace")
    assert "direct callers only (codec_in_engine); the codec loads on the first request" in log
    assert "loaded its codec for a direct request" not in log
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    cfg = codec.config
    rng = np.random.default_rng(3)
    codes = np.concatenate([rng.integers(0, cfg.semantic_codebook_size, (6, 1)),
                            rng.integers(0, cfg.codebook_size, (6, cfg.n_codebooks))], 1).astype(np.int32)
    got = []
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        for part, start, final in ((codes[:4], True, False), (codes[4:], False, True)):
            inputs = [grpcclient.InferInput("codes", [1, *part.shape], "INT32"),
                      grpcclient.InferInput("stream_id", [1, 1], "BYTES"),
                      grpcclient.InferInput("start", [1, 1], "BOOL"), grpcclient.InferInput("final", [1, 1], "BOOL")]
            inputs[0].set_data_from_numpy(part[None])
            inputs[1].set_data_from_numpy(np.array([[b"direct-1"]], dtype=object))
            inputs[2].set_data_from_numpy(np.array([[start]]))
            inputs[3].set_data_from_numpy(np.array([[final]]))
            got.append(c.infer("dac_decoder", inputs).as_numpy("audio")[0])
    assert "loaded its codec for a direct request" in server.log_path.read_text(errors="replace")
    import torch

    with torch.inference_mode():
        want = codec.decode(torch.as_tensor(codes.T[None].astype(np.int64)))[0, 0].numpy()
    audio = np.concatenate(got)
    assert audio.shape == want.shape == (6 * FRAME,)
    assert np.abs(audio - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_the_engine_in_s2pro_and_a_chunk_crosses_processes_twice(in_s2pro):
    """engine_in_s2pro: no slow_ar model; s2pro's log says it holds the engine; a request's chunks make no call out
    of s2pro but their responses: 2 process crossings a chunk between the engine and the client (s2pro ->
    tritonserver -> client), where through slow_ar each chunk is also a BLS call (4 more; tests/test_triton.py
    counts those)."""
    from servers import pipeline_calls

    server = in_s2pro
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{server.http_url}/v2/models/slow_ar/ready", timeout=5)
    log = server.log_path.read_text(errors="replace")
    assert "[s2tts:s2pro] INFO slow_ar ready in" in log and "codec_in_engine=True" in log
    before = read_metrics(server.metrics_url)
    res = synth(server, text="Count the crossings of every chunk.", seed=6, max_new_tokens=20, ignore_eos=True,
                first_chunk_frames=2, chunk_frames=4)
    chunks = len(res.chunks)
    assert res.stats["frames"] == 20 and chunks >= 2
    deadline = time.monotonic() + 10
    while True:  # the send of the final response is observed after it went
        m = read_metrics(server.metrics_url)
        sends = pipeline_calls(m, "send")[0] - pipeline_calls(before, "send")[0]
        if sends >= chunks + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sends == chunks + 1  # each chunk's response and the final one: 2 crossings each
    outside = {k for k in m if k.startswith("s2tts_pipeline_call_seconds_count") and 'model="s2pro"' in k
               and 'call="send"' not in k and m[k] > before.get(k, 0)}
    assert not outside, outside  # no BLS call for this request: no slow_ar, no dac_decoder, no dac_encoder
    assert _gauge(server, "s2tts_engine_slots_total", "slow_ar") == 8  # the engine's metrics, from s2pro's process


def test_a_killed_client_frees_the_engine_in_s2pro(in_s2pro):
    from servers import assert_killed_client_is_cancelled

    server = in_s2pro
    assert_killed_client_is_cancelled(server, "killed-in-process")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _gauge(server, "s2tts_engine_slots_used", "slow_ar") != 0:
        time.sleep(0.2)
    assert _gauge(server, "s2tts_engine_slots_used", "slow_ar") == 0
