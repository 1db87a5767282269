"""Several engines (`device` lists several devices, `s2tts.layout`): rendering, placement, faults, and a real server.

On the CPU, `device=cpu,cpu` gives the same layout as `cuda:0,cuda:1` on a GPU host: two slow_ar engines
(`slow_ar`, `slow_ar_1`), each with its own dac_decoder, and s2pro spreading requests over them.
"""

import threading
import time

import numpy as np
import pytest

from fake_triton import FakeTriton
from s2tts import errors
from s2tts.errors import S2Error
from s2tts.layout import Layout, parse_devices


# ---- the layout setting ------------------------------------------------------------------------------------------
def test_device_lists():
    assert parse_devices("cuda:0, cuda:1") == ("cuda:0", "cuda:1")
    assert parse_devices(None) == ("auto",)
    for bad, words in (("gpu0", "not a device"), ("cuda:0,auto", "stands alone"), ("cuda:0,,cuda:1", "not a device")):
        with pytest.raises(S2Error) as ei:
            parse_devices(bad)
        assert words in ei.value.message and ei.value.param == "device"
    two = Layout.from_values({"device": "cuda:0,cuda:1"})
    assert two.codecs == two.engines and [two.decoder(i) for i in range(2)] == ["dac_decoder", "dac_decoder_1"]
    shared = Layout.from_values({"device": "cuda:0,cuda:1", "codec_device": "cuda:2"})
    assert [shared.engine(i) for i in range(2)] == ["slow_ar", "slow_ar_1"]
    assert [shared.decoder(i) for i in range(2)] == ["dac_decoder", "dac_decoder"]
    assert shared.replica_models() == ["slow_ar_1"]
    with pytest.raises(S2Error) as ei:
        Layout.from_values({"device": "cuda:0", "codec_device": "cuda:1,cuda:2"})
    assert ei.value.param == "codec_device"
    assert all(0 <= two.preferred(v) < 2 for v in ("", "a voice", "another"))
    assert two.preferred("a voice") == two.preferred("a voice")


def test_engine_in_s2pro_renders_no_slow_ar_and_needs_one_engine(tiny_ckpt, tmp_path):
    """engine_in_s2pro: rendering leaves slow_ar out (s2pro holds the engine, with the engine's settings in its own
    config) and the repository validates; several engines, or fast_ar=bls, are refused naming the setting."""
    from s2tts import settings as S
    from s2tts.repository import render_repository, validate_repository

    base = {"checkpoint": str(tiny_ckpt), "device": "cpu"}
    repo = render_repository(tmp_path / "in", {**base, "engine_in_s2pro": "true", "max_batch": "5"})
    assert not (repo / "slow_ar").exists() and (repo / "s2pro").is_dir()
    assert validate_repository(repo) == []
    cfg = (repo / "s2pro" / "config.pbtxt").read_text()
    assert 'key: "max_batch" value { string_value: "5" }' in cfg and 'key: "engine_in_s2pro" value { string_value: "true" }' in cfg
    assert (render_repository(tmp_path / "out", base) / "slow_ar").is_dir()  # the default: slow_ar, its own process
    for bad in ({"device": "cpu,cpu"}, {"fast_ar": "bls"}):
        with pytest.raises(S2Error) as ei:
            S.resolve({**base, "engine_in_s2pro": "true", **bad})
        assert ei.value.param == "engine_in_s2pro" and "engine_in_s2pro" in ei.value.message


def test_codec_in_engine_is_decided_once_from_the_layout(tiny_ckpt):
    """auto: on when every engine has its codec on its own GPU; the rendered value is what slow_ar and dac_decoder
    both read (so dac_decoder knows to skip its stream pool)."""
    from s2tts import settings as S

    def decided(**kw):
        return S.resolve({"checkpoint": str(tiny_ckpt), **kw})["codec_in_engine"]

    assert decided(device="cuda:0") is True
    assert decided(device="cuda:0,cuda:1") is True
    assert decided(device="cuda:0", codec_device="cuda:1") is False  # the codec on a second GPU: dac_decoder
    assert decided(device="cuda:0,cuda:1", codec_device="cuda:0") is False  # engine 1's codec is on GPU 0
    assert decided(device="cpu") is False and decided(device="cpu,cpu") is False
    assert decided(device="cuda:0", codec_in_engine="false") is False
    assert decided(device="cpu", codec_in_engine="true") is True  # a test's choice: the CPU can run it too


def _render(tiny_ckpt, tmp_path, **settings):
    from s2tts.repository import render_repository

    base = {"checkpoint": str(tiny_ckpt), "device": "cpu,cpu", "dtype": "fp32", "max_batch": "4", "max_seq_len": "2048",
            "chunk_frames": "4", "first_chunk_frames": "2", "stall_timeout_s": "1", "request_timeout_s": "60"}
    base.update({k: str(v) for k, v in settings.items()})
    return render_repository(tmp_path / "repo", base)


def test_rendered_replicas(tiny_ckpt, tmp_path):
    from s2tts.repository import parse_model_config, render_model_repository, validate_repository

    repo = _render(tiny_ckpt, tmp_path)
    assert sorted(p.name for p in repo.iterdir()) == ["dac_decoder", "dac_decoder_1", "dac_encoder", "fast_ar", "s2pro",
                                                      "slow_ar", "slow_ar_1"]
    params = {}
    for name in ("slow_ar", "slow_ar_1", "dac_decoder_1", "s2pro", "fast_ar", "dac_encoder"):
        cfg = parse_model_config(repo / name / "config.pbtxt")
        assert cfg.name == name
        params[name] = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["slow_ar"]["device"] == params["slow_ar_1"]["device"] == params["fast_ar"]["device"] == "cpu"
    assert params["dac_decoder_1"]["codec_device"] == params["dac_encoder"]["codec_device"] == "cpu"
    assert params["s2pro"]["device"] == params["s2pro"]["codec_device"] == "cpu,cpu"
    assert params["slow_ar_1"]["codec_in_engine"] == "false" and params["slow_ar_1"]["codec_device"] == "cpu"
    assert (repo / "slow_ar_1" / "1" / "model.py").read_text() == (repo / "slow_ar" / "1" / "model.py").read_text()
    assert validate_repository(repo) == []
    from s2tts.server import TritonServer  # the launcher loads all 7 at once (Triton's default is 4 at a time)

    assert "--model-load-thread-count=7" in TritonServer(tiny_ckpt, workdir=tmp_path / "w").command("tritonserver", repo)
    (repo / "dac_decoder_1" / "config.pbtxt").unlink()
    assert any("dac_decoder_1" in p for p in validate_repository(repo))

    one_codec = _render(tiny_ckpt, tmp_path, codec_device="cpu")
    assert not (one_codec / "dac_decoder_1").exists() and (one_codec / "slow_ar_1").is_dir()
    with pytest.raises(S2Error) as ei:
        _render(tiny_ckpt, tmp_path, fast_ar="bls")
    assert ei.value.param == "fast_ar" and "fast_ar=inprocess" in ei.value.message
    with pytest.raises(ValueError, match="backend=python"):
        render_model_repository(tmp_path / "trt", {"checkpoint": str(tiny_ckpt), "device": "cuda:0,cuda:1",
                                                   "backend": "onnxruntime"}, require_engines=False)


# ---- s2pro over two engines (the real model.py files in this process) ----------------------------------------------
@pytest.fixture
def two_engines(tiny_ckpt, tmp_path):
    h = FakeTriton(_render(tiny_ckpt, tmp_path))
    calls = []  # (model, request id) of every BLS call
    bls = h.bls

    def recording(model, inputs, request_id, decoupled):
        calls.append((model, request_id))
        return bls(model, inputs, request_id, decoupled)

    h.bls, h.bls_calls = recording, calls
    yield h
    h.shutdown()


def _inputs(text, seed=1, max_new_tokens=12, **kw):
    out = {"text": np.array([text.encode()], dtype=object), "seed": np.array([seed], np.int64),
           "max_new_tokens": np.array([max_new_tokens], np.int32)}
    out.update(kw)
    return out


def _result(req, timeout=60):
    """(error or None, audio, codes) of a finished harness request; exactly one final response."""
    assert req.sender.done.wait(timeout), "no final response"
    s = req.sender
    assert s.finals == 1 and s.late == 0
    chunks = [r for r in s.responses if not r.has_error()]
    audio = np.concatenate([r.get("audio") for r in chunks]) if chunks else np.zeros(0, np.float32)
    codes = np.concatenate([r.get("codes") for r in chunks]) if chunks else np.zeros((0, 0), np.int32)
    return s.error, audio, codes


def _placement(h, client: str) -> tuple[set, set]:
    """The slow_ar and dac_decoder models that served `client`'s request (BLS ids are `<client>/<n>[.k]`)."""
    mine = {m for m, rid in h.bls_calls if rid.split("/")[0] == client}
    return {m for m in mine if m.startswith("slow_ar")}, {m for m in mine if m.startswith("dac_decoder")}


def _released(h, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        busy = [n for n in ("slow_ar", "slow_ar_1") if len(h.models[n].service.table)
                or h.models[n].service.engine.counts()["live"]]
        busy += [n for n in ("dac_decoder", "dac_decoder_1") if h.models[n].decoder.states]
        if not busy and not len(h.models["s2pro"].service.table) and not any(h.models["s2pro"].service.load()):
            return
        time.sleep(0.05)
    raise AssertionError(f"not released: {busy}, s2pro {h.models['s2pro'].service.status()}")


def test_requests_spread_and_each_stays_on_its_replica(two_engines, tiny_ckpt):
    from s2tts.codec.loading import load_codec_from_dir
    from s2tts.codec.stream import StreamDecoder

    h = two_engines
    # the same seeded request twice at once: one per engine (each alone there), the same codes and audio
    twins = [h.request("s2pro", _inputs("The same words, twice.", seed=7, max_new_tokens=20), f"twin{i}") for i in range(2)]
    (e0, a0, c0), (e1, a1, c1) = (_result(r) for r in twins)
    assert e0 is None and e1 is None and a0.size > 0
    engines = [_placement(h, f"twin{i}")[0] for i in range(2)]
    assert sorted(min(e) for e in engines) == ["slow_ar", "slow_ar_1"], engines
    np.testing.assert_array_equal(c0, c1)
    # each engine's pace sets its chunk lengths, and the codec's float sums differ in the last bits with the chunk
    # boundaries: the same audio to within one step of 16-bit PCM
    np.testing.assert_allclose(a0, a1, rtol=0, atol=1 / 32768)

    reqs = {f"c{i}": h.request("s2pro", _inputs(f"Request number {i}.", seed=i), f"c{i}") for i in range(6)}
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    for client, req in reqs.items():
        err, audio, codes = _result(req)
        assert err is None and audio.size == codes.shape[0] * 2048
        # every chunk of a stream went through one decoder state, on its engine's codec: no seam
        whole = StreamDecoder(codec).decode_many([("k", "s", codes.astype(np.int64), True, True)], now=0.0)["k"]
        np.testing.assert_allclose(audio, whole, atol=1e-4, rtol=0)
    used = {}
    for client in reqs:
        engines, decoders = _placement(h, client)
        assert len(engines) == 1 and len(decoders) == 1, (client, engines, decoders)  # never moves
        engine = engines.pop()
        assert decoders.pop() == ("dac_decoder" if engine == "slow_ar" else "dac_decoder_1")
        used[engine] = used.get(engine, 0) + 1
    assert used == {"slow_ar": 3, "slow_ar_1": 3}, used  # six at once: the fewest-requests rule alternates
    _released(h)


def test_a_failed_engine_ends_only_its_requests_and_the_other_takes_new_ones(two_engines):
    h = two_engines
    reloading = threading.Event()
    load = h.load

    def slow_load(name):  # hold slow_ar_1's reload until the test has sent a request meanwhile
        if name == "slow_ar_1":
            assert reloading.wait(60)
        return load(name)

    h.load = slow_load
    long = dict(max_new_tokens=300, ignore_eos=np.array([True]))
    victims = [h.request("s2pro", _inputs(f"Long one {i}.", seed=i, **long), f"long{i}") for i in range(2)]
    while not all(v.sender.responses for v in victims):
        time.sleep(0.01)
    on_1 = next(i for i in range(2) if _placement(h, f"long{i}")[0] == {"slow_ar_1"})
    h.kill("slow_ar_1")
    err, _, _ = _result(victims[on_1], 30)
    assert errors.parse(err.message()).code == "unavailable" and "slow_ar_1" in err.message()
    s2pros = [m.service for m in h.instances["s2pro"]]  # two instances (s2pro_instances: one per engine)
    deadline = time.time() + 10
    while not any("slow_ar_1" in s.recovering for s in s2pros) and time.time() < deadline:
        time.sleep(0.01)
    assert any("slow_ar_1" in s.recovering for s in s2pros)  # the instance whose request it was reloads it
    while not all(sum(s.load()) + sum(s.shared_load.others()) == 1 for s in s2pros):  # the victim's end published:
        assert time.time() < deadline  # by load, the dead engine's is now the emptiest
        time.sleep(0.01)
    for k in range(2):  # either instance keeps new requests off it meanwhile, the one that saw nothing too
        meanwhile = h.request("s2pro", _inputs("While one engine reloads."), f"meanwhile{k}", instance=k)
        assert _result(meanwhile)[0] is None
        assert _placement(h, f"meanwhile{k}")[0] == {"slow_ar"}
    survivor = _result(victims[1 - on_1])
    assert survivor[0] is None and survivor[2].shape[0] == 300  # the other engine's request never noticed
    reloading.set()
    while any(s.recovering for s in s2pros) and time.time() < deadline + 30:
        time.sleep(0.05)
    assert not any(s.recovering for s in s2pros) and h.calls.count(("slow_ar_1", "unload")) == 1
    after = [h.request("s2pro", _inputs(f"After {i}.", max_new_tokens=30), f"after{i}") for i in range(2)]
    assert all(_result(r)[0] is None for r in after)
    assert {min(_placement(h, f"after{i}")[0]) for i in range(2)} == {"slow_ar", "slow_ar_1"}
    _released(h)


def test_later_chunks_grow_with_the_engines_s2pro_relays_for(tiny_ckpt):
    """chunk_frames unset: 16 frames for each engine (one s2pro relays them all), at most max_chunk_frames; a given
    value is kept. The value resolved is the one rendered into every model."""
    from s2tts import settings as S

    def chunk(**kw):
        return S.resolve({"checkpoint": str(tiny_ckpt), **kw})["chunk_frames"]

    assert chunk(device="cuda:0") == chunk(device="cpu") == S.SCHEMA["chunk_frames"].default == 16
    assert chunk(device="cuda:0,cuda:1") == chunk(device="cpu,cpu") == 32
    assert chunk(device="cuda:0,cuda:1,cuda:2,cuda:3") == 64
    assert chunk(device="cuda:0,cuda:1", max_chunk_frames="24") == 24
    assert chunk(device="cuda:0,cuda:1", chunk_frames="8") == 8
    assert chunk(device="cuda:0,cuda:1", codec_device="cuda:2") == 32  # engines, not codecs
