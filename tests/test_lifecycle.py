"""The request lifecycle under faults: every request ends with exactly one final response.

Engine-level tests drive `s2tts.engine.Engine` directly; the rest run the real model.py
files of the repository in-process through `tests/fake_triton.py` (a fake
`triton_python_backend_utils`), with faults injected where they happen in production:
the engine step, the codec, a model's threads, its process, shutdown, deadlines, admission.
"""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from s2tts import errors
from s2tts.codec.loading import codec_codebook_sizes
from s2tts.ar.loading import load_model
from s2tts.engine import FINISH_CANCELLED, FINISH_ERROR, Engine, EngineConfig
from s2tts.frontend.prompt_builder import PromptBuilder
from s2tts.serving.lifecycle import RequestTable
from s2tts.ar.sampling import SamplingParams

from fake_triton import one_final as _one_final
from fake_triton import slow_ar_inputs
from fake_triton import quiet as _quiet
from fake_triton import tts_inputs as _tts_inputs
from fake_triton import wait_final as _wait

C = 10


# ---- the engine alone -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_parts(tiny_ckpt):
    model = load_model(tiny_ckpt, "cpu", "fp32")
    return model, codec_codebook_sizes(tiny_ckpt)[1], PromptBuilder.from_dir(tiny_ckpt, model.s2)


def _engine(parts, max_batch=4):
    model, residual, _ = parts
    return Engine(model, residual, EngineConfig(max_batch=max_batch, max_seq_len=512))


def _run(engine, n_steps=200):
    outs = {}
    for _ in range(n_steps):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if not engine.has_work():
            break
    return outs


def test_failed_decode_while_admitting_loses_nothing(engine_parts):
    eng = _engine(engine_parts)
    prompts = engine_parts[2]
    p = SamplingParams(seed=1, max_new_tokens=6)
    eng.submit("a", prompts.build("First."), p)
    eng.submit("b", prompts.build("Second."), p)
    eng.step()  # a and b prefilled: live
    eng.submit("c", prompts.build("Third, admitted in the failing step."), p)
    eng.cancel("b")  # a cancellation pending when the step fails

    def boom(phase, reqs):
        if phase == "decode":
            raise RuntimeError("injected decode failure")

    eng.fault_hook = boom
    outs = eng.step()
    eng.fault_hook = None
    by = {o.request_id: o for o in outs}
    assert by["b"].finish_reason == FINISH_CANCELLED  # applied before any device work: not lost
    assert by["a"].finish_reason == FINISH_ERROR and "injected decode failure" in by["a"].error
    assert "c" not in by  # not touched: back at the head of the queue
    assert isinstance(eng.last_fault, RuntimeError)
    idle = {"live": 0, "free_slots": 4, "kv_tokens": 0, "kv_blocks_used": 0}  # every KV block back in the pool
    assert eng.counts()["waiting"] == 1 and eng.counts().items() >= idle.items()
    rest = _run(eng)
    assert rest["c"][-1].finished and rest["c"][-1].finish_reason in ("end", "length")
    assert eng.counts()["waiting"] == 0 and eng.counts().items() >= idle.items()


def test_failed_prefill_ends_only_the_admitted(engine_parts):
    eng = _engine(engine_parts)
    prompts = engine_parts[2]
    p = SamplingParams(seed=2, max_new_tokens=5)
    eng.submit("running", prompts.build("Already running."), p)
    eng.step()
    eng.submit("new", prompts.build("Admitted now."), p)
    eng.fault_hook = lambda phase, reqs: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory")) \
        if phase == "prefill" else None
    outs = {o.request_id: o for o in eng.step()}
    eng.fault_hook = None
    assert outs["new"].finish_reason == FINISH_ERROR
    assert errors.from_exception(outs["new"].exception).code == "resource_exhausted"
    assert outs["running"].codes.shape == (1, C)  # the decode part of the step went through
    assert not errors.is_fatal_device_error(eng.last_fault)
    rest = _run(eng)
    assert rest["running"][-1].finished and eng.counts()["free_slots"] == 4 and eng.counts()["kv_blocks_used"] == 0


def test_fatal_device_errors_are_told_apart():
    assert errors.is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert errors.is_fatal_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not errors.is_fatal_device_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert not errors.is_fatal_device_error(ValueError("bad shape"))


def test_error_tags_round_trip():
    e = errors.invalid("seed must be >= 0", "seed")
    back = errors.parse(e.wire())
    assert (back.code, back.param, back.message) == ("invalid_argument", "seed", "seed must be >= 0")
    assert isinstance(back, ValueError)
    assert errors.parse("Stub process 'slow_ar_0_0' is not healthy.").code == "unavailable"
    assert errors.parse("Stream removed (Socket closed)").code == "unavailable"  # the connection broke: retry
    assert errors.model_is_dead("Stub process 'slow_ar_0_0' is not healthy.")
    from s2tts.serving.lifecycle import Health

    gone = Health("slow_ar")
    gone.fail("unrecoverable device error")
    # a model's own verdict, as its failed requests carry it to s2pro: dead, whether or not Triton says so yet
    assert errors.model_is_dead(errors.parse(gone.error().wire()).message)
    assert not errors.model_is_dead("slow_ar: the device ran out of memory for this request")
    assert errors.parse("something odd").code == "internal"
    assert errors.HTTP_STATUS["already_exists"] == 409 and errors.HTTP_STATUS["unavailable"] == 503


class _Responder:
    def __init__(self):
        self.sent, self.finals = [], 0

    def send(self, response, final):
        assert not self.finals, "a response after the final one"
        self.sent.append(response)
        self.finals += final

    def is_cancelled(self):
        return False


def test_request_table_exactly_one_final_and_admission():
    table = RequestTable("m", make_error=lambda e: ("error", e.code), limit=2)
    r1, r2 = _Responder(), _Responder()
    a = table.open("x", r1)
    with pytest.raises(errors.S2Error) as dup:
        table.open("x", _Responder())
    assert dup.value.code == "already_exists" and table.by_client("x") is a  # the live one is untouched
    table.open("y", r2)
    with pytest.raises(errors.S2Error) as full:
        table.open("z", _Responder())
    assert full.value.code == "unavailable"
    # finish races: one final whoever comes first; later sends are dropped, never delivered
    results = []
    threads = [threading.Thread(target=lambda: results.append(a.finish(("final", i), "ok"))) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results.count(True) == 1 and r1.finals == 1
    assert not a.send("late") and a.dropped >= 1
    assert table.fail_all(errors.unavailable("shutting down")) == 1 and r2.sent[-1] == ("error", "unavailable")
    assert len(table) == 0 and table.open("x", _Responder())  # the id is free again


def test_a_final_response_frees_the_slot_before_the_client_hears_it():
    """A client that sends its next request the moment its final response arrives finds the slot free (at c=64
    with s2pro's limit at 64, some were refused `busy` when the slot was freed after the send)."""
    table = RequestTable("m", make_error=lambda e: ("error", e.code), limit=1)
    follow = []

    class Eager(_Responder):
        def send(self, response, final):
            super().send(response, final)
            if final:
                follow.append(table.open("next", _Responder()))

    table.open("first", Eager()).finish(("final", 0), "ok")
    assert len(follow) == 1 and table.by_client("next") is follow[0]


def test_worker_pool_queues_past_its_limit_and_never_holds_the_exit():
    from s2tts.serving.threads import WorkerPool

    pool, done, release = WorkerPool(2, "t-worker"), [], threading.Event()
    for i in range(6):  # 2 workers: the other 4 wait in the queue, none is lost
        pool.submit(lambda i=i: (release.wait(10), done.append(i)))
    time.sleep(0.2)
    assert pool.size == 2 and done == []
    release.set()
    for _ in range(100):
        if len(done) == 6:
            break
        time.sleep(0.05)
    assert sorted(done) == list(range(6)) and pool.size == 2
    pool.submit(lambda: 1 / 0)  # a worker survives its work raising
    pool.submit(lambda: done.append("after"))
    time.sleep(0.3)
    assert done[-1] == "after" and pool.size == 2
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(print)

    # a worker blocked forever (on a model that died) must not keep the process alive at exit
    code = ("import threading; from s2tts.serving.threads import WorkerPool; p = WorkerPool(4, 'w'); "
            "p.submit(threading.Event().wait); print('exiting', flush=True)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and "exiting" in r.stdout, r.stderr


def test_worker_pool_shutdown_waits_for_idle_workers_not_for_given_up_ones():
    """A model's unload (`finalize`) shuts its pool down: idle workers are joined, a worker given up in a call that
    never returns is not (it once held every unload after a dead model for the whole 5 s of the join)."""
    from s2tts.serving.threads import WorkerPool

    pool, started, stuck, worker = WorkerPool(2, "t-worker"), threading.Event(), threading.Event(), []
    pool.submit(lambda: (worker.append(threading.current_thread()), started.set(), stuck.wait(120)))
    pool.submit(lambda: None)
    assert started.wait(10) and pool.give_up(worker[0])
    done = threading.Event()
    threading.Thread(target=lambda: (pool.shutdown(timeout=60), done.set()), daemon=True).start()
    assert done.wait(20), "shutdown waited for the worker stuck in its call"
    assert [t for t in pool._threads if t.is_alive()] == worker  # the idle one was joined, the stuck one left
    stuck.set()


# ---- the real model.py files in-process ---------------------------------------------------------------
def test_happy_path_and_release(harness_factory):
    h = harness_factory()
    req = _wait(h.request("s2pro", _tts_inputs(), "client-1"))
    assert _one_final(req) is None
    audio = [r.get("audio") for r in req.sender.responses]
    assert sum(a.size for a in audio) > 0
    stats = req.sender.responses[-1].get("stats")[0]
    assert b'"queue_s"' in stats and b'"request_id": "client-1"' in stats
    assert _quiet(h)["free_slots"] == 4


def test_pipeline_pace_reaches_slow_ar_chunker(harness_factory):
    """A slow codec sets the pipeline's pace; s2pro measures it and tells slow_ar, whose chunker then follows the
    slower of it and the engine's own step time."""
    h = harness_factory(chunk_frames=16)
    dec = h.models["dac_decoder"]
    decode = dec.execute
    # 70 ms per frame of every chunk (a frame is 46 ms of audio): the codec is the slowest stage on any machine
    frames = lambda requests: sum(r._inputs["codes"].as_numpy().shape[1] for r in requests)  # noqa: E731
    dec.execute = lambda requests: (time.sleep(0.07 * frames(requests)), decode(requests))[1]
    req = _wait(h.request("s2pro", _tts_inputs(max_new_tokens=40, ignore_eos=np.array([True])), "paced"))
    assert _one_final(req) is None
    s2, slow = h.models["s2pro"].service, h.models["slow_ar"].service
    assert s2.pace is not None and s2.pace > 0
    deadline = time.time() + 5  # reports come at most once a second; the last one carries the final average
    while (slow.load.reported() is None or slow.load.reported()[0] != pytest.approx(s2.pace, abs=1e-3)) \
            and time.time() < deadline:
        time.sleep(0.05)
    assert slow.load.reported() is not None, "s2pro never reported the pace"
    reported = slow.load.reported()[0]
    assert reported == pytest.approx(s2.pace, abs=1e-3)
    own = slow.load.step_s / slow.frame_seconds
    assert reported > own and slow.load.pace() == pytest.approx(reported)  # the codec, not the engine, is the slow stage
    with pytest.raises(errors.S2Error, match="out of range"):
        slow.control("pace=-1", "s2pro~aaa")


def test_engine_step_fails_while_admitting(harness_factory):
    h = harness_factory()
    slow = h.models["slow_ar"].service
    first = h.request("s2pro", _tts_inputs("Running already.", max_new_tokens=200, ignore_eos=np.array([True])), "run")
    while not first.sender.responses:
        time.sleep(0.01)
    state = {"armed": True}

    def fault(phase, reqs):
        if phase == "decode" and state["armed"]:
            state["armed"] = False
            raise RuntimeError("injected: step failed while admitting")

    slow.engine.fault_hook = fault
    second = h.request("s2pro", _tts_inputs("Arrives during the failing step.", seed=2), "new")
    _wait(first)
    _wait(second)
    err = _one_final(first)
    assert err is not None and "injected" in err.message() and errors.parse(err.message()).code == "internal"
    assert _one_final(second) is None  # untouched by the failed step: it ran afterwards
    assert slow.health.ok
    _quiet(h)


def test_sticky_device_error_makes_slow_ar_unhealthy_and_s2pro_reloads_it(harness_factory):
    h = harness_factory()
    slow = h.models["slow_ar"].service
    slow.engine.fault_hook = lambda phase, reqs: (_ for _ in ()).throw(
        RuntimeError("CUDA error: an illegal memory access was encountered"))
    reqs = [h.request("s2pro", _tts_inputs(f"Request {i}.", seed=i), f"r{i}") for i in range(3)]
    for r in reqs:
        err = _one_final(_wait(r))
        assert err is not None and errors.parse(err.message()).code == "unavailable"
    deadline = time.time() + 10  # the requests are failed first, then the model unloads itself
    while time.time() < deadline and ("slow_ar", "unload") not in h.calls:
        time.sleep(0.05)
    assert not slow.health.ok and ("slow_ar", "unload") in h.calls
    direct = _wait(h.request("slow_ar", {"input_ids": np.array([1, 2, 3], np.int32)}, "direct")) \
        if "slow_ar" in h.models else None
    if direct is not None:  # still loaded: refuses at once
        assert errors.parse(_one_final(direct).message()).code == "unavailable"
    deadline = time.time() + 60
    while time.time() < deadline and not (("slow_ar", "load") in h.calls[1:] and "slow_ar" in h.models
                                          and not h.models["s2pro"].service.recovering):
        time.sleep(0.05)
    assert h.calls.count(("slow_ar", "load")) == 2, h.calls  # loaded at start, reloaded by s2pro
    after = _wait(h.request("s2pro", _tts_inputs("After the reload."), "after"))
    assert _one_final(after) is None and h.models["slow_ar"].service.health.ok


def test_codec_fails_on_chunk_k_stops_generation(harness_factory):
    h = harness_factory()
    from injection import fail_on_call

    dec = h.models["dac_decoder"].decoder
    dec.decode_many = fail_on_call(dec.decode_many, 2, "injected codec failure on chunk 2")
    req = _wait(h.request("s2pro", _tts_inputs(max_new_tokens=400, ignore_eos=np.array([True])), "codec"))
    err = _one_final(req)
    assert err is not None and "injected codec failure" in err.message()
    assert errors.parse(err.message()).code == "internal"
    slow = h.models["slow_ar"].service
    counts = _quiet(h, timeout=10)  # generation was cancelled well before 400 frames
    assert counts["free_slots"] == 4 and slow.table.counts["finished"] >= 1


def test_duplicate_request_ids(harness_factory):
    h = harness_factory()
    prompt = h.models["s2pro"].service.prompts.build("Direct to the engine.")
    inputs = {"input_ids": prompt.tokens.numpy().astype(np.int32), "input_codes": prompt.codes.numpy().astype(np.int32),
              "semantic_mask": prompt.semantic.numpy(), "max_new_tokens": np.array([30], np.int32),
              "ignore_eos": np.array([True]), "seed": np.array([3], np.int64), "chunk_frames": np.array([5], np.int32)}
    a = h.request("slow_ar", inputs, "same-id")
    b = _wait(h.request("slow_ar", inputs, "same-id"))
    err = _one_final(b)
    assert errors.parse(err.message()).code == "already_exists" and errors.parse(err.message()).param == "request_id"
    assert sum(c.shape[0] for c in _pull_all(h, a, "same-id")) == 30  # the first stream was not disturbed
    # through s2pro the same client id twice is fine: ids are internal
    x, y = (h.request("s2pro", _tts_inputs(seed=5), "dup") for _ in range(2))
    assert _one_final(_wait(x)) is None and _one_final(_wait(y)) is None
    _quiet(h)


@pytest.mark.parametrize("loop", ["engine", "sender"])
def test_a_dying_thread_fails_requests_and_health(harness_factory, loop):
    h = harness_factory()
    slow = h.models["slow_ar"].service
    req = h.request("s2pro", _tts_inputs(max_new_tokens=900, ignore_eos=np.array([True])), "t")
    while not req.sender.responses:
        time.sleep(0.01)

    def die(*a, **k):
        raise SystemExit(f"injected: {loop} thread killed")

    if loop == "engine":
        slow.engine.step = slow.engine.step_ahead = die  # what the engine loop calls each pass (one or the other)
    else:
        slow.outbox.get = die  # what the sender loop calls each pass
    err = _one_final(_wait(req))
    assert err is not None and errors.parse(err.message()).code == "unavailable"
    deadline = time.time() + 10  # the requests are failed first, then the model unloads itself
    while time.time() < deadline and ("slow_ar", "unload") not in h.calls:
        time.sleep(0.05)
    assert not slow.health.ok and "thread died" in slow.health.reason and ("slow_ar", "unload") in h.calls


def test_s2pro_supervisor_death_is_reported(harness_factory):
    h = harness_factory()
    s2 = h.models["s2pro"].service
    real = s2.table.live

    def die_once():  # what each supervisor pass reads first
        s2.table.live = real
        raise SystemExit("injected: supervisor killed")

    s2.table.live = die_once
    deadline = time.time() + 10
    while time.time() < deadline and s2.table.health.ok:
        time.sleep(0.05)
    assert not s2.table.health.ok
    # s2pro unloads itself: Triton's readiness says so (an orchestrator restarts the server); until the unload
    # completes, a request is refused with `unavailable`
    deadline = time.time() + 10
    while time.time() < deadline and ("s2pro", "unload") not in h.calls:
        time.sleep(0.05)
    assert ("s2pro", "unload") in h.calls and not h.pb.is_model_ready("s2pro")
    with pytest.raises(errors.S2Error) as ei:  # a request that reached the service before the unload
        s2.table.open("late", None)
    assert ei.value.code == "unavailable"


def test_finalize_with_streams_in_flight(harness_factory):
    h = harness_factory()
    reqs = [h.request("s2pro", _tts_inputs(f"Long {i}.", seed=i, max_new_tokens=500, ignore_eos=np.array([True])), f"f{i}")
            for i in range(3)]
    while not all(r.sender.responses for r in reqs):
        time.sleep(0.01)
    h.shutdown()
    for r in reqs:
        err = _one_final(_wait(r, 15))
        assert errors.parse(err.message()).code == "unavailable" and "shutting down" in err.message()


def test_deadline(harness_factory):
    h = harness_factory(request_timeout_s=1.5)
    slow = h.models["slow_ar"].service
    slow.engine.fault_hook = lambda phase, reqs: time.sleep(0.05)  # a slow device
    req = _wait(h.request("s2pro", _tts_inputs(max_new_tokens=1000, ignore_eos=np.array([True])), "slow"), 30)
    err = _one_final(req)
    assert errors.parse(err.message()).code == "deadline_exceeded" and "request_timeout_s=1.5" in err.message()
    slow.engine.fault_hook = None
    _quiet(h)


def test_deadline_is_per_text_segment(harness_factory):
    """A long text runs longer than request_timeout_s in all, each of its segments well within it: it completes. The
    same time spent in one segment still ends the request (test_deadline)."""
    h = harness_factory(request_timeout_s=3, chunk_frames=2)
    dec = h.models["dac_decoder"]
    decode = dec.execute
    calls = []
    dec.execute = lambda requests: (calls.append(1), time.sleep(0.3), decode(requests))[2]  # 3 chunks a segment
    text = "First sentence here. Second one follows. The third sentence. And a fourth one. A fifth to end."
    req = _wait(h.request("s2pro", _tts_inputs(text, max_new_tokens=6, ignore_eos=np.array([True]),
                                               chunk_length=np.array([24], np.int32)), "long"), 60)
    assert _one_final(req) is None
    stats = json.loads(req.sender.responses[-1].get("stats")[0])
    # five segments; the decodes alone slept longer than the timeout in all
    assert stats["frames"] == 6 * 5 and 0.3 * len(calls) > 3, (stats, len(calls))
    _quiet(h)


def test_cancel_while_waiting_on_a_slow_engine_frees_admission_at_once(harness_factory):
    """A client cancels while its worker waits seconds for slow_ar's next chunk: the supervisor ends the request
    within about a second (its final response, generation cancelled), so the one admission slot takes a new request
    long before that chunk would have come."""
    h = harness_factory(max_concurrent_requests=1, chunk_frames=16, first_chunk_frames=2)
    slow = h.models["slow_ar"].service
    slow.engine.fault_hook = lambda phase, reqs: time.sleep(0.3)  # 16 frames: ~5 s to the second chunk
    req = h.request("s2pro", _tts_inputs(max_new_tokens=200, ignore_eos=np.array([True])), "leaving")
    deadline = time.time() + 30
    while not req.sender.responses and time.time() < deadline:
        time.sleep(0.01)
    assert req.sender.responses, "no first chunk"
    req.cancelled = True
    _wait(req, 10)
    assert _one_final(req) is None
    assert len(req.sender.responses) == 2  # the first chunk, then the final response: not the next chunk's
    stats = json.loads(req.sender.responses[-1].get("stats")[0])
    assert stats["finish_reason"] == "cancelled"
    slow.engine.fault_hook = None
    nxt = _wait(h.request("s2pro", _tts_inputs("Right after.", max_new_tokens=6), "next"), 60)
    assert _one_final(nxt) is None  # admitted: the cancelled request no longer holds the slot
    _quiet(h)


def test_admission_full(harness_factory):
    h = harness_factory(max_concurrent_requests=1)
    a = h.request("s2pro", _tts_inputs(max_new_tokens=200, ignore_eos=np.array([True])), "a")
    b = _wait(h.request("s2pro", _tts_inputs(), "b"), 5)
    assert not a.sender.done.is_set()  # refused while a held the slot, not queued behind it
    err = _one_final(b)
    assert errors.parse(err.message()).code == "unavailable" and "busy" in err.message()
    assert _one_final(_wait(a)) is None


def _pull_all(h, first, rid, timeout=60):
    """A slow_ar stream read as s2pro reads it: the generation request's answer, then `control=next` until the
    answer with a finish reason. Returns the chunks' codes."""
    chunks, req = [], first
    deadline = time.time() + timeout
    while True:
        assert _one_final(_wait(req, max(1, deadline - time.time()))) is None
        assert len(req.sender.responses) == 1  # request-response: one answer per request
        resp = req.sender.responses[0]
        chunks.append(resp.get("codes"))
        if int(resp.get("finish_reason")[0]):
            return chunks
        req = h.request("slow_ar", {"request_id": np.array([rid.encode()], object),
                                    "control": np.array([b"next"], object)}, rid)


def _engine_inputs(h, text="Pulled a chunk at a time.", **kw):
    return slow_ar_inputs(h, text, **{"max_new_tokens": np.array([24], np.int32), **kw})


def test_slow_ar_streams_by_pulls(harness_factory):
    """slow_ar is request-response: a generation request answers the first chunk, each `next` the following one;
    reads that cannot be served say why; a request without an id gets the whole generation in one answer; a stream
    nobody reads is cancelled and dropped."""
    h = harness_factory(stream_idle_timeout_s=1, adaptive_chunks=False)  # chunks of exactly 2, then 4 frames
    slow = h.models["slow_ar"]
    chunks = _pull_all(h, h.request("slow_ar", _engine_inputs(h), "pulled"), "pulled")
    assert [c.shape for c in chunks][:2] == [(2, C), (4, C)] and sum(c.shape[0] for c in chunks) == 24
    whole = _wait(h.request("slow_ar", _engine_inputs(h)))  # no id: one answer with every frame
    assert _one_final(whole) is None and len(whole.sender.responses) == 1
    assert int(whole.sender.responses[0].get("finish_reason")[0]) == 2  # length
    np.testing.assert_array_equal(whole.sender.responses[0].get("codes"), np.concatenate(chunks))  # same seed
    nxt = {"request_id": np.array([b"pulled"], object), "control": np.array([b"next"], object)}
    err = _one_final(_wait(h.request("slow_ar", nxt, "pulled")))  # its final answer was read: the stream is gone
    assert errors.parse(err.message()).code == "not_found" and errors.parse(err.message()).param == "request_id"

    # a second read while one waits is refused; the waiting one is answered
    long = _engine_inputs(h, max_new_tokens=np.array([2000], np.int32))
    first = _wait(h.request("slow_ar", long, "twice"))
    r1 = h.request("slow_ar", {**nxt, "request_id": np.array([b"twice"], object)}, "twice")
    r2 = h.request("slow_ar", {**nxt, "request_id": np.array([b"twice"], object)}, "twice")
    _wait(r1), _wait(r2)
    codes = [errors.parse(e.message()).code for e in (_one_final(r1), _one_final(r2)) if e is not None]
    assert codes == ["invalid_argument"], codes  # exactly one of the two was refused
    assert _one_final(first) is None

    # nobody reads it: after stream_idle_timeout_s it is cancelled, its KV slot comes back, the stream is dropped
    deadline = time.time() + 30
    while time.time() < deadline and (len(slow.service.table) or len(slow.streams)):
        time.sleep(0.1)
        slow.streams.sweep()
    assert len(slow.service.table) == 0 and len(slow.streams) == 0
    assert slow.service.table.outcomes().get("cancelled", 0) >= 1
    _quiet(h)


def test_slow_ar_queue_limit(harness_factory):
    h = harness_factory(max_batch=1, max_queued_requests=1)
    long = dict(max_new_tokens=200, ignore_eos=np.array([True]))
    a = h.request("s2pro", _tts_inputs("One.", **long), "a")
    b = h.request("s2pro", _tts_inputs("Two.", **long), "b")  # waits for the one KV slot
    slow = h.models["slow_ar"].service
    while len(slow.table) < 2:
        time.sleep(0.01)
    c = _wait(h.request("s2pro", _tts_inputs("Three.", **long), "c"), 10)
    err = _one_final(c)
    assert errors.parse(err.message()).code == "unavailable"
    for r in (a, b):
        assert _one_final(_wait(r)) is None
    stats = [r.sender.responses[-1].get("stats")[0] for r in (a, b)]
    assert any(b'"queue_s": 0.0' not in s for s in stats)


@pytest.mark.parametrize("pull_groups", [True, False])
def test_killed_slow_ar_mid_stream(harness_factory, pull_groups):
    h = harness_factory(stall_timeout_s=1, pull_groups=pull_groups)
    req = h.request("s2pro", _tts_inputs(max_new_tokens=500, ignore_eos=np.array([True])), "victim")
    while not req.sender.responses:
        time.sleep(0.01)
    # killed while the victim's later chunks are awaited inside slow_ar's call (its own pull, or s2pro's group pull
    # with the victim's worker reading the relay's inbox), not while it decodes or sends a chunk between two calls
    pulls, deadline = h.models["slow_ar"].streams, time.time() + 30
    relay = h.models["s2pro"].downstream.relay
    while not (any(g.waiting is not None for g in list(pulls._groups.values())) and
               any(b.reading for b in list(relay._inboxes.values())) if pull_groups else
               any(st._waiting is not None for st in list(pulls._streams.values()))):
        assert time.time() < deadline, "the victim's chunks were never awaited in slow_ar's call"
        time.sleep(0.001)
    h.kill("slow_ar")
    err = _one_final(_wait(req, 30))
    assert errors.parse(err.message()).code == "unavailable"
    deadline = time.time() + 60
    while time.time() < deadline and ("slow_ar" not in h.models or "slow_ar" in h.dead
                                      or h.models["s2pro"].service.recovering):
        time.sleep(0.05)
    assert ("slow_ar", "unload") in h.calls and h.calls.count(("slow_ar", "load")) == 2
    after = _wait(h.request("s2pro", _tts_inputs("After recovery.", max_new_tokens=40,
                                                 ignore_eos=np.array([True])), "next"))
    assert _one_final(after) is None and sum(r.get("codes").shape[0] for r in after.sender.responses) == 40
    s2, deadline = h.models["s2pro"].service, time.time() + 10
    if pull_groups:
        # the victim's worker read the relay's inbox, which the failure ended: nobody was left in the dead call but
        # the relay's thread, and the request after recovery read its chunks through a new one
        assert s2.status()["workers_given_up"] == 0 and relay.fetches > 0
        return
    # the victim's worker, still in the dead process's call, is given up: another serves in its place, and s2pro's
    # unload does not wait for it
    while s2.status()["workers_given_up"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    assert s2.status()["workers_given_up"] == 1


def test_grpc_input_edges(harness_factory):
    h = harness_factory()
    err = _one_final(_wait(h.request("s2pro", _tts_inputs(seed=-5), "neg")))
    e = errors.parse(err.message())
    assert e.code == "invalid_argument" and e.param == "seed" and "seed=-5" in e.message
    # a codec chunk for a stream that was never started is an error, not a silent reset
    resp = _wait(h.request("dac_decoder", {"codes": np.zeros((1, 3, C), np.int32),
                                           "stream_id": np.array([[b"nope"]], dtype=object),
                                           "start": np.array([[False]]), "final": np.array([[False]])}))
    e = errors.parse(_one_final(resp).message())
    assert e.code == "not_found" and e.param == "stream_id"


def test_a_request_its_engine_lost_lets_its_worker_go(harness_factory):
    """slow_ar loses a request whose later chunks s2pro's worker reads from the relay (its stream gone, its
    generation ended, nothing more sent): s2pro's supervisor ends it (`unavailable`, the engine no longer knows it),
    and the worker waiting in its inbox is let go of then, not left waiting for good."""
    from s2tts.serving.threads import WorkerPool

    h = harness_factory(stall_timeout_s=1)
    s2 = h.models["s2pro"].service
    s2.pool = WorkerPool(1, "s2pro-worker")  # one worker: is it back?
    req = h.request("s2pro", _tts_inputs(max_new_tokens=500, ignore_eos=np.array([True])), "lost")
    relay, slow, deadline = h.models["s2pro"].downstream.relay, h.models["slow_ar"], time.time() + 30
    while not any(b.reading for b in list(relay._inboxes.values())):
        assert time.time() < deadline, "the request's worker never read its inbox"
        time.sleep(0.005)
    pulls = slow.streams
    with pulls._lock:  # the stream is lost: whatever the engine still sends for it goes nowhere
        (rid, stream), = pulls._streams.items()
        del pulls._streams[rid]
        with stream.group.lock:
            del stream.group.streams[rid]
    slow.service.cancel(rid)
    err = _one_final(_wait(req, 30))
    assert errors.parse(err.message()).code == "unavailable", err.message()
    while s2.pool._idle < 1 and time.time() < deadline + 30:
        time.sleep(0.02)
    assert s2.pool._idle == 1 and s2.status()["workers_given_up"] == 0  # the worker returned (none given up)
    # its inbox is kept a while for the engine's last item, which this engine will never send
    assert [b.abandoned_at is not None for b in relay._inboxes.values()] == [True]


class _Reader:
    """A one-shot reader as Triton's response sender of a request-response request."""

    def __init__(self, cancelled=False):
        self.got, self.cancelled = [], cancelled

    def send(self, response, final):
        assert final and not self.got, "a pull is answered exactly once"
        self.got.append(response)

    def is_cancelled(self):
        return self.cancelled


def test_pull_stream_order_waiting_read_and_abandonment():
    from s2tts.serving.pull import PullStreams

    hub = PullStreams("slow_ar", make_error=lambda e: ("error", e.code), idle_timeout_s=0.2)
    first = _Reader()
    s = hub.open("a", first)
    assert hub.open("a", dup := _Reader()) is None and dup.got == [("error", "already_exists")]
    s.send("c1", False)  # the waiting first read gets it at once
    s.send("c2", False)
    s.send("c3", False)  # queued in order
    assert first.got == ["c1"]
    r2, r3 = _Reader(), _Reader()
    hub.pull("a", r2), hub.pull("a", r3)
    assert (r2.got, r3.got) == (["c2"], ["c3"])
    r4, r5 = _Reader(), _Reader()
    hub.pull("a", r4)  # nothing queued: waits
    hub.pull("a", r5)  # a second read while one waits is refused
    assert r4.got == [] and r5.got == [("error", "invalid_argument")]
    s.send("last", True)  # to the waiting read: no sweep has run since
    assert r4.got == ["last"] and s.finished
    after = _Reader()
    hub.pull("a", after)
    assert after.got == [("error", "not_found")] and hub.sweep() == 0  # read to its end: dropped
    with pytest.raises(RuntimeError):
        s.send("late", False)
    gone = _Reader()
    hub.pull("a", gone)
    assert gone.got == [("error", "not_found")]

    # a stream nobody reads: cancelled for its producer after idle_timeout_s, dropped once its final is stale
    b = hub.open("b", _Reader())
    b.send("c1", False)
    assert not b.is_cancelled()
    time.sleep(0.3)
    assert b.is_cancelled()
    b.send("end", True)
    time.sleep(0.3)
    assert hub.sweep() == 0
    # a waiting reader that its client cancelled cancels the stream
    c = hub.open("c", _Reader(cancelled=True))
    assert c.is_cancelled()


def test_pull_group_answers_every_stream_of_a_reader_in_one_pull(monkeypatch):
    from s2tts.serving import pull
    from s2tts.serving.pull import PullStreams

    hub = PullStreams("slow_ar", make_error=lambda e: ("error", e.code), idle_timeout_s=0.3, group_wait_s=0.2,
                      nbytes=len)
    fa, fb = _Reader(), _Reader()
    a, b = hub.open("a", fa, group="g", tag=1), hub.open("b", fb, group="g", tag=2)
    other = hub.open("c", _Reader(), group="h", tag=1)  # another reader's group: never in g's answers
    a.send("a1", False)  # a stream's first response goes to the request that opened it
    a.send("a2", False), a.send("a3", False), other.send("c1", False), other.send("c2", False)
    g1 = _Reader()
    hub.pull_group("g", g1)  # responses queued in a pass still being sent: held to its end, then in order
    assert fa.got == ["a1"] and g1.got == []
    hub.flush()
    assert g1.got == [[(1, "a2", False), (1, "a3", False)]]
    a.send("a3b", False)
    hub.flush()  # a pass sent while no group read waits: the next is answered at once
    hub.pull_group("g", g1b := _Reader())
    assert g1b.got == [[(1, "a3b", False)]]
    g2, g3 = _Reader(), _Reader()
    hub.pull_group("g", g2)  # nothing queued: waits
    hub.pull_group("g", g3)  # a second group read while one waits is refused
    assert g2.got == [] and g3.got == [("error", "invalid_argument")]
    b.send("b1", False)  # to its opener
    b.send("b2", False), a.send("a4", True), b.send("b3", False)
    assert g2.got == []  # held until the producer has sent what it had
    hub.flush()
    assert fb.got == ["b1"] and len(g2.got) == 1
    got = g2.got[0]
    assert [r for t, r, _ in got if t == 1] == ["a4"] and [r for t, r, _ in got if t == 2] == ["b2", "b3"]
    assert [f for t, _, f in got if t == 1] == [True] and a.finished and not b.finished
    hub.flush()  # nothing new, no group read waiting: nothing sent
    assert len(g2.got) == 1
    # a group read that waited group_wait_s is answered with nothing, so that its reader can look again
    g4 = _Reader()
    hub.pull_group("g", g4)
    time.sleep(0.3)
    assert hub.sweep() == 2 and g4.got == [[]]  # a (read to its end) dropped; b and c left
    # while group reads come, a grouped stream is read: not abandoned however long since its own last pull
    for _ in range(4):
        time.sleep(0.1)
        hub.pull_group("g", r := _Reader())
        hub.close()  # (answers the waiting read with nothing)
        assert r.got == [[]]
    assert not b.is_cancelled() and other.is_cancelled()  # h's streams were never read after their first
    # an answer is bounded by the responses' bytes (the first always goes); the rest come with the next read at once
    monkeypatch.setattr(pull, "GROUP_MAX_BYTES", 5)
    b.send("x" * 4, False), b.send("y" * 4, False), b.send("z" * 4, True), hub.flush()
    hub.pull_group("g", r1 := _Reader()), hub.pull_group("g", r2 := _Reader())
    assert [i[1] for i in r1.got[0]] == ["x" * 4, "y" * 4] and [i[1] for i in r2.got[0]] == ["z" * 4]
    # an answer that cannot be delivered abandons the streams whose responses it held
    d = hub.open("d", _Reader(), group="k", tag=7)
    d.send("d1", False), d.send("d2", False), hub.flush()

    class Gone(_Reader):
        def send(self, response, final):
            raise RuntimeError("the reader went away")

    hub.pull_group("k", Gone())
    assert d.is_cancelled()
    # at shutdown a waiting group read is answered
    hub.pull_group("g", last := _Reader())
    hub.close()
    assert last.got == [[]]


def test_group_answers_end_at_a_pass_and_take_turns_under_the_byte_bound(monkeypatch):
    """A pass sent while no group read waits is due to the next read at once, but only until the producer's next
    pass begins: a read that comes in that pass waits for its flush and takes both passes, never half of one. When
    the byte bound cuts an answer, the next starts at another stream, so that no stream waits behind the others."""
    from s2tts.serving import pull
    from s2tts.serving.pull import PullStreams

    hub = PullStreams("slow_ar", make_error=lambda e: ("error", e.code), group_wait_s=5, nbytes=len)
    a, b = (hub.open(k, _Reader(), group="g", tag=t) for k, t in (("a", 1), ("b", 2)))
    a.send("a0", False), b.send("b0", False)  # (the first responses, to their openers)
    a.send("a1", False), b.send("b1", False), hub.flush()  # a pass sent, nobody reading
    a.send("a2", False)  # the next pass begins
    hub.pull_group("g", r := _Reader())
    assert r.got == []  # held to that pass's end
    b.send("b2", False), hub.flush()
    assert sorted(i[1] for i in r.got[0]) == ["a1", "a2", "b1", "b2"]
    monkeypatch.setattr(pull, "GROUP_MAX_BYTES", 4)  # an answer holds one 4-byte response
    for k in range(3):
        a.send(f"a{k}xx", False), b.send(f"b{k}xx", False)
    hub.flush()
    firsts = []
    for _ in range(6):
        hub.pull_group("g", r := _Reader())
        (item,) = r.got[0]
        firsts.append(item[0])
    assert firsts.count(1) == firsts.count(2) == 3 and firsts[:2] in ([1, 2], [2, 1]), firsts


def test_a_group_read_of_a_group_swept_as_it_came_is_answered():
    """A group read that finds its group without streams (the first read after an idle spell) while the producer's
    thread sweeps groups with neither streams nor a read: the sweep cannot drop the group between the read's finding
    it and waiting on it, so the streams opened next in that group answer it (it waited on a dropped group, which
    nothing would ever answer)."""
    import threading

    from s2tts.serving import pull
    from s2tts.serving.pull import PullStreams

    hub = PullStreams("slow_ar", make_error=lambda e: ("error", e.code), group_wait_s=5)
    sweeps: list[threading.Thread] = []

    class SweptLock:  # a group's lock whose first taking lets a sweep run on another thread first
        def __init__(self):
            self.inner = threading.Lock()

        def __enter__(self):
            if not sweeps:
                sweeps.append(threading.Thread(target=hub.sweep))
                sweeps[0].start()
                sweeps[0].join(0.5)  # (blocked while the read holds the table's lock, as it must be)
            return self.inner.__enter__()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    class Group(pull.PullGroup):
        def __init__(self, key):
            super().__init__(key)
            self.lock = SweptLock()

    pull.PullGroup, real = Group, pull.PullGroup
    try:
        hub.pull_group("g", r := _Reader())
    finally:
        pull.PullGroup = real
    sweeps[0].join(5)
    assert not sweeps[0].is_alive()
    s = hub.open("a", _Reader(), group="g", tag=1)
    s.send("a0", False), s.send("a1", False)
    hub.flush()
    assert r.got == [[(1, "a1", False)]]


def test_a_failed_group_read_ends_every_request_of_its_engine_and_a_refused_one_none():
    """The relay's fetch failing: an answer it lost may have held chunks of any request of that engine, so all of
    them end with its error, the ones still busy with their first chunk too; a read refused because another of the
    group waits took nothing, and ends none; a thread left behind by `failed` hands out what its read got."""
    import queue as q
    import threading

    from s2tts.frontend.pull_relay import PullRelay

    calls: q.Queue = q.Queue()  # each fetch: (its thread, the queue its answer comes from)

    def fetch(engine, group):
        mine: q.Queue = q.Queue()
        calls.put((threading.current_thread(), mine))
        got = mine.get(timeout=10)
        if isinstance(got, Exception):
            raise got
        return got

    def answer(got):
        thread, mine = calls.get(timeout=10)
        mine.put(got)
        return thread

    relay = PullRelay(fetch)
    (k1, b1), (k2, b2) = relay.open("slow_ar"), relay.open("slow_ar")
    b1.reading = True  # one reads already, the other has yet to take its first chunk
    answer(errors.invalid("group g: a group read is already waiting; read one at a time", "control"))
    answer([(k1, ("c1", None, "", None))])
    assert b1.get() == ("c1", None, "", None)  # the refusal ended nobody
    answer(errors.unavailable("slow_ar stopped answering"))
    assert isinstance(b1.get(), errors.S2Error) and isinstance(b2.get(), errors.S2Error)
    # a thread left behind in a process that still answers: what its read gets reaches its requests
    k3, b3 = relay.open("slow_ar")
    old_thread, old = calls.get(timeout=10)  # its read waits
    relay.failed("slow_ar", errors.unavailable("slow_ar failed"))
    assert isinstance(b3.get(), errors.S2Error)
    k4, b4 = relay.open("slow_ar")  # a new reader, a new thread; the old read answers with k4's chunk
    new_thread, new = calls.get(timeout=10)
    assert new_thread is not old_thread
    old.put([(k4, ("c4", None, "end", None))])
    assert b4.get() == ("c4", None, "end", None)
    old_thread.join(5)
    assert not old_thread.is_alive()  # it left once it had handed them out
    relay.shutdown()
    new.put([])
    new_thread.join(5)


def test_pull_relay_hands_each_stream_its_own_items_in_order():
    """s2pro's relay over a real `PullStreams` as the fetch's far side, a producer on a thread: every stream's items
    arrive whole and in order in its own inbox, a pass's items of all streams in one group read."""
    import queue as q
    import threading

    from s2tts.frontend.pull_relay import PullRelay
    from s2tts.serving.pull import PullStreams

    hub = PullStreams("slow_ar", make_error=lambda e: e, idle_timeout_s=30)

    class Answer:
        def __init__(self):
            self.q = q.Queue()

        def send(self, response, final):
            self.q.put(response)

        def is_cancelled(self):
            return False

    def fetch(engine, group):
        ans = Answer()
        hub.pull_group(group, ans)
        got = ans.q.get(timeout=10)
        if isinstance(got, Exception):
            raise got
        return [(tag, item) for tag, item, _final in got]

    relay = PullRelay(fetch)
    N, ITEMS = 6, 12
    opened = [relay.open("slow_ar") for _ in range(N)]
    streams = [hub.open(f"r{i}", Answer(), group=relay.group, tag=key) for i, (key, _) in enumerate(opened)]

    def produce():  # as the engine's sender: a pass's item of every stream, then the flush
        for k in range(ITEMS):
            last = k == ITEMS - 1
            for i, s in enumerate(streams):
                s.send((np.full((1, 1), 100 * i + k), None, "end" if last else "", None), last)
            hub.flush()
            time.sleep(0.001)

    threads = [threading.Thread(target=produce)]
    for t in threads:
        t.start()
    got = []
    for i, (key, inbox) in enumerate(opened):
        items = []
        while not items or not items[-1][2]:
            items.append(inbox.get())
        got.append([int(it[0][0, 0]) for it in items])
        relay.close(key)
    for t in threads:
        t.join()
    # the first item of each stream went to the request that opened it (slow_ar's answer to the submit)
    assert got == [[100 * i + k for k in range(1, ITEMS)] for i in range(N)]
    assert 0 < relay.fetches <= ITEMS  # a pass's items in one read (a read that comes mid-pass waits for its end)
    # an engine that failed: whoever reads from it gets the error, and a later reader a thread of its own
    key, inbox = relay.open("slow_ar")
    relay.failed("slow_ar", errors.unavailable("slow_ar failed"))
    assert isinstance(inbox.get(), errors.S2Error)
    key2, inbox2 = relay.open("slow_ar")
    s = hub.open("late", Answer(), group=relay.group, tag=key2)
    s.send("first", False), s.send((np.zeros((1, 1)), None, "end", None), True)
    hub.flush()
    assert inbox2.get()[2] == "end"
    relay.shutdown()


def test_long_text_is_spoken_segment_after_segment_in_one_seamless_stream(harness_factory):
    """A text longer than chunk_length: each segment is its own slow_ar generation whose prompt holds the earlier
    segments with their codes; every chunk goes through one codec stream, so the streamed audio equals one whole
    decode of all the request's codes (no gap or click at the joins)."""
    from s2tts.codec.stream import StreamDecoder
    from s2tts.frontend.segment import batches

    h = harness_factory()
    slow = h.models["slow_ar"].service
    prompts = []
    real_submit = slow.submit
    slow.submit = lambda cid, resp, prompt, *a, **kw: (prompts.append(prompt), real_submit(cid, resp, prompt, *a, **kw))[1]
    text = ("First sentence of a longer text. The second sentence follows it. A third one ends the first part. "
            "Then the fourth sentence. And a fifth to close.")
    segments = batches(text, 48)
    assert len(segments) >= 3
    req = _wait(h.request("s2pro", _tts_inputs(text, seed=4, max_new_tokens=5, ignore_eos=np.array([True]),
                                               chunk_length=np.array([48], np.int32)), "long"))
    assert _one_final(req) is None
    chunks = [r for r in req.sender.responses if r.get("audio").size]
    codes = np.concatenate([r.get("codes") for r in chunks])
    stats = json.loads(req.sender.responses[-1].get("stats")[0])
    assert codes.shape[0] == 5 * len(segments) == stats["frames"] and stats["finish_reason"] == "length"

    # one generation per segment; segment k's prompt holds segments < k and the codes they produced
    assert len(prompts) == len(segments)
    made = 0
    for k, p in enumerate(prompts):
        assert int(p.semantic.sum()) == made
        if made:
            np.testing.assert_array_equal(p.codes[p.semantic].numpy(), codes[:made])
        made += 5

    # the stream is seamless: one whole decode of every code gives the same samples
    codec = h.models["dac_decoder"].decoder.codec
    whole = StreamDecoder(codec).decode_many([("all", "whole", codes, True, True)], now=0.0)["all"]
    streamed = np.concatenate([r.get("audio") for r in chunks])
    assert streamed.shape == whole.shape
    np.testing.assert_allclose(streamed, whole, atol=1e-5, rtol=0)
    _quiet(h)


def test_fast_ar_loads_its_weights_on_a_direct_request_and_a_failed_load_is_tried_again(tiny_ckpt, tmp_path):
    """fast_ar (slow_ar runs its own fast AR by default) holds no weights until a direct request comes. If loading
    them fails then, that request gets an error saying what failed, and the next request loads them
    and is answered."""
    import shutil

    from fake_triton import FakeTriton, render
    from s2tts.checkpoint_config import S2Config

    ck = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ck)
    h = FakeTriton(render(ck, tmp_path), models=["fast_ar"])
    try:
        model = h.models["fast_ar"]
        assert model.run is None  # no weights before a direct request
        s2 = S2Config.from_dir(ck)
        B = 2
        inputs = {"hidden": np.random.default_rng(0).standard_normal((B, s2.text.dim)).astype(np.float32),
                  "code0": np.array([3, 5], np.int32), "temperature": np.full(B, 0.7, np.float32),
                  "top_p": np.full(B, 0.9, np.float32), "top_k": np.full(B, 30, np.int32),
                  "seed": np.array([1, 2], np.int64), "step": np.zeros(B, np.int64)}
        shards = sorted(ck.glob("*.safetensors"))
        for f in shards:
            f.rename(f.with_name(f.name + ".away"))
        resp, _ = h.request("fast_ar", inputs).sender.q.get(timeout=60)
        assert resp.has_error() and "which is not in" in resp.error().message(), resp  # the missing shard named
        assert model.run is None
        for f in shards:
            f.with_name(f.name + ".away").rename(f)
        resp, _ = h.request("fast_ar", inputs).sender.q.get(timeout=60)
        assert not resp.has_error(), resp.error().message()
        codes = resp.get("codes")
        assert codes.shape == (B, s2.num_codebooks - 1) and codes.dtype == np.int32 and codes.min() >= 0
    finally:
        h.shutdown()
