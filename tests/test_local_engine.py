"""s2pro holding the engine (`engine_in_s2pro`, `s2tts.frontend.local_engine`), on the tests' fake Triton: the same codes
and audio as through slow_ar, no BLS call for generation, a client's cancel ending the engine's request, a cancel
that reaches the engine before its request, and an engine fault that ends every request once and unloads s2pro."""

import threading
import time

import numpy as np

from fake_triton import one_final, quiet, tts_inputs, wait_final
from s2tts import errors


def _chunks(req):
    """(codes [frames, C], audio) of a finished s2pro request."""
    outs = [r for r in req.sender.responses if not r.has_error()]
    codes = np.concatenate([r.get("codes") for r in outs])
    audio = np.concatenate([r.get("audio") for r in outs])
    return codes, audio


def test_codes_and_audio_equal_slow_ars(harness_factory):
    """The same requests, one after another, through slow_ar and through the engine in s2pro: equal codes and the same audio
    (one engine, one codec, the same seeds), a dialogue over several segments included; and in s2pro's process no
    BLS call goes to an engine."""
    texts = [("Hello there, in one piece.", {}),
             ("<|speaker:0|>First turn of two. <|speaker:1|>Second turn, the other voice.",
              {"chunk_length": np.array([24], np.int32)})]
    got = {}
    for mode in ("false", "true"):
        h = harness_factory(codec_in_engine="true", engine_in_s2pro=mode)
        assert ("slow_ar" in h.models) == (mode == "false")
        calls = []
        bls = h.bls
        h.bls = lambda model, *a: (calls.append(model), bls(model, *a))[1]
        outs = []
        for i, (text, extra) in enumerate(texts):
            r = wait_final(h.request("s2pro", tts_inputs(text, seed=7 + i, max_new_tokens=10, **extra), f"{mode}-{i}"))
            assert one_final(r) is None
            outs.append(_chunks(r))
        got[mode] = outs
        assert not [m for m in calls if m.startswith("slow_ar")] or mode == "false"
        assert not [m for m in calls if m.startswith("dac_decoder")]  # the codec decodes in the engine's loop
        quiet(h)
        h.shutdown()  # (the fake's module is one per process: the next harness replaces it)
    for (c0, a0), (c1, a1) in zip(got["false"], got["true"]):
        np.testing.assert_array_equal(c0, c1)
        # (chunk lengths follow the measured pace, and the codec's sums round differently per length: ~4e-6)
        np.testing.assert_allclose(a0, a1, atol=1e-4, rtol=0)
        assert a0.size == c0.shape[0] * 2048


def test_a_clients_cancel_ends_the_engines_request(harness_factory):
    h = harness_factory(codec_in_engine="true", engine_in_s2pro="true")
    engine = h.models["s2pro"].downstream.services["slow_ar"]
    r = h.request("s2pro", tts_inputs("Cancel me part way.", max_new_tokens=400,
                                      ignore_eos=np.array([True])), "gone")
    deadline = time.time() + 30
    while time.time() < deadline and not [x for x in r.sender.responses if not x.has_error()]:
        time.sleep(0.02)
    r.cancelled = True
    wait_final(r)
    assert one_final(r) is None
    final = r.sender.responses[-1]
    assert b'"finish_reason": "cancelled"' in final.get("stats").reshape(-1)[0]
    assert quiet(h)["live"] == 0 and engine.status()["in_flight"] == 0


def test_a_cancel_before_its_generation_wins(harness_factory):
    """A cancel for a request id the engine has not seen (s2pro's supervisor ending a request whose worker has not
    submitted yet) is remembered: the generation, when it comes, ends at once."""
    h = harness_factory(codec_in_engine="true", engine_in_s2pro="true")
    local = h.models["s2pro"].downstream
    local.control("slow_ar", "early", "cancel")
    from fake_triton import Request

    s2pro = h.models["s2pro"]
    req = s2pro._parse(Request(tts_inputs("Never generated.", max_new_tokens=300)))
    prompt = s2pro.service.prompts.build_segment(req.text, None, None, [], 2000)
    out = list(local.generate("slow_ar", "early", prompt, req, ("early", True, True)))
    assert len(out) == 1 and out[0][2] == "cancelled" and out[0][0].shape[0] == 0
    assert local.services["slow_ar"].engine.counts()["live"] == 0


def test_an_engine_fault_ends_every_request_once_and_unloads_s2pro(harness_factory):
    """A sticky device error in the engine's step: every request in flight ends once with `unavailable`, and s2pro
    (which holds the engine) unloads itself, so Triton's readiness says so; nothing tries to reload an engine that
    lives in s2pro's process."""
    h = harness_factory(codec_in_engine="true", engine_in_s2pro="true")
    engine = h.models["s2pro"].downstream.services["slow_ar"]
    engine.engine.fault_hook = lambda phase, reqs: (_ for _ in ()).throw(
        RuntimeError("CUDA error: an illegal memory access was encountered"))
    reqs = [h.request("s2pro", tts_inputs(f"Request {i}.", seed=i), f"r{i}") for i in range(3)]
    for r in reqs:
        err = one_final(wait_final(r))
        assert err is not None and errors.parse(err.message()).code == "unavailable", err
    deadline = time.time() + 10
    while time.time() < deadline and ("s2pro", "unload") not in h.calls:
        time.sleep(0.05)
    assert ("s2pro", "unload") in h.calls and not engine.health.ok
    assert not [c for c in h.calls if c[0] == "slow_ar"]
    assert not [t for t in threading.enumerate() if t.name.startswith("s2tts-reload")]
