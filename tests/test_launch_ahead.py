"""The engine with two steps in flight (`Engine.step_ahead`, the `launch_ahead` setting): the same steps as
`step()`'s, each launched before the last one is finished and its outputs handled. On the tiny checkpoint, fp32, CPU (where
a launch runs the step at once: what is checked is the order and the bookkeeping, which are the GPU's too)."""

import numpy as np
import pytest
import torch

from s2tts.engine import Engine, EngineConfig
from s2tts.engine.service import EngineService
from s2tts.ar.sampling import SamplingParams

RESIDUAL = 32


def _run(model, prompts, ahead: bool):
    """Five requests through one engine: three at once (one stops at its end token or its length, whichever comes
    first), a fourth joining at step 4, the second cancelled at step 6 (no frame of step 6 or later), a fifth
    joining at step 9. With `step()`, call j runs step j: the commands for step j come before it. With
    `step_ahead()`, call j launches step j + 1 and then finishes step j (call 1 launches steps 1 and 2): a request
    for step j comes before call j - 1; a cancel taken at call j's launch drops the request's row of step j, still
    in flight. -> {id: (codes [frames, C], finish reason)}, calls."""
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=256, prefix_cache_mb=0))
    later = {4: ("add", "d"), 6: ("cancel", "b"), 9: ("add", "e")}
    texts = {"a": "First of all.", "b": "Cancel me later.", "c": "A third voice.", "d": "Joining late.", "e": "Last."}

    def add(rid):
        sp = SamplingParams(seed=ord(rid), max_new_tokens=14, temperature=1.0, top_p=1.0, top_k=4096) if rid == "a" \
            else SamplingParams(seed=ord(rid), max_new_tokens=12, ignore_end=True)
        eng.submit(rid, prompts.build(texts[rid]), sp)

    for rid in "abc":
        add(rid)
    at_call = {(j - 1 if ahead and verb == "add" else j): (verb, rid) for j, (verb, rid) in later.items()}
    frames, reasons, call = {}, {}, 0
    while eng.has_work() or call < max(later):
        call += 1
        verb, rid = at_call.get(call, (None, None))
        if verb == "add":
            add(rid)
        elif verb == "cancel":
            eng.cancel(rid)
        for o in eng.step_ahead() if ahead else eng.step():
            frames.setdefault(o.request_id, []).append(o.codes)
            if o.finished:
                assert o.request_id not in reasons, f"{o.request_id} ended twice"
                reasons[o.request_id] = o.finish_reason
    assert not eng._inflight and not eng.live and eng.blocks.free == eng.blocks.capacity
    return {r: (np.concatenate(f), reasons[r]) for r, f in frames.items()}, call


def test_steps_launched_ahead_give_the_same_frames_and_ends(model, prompts):
    plain, calls = _run(model, prompts, ahead=False)
    ahead, calls_ahead = _run(model, prompts, ahead=True)
    assert sorted(ahead) == sorted(plain) == list("abcde")
    for rid in plain:
        np.testing.assert_array_equal(ahead[rid][0], plain[rid][0], err_msg=rid)
        assert ahead[rid][1] == plain[rid][1], rid
    assert plain["b"][1] == "cancelled" and 0 < plain["b"][0].shape[0] < 12
    assert {plain[r][1] for r in "cde"} == {"length"} and plain["a"][1] in ("end", "length")
    assert calls_ahead == calls  # the one behind: no step more, none fewer


def test_fail_all_with_a_step_in_flight_frees_everything(model, prompts):
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=2, max_seq_len=256, prefix_cache_mb=0))
    for rid in "xy":
        eng.submit(rid, prompts.build("In flight."), SamplingParams(seed=1, max_new_tokens=20, ignore_end=True))
    eng.step_ahead()
    eng.step_ahead()
    assert eng._inflight  # a step launched, its frames not taken
    ended = eng.fail_all("shutting down")
    assert {o.request_id for o in ended} == {"x", "y"} and all(o.finish_reason == "error" for o in ended)
    assert not eng._inflight and not eng.live and eng.blocks.free == eng.blocks.capacity
    codes, reason = eng.generate(prompts.build("After."), SamplingParams(seed=2, max_new_tokens=3, ignore_end=True))
    assert codes.shape[1] == 3 and reason == "length"


@pytest.mark.parametrize("ahead", [None, True])
def test_engine_service_serves_the_same_codes_launching_ahead(model, prompts, ahead):
    """EngineService with `launch_ahead` (None is off on a CPU): four requests, exactly one final each, the same
    codes as the engine's own `generate` of each alone."""
    import threading

    class Responder:
        def __init__(self):
            self.sent, self.done = [], threading.Event()

        def send(self, response, final):
            self.sent.append(response)
            if final:
                assert not self.done.is_set(), "a second final response"
                self.done.set()

        def is_cancelled(self):
            return False

    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=256, prefix_cache_mb=0, launch_ahead=ahead))
    svc = EngineService(eng, lambda codes, reason, stats, audio: (codes, reason), lambda e: (None, e.wire()))
    assert svc.launch_ahead is bool(ahead)
    rs = [Responder() for _ in range(4)]
    try:
        for i, r in enumerate(rs):
            svc.submit(f"q{i}", r, prompts.build(f"Ahead {i}."), SamplingParams(seed=i, max_new_tokens=9 + i,
                                                                                 ignore_end=True), 2, 3)
        for r in rs:
            assert r.done.wait(120), "no final response"
    finally:
        svc.shutdown()
    alone = Engine(model, RESIDUAL, EngineConfig(max_batch=1, max_seq_len=256, prefix_cache_mb=0))
    for i, r in enumerate(rs):
        assert r.sent[-1][1] == "length"
        codes = np.concatenate([c for c, _ in r.sent])
        want, _ = alone.generate(prompts.build(f"Ahead {i}."), SamplingParams(seed=i, max_new_tokens=9 + i,
                                                                             ignore_end=True))
        np.testing.assert_array_equal(codes.T, want)


def _many(model, prompts, ahead: bool, kv_cache_tokens: int):
    """24 requests sampled over the whole vocabulary (some meet their end token within 30 frames) through 6 slots,
    `batch_invariant` (a row's numbers do not depend on the rows beside it, so steps that carry a dropped row give
    the same frames) -> {id: (codes, finish reason)}, preemptions."""
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=6, max_seq_len=256, prefix_cache_mb=0, kv_block_tokens=16,
                                               kv_cache_tokens=kv_cache_tokens, batch_invariant=True))
    for seed in range(24):
        eng.submit(f"s{seed}", prompts.build("Any."),
                   SamplingParams(seed=seed, max_new_tokens=30, temperature=1.0, top_p=1.0, top_k=4096))
    frames, reasons = {}, {}
    while eng.has_work():
        for o in eng.step_ahead() if ahead else eng.step():
            assert o.request_id not in reasons, f"{o.request_id}: an output after its final one"
            frames.setdefault(o.request_id, []).append(o.codes)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not eng._inflight and not eng.live and eng.blocks.free == eng.blocks.capacity
    return {r: (np.concatenate(f), reasons[r]) for r, f in frames.items()}, eng.preemptions


def test_end_tokens_with_two_steps_in_flight(model, prompts):
    """With `step_ahead()` a request's row in the step after its end token (launched before that token was known)
    is dropped: every request gives the same codes and end as with `step()`."""
    plain, _ = _many(model, prompts, False, 4096)
    ahead, _ = _many(model, prompts, True, 4096)
    assert sorted(plain) == sorted(ahead) == sorted(f"s{i}" for i in range(24))
    assert {why for _, why in plain.values()} == {"end", "length"}
    for rid in plain:
        np.testing.assert_array_equal(ahead[rid][0], plain[rid][0], err_msg=rid)
        assert ahead[rid][1] == plain[rid][1], rid


def test_preemptions_with_two_steps_in_flight(model, prompts):
    """A KV pool too small for 6 growing requests: requests are preempted while a step of theirs is in flight (its
    frame is dropped and made again after they resume). Every request ends exactly once, with all its frames (30,
    or fewer before its end token), and every block and slot is free at the end. (A resumed request prefills its
    frames as prompt, whose numbers differ from its decode steps' in the last bits: its later codes may differ
    from a run without that preemption, so they are not compared.)"""
    ahead, preempted = _many(model, prompts, True, 16 * 16)
    assert preempted > 0
    assert sorted(ahead) == sorted(f"s{i}" for i in range(24))
    for rid, (codes, why) in ahead.items():
        assert (codes.shape[0] == 30) if why == "length" else (why == "end" and codes.shape[0] < 30), (rid, why)


def test_faults_at_a_launch_with_a_step_in_flight(model, prompts):
    """A step that fails at its launch while the step before it is in flight: a prompt's fault (out of memory) ends
    only that request, the decode rows run without it; a decode fault ends the decoding requests, and their rows
    of the step in flight are dropped (nothing after a request's final output). The others run to their end; the
    pool is free at the end."""
    import torch

    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=256, prefix_cache_mb=0))
    p = SamplingParams(seed=4, max_new_tokens=10, ignore_end=True)
    finals: dict[str, object] = {}
    frames: dict[str, int] = {}

    def take(outs):
        for o in outs:
            assert o.request_id not in finals, f"{o.request_id}: an output after its final one"
            frames[o.request_id] = frames.get(o.request_id, 0) + o.codes.shape[0]
            if o.finished:
                finals[o.request_id] = o

    for rid in "ab":
        eng.submit(rid, prompts.build(f"Running {rid}."), p)
    take(eng.step_ahead())
    take(eng.step_ahead())
    eng.submit("c", prompts.build("Admitted into a failing launch."), p)
    eng.fault_hook = lambda phase, reqs: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory")) \
        if phase == "prefill" else None
    take(eng.step_ahead())
    eng.fault_hook = None
    assert finals["c"].finish_reason == "error" and isinstance(eng.last_fault, torch.cuda.OutOfMemoryError)
    assert len(eng._inflight) == 1 and {r.id for r in eng.live.values()} == {"a", "b"}
    take(eng.step_ahead())
    eng.submit("d", prompts.build("Running d."), p)
    take(eng.step_ahead())
    take(eng.step_ahead())
    assert eng._inflight and "d" in {r.id for r in eng.live.values()}

    def boom(phase, reqs):
        if phase == "decode":
            raise RuntimeError("injected decode failure")

    eng.fault_hook = boom
    take(eng.step_ahead())
    eng.fault_hook = None
    assert {finals[r].finish_reason for r in "abd"} == {"error"}
    while eng.has_work():
        take(eng.step_ahead())
    assert sorted(finals) == list("abcd") and frames["c"] == 0
    assert not eng._inflight and not eng.live and eng.blocks.free == eng.blocks.capacity
    codes, reason = eng.generate(prompts.build("After."), SamplingParams(seed=2, max_new_tokens=3, ignore_end=True))
    assert codes.shape[1] == 3 and reason == "length"


def test_a_failed_launch_is_reported_once(model, prompts):
    """Two prompts that fail at their launches, one after the other, beside a running request: each fault is
    `last_fault` of the one call that met it (the call after it, which only finishes the step in flight, reports
    none), so the service counts two failed steps, not four, and stays healthy where `step()` would (its limit
    of failed steps in a row is 3)."""
    pb, pc = prompts.build("The second."), prompts.build("The third.")
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=256, prefix_cache_mb=0,
                                               max_prefill_tokens=max(len(pb), len(pc))))
    eng.submit("a", prompts.build("Running a."), SamplingParams(seed=1, max_new_tokens=12, ignore_end=True))
    eng.step_ahead(), eng.step_ahead()

    def hook(phase, reqs):
        if phase == "prefill" and any(r.id in "bc" for r in reqs):
            raise RuntimeError(f"injected prefill fault of {[r.id for r in reqs]}")

    eng.fault_hook = hook
    for rid, p in (("b", pb), ("c", pc)):
        eng.submit(rid, p, SamplingParams(seed=2, max_new_tokens=4, ignore_end=True))
    faults, finals = [], {}
    while eng.has_work():
        for o in eng.step_ahead():
            if o.finished:
                finals[o.request_id] = o.finish_reason
        faults.append(eng.last_fault)
    reported = [f for f in faults if f is not None]
    assert len(reported) == 2 and reported[0] is not reported[1], faults
    assert finals == {"a": "length", "b": "error", "c": "error"}


class _NumbersThroughIndex:
    """A dispatch mode that records every Python number written through a tensor index (`t[idx] = -1`: the number
    made a tensor by `aten.lift_fresh`, then the value of an `aten.index_put_`): on a GPU that value is copied from
    pageable host memory, a copy that waits for all the work queued on the stream (the step in flight), so a launch
    must never do it. (A 1-element device tensor written the same way, viewed as 0-dim, is not one.)"""

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        found = self.found = []
        numbers = weakref.WeakSet()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if name == "lift_fresh":
                    numbers.add(out)
                elif name in ("index_put_", "index_put", "_index_put_impl_") and args[2] in numbers:
                    found.append((str(func), tuple(args[0].shape)))
                return out

        self.mode = Mode()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_launch_never_waits_for_the_device(tiny_ckpt, prompts, device):
    """Launching steps with requests starting (their sampling state set, their prompt rows), decoding and joining:
    no Python number goes through a tensor index (the CPU's check of what on a GPU is a copy that waits for the step
    in flight, launching a prompt's first step late), and on a GPU nothing in a launch
    synchronizes with the device at all (`torch.cuda.set_sync_debug_mode("error")`)."""
    from s2tts.ar.loading import load_model

    model = load_model(tiny_ckpt, device, "fp32")
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=256, prefix_cache_mb=0))
    check, launches = _NumbersThroughIndex(), []
    launch = eng._launch

    def checked():
        launches.append(len(eng.scheduler.live))
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            with check.mode:
                return launch()
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")

    eng._launch = checked
    for i, text in enumerate(["One to start.", "And a second."]):
        eng.submit(f"r{i}", prompts.build(text), SamplingParams(seed=i, max_new_tokens=6, ignore_end=True))
    frames, calls = {}, 0
    while eng.has_work():
        calls += 1
        if calls == 3:
            eng.submit("late", prompts.build("Joining late."), SamplingParams(seed=9, max_new_tokens=4, ignore_end=True))
        for o in eng.step_ahead():
            frames[o.request_id] = frames.get(o.request_id, 0) + len(o.codes)
    assert frames == {"r0": 6, "r1": 6, "late": 4}
    assert len(launches) >= 8 and check.found == [], check.found
