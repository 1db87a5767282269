"""Tests for the codec (s2tts.codec): reference parity, loader strictness, shapes, streaming, audio helpers."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from s2tts.codec.model import DAC, CodecConfig, StreamState, full_codec_config, make_codec, tiny_codec_config
from s2tts.codec.loading import codec_state_dict, config_from_state_dict, load_codec
from s2tts.codec.audio import prepare_audio, resample

SR = 44100


def _reference():
    """tests/dac_reference.py, importable whatever pytest's import mode."""
    pytest.importorskip("fish_speech")
    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import dac_reference

    return dac_reference


def _audio(seconds: float, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """A chirp with a slow envelope plus gated noise: [batch, 1, T]."""
    g = torch.Generator().manual_seed(seed)
    n = int(SR * seconds)
    t = torch.arange(n, dtype=torch.float64) / SR
    freq = 80 + 3000 * t / max(seconds, 1e-3)
    tone = torch.sin(2 * math.pi * torch.cumsum(freq, 0) / SR) * (0.6 + 0.4 * torch.sin(2 * math.pi * 3 * t))
    gate = ((t * 7) % 1 < 0.3).double()
    out = [0.4 * tone + 0.15 * gate * torch.randn(n, generator=g, dtype=torch.float64) for _ in range(batch)]
    return torch.stack(out)[:, None].float()


def _random_codes(config: CodecConfig, frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    semantic = torch.randint(0, config.semantic_codebook_size, (batch, 1, frames), generator=g)
    residual = torch.randint(0, config.codebook_size, (batch, config.n_codebooks, frames), generator=g)
    return torch.cat([semantic, residual], dim=1)


def _streamed(codec: DAC, codes: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Audio of `codes` streamed in chunks ending at each cut (one stream)."""
    state, chunks = codec.new_stream_state(codes.shape[0]), []
    for a, b in zip([0] + cuts[:-1], cuts):
        audio, state = codec.decode_stream(codes[..., a:b], state)
        chunks.append(audio)
    return torch.cat(chunks, dim=-1)


def _assert_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4):
    assert a.shape == b.shape
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    assert err <= rel * scale + 1e-7, f"max abs error {err:.3g} vs scale {scale:.3g}"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These tests run many small ops: on a busy 2-core machine OpenMP's spinning threads
    made them 5-10x slower than one thread does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny() -> DAC:
    return make_codec(tiny_codec_config(), seed=0)


@pytest.fixture(scope="module")
def tiny_window8() -> DAC:
    """Tiny codec whose quantizer transformers see only 8 frames: streams cross many windows."""
    return make_codec(dataclasses.replace(tiny_codec_config(), quantizer_window=8), seed=1)


# --------------------------------------------------------------------------- reference parity


@pytest.fixture(scope="module")
def reference_full(tmp_path_factory):
    import os
    import shutil
    import tempfile

    ref = _reference().build_reference_dac(seed=0)
    # the ~2 GB file in memory (/dev/shm) where there is room: written and read back in 3.5 s there, 9 s on this disk
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 6 << 30 else None
    folder = Path(tempfile.mkdtemp(prefix="s2tts-codec-", dir=shm)) if shm else tmp_path_factory.mktemp("codec")
    path = folder / "codec.pth"
    torch.save(ref.state_dict(), path)
    ours = load_codec(path)
    yield ref, ours
    path.unlink()  # ~2 GB
    if shm:
        folder.rmdir()


@pytest.fixture(scope="module")
def reference_tiny():
    dac_reference = _reference()
    ref = dac_reference.build_reference_dac(seed=3, overrides=dac_reference.TINY_OVERRIDES)
    ours = load_codec(ref.state_dict(), quantizer_window=8)
    return ref, ours


def _ref_encode(ref, audio):
    with torch.no_grad():
        codes, _ = ref.encode(audio)
    return codes


def _ref_decode(ref, codes):
    with torch.no_grad():
        audio, _ = ref.decode(codes.clone(), torch.tensor([codes.shape[-1]]))
    return audio


def test_parity_full_config_inferred(reference_full):
    _, ours = reference_full
    assert ours.config == full_codec_config()
    assert next(ours.parameters()).dtype == torch.float32


def test_parity_full_encode(reference_full):
    ref, ours = reference_full
    audio = _audio(0.3, seed=1)  # 13230 samples -> padded to 7 frames
    expected = _ref_encode(ref, audio)
    codes = ours.encode(audio)
    assert codes.shape == (1, 10, 7) and codes.dtype == torch.long
    assert torch.equal(codes, expected)
    assert len(set(codes[0, 1].tolist())) > 1  # not a degenerate constant code


def test_parity_full_decode_and_stream(reference_full):
    ref, ours = reference_full
    codes = _random_codes(full_codec_config(), 7, seed=2)
    codes[0, 0, 3] = 5000  # out of range: both clamp to the last entry
    codes[0, 4, 2] = 1500
    expected = _ref_decode(ref, codes)
    assert expected.abs().max() > 1e-3
    _assert_close(ours.decode(codes), expected)

    _assert_close(_streamed(ours, codes, [2, 3, 7]), expected)


@pytest.mark.parametrize("batch,channels,length,dilation", [(2, 5, 60, 9), (3, 4, 37, 3), (1, 6, 55, 9), (2, 3, 20, 2)])
def test_conv1d_phases_is_the_dilated_convolution(batch, channels, length, dilation):
    from s2tts.codec.model import conv1d_phases

    g = torch.Generator().manual_seed(length)
    x = torch.randn(batch, channels, length, generator=g)
    w, b = torch.randn(7, channels, 3, generator=g), torch.randn(7, generator=g)
    expected = torch.nn.functional.conv1d(x, w, b, dilation=dilation)
    got = conv1d_phases(x, w, b, dilation)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gpu_formulations_match_reference(reference_tiny, monkeypatch):
    """What `use_triton_kernels` changes on a GPU besides the kernels: the codebooks decoded as one lookup in a table
    of their projections, and dilated convolutions as their phases (there only for shapes where that is faster; all
    of them here) still give the reference codec's audio, whole and streamed."""
    import s2tts.codec.model as codec_module

    ref, ours = reference_tiny
    codes = _random_codes(ours.config, 9, seed=4)
    codes[0, 0, 3], codes[0, 5, 1], codes[0, 2, 2] = 10**6, 10**6, -4  # out of range: clamped, as the reference does
    expected = _ref_decode(ref, codes.clamp(min=0))
    phased = [m for m in ours.decoder.modules() if isinstance(m, codec_module.CausalConv1d) and m.conv.dilation[0] > 1]
    assert phased
    monkeypatch.setattr(codec_module, "_phases_pay", lambda *args: True)
    calls, phases = [], codec_module.conv1d_phases
    monkeypatch.setattr(codec_module, "conv1d_phases", lambda *args: calls.append(1) or phases(*args))
    try:
        for m in phased:
            m.phase_plan = True
        ours.quantizer.fuse_embeddings(True)
        assert ours.quantizer.table.shape[0] == ours.config.semantic_codebook_size + 9 * ours.config.codebook_size
        _assert_close(ours.decode(codes), expected)
        _assert_close(_streamed(ours, codes, [1, 5, 9]), expected)
        assert len(calls) == 4 * len(phased)  # every dilated convolution of each call went through its phases
    finally:
        for m in phased:
            m.phase_plan = False
        ours.quantizer.fuse_embeddings(False)


def test_parity_tiny_long(reference_tiny):
    """Tiny widths, window 8: 6.5 s spans >512 encoder latent frames and many quantizer windows."""
    ref, ours = reference_tiny
    audio = _audio(6.5, seed=4)
    expected = _ref_encode(ref, audio)
    codes = ours.encode(audio)
    assert codes.shape == (1, 10, 140)
    assert torch.equal(codes, expected)
    assert len(set(codes[0, 0].tolist())) > 1

    codes = _random_codes(ours.config, 70, seed=5)
    expected = _ref_decode(ref, codes)
    _assert_close(ours.decode(codes), expected)
    _assert_close(_streamed(ours, codes, [4, 29, 32, 70]), expected)


def _transformer_pairs(ref, ours):
    """(name, reference module, our module) for every windowed transformer of the codec."""
    top = len(ours.config.encoder_rates)
    return [
        ("encoder", ref.encoder.block[top].block[5], ours.encoder.block[top].block[5]),
        ("pre_module", ref.quantizer.pre_module, ours.quantizer.pre_module),
        ("post_module", ref.quantizer.post_module, ours.quantizer.post_module),
    ]


@pytest.mark.parametrize("which", ["reference_tiny", "reference_full"])
def test_parity_transformers_tight(which, request):
    """The transformers alone, at a tolerance tight enough to see RoPE's bf16 rounding
    (dropping it moves these outputs by ~7e-6 relative; the waveform barely notices)."""
    ref, ours = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(11)
    frames = 40 if which == "reference_tiny" else 12
    for name, ref_t, our_t in _transformer_pairs(ref, ours):
        dim = our_t.layers[0].attention.wo.weight.shape[0]
        x = torch.randn(2, dim, frames, generator=g)
        with torch.no_grad():
            _assert_close(our_t(x), ref_t(x), rel=2e-6)


# --------------------------------------------------------------------------- loader


def _decode_equal(a: DAC, b: DAC):
    codes = _random_codes(a.config, 6, seed=9)
    _assert_close(a.decode(codes), b.decode(codes), rel=1e-5)


def test_loader_roundtrip_file_and_config(tiny, tmp_path):
    path = tmp_path / "codec.pth"
    torch.save(codec_state_dict(tiny), path)
    loaded = load_codec(path)
    assert loaded.config == tiny.config
    _decode_equal(loaded, tiny)
    audio = _audio(0.5)
    assert torch.equal(loaded.encode(audio), tiny.encode(audio))


def test_state_dict_reference_key_style(tiny):
    sd = codec_state_dict(tiny)
    assert "encoder.block.0.conv.parametrizations.weight.original0" in sd
    assert "encoder.block.0.conv.parametrizations.weight.original1" in sd
    assert "decoder.model.1.block.1.conv.parametrizations.weight.original1" in sd  # transposed conv
    assert "quantizer.quantizer.quantizers.0.in_proj.weight_g" in sd
    assert "quantizer.semantic_quantizer.quantizers.0.out_proj.weight_v" in sd
    assert "quantizer.downsample.0.0.conv.weight" in sd  # not weight-normed in the reference
    assert "quantizer.upsample.1.1.dwconv.conv.weight" in sd
    assert not any(k.endswith("conv.weight") and k.startswith(("encoder.", "decoder.")) for k in sd)
    # g is per output channel of a conv, per input channel of a transposed conv (dim 0)
    assert sd["decoder.model.1.block.1.conv.parametrizations.weight.original0"].shape == (64, 1, 1)


@pytest.mark.parametrize("style", ["weight_g", "parametrizations", "plain"])
def test_loader_weight_norm_styles(tiny, style):
    sd = codec_state_dict(tiny, style=style)
    if style == "weight_g":
        assert "encoder.block.0.conv.weight_g" in sd
    _decode_equal(load_codec(sd), tiny)


def test_loader_wrapper_and_generator_prefix(tiny, caplog):
    sd = {f"generator.{k}": v for k, v in codec_state_dict(tiny).items()}
    sd["discriminator.conv.weight"] = torch.zeros(3)
    with caplog.at_level(logging.INFO, logger="s2tts"):
        loaded = load_codec({"state_dict": sd})
    _decode_equal(loaded, tiny)
    lines = [r.getMessage() for r in caplog.records if "unused" in r.getMessage()]
    assert len(lines) == 1 and "discriminator.conv.weight" in lines[0]


def test_loader_extra_tensors_logged_once(tiny, caplog):
    sd = codec_state_dict(tiny)
    sd["quantizer.post_module.freqs_cis"] = torch.zeros(16, 32, 2, dtype=torch.bfloat16)
    sd["quantizer.post_module.causal_mask"] = torch.ones(16, 16, dtype=torch.bool)
    sd["some.extra.tensor"] = torch.zeros(1)
    with caplog.at_level(logging.INFO, logger="s2tts"):
        loaded = load_codec(sd)
    _decode_equal(loaded, tiny)
    lines = [r.getMessage() for r in caplog.records if "unused" in r.getMessage()]
    assert len(lines) == 1
    for key in ("quantizer.post_module.freqs_cis", "quantizer.post_module.causal_mask", "some.extra.tensor"):
        assert key in lines[0]


@pytest.mark.parametrize(
    "key",
    [
        "decoder.model.2.block.3.block.1.conv.bias",
        "quantizer.post_module.layers.1.attention.wo.weight",
        "quantizer.quantizer.quantizers.8.codebook.weight",
        "encoder.block.4.block.5.layers.0.ffn_layer_scale.gamma",
        "quantizer.upsample.0.1.gamma",
        "decoder.model.5.alpha",
        "encoder.block.0.conv.weight",  # needed to infer the config
        "quantizer.semantic_quantizer.quantizers.0.codebook.weight",  # idem
    ],
)
def test_loader_missing_tensor_named(tiny, key):
    sd = codec_state_dict(tiny, style="plain")
    del sd[key]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_codec(sd)


@pytest.mark.parametrize(
    "key",
    [
        "decoder.model.1.block.1.conv.parametrizations.weight.original1",
        "quantizer.quantizer.quantizers.3.in_proj.weight_g",
    ],
)
def test_loader_missing_weight_norm_half_named(tiny, key):
    sd = codec_state_dict(tiny)
    del sd[key]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_codec(sd)


@pytest.mark.parametrize(
    "key, shape",
    [
        ("decoder.model.3.block.4.block.1.conv.parametrizations.weight.original1", (8, 8, 5)),
        ("quantizer.post_module.layers.0.feed_forward.w2.weight", (64, 100)),
        ("quantizer.quantizer.quantizers.2.codebook.weight", (31, 8)),
        ("encoder.block.2.block.0.block.0.alpha", (1, 15, 1)),
        ("quantizer.downsample.1.1.norm.bias", (65,)),
    ],
)
def test_loader_misshaped_tensor_named(tiny, key, shape):
    sd = codec_state_dict(tiny)
    sd[key] = torch.zeros(shape)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_codec(sd)


def test_loader_missing_weight_norm_pair_named(tiny):
    """Both halves gone: the message names the plain key and its weight-norm forms."""
    sd = codec_state_dict(tiny, style="weight_g")
    base = "decoder.model.2.block.3.block.1.conv"
    del sd[f"{base}.weight_g"], sd[f"{base}.weight_v"]
    with pytest.raises(ValueError, match=rf"{base}\.weight'.*{base}\.weight_g"):
        load_codec(sd)


def test_config_from_raw_state_dict(tiny):
    wrapped = {"state_dict": {f"generator.{k}": v for k, v in codec_state_dict(tiny).items()}}
    assert config_from_state_dict(wrapped) == tiny.config
    assert config_from_state_dict(codec_state_dict(tiny), quantizer_window=8).quantizer_window == 8


def test_loader_rejects_non_dict(tmp_path):
    with pytest.raises(ValueError):
        load_codec([torch.zeros(1)])


def test_load_dtype(tiny):
    loaded = load_codec(codec_state_dict(tiny), dtype=torch.bfloat16)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    audio = loaded.decode(_random_codes(tiny.config, 3))
    assert audio.dtype == torch.float32 and torch.isfinite(audio).all()


# --------------------------------------------------------------------------- shapes / init


def test_configs():
    full, tiny = full_codec_config(), tiny_codec_config()
    for cfg in (full, tiny):
        assert cfg.hop_length == 512 and cfg.frame_length == 2048 and cfg.num_codebooks == 10
    assert (tiny.semantic_codebook_size, tiny.codebook_size) == (64, 32)
    assert (full.semantic_codebook_size, full.codebook_size, full.n_codebooks) == (4096, 1024, 9)


@pytest.mark.parametrize("samples", [1, 2047, 2048, 2049, 10000])
def test_encode_shapes(tiny, samples):
    audio = _audio(samples / SR, batch=2)
    codes = tiny.encode(audio)
    assert codes.shape == (2, 10, math.ceil(samples / 2048)) and codes.dtype == torch.long
    assert codes[:, 0].max() < 64 and codes[:, 1:].max() < 32 and codes.min() >= 0


def test_encode_is_causal_and_batch_independent(tiny):
    audio = _audio(1.0, seed=2, batch=2)
    codes = tiny.encode(audio)
    assert torch.equal(tiny.encode(audio[1:]), codes[1:])
    # frames only depend on the past: encoding a prefix gives the prefix of the codes
    assert torch.equal(tiny.encode(audio[..., : 2048 * 7]), codes[..., :7])


@pytest.mark.parametrize("frames", [1, 5, 23])
def test_decode_shapes(tiny, frames):
    audio = tiny.decode(_random_codes(tiny.config, frames, batch=2))
    assert audio.shape == (2, 1, frames * 2048) and audio.dtype == torch.float32


def test_decode_clamps_without_modifying_input(tiny):
    codes = _random_codes(tiny.config, 4)
    wild = codes.clone()
    wild[0, 0, 1], wild[0, 5, 2], wild[0, 9, 3] = 10_000, 777, -5
    before = wild.clone()
    clamped = wild.clone()
    clamped[0, 0, 1], clamped[0, 5, 2], clamped[0, 9, 3] = 63, 31, 0
    assert torch.equal(tiny.decode(wild), tiny.decode(clamped))
    assert torch.equal(wild, before)


def test_decode_rejects_wrong_codebook_count(tiny):
    with pytest.raises(ValueError):
        tiny.decode(torch.zeros(1, 9, 4, dtype=torch.long))


def test_make_codec_deterministic_and_audible():
    cfg = tiny_codec_config()
    a, b, c = make_codec(cfg, 7), make_codec(cfg, 7), make_codec(cfg, 8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    audio = a.decode(_random_codes(cfg, 10))
    rms = audio.pow(2).mean().sqrt().item()
    assert torch.isfinite(audio).all() and 0.01 < rms < 0.7
    assert audio.abs().max() < 0.999  # not saturating the tanh


# --------------------------------------------------------------------------- streaming


def _stream(model: DAC, codes: torch.Tensor, sizes) -> torch.Tensor:
    state, out, start = model.new_stream_state(codes.shape[0]), [], 0
    for size in sizes:
        audio, state = model.decode_stream(codes[..., start : start + size], state)
        assert audio.shape[-1] == size * 2048
        out.append(audio)
        start += size
    assert start == codes.shape[-1]
    return torch.cat(out, dim=-1)


def test_stream_matches_decode(tiny_window8):
    codes = _random_codes(tiny_window8.config, 40, seed=3)
    full = tiny_window8.decode(codes)
    _assert_close(_stream(tiny_window8, codes, [4, 25, 3, 1, 7]), full)
    _assert_close(_stream(tiny_window8, codes, [1] * 10 + [30]), full)


def test_stream_matches_decode_official_window(tiny):
    """Window 128 frames: the KV window of the post transformer has to wrap."""
    codes = _random_codes(tiny.config, 150, seed=4)
    _assert_close(_stream(tiny, codes, [4, 25, 3, 100, 18]), tiny.decode(codes))


def test_stream_does_not_modify_state_and_zero_chunk(tiny_window8):
    codes = _random_codes(tiny_window8.config, 12, seed=5)
    state = tiny_window8.new_stream_state(1)
    _, state = tiny_window8.decode_stream(codes[..., :5], state)
    snapshot = {k: v.clone() for k, v in state.tensors.items()}
    a, _ = tiny_window8.decode_stream(codes[..., 5:], state)
    b, same = tiny_window8.decode_stream(codes[..., 5:5], state)
    c, _ = tiny_window8.decode_stream(codes[..., 5:], state)  # replay from the same state
    assert all(torch.equal(snapshot[k], state.tensors[k]) for k in snapshot)
    assert b.shape == (1, 1, 0) and same is state
    assert torch.equal(a, c)


def test_stream_state_stack_and_split(tiny_window8):
    """Two requests at different positions decode as one batch and split back."""
    m = tiny_window8
    x, y = _random_codes(m.config, 20, seed=6), _random_codes(m.config, 20, seed=7)
    sx, sy = m.new_stream_state(), m.new_stream_state()
    _, sx = m.decode_stream(x[..., :9], sx)  # x is 9 frames in, y 3 frames in
    _, sy = m.decode_stream(y[..., :3], sy)
    ax, sx_next = m.decode_stream(x[..., 9:15], sx)
    ay, sy_next = m.decode_stream(y[..., 3:9], sy)

    batched = StreamState.stack([sx, sy])
    assert batched.batch_size == 2
    audio, batched = m.decode_stream(torch.cat([x[..., 9:15], y[..., 3:9]]), batched)
    _assert_close(audio[:1], ax)
    _assert_close(audio[1:], ay)
    bx, by = batched.split()
    for key in sx_next.tensors:
        _assert_close(bx.tensors[key].float(), sx_next.tensors[key].float())
        _assert_close(by.tensors[key].float(), sy_next.tensors[key].float())


# --------------------------------------------------------------------------- audio helpers


def test_prepare_audio_stereo_48k():
    n = 48000
    t = np.arange(n) / 48000
    left, right = 0.5 * np.sin(2 * np.pi * 440 * t), 0.1 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([left, right], axis=1).astype(np.float32)  # soundfile layout [T, C]
    out = prepare_audio(stereo, 48000, SR)
    assert out.shape == (1, 1, SR) and out.dtype == torch.float32
    expected = 0.3 * np.sin(2 * np.pi * 440 * np.arange(SR) / SR)
    mid = slice(200, SR - 200)  # away from the zero-padded edges
    assert np.abs(out[0, 0, mid].numpy() - expected[mid]).max() < 2e-3
    # [C, T] layout and a torch tensor give the same
    torch.testing.assert_close(prepare_audio(torch.from_numpy(stereo.T.copy()), 48000, SR), out)


def test_prepare_audio_int16_mono_and_passthrough():
    pcm = (np.sin(np.arange(1000) / 10) * 16000).astype(np.int16)
    out = prepare_audio(pcm, SR, SR)
    assert out.shape == (1, 1, 1000)
    np.testing.assert_allclose(out[0, 0].numpy(), pcm / 32768.0, atol=1e-6)


@pytest.mark.parametrize(
    "wav, match",
    [
        (np.zeros(0, dtype=np.float32), "empty"),
        (np.zeros((0, 2), dtype=np.float32), "empty"),
        (np.array([0.0, np.nan, 0.1], dtype=np.float32), "NaN"),
        (np.array([0.0, np.inf], dtype=np.float32), "NaN or infinite"),
        (np.zeros((2, 3, 4), dtype=np.float32), "samples"),
    ],
)
def test_prepare_audio_rejects(wav, match):
    with pytest.raises(ValueError, match=match):
        prepare_audio(wav, 16000, SR)


@pytest.mark.parametrize("orig, new", [(48000, 44100), (16000, 44100), (44100, 22050), (44100, 44099)])
def test_resample_sine(orig, new):
    n = orig // 2
    x = torch.sin(2 * math.pi * 1000 * torch.arange(n, dtype=torch.float64) / orig).float()
    y = resample(x[None], orig, new)[0]
    assert y.shape[-1] == math.ceil(n * new / orig)
    expected = torch.sin(2 * math.pi * 1000 * torch.arange(y.shape[-1], dtype=torch.float64) / new).float()
    mid = slice(100, y.shape[-1] - 100)
    assert (y[mid] - expected[mid]).abs().max() < 2e-3


def test_resample_keeps_the_passband_and_removes_what_is_above_the_new_nyquist():
    """48 kHz -> 44.1 kHz: a tone at 0.9 x the new Nyquist keeps its level; tones between the two Nyquists vanish."""
    t = torch.arange(48000, dtype=torch.float64) / 48000
    kept = resample(torch.sin(2 * math.pi * 19845 * t), 48000, SR)[2000:-2000]
    assert abs(kept.pow(2).mean().sqrt().item() / math.sqrt(0.5) - 1) < 0.01  # within 0.1 dB
    above = sum(torch.sin(2 * math.pi * f * t) for f in (22300, 23000, 23700))
    assert resample(above, 48000, SR)[2000:-2000].abs().max() < 1e-4


def test_resample_removes_aliasing():
    """A 30 kHz tone at 96 kHz is above the 22.05 kHz Nyquist of 44.1 kHz: it must vanish."""
    n = 9600
    x = torch.sin(2 * math.pi * 30000 * torch.arange(n) / 96000)
    y = resample(x, 96000, SR)
    assert y[200:-200].abs().max() < 1e-2
    assert torch.equal(resample(x, SR, SR), x)
