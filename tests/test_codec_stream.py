"""Many streams over one codec (what dac_decoder runs): batched chunks of equal length, per-stream state."""

import numpy as np
import torch

from s2tts.checkpoint import load_codec_from_dir
from s2tts.codec_stream import StreamDecoder
from s2tts.errors import S2Error


def test_interleaved_batched_streams_equal_whole_decode(tiny_ckpt):
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    dec = StreamDecoder(codec)
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
    assert not dec.states  # every stream ended with a final chunk
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
