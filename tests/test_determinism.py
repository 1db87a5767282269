"""Batch-invariant generation: a seeded request gives the same codes (and audio) alone and beside others.

bf16 is where it matters: the same request's logits move with the batch's shape (most seeded requests change side
by side on the tiny model without it), so these tests run in bf16 with
`batch_invariant` on, in the engine and through a real tritonserver.
"""

import threading

import numpy as np
import pytest
import torch

from s2tts.ar.loading import load_model
from s2tts.client import S2ProClient, TTSInput
from s2tts.engine import Engine, EngineConfig
from s2tts.frontend.prompt_builder import PromptBuilder
from s2tts.ar.sampling import SamplingParams

from servers import tiny_server

RESIDUAL = 32  # the tiny codec's residual codebook size
N = 6


@pytest.fixture(scope="module")
def parts(tiny_ckpt):
    return load_model(tiny_ckpt, "cpu", "bf16"), PromptBuilder.from_dir(tiny_ckpt)


def _prompts(builder):
    ref = torch.randint(0, 32, (10, 40), generator=torch.Generator().manual_seed(5))
    # odd ones clone one voice: side by side, the later ones find its prefix in the cache; alone, none does
    return [builder.build(f"Sentence {i} with {'more ' * i}words.", ref if i % 2 else None, "Ref text." if i % 2 else None)
            for i in range(N)]


def _run(model, prompts, ids, invariant, every=1):
    """Requests `ids`, one submitted every `every` steps (so they join a batch already running) -> codes per id."""
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=512, prefix_cache_mb=64,
                                               batch_invariant=invariant))
    out, pending, done, k = {i: [] for i in ids}, list(ids), set(), 0
    while len(done) < len(ids):
        if pending and k % every == 0:
            i = pending.pop(0)
            eng.submit(str(i), prompts[i], SamplingParams(seed=1000 + i, max_new_tokens=24, ignore_end=True))
        k += 1
        for o in eng.step():
            out[int(o.request_id)].append(o.codes)
            done |= {int(o.request_id)} if o.finished else set()
    return {i: np.concatenate(v) for i, v in out.items()}, eng


def test_engine_codes_do_not_depend_on_neighbours(parts):
    model, builder = parts
    prompts = _prompts(builder)
    # 6 requests through 4 slots: they join and leave a running batch, wait for slots, hit the prefix cache
    together, eng = _run(model, prompts, list(range(N)), True, every=3)
    assert eng.prefix_cache.hits >= 1
    for i in range(N):
        alone, _ = _run(model, prompts, [i], True)
        np.testing.assert_array_equal(together[i], alone[i], err_msg=f"request {i} changed beside others")
    assert len({together[i][:4].tobytes() for i in range(N)}) == N  # the requests differ from each other


@pytest.fixture(scope="module")
def invariant_server(tiny_ckpt, tmp_path_factory):
    with tiny_server(tiny_ckpt, tmp_path_factory.mktemp("invariant"), dtype="bf16", batch_invariant="true",
                     max_batch=4, max_seq_len=1024, chunk_frames=6) as server:
        yield server


def test_served_audio_does_not_depend_on_neighbours(invariant_server, tiny_ckpt):
    ref = np.random.default_rng(3).integers(0, 32, (10, 30)).astype(np.int32)
    reqs = [TTSInput(text=f"Request {i}, {'and more ' * i}text.", seed=50 + i, max_new_tokens=18, ignore_eos=True,
                     reference_codes=ref if i % 2 else None, reference_text="Ref text." if i % 2 else None)
            for i in range(4)]

    def synth(r):
        with S2ProClient(invariant_server.grpc_url) as c:
            return c.synthesize(r)

    alone = [synth(r) for r in reqs]
    together = [None] * len(reqs)

    def run(i):
        together[i] = synth(reqs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert "batch_invariant=True" in invariant_server.log_tail(100000)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b is not None, f"request {i} did not finish"
        np.testing.assert_array_equal(a.codes, b.codes, err_msg=f"request {i}: codes changed beside others")
        assert a.audio.size == 18 * 2048 and np.abs(a.audio).max() > 1e-4
        assert np.abs(a.audio - b.audio).max() <= 1 / 32768  # within 1 LSB of 16-bit PCM
