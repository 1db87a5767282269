"""Many streams over one codec (what dac_decoder runs): batched chunks of equal length, per-stream state."""

import numpy as np
import pytest
import torch

from s2tts.codec.loading import load_codec_from_dir
from s2tts.codec.stream import StreamDecoder
from s2tts.errors import S2Error


# no pool; all pooled; two pooled and one on its own state; pooled with prepared lengths (final chunks padded);
# the same with at most 8 frames a call (3 streams of 4 frames: calls of 2 and 1)
@pytest.mark.parametrize("pool_size,lengths,max_frames", [(0, None, None), (8, None, None), (2, None, None),
                                                          (8, [4, 8], None), (8, [4, 8], 8)])
def test_interleaved_batched_streams_equal_whole_decode(tiny_ckpt, pool_size, lengths, max_frames):
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    dec = StreamDecoder(codec, pool_size=pool_size)
    if lengths:
        dec.pool.warm(lengths, max_batch=4, max_frames=max_frames)
        assert dec.pool.padded(3) == 4 and dec.pool.padded(5) == 8 and dec.pool.padded(9) == 9
        assert dec.pool.cap == ({4: 2, 8: 1} if max_frames else {4: 4, 8: 4})
    gen = np.random.default_rng(0)
    n = {"a": 13, "b": 9, "c": 11}
    codes = {k: np.concatenate([gen.integers(0, 64, (1, f)), gen.integers(0, 32, (9, f))]) for k, f in n.items()}
    chunks = {"a": [4, 4, 5], "b": [4, 5], "c": [4, 4, 3]}  # equal lengths land in one batch
    got = {k: [] for k in n}
    pos = dict.fromkeys(n, 0)
    for i in range(3):
        jobs = []
        for k, sizes in chunks.items():
            if i < len(sizes):
                c = codes[k][:, pos[k] : pos[k] + sizes[i]].T  # [frames, C] on the wire
                pos[k] += sizes[i]
                jobs.append((k, k, c, i == 0, i == len(sizes) - 1))
        for key, audio in dec.decode_many(jobs, now=float(i)).items():
            got[key].append(audio)
        if lengths and i == 2:  # "a" ends with 5 frames and "c" with 3: padded to 8 and 4, not batched with 4s
            assert dec.batches[-2:] == [1, 1]
    assert not dec.states  # every stream ended with a final chunk
    if pool_size:
        assert sorted(dec.pool.free) == list(range(pool_size))  # every slot came back
    for k in n:
        whole = codec.decode(torch.as_tensor(codes[k])[None])[0, 0].numpy()
        stream = np.concatenate(got[k])
        assert stream.shape == whole.shape == (n[k] * 2048,)
        np.testing.assert_allclose(stream, whole, atol=1e-5)


def test_idle_streams_are_dropped(tiny_ckpt):
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    dec = StreamDecoder(codec, idle_timeout_s=10)
    c = np.zeros((2, 10), np.int64)
    dec.decode_many([(0, "x", c, True, False)], now=0.0)
    assert "x" in dec.states
    dec.decode_many([(0, "y", c, True, True)], now=11.0)
    assert not dec.states
    # the dropped stream's next chunk is an error, not a silent restart
    got = dec.decode_many([(0, "x", c, False, False)], now=12.0)[0]
    assert isinstance(got, S2Error) and got.code == "not_found" and "dropped after 10 s" in got.message


def test_stream_errors_are_per_job(tiny_ckpt):
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    dec = StreamDecoder(codec)
    c = np.zeros((3, 10), np.int64)
    got = dec.decode_many([("a", "s1", c, True, False), ("b", "never-started", c, False, False),
                           ("c", "s2", np.zeros((3, 4), np.int64), True, False)], now=0.0)
    assert got["a"].shape == (3 * 2048,)
    assert got["b"].code == "not_found" and got["b"].param == "stream_id"
    assert got["c"].code == "invalid_argument" and "[frames, 10]" in got["c"].message
    again = dec.decode_many([("d", "s1", c, True, False)], now=1.0)["d"]
    assert again.code == "already_exists"
    assert set(dec.states) == {"s1"}
    # codes outside their codebook (the codec would clamp them): refused, naming each codebook's range
    for bad in ((0, 64), (3, 32), (1, -1)):  # (codebook, code): tiny's semantic codebook has 64, the others 32
        codes = np.zeros((3, 10), np.int64)
        codes[1, bad[0]] = bad[1]
        err = dec.decode_many([("e", "s3", codes, True, True)], now=2.0)["e"]
        assert err.code == "invalid_argument" and err.param == "codes" and "0 to 63" in err.message, err.message
    assert set(dec.states) == {"s1"}


HOT = 63  # the semantic code whose codebook row is scaled: frames using it overflow fp16 (finite weights, inf activations)


def _overflowing_codec(tiny_ckpt, dtype):
    codec = load_codec_from_dir(tiny_ckpt, "cpu", dtype)
    w = dict(codec.named_parameters())["quantizer.semantic_quantizer.quantizers.0.codebook.weight"]
    with torch.no_grad():
        w[HOT] = (w[HOT].float() * 3e4).to(w.dtype)
    assert w.isfinite().all()
    return codec


# no pool; pooled; pooled and warmed (the old states the redo starts from in the pool's one shared buffer); the same
# with one stream a call (the two streams' chunks in two calls, each call's old states kept apart)
@pytest.mark.parametrize("pool_size,warm_batch,max_frames", [(0, None, None), (4, None, None), (4, 2, None),
                                                             (4, 2, 4)])
def test_fp16_chunk_that_overflows_is_decoded_again_in_fp32(tiny_ckpt, caplog, pool_size, warm_batch, max_frames):
    """Two streams in fp16, decoded together; one uses a code that overflows in its second chunk. That chunk is
    decoded again in fp32 from the stream's previous state and the stream stays fp32; the other stream stays fp16.
    Each stream's audio is finite and matches the fp32 codec to fp16's error."""
    ref, fp16 = _overflowing_codec(tiny_ckpt, "fp32"), _overflowing_codec(tiny_ckpt, "fp16")
    dec = StreamDecoder(fp16, fallback=ref, pool_size=pool_size)
    if warm_batch:
        dec.pool.warm([4], max_batch=warm_batch, max_frames=max_frames)
        assert {t.shape[0] for t in dec.pool.old_rows.values()} == {warm_batch}
        assert dec.pool.cap == {4: 1 if max_frames else 2}
    gen = np.random.default_rng(1)
    cool = np.concatenate([gen.integers(0, HOT, (1, 12)), gen.integers(0, 32, (9, 12))])
    hot = np.concatenate([gen.integers(0, HOT, (1, 12)), gen.integers(0, 32, (9, 12))])  # its own states
    hot[0, 6] = HOT  # in the second chunk of 4 frames
    codes = {"hot": hot, "cool": cool}  # "hot" first: with one stream a call, the call after it reuses the buffer
    got = {k: [] for k in codes}
    for i in range(3):
        jobs = [(k, k, c[:, 4 * i : 4 * i + 4].T, i == 0, i == 2) for k, c in codes.items()]
        for key, audio in dec.decode_many(jobs, now=float(i)).items():
            assert not isinstance(audio, S2Error), audio
            got[key].append(audio)
        assert dec.in_fp32 == ({"hot"} if i == 1 else set())  # after chunk 3 (final) the stream is gone
        assert dec.redone == (0 if i == 0 else 1)  # once: later chunks of "hot" run in fp32 from the start
    assert not dec.states and not dec.in_fp32
    if pool_size:
        assert sorted(dec.pool.free) == list(range(pool_size))
    assert "overflowed in torch.float16; decoded again in fp32" in caplog.text
    for k, c in codes.items():
        audio = np.concatenate(got[k])
        whole = ref.decode(torch.as_tensor(c)[None])[0, 0].numpy()
        assert np.isfinite(audio).all() and audio.shape == whole.shape
        err = np.abs(audio - whole).max()
        assert err < 0.05 * np.abs(whole).max(), (k, err)
    # without the fallback the same chunk is not finite: the case above is a real overflow
    bare = StreamDecoder(fp16)
    bare.decode_many([(0, "h", hot[:, :4].T, True, False)], now=0.0)
    assert not np.isfinite(bare.decode_many([(0, "h", hot[:, 4:8].T, False, False)], now=1.0)[0]).all()


@pytest.mark.parametrize("pool_size", [0, 4])
def test_a_chunk_not_finite_in_fp32_either_ends_its_stream_alone(tiny_ckpt, pool_size):
    """A chunk whose audio overflows in fp16 and in the fp32 redo too: its stream alone ends with an error (and its
    state goes); the stream decoded beside it in the same call gets the audio it gets alone."""
    fp16 = _overflowing_codec(tiny_ckpt, "fp16")
    broken = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    w = dict(broken.named_parameters())["quantizer.semantic_quantizer.quantizers.0.codebook.weight"]
    with torch.no_grad():
        w[HOT] = float("inf")  # (a row no float32 decode of it survives)
    gen = np.random.default_rng(2)
    cool = np.concatenate([gen.integers(0, HOT, (1, 4)), gen.integers(0, 32, (9, 4))]).T
    hot = cool.copy()
    hot[1, 0] = HOT
    alone = StreamDecoder(fp16, fallback=broken, pool_size=pool_size)
    want = alone.decode_many([("c", "c", cool, True, True)], now=0.0)["c"]
    dec = StreamDecoder(fp16, fallback=broken, pool_size=pool_size)
    got = dec.decode_many([("h", "h", hot, True, False), ("c", "c", cool, True, False)], now=0.0)
    assert isinstance(got["h"], S2Error) and got["h"].code == "internal" and "not finite" in got["h"].message
    np.testing.assert_array_equal(got["c"], want)
    assert set(dec.states) == {"c"}
    if pool_size:
        assert len(dec.pool.free) == pool_size - 1  # the failed stream's slot given back


def test_pool_slots_are_reused_from_a_fresh_state(tiny_ckpt):
    """A slot a finished stream gave back holds its last state: the next stream on it (even one whose first chunk
    is empty) starts from a fresh state, and its audio equals a whole decode. Streams past the pool's size run on
    their own state, batched apart, with the same result."""
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    dec = StreamDecoder(codec, pool_size=1)
    gen = np.random.default_rng(3)
    a, b, c = (np.concatenate([gen.integers(0, 64, (1, 8)), gen.integers(0, 32, (9, 8))]) for _ in range(3))
    got_a = [dec.decode_many([(0, "a", a[:, :4].T, True, False)], now=0.0)[0]]
    got_a.append(dec.decode_many([(0, "a", a[:, 4:].T, False, True)], now=1.0)[0])
    assert dec.pool.free == [0] and not dec.states
    got_b = [dec.decode_many([(0, "b", np.zeros((0, 10), np.int64), True, False)], now=2.0)[0]]  # opens, decodes nothing
    assert dec.states["b"].slot == 0 and dec.states["b"].fresh
    both = dec.decode_many([(0, "b", b[:, :4].T, False, False), (1, "c", c[:, :4].T, True, False)], now=3.0)
    assert dec.states["c"].slot is None and dec.states["c"].state is not None  # the pool is full: its own state
    got_b.append(both[0])
    got_c = [both[1]]
    both = dec.decode_many([(0, "b", b[:, 4:].T, False, True), (1, "c", c[:, 4:].T, False, True)], now=4.0)
    got_b.append(both[0])
    got_c.append(both[1])
    assert dec.batches[-2:] == [1, 1]  # pooled and own-state streams are decoded apart
    for codes, got in ((a, got_a), (b, got_b), (c, got_c)):
        whole = codec.decode(torch.as_tensor(codes)[None])[0, 0].numpy()
        np.testing.assert_allclose(np.concatenate(got), whole, atol=1e-5)
    assert dec.pool.free == [0] and not dec.states


def test_codec_dtype_auto():
    from unittest import mock

    from s2tts.codec.loading import codec_dtype_for

    assert codec_dtype_for("auto", "cpu", "decoder") == "fp32"
    assert codec_dtype_for("fp16", "cpu", "decoder") == "fp16"
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert codec_dtype_for("auto", "cuda", "decoder") == "fp16"
        assert codec_dtype_for("auto", "cuda:1", "encoder") == "fp32"
        assert codec_dtype_for("fp32", "cuda", "decoder") == "fp32"  # exact: one setting away


def test_dac_decoder_model_fp16_with_fp32_fallback(tiny_ckpt, tmp_path):
    """The dac_decoder model.py (in-process, tests/fake_triton.py) with codec_dtype=fp16 loads the fp32 fallback
    and answers a chunk that overflows with finite audio."""
    import logging
    import shutil

    from fake_triton import FakeTriton

    from s2tts.repository import render_repository

    ck = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ck)
    sd = torch.load(ck / "codec.pth", map_location="cpu", weights_only=True)
    inner = sd["state_dict"] if isinstance(sd.get("state_dict"), dict) else sd
    key = next(k for k in inner if k.endswith("semantic_quantizer.quantizers.0.codebook.weight"))
    inner[key][HOT] *= 3e4
    torch.save(sd, ck / "codec.pth")
    repo = render_repository(tmp_path / "repo", {"checkpoint": str(ck), "device": "cpu", "codec_dtype": "fp16"})
    lines = []  # the model's logger does not propagate (it writes to stderr for Triton): listen to it directly
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("s2tts").addHandler(handler)
    h = FakeTriton(repo, models=("dac_decoder",))
    try:
        dec = h.models["dac_decoder"].decoder
        assert next(dec.codec.parameters()).dtype == torch.float16
        assert next(dec.fallback.parameters()).dtype == torch.float32
        gen = np.random.default_rng(2)
        hot = np.concatenate([gen.integers(0, HOT, (1, 8)), gen.integers(0, 32, (9, 8))]).astype(np.int32)
        hot[0, 5] = HOT
        audio = []
        for i in range(2):
            req = h.request("dac_decoder", {"codes": hot[:, 4 * i : 4 * i + 4].T[None], "stream_id": np.array([b"s1"], object),
                                            "start": np.array([i == 0]), "final": np.array([i == 1])})
            resp, final = req.sender.q.get(timeout=60)
            assert final and not resp.has_error(), resp.error() and resp.error().message()
            audio.append(resp.get("audio")[0])
    finally:
        h.shutdown()
        logging.getLogger("s2tts").removeHandler(handler)
    text = "\n".join(lines)
    audio = np.concatenate(audio)
    assert audio.shape == (8 * 2048,) and np.isfinite(audio).all() and np.abs(audio).max() > 1e-4
    assert "stream s1: a chunk of 4 frames overflowed" in text and dec.redone == 1


def test_a_decode_only_codec_streams_as_before_and_refuses_to_encode(tiny_ckpt):
    """`DAC.drop_encoding` (what every stream decoder loads: the encoder and the quantizer's encoding half are 207 M
    of S2 Pro's 391 M parameters) leaves streaming decode unchanged, and encode says what to do instead."""
    full = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    lean = load_codec_from_dir(tiny_ckpt, "cpu", "fp32").drop_encoding()
    assert sum(p.numel() for p in lean.parameters()) < sum(p.numel() for p in full.parameters())
    cfg = full.config
    codes = torch.cat([torch.randint(0, cfg.semantic_codebook_size, (2, 1, 5)),
                       torch.randint(0, cfg.codebook_size, (2, cfg.n_codebooks, 5))], 1)
    with torch.inference_mode():
        a, sa = full.decode_stream(codes[..., :3], full.new_stream_state(2))
        b, sb = lean.decode_stream(codes[..., :3], lean.new_stream_state(2))
        assert torch.equal(a, b) and torch.equal(full.decode_stream(codes[..., 3:], sa)[0],
                                                 lean.decode_stream(codes[..., 3:], sb)[0])
        with pytest.raises(RuntimeError, match="decode only"):
            lean.encode(torch.zeros(1, 1, cfg.frame_length))


def test_an_encode_only_codec_encodes_as_before_and_refuses_to_decode(tiny_ckpt):
    """`DAC.drop_decoding` (what dac_encoder loads: the decoder and the quantizer's decoding half are 315 M of S2
    Pro's 391 M parameters) leaves encode unchanged, and decoding says what to do instead."""
    full = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    lean = load_codec_from_dir(tiny_ckpt, "cpu", "fp32").drop_decoding()
    assert sum(p.numel() for p in lean.parameters()) < sum(p.numel() for p in full.parameters())
    audio = torch.randn(2, 1, 5 * full.config.frame_length + 100, generator=torch.Generator().manual_seed(0)) * 0.1
    with torch.inference_mode():
        assert torch.equal(full.encode(audio), lean.encode(audio))
        for decode in (lambda: lean.decode(full.encode(audio)), lambda: lean.new_stream_state(1)):
            with pytest.raises(RuntimeError, match="encode only"):
                decode()


def test_the_served_decoder_opens_with_the_device_as_settings_name_it(tiny_ckpt):
    """`open_stream_decoder` (dac_decoder, slow_ar) takes `codec_device` as written in the settings: `auto` (the
    default) opened no decoder once (tritonserver refused to load dac_decoder)."""
    from s2tts.codec.stream import open_stream_decoder

    for device in ("auto", "cpu"):
        dec, dtype, graphs = open_stream_decoder(tiny_ckpt, device, "auto", 4, 60.0, [4], 2)
        assert dtype == "fp32" and graphs == 0 and dec.device.type == "cpu"
        codes = np.zeros((4, dec.C), np.int64)
        assert dec.decode_many([("k", "s", codes, True, True)], now=0.0)["k"].shape == (4 * 2048,)
    # where its making went, for the log line (seconds; GPU memory only on a GPU)
    from s2tts.codec.stream import making_line

    assert list(dec.making) == ["weights", "fp32 fallback", "kernels chosen", "stream slots", "warm-up"]
    assert all(sec >= 0 and mib is None for sec, mib in dec.making.values()), dec.making
    line = making_line(dec.making)
    assert line.startswith("; made in: weights ") and " s, fp32 fallback " in line and "MiB" not in line, line
    assert making_line({"weights": (1.25, 784.0), "CUDA graphs": (9.0, 4156.0)}) == \
        "; made in: weights 1.2 s (784 MiB), CUDA graphs 9.0 s (4156 MiB); GPU memory held: 4.82 GiB"
