"""Transport-free logic of the s2pro/slow_ar models: chunk planning and request validation."""

import numpy as np
import pytest

from s2tts.sampling import SamplingParams
from s2tts.service import Chunker, Limits, TTSRequest


def frames(n, start=0):
    return np.arange(start, start + n)[:, None].repeat(10, 1)


def test_chunker_first_then_fixed_sizes():
    c = Chunker(4, 6)
    got = [ch.shape[0] for i in range(20) for ch in c.add(frames(1, i))]
    assert got == [4, 6, 6] and c.flush().shape[0] == 4


@pytest.mark.parametrize("kw,msg", [
    (dict(text=" "), "text is empty"),
    (dict(first_chunk_frames=0), "first_chunk_frames=0 is out of range"),
    (dict(reference_codes=np.zeros((10, 3)), reference_audio=np.zeros(16000, np.float32), reference_sample_rate=16000,
          reference_text="x"), "either reference_audio or reference_codes"),
    (dict(reference_audio=np.zeros(10, np.float32), reference_sample_rate=16000, reference_text="x"), "at least a second"),
    (dict(reference_audio=np.zeros(16000, np.float32), reference_sample_rate=4000, reference_text="x"), "between 8000"),
])
def test_request_validation(kw, msg):
    base = dict(text="Hello.", params=SamplingParams(), first_chunk_frames=4, chunk_frames=16)
    with pytest.raises(ValueError, match=msg):
        TTSRequest(**{**base, **kw}).validate(Limits(), 10)
