"""ONNX export (s2tts.export): every graph run by onnxruntime against the PyTorch modules on the tiny
checkpoint, the TensorRT variants of the model repository and their switch (s2tts.repository), the
engine build script (with a stand-in trtexec), and the whole variant served by tritonserver with
onnxruntime in place of the engines. TensorRT itself is not here (docs/TENSORRT.md)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from s2tts import repository as rp  # noqa: E402
from s2tts.codec.loading import load_codec_from_dir  # noqa: E402
from s2tts.ar.loading import load_model  # noqa: E402
from s2tts.codec.model import make_codec, tiny_codec_config  # noqa: E402
from s2tts.export import checks as xc  # noqa: E402
from s2tts.export import driver as xd  # noqa: E402
from s2tts.export import onnx_graphs as xg  # noqa: E402
from s2tts.export import runtime as xr  # noqa: E402
from s2tts.repository import MODEL_REPOSITORY, render_repository  # noqa: E402
from s2tts.ar.sampling import sample  # noqa: E402
from s2tts.server import server_has_tensorrt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fast_model(tiny_ckpt):
    return load_model(tiny_ckpt, "cpu", "fp32", parts=("fast",))


@pytest.fixture(scope="module")
def codec(tiny_ckpt):
    return load_codec_from_dir(tiny_ckpt, "cpu", "fp32")


@pytest.fixture(scope="module")
def onnx_dir(tiny_ckpt, fast_model, codec, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx")
    xd.export_all(tiny_ckpt, out, model=fast_model, codec=codec)
    return out


@pytest.fixture(scope="module")
def manifest(onnx_dir):
    return xd.load_manifest(onnx_dir)


def _report(check):
    print(check.line())  # the measured values show with pytest -s / -rP
    return check


# --------------------------------------------------------------------------- the export-friendly modules (PyTorch)


def test_sample_from_uniforms_is_sample():
    g = torch.Generator().manual_seed(0)
    B, V = 512, 32
    logits = torch.randn(B, V, generator=g) * 3
    temperature = torch.rand(B, generator=g) * 1.5
    temperature[:8] = 0.0  # greedy rows
    top_p = torch.rand(B, generator=g)
    top_p[8:16] = 1.0
    top_k = torch.randint(0, 40, (B,), generator=g)
    top_k[16:24] = 0  # off
    seed, step = torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 5000, (B,), generator=g)
    for stream in (2, 10):
        want = sample(logits, temperature, top_p, top_k, seed, step, stream)
        u = xg.fast_ar_uniforms(seed, step, 9, V)[:, stream - 1 - xg.FAST_AR_STREAM0]
        got = xg.sample_from_uniforms(logits, temperature, top_p, top_k.int(), u, V)
        assert torch.equal(got, want)


def test_frame_module_equals_cached_fast_ar(fast_model, tiny_ckpt):
    """The cache-free unrolled frame (what is exported) gives the engine's codes, both noise flavours."""
    x = xc.random_sampling_inputs(256, fast_model.s2.audio.dim, fast_model.s2.codebook_size, seed=7)
    ref = xc.reference_fast_ar(fast_model, 32, x)
    base = [x[k] for k in ("hidden", "code0", "temperature", "top_p", "top_k")]
    with torch.inference_mode():
        seeded = xg.FastARFrame(fast_model.fast, 32, seeded=True)(*base, x["seed"], x["step"])
        given = xg.FastARFrame(fast_model.fast, 32)(*base, xg.fast_ar_uniforms(x["seed"], x["step"], 9, 32))
    assert seeded.dtype == torch.int32 and seeded.shape == (256, 9)
    assert torch.equal(seeded.long(), ref) and torch.equal(given.long(), ref)


# --------------------------------------------------------------------------- the ONNX graphs (onnxruntime)


def test_manifest_describes_the_graphs(manifest, codec, onnx_dir):
    assert set(manifest["graphs"]) == set(xg.GRAPHS)
    assert (manifest["num_codebooks"], manifest["residual_size"], manifest["dim"], manifest["frame_length"]) == (10, 32, 64, 2048)
    fa = manifest["graphs"]["fast_ar"]
    assert [(t["name"], t["data_type"], t["dims"]) for t in fa["inputs"]] == [
        ("hidden", "TYPE_FP32", [-1, 64]), ("code0", "TYPE_INT32", [-1]), ("temperature", "TYPE_FP32", [-1]),
        ("top_p", "TYPE_FP32", [-1]), ("top_k", "TYPE_INT32", [-1]), ("uniforms", "TYPE_FP32", [-1, 9, 32])]
    assert fa["outputs"] == [{"name": "codes", "data_type": "TYPE_INT32", "dims": [-1, 9]}]
    assert [t["name"] for t in manifest["graphs"]["fast_ar_seeded"]["inputs"]][-2:] == ["seed", "step"]
    st = manifest["graphs"]["dac_decoder_stream"]
    keys = list(codec.new_stream_state(1).tensors)
    assert [s["key"] for s in st["state"]] == keys
    assert [t["name"] for t in st["inputs"]] == ["codes"] + [xg.state_tensor_name(k) for k in keys]
    assert [t["name"] for t in st["outputs"]] == ["audio"] + [xg.state_tensor_name(k, new=True) for k in keys]
    assert st["profile"]["shapes"]["max"]["codes"] == [64, 10, 32]
    assert manifest["graphs"]["dac_encoder"]["profile"]["shapes"]["max"]["waveform"] == [4, 1, 660 * 2048]
    assert st["profile"]["trtexec"]["min"].startswith("codes:1x10x1,state_quantizer_post_module_pos:1x1,")


@pytest.mark.parametrize("seeded", [False, True], ids=["uniforms", "seeded"])
def test_fast_ar_graph_gives_identical_codes(onnx_dir, fast_model, seeded):
    c = _report(xc.check_fast_ar(onnx_dir, fast_model, 32, batch=64, rounds=2, seeded=seeded))
    assert c.value == 0 and c.ok, c.line()


def test_decoder_graphs_match_pytorch(onnx_dir, codec, manifest):
    checks = [xc.check_decoder(onnx_dir, codec, batch=3, frames=7)]
    checks += xc.check_stream_decoder(onnx_dir, codec, manifest, batch=2, chunks=(1, 4, 5))
    for c in map(_report, checks):
        assert c.ok, c.line()


def test_encoder_graph_matches_pytorch(onnx_dir, codec):
    c = _report(xc.check_encoder(onnx_dir, codec, batch=2, frames=8))
    assert c.ok, c.line()


def test_graphs_cross_transformer_windows(tmp_path):
    """A codec whose transformer windows are 8 frames (decoder) and 16 latent steps (encoder), so the
    chunked window attention of the graphs runs with several chunks, partial last chunks and a state
    that carries across windows."""
    small = make_codec(dataclasses.replace(tiny_codec_config(), quantizer_window=8, encoder_window=16), seed=3)
    m = xd.export_all("unused", tmp_path, graphs=("dac_decoder_stream", "dac_encoder"), codec=small, max_positions=512)
    checks = xc.check_stream_decoder(tmp_path, small, m, batch=2, chunks=(3, 9, 1, 6))  # windows end at 8, 16
    checks.append(xc.check_encoder(tmp_path, small, batch=1, frames=9))  # 36 latent steps: 3 windows of 16
    for c in map(_report, checks):
        assert c.ok, c.line()


def test_checks_fail_when_the_graph_drifts(onnx_dir, tiny_ckpt, codec, manifest):
    """The same checks against modules that differ slightly from the exported ones must fail."""
    drifted = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    with torch.no_grad():
        drifted.decoder.model[0].conv.weight.mul_(1.01)
    assert not xc.check_decoder(onnx_dir, drifted, frames=4).ok
    assert not xc.check_stream_decoder(onnx_dir, drifted, manifest, chunks=(2, 3))[0].ok
    fast = load_model(tiny_ckpt, "cpu", "fp32", parts=("fast",))
    with torch.no_grad():
        fast.fast.output.weight.mul_(1.5)
    c = xc.check_fast_ar(onnx_dir, fast, 32, batch=64, rounds=1)
    assert not c.ok and c.detail["rows_differing"] > 0


def test_tensorrt_operator_table(onnx_dir):
    """The graphs meant for TensorRT use only operators/types its ONNX parser lists; the seeded fast AR
    needs integer XOR (onnxruntime only, hence the uniforms input)."""
    for g in ("fast_ar", "dac_decoder", "dac_decoder_stream", "dac_encoder"):
        assert xc.tensorrt_lint(onnx_dir / f"{g}.onnx") == [], g
    assert "BitwiseXor: not supported by TensorRT" in xc.tensorrt_lint(onnx_dir / "fast_ar_seeded.onnx")


def test_stream_decoder_over_the_graph(onnx_dir, codec, manifest):
    """codec.stream.StreamDecoder with the graph-backed codec (what dac_decoder runs in the TensorRT variant)
    against StreamDecoder with the PyTorch codec: interleaved streams, batched chunks, pieces cut to the
    engine's frame profile (max_frames=4), released states."""
    from s2tts.codec.stream import StreamDecoder

    graph = xr.GraphStreamCodec(xr.ort_runner(onnx_dir / "dac_decoder_stream.onnx"), manifest, max_frames=4, max_batch=2)
    ours, ref = StreamDecoder(graph), StreamDecoder(codec)
    codes = {s: xc._random_codes(codec, 1, 14, seed=s)[0].numpy() for s in range(3)}
    plan = [[("a", 0, 0, 3), ("b", 1, 0, 3), ("c", 2, 0, 3)],  # three streams, same length: one batch (cut to 2+1)
            [("a", 0, 3, 12), ("b", 1, 3, 4)],                  # a long chunk (cut into pieces of 4 frames)
            [("a", 0, 12, 14), ("b", 1, 4, 6), ("c", 2, 3, 5)]]
    for step, jobs in enumerate(plan):
        js = [(key, f"s{s}", codes[s][:, lo:hi].T, step == 0, step == 2) for key, s, lo, hi in jobs]
        got, want = ours.decode_many(js, now=0.0), ref.decode_many(js, now=0.0)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].shape == want[k].shape
            assert xc.relative_error(got[k], want[k]) < xc.LIMITS["audio_rel"], (step, k)
    assert ours.states == {}
    with pytest.raises(ValueError, match="batch"):
        graph.decode_stream(torch.zeros(2, 10, 1, dtype=torch.long), graph.new_stream_state(1))


def test_export_cli(tiny_ckpt, tmp_path):
    out = tmp_path / "onnx"
    p = subprocess.run([sys.executable, "build/export_onnx.py", "--checkpoint", str(tiny_ckpt), "--out", str(out),
                        "--graphs", "fast_ar", "--fast-ar-batch", "1,8,32"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ok   fast_ar" in p.stdout and "fast_ar: no problem found" in p.stdout
    report = json.loads((out / "check_report.json").read_text())
    assert report[0]["ok"] and report[0]["rows_differing"] == 0
    assert xd.load_manifest(out)["graphs"]["fast_ar"]["profile"]["sizes"]["batch"] == [1, 8, 32]
    bad = subprocess.run([sys.executable, "build/export_onnx.py", "--checkpoint", str(tiny_ckpt), "--out", str(out),
                          "--graphs", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "unknown graph" in bad.stderr


# --------------------------------------------------------------------------- engines and the repository switch


def _fake_trtexec(path: Path) -> Path:
    """A stand-in for trtexec: records its arguments, writes the engine file."""
    path.write_text("#!/usr/bin/env bash\n"
                    "echo \"$@\" >> \"$(dirname \"$0\")/trtexec.calls\"\n"
                    "for a in \"$@\"; do case \"$a\" in --saveEngine=*) echo plan > \"${a#--saveEngine=}\" ;; esac; done\n")
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def engine_build(onnx_dir, tmp_path_factory):
    """Engines 'built' by build/build_engines.sh with a stand-in trtexec."""
    d = tmp_path_factory.mktemp("engines")
    tool = _fake_trtexec(tmp_path_factory.mktemp("bin") / "trtexec")
    env = {**os.environ, "TRTEXEC": str(tool), "TRTEXEC_ARGS": "--memPoolSize=workspace:1024"}
    p = subprocess.run(["bash", "build/build_engines.sh", str(onnx_dir), str(d)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return d, (tool.parent / "trtexec.calls").read_text().splitlines()


@pytest.fixture(scope="module")
def engine_dir(engine_build):
    return engine_build[0]


def test_build_engines_script(engine_build, manifest, onnx_dir):
    engine_dir, calls = engine_build
    assert len(calls) == 3
    assert {p.name for p in engine_dir.glob("*.plan")} == {"fast_ar.plan", "dac_decoder_stream.plan", "dac_encoder.plan"}
    assert json.loads((engine_dir / "manifest.json").read_text()) == manifest
    for graph, call in zip(("fast_ar", "dac_decoder_stream", "dac_encoder"), calls):
        t = manifest["graphs"][graph]["profile"]["trtexec"]
        assert f"--onnx={onnx_dir}/{graph}.onnx" in call and f"--saveEngine={engine_dir}/{graph}.plan" in call
        assert f"--minShapes={t['min']}" in call and f"--optShapes={t['opt']}" in call and f"--maxShapes={t['max']}" in call
        assert "--memPoolSize=workspace:1024" in call
        assert ("--bf16" in call) == (graph == "fast_ar")
    dry = subprocess.run(["bash", "build/build_engines.sh", "--dry-run", str(onnx_dir)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "GRAPHS": "dac_decoder", "TRTEXEC": ""}, timeout=60)
    assert dry.returncode == 0 and "dac_decoder.plan" in dry.stdout and "--maxShapes=codes:4x10x1024" in dry.stdout
    missing = subprocess.run(["bash", "build/build_engines.sh", str(onnx_dir)], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "TRTEXEC": "", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert missing.returncode == 1 and "trtexec not found" in missing.stderr


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def test_backend_python_is_the_default(tiny_ckpt, tmp_path):
    settings = {"checkpoint": str(tiny_ckpt), "device": "cpu"}
    a = render_repository(tmp_path / "a", settings)
    for extra in ({}, {"backend": "python"}):
        b = rp.render_model_repository(tmp_path / "b", {**settings, **extra})
        assert _tree(a) == _tree(b)
    assert rp.validate_repository(a) == []


def test_tensorrt_variant_is_a_valid_repository(tiny_ckpt, engine_dir, manifest, tmp_path):
    repo = rp.render_model_repository(tmp_path / "repo", {"checkpoint": str(tiny_ckpt), "device": "cuda", "backend": "tensorrt",
                                                          "engine_dir": str(engine_dir)})
    assert rp.validate_repository(repo, manifest, reference=MODEL_REPOSITORY) == []
    names = {p.name for p in repo.iterdir()}
    assert names == {"s2pro", "slow_ar", "fast_ar", "fast_ar_noise", "fast_ar_trt", "dac_decoder", "dac_decoder_trt",
                     "dac_encoder", "dac_encoder_trt"}
    for model, graph in rp.ENGINE_MODELS.items():
        cfg = rp.parse_model_config(repo / model / "config.pbtxt")
        assert cfg.platform == "tensorrt_plan"
        assert (repo / model / "1" / "model.plan").resolve() == (engine_dir / f"{graph}.plan").resolve()
    assert rp.parse_model_config(repo / "dac_decoder_trt" / "config.pbtxt").max_batch_size == 64
    assert rp.parse_model_config(repo / "fast_ar" / "config.pbtxt").platform == "ensemble"
    slow = rp.parse_model_config(repo / "slow_ar" / "config.pbtxt")
    assert slow.parameters["fast_ar"].string_value == "bls"
    dec = rp.parse_model_config(repo / "dac_decoder" / "config.pbtxt")
    assert dec.parameters["engine_dir"].string_value == str(engine_dir.resolve())
    assert dec.parameters["device"].string_value == "cuda"
    # a subset stays a subset: only the decoder and its engine
    sub = rp.render_model_repository(tmp_path / "sub", {"checkpoint": str(tiny_ckpt), "backend": "tensorrt", "engine_dir": str(engine_dir)},
                                     models=("s2pro", "dac_decoder"))
    assert {p.name for p in sub.iterdir()} == {"s2pro", "dac_decoder", "dac_decoder_trt"}
    # an explicit fast_ar setting wins (in-process fast AR, TensorRT codec)
    repo2 = rp.render_model_repository(tmp_path / "repo2", {"checkpoint": str(tiny_ckpt), "backend": "tensorrt",
                                                            "engine_dir": str(engine_dir), "fast_ar": "inprocess"})
    assert rp.parse_model_config(repo2 / "slow_ar" / "config.pbtxt").parameters["fast_ar"].string_value == "inprocess"


def test_validation_catches_broken_variants(tiny_ckpt, engine_dir, manifest, tmp_path):
    def fresh(name):
        return rp.render_model_repository(tmp_path / name, {"checkpoint": str(tiny_ckpt), "backend": "tensorrt",
                                                            "engine_dir": str(engine_dir)})

    repo = fresh("r1")
    cfg = repo / "dac_decoder_trt" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('"state_decoder_model_0"', '"state_decoder_model_zero"'))
    assert any("dac_decoder_trt: inputs" in p for p in rp.validate_repository(repo, manifest))
    repo = fresh("r2")
    cfg = repo / "fast_ar" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('input_map { key: "uniforms" value: "_uniforms" }', ""))
    assert any("leaves input fast_ar_trt.uniforms unfed" in p for p in rp.validate_repository(repo, manifest))
    repo = fresh("r3")
    cfg = repo / "dac_encoder" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("max_batch_size: 0", "max_batch_sise: 0"))
    assert any("does not parse" in p for p in rp.validate_repository(repo, manifest))
    repo = fresh("r4")
    cfg = repo / "dac_decoder" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('{ name: "final" data_type: TYPE_BOOL', '{ name: "final" data_type: TYPE_INT32'))
    assert any("differ from the Python-backend model" in p for p in rp.validate_repository(repo, manifest, MODEL_REPOSITORY))
    (repo / "fast_ar_trt" / "1" / "model.plan").unlink()
    assert "fast_ar_trt: 1/model.plan missing" in rp.validate_repository(repo, manifest)


def test_switch_errors_say_what_to_do(tiny_ckpt, onnx_dir, tmp_path):
    base = {"checkpoint": str(tiny_ckpt)}
    with pytest.raises(ValueError, match="use one of python, tensorrt, onnxruntime"):
        rp.render_model_repository(tmp_path / "a", {**base, "backend": "tensorrtt"})
    with pytest.raises(ValueError, match="engine_dir is only used"):
        rp.render_model_repository(tmp_path / "a", {**base, "engine_dir": str(onnx_dir)})
    with pytest.raises(FileNotFoundError, match="build_engines.sh"):  # ONNX exported, engines not built
        rp.render_model_repository(tmp_path / "a", {**base, "backend": "tensorrt", "engine_dir": str(onnx_dir)})
    with pytest.raises(FileNotFoundError, match="export_onnx.py"):  # default engine_dir: CHECKPOINT/engines
        rp.render_model_repository(tmp_path / "a", {**base, "backend": "tensorrt"})
    with pytest.raises(ValueError, match="needs a tritonserver with the TensorRT backend"):
        rp.render_model_repository(tmp_path / "a", {**base, "backend": "tensorrt", "engine_dir": str(onnx_dir)},
                                   has_tensorrt=lambda: False)
    if not server_has_tensorrt():  # this machine: the wheel's server, Python backend only
        with pytest.raises(ValueError, match="needs a tritonserver with the TensorRT backend"):
            rp.render_model_repository(tmp_path / "a", {**base, "backend": "tensorrt", "engine_dir": str(onnx_dir)},
                                       has_tensorrt=server_has_tensorrt)
    other = tmp_path / "other"
    shutil.copytree(onnx_dir, other)
    m = json.loads((other / "manifest.json").read_text())
    m["dim"] = 2560
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="dim=2560 but checkpoint"):
        rp.render_model_repository(tmp_path / "a", {**base, "backend": "onnxruntime", "engine_dir": str(other)})


# --------------------------------------------------------------------------- the variant served (onnxruntime in place of TensorRT)


def test_variant_served_by_tritonserver_matches_offline(tiny_ckpt, onnx_dir, manifest, tmp_path_factory):
    """tritonserver on the TensorRT variant with backend=onnxruntime: s2pro -> slow_ar -> fast_ar ensemble
    (fast_ar_noise + fast_ar_trt) per frame, dac_decoder -> dac_decoder_trt per chunk, dac_encoder ->
    dac_encoder_trt for a reference. Codes must equal the offline PyTorch pipeline's, audio within 1e-4."""
    from s2tts import server
    from s2tts.client import S2ProClient, TTSInput
    from s2tts.pipeline import S2Pipeline
    from s2tts.ar.sampling import SamplingParams

    try:
        server.find_server()
    except RuntimeError as e:
        pytest.skip(str(e))
    # fixed chunks (3, 7, ...): the adaptive rule may grow the first chunk on a slow machine, and this test wants
    # several chunks through the variant's dac_decoder
    srv = server.TritonServer(tiny_ckpt, {"device": "cpu", "dtype": "fp32", "max_batch": "4", "max_seq_len": "1024",
                                          "backend": "onnxruntime", "engine_dir": str(onnx_dir),
                                          "adaptive_chunks": "false"},
                              workdir=tmp_path_factory.mktemp("triton_onnx"))
    srv.start(timeout=300)
    try:
        repo = srv.workdir / "model_repository"
        assert rp.validate_repository(repo, manifest, MODEL_REPOSITORY) == []
        t = np.arange(44100) / 44100
        ref_audio = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
        with S2ProClient(srv.grpc_url) as c:
            plain = c.synthesize(TTSInput(text="The same seed gives the same audio.", seed=1234, max_new_tokens=20,
                                          temperature=0.9, top_p=0.9, top_k=20, first_chunk_frames=3, chunk_frames=7))
            clone = c.synthesize(TTSInput(text="Cloned voice.", seed=9, max_new_tokens=10, reference_audio=ref_audio,
                                          reference_sample_rate=44100, reference_text="A humming tone."))
    finally:
        srv.stop()
    pipe = S2Pipeline(tiny_ckpt, "cpu", "fp32")
    want = pipe.synthesize("The same seed gives the same audio.",
                           SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_new_tokens=20, seed=1234))
    assert plain.codes.shape == want.codes.shape and len(plain.chunks) > 2
    np.testing.assert_array_equal(plain.codes, want.codes)
    assert xc.relative_error(plain.audio, want.audio) < 1e-4
    ref_codes = pipe.encode_reference(ref_audio, 44100)
    want = pipe.synthesize("Cloned voice.", SamplingParams(max_new_tokens=10, seed=9), ref_codes, "A humming tone.")
    np.testing.assert_array_equal(clone.codes, want.codes)
    assert xc.relative_error(clone.audio, want.audio) < 1e-4
