"""The path of a request between s2pro and slow_ar: the order of its calls, who names what, what a call may wait for.

Each test here guards against a defect this path can have: each fails on code that has it.
They run the repository's real model.py files in this process (`tests/fake_triton.py`), or the pieces directly.
"""

import threading
import time

import numpy as np

from s2tts import errors
from s2tts.serving.wire import FINISH_CODES
from s2tts.serving.lifecycle import RequestTable
from s2tts.serving.threads import WorkerPool

from fake_triton import Request, one_final, quiet, slow_ar_inputs, tts_inputs, wait_final


def _control(h, rid, what):
    return wait_final(h.request("slow_ar", {"request_id": np.array([rid.encode()], object),
                                            "control": np.array([what.encode()], object)}, rid))


def _pull_to_end(h, first, rid):
    """The chunks' codes and the finish reason of a slow_ar stream read as s2pro reads it."""
    chunks, req = [], first
    while True:
        assert one_final(wait_final(req)) is None
        resp = req.sender.responses[0]
        chunks.append(resp.get("codes"))
        reason = int(resp.get("finish_reason")[0])
        if reason:
            return chunks, reason
        req = h.request("slow_ar", {"request_id": np.array([rid.encode()], object),
                                    "control": np.array([b"next"], object)}, rid)


# ---- 1. a cancel that overtakes its request ------------------------------------------------------
def test_a_cancel_that_arrives_before_its_request_wins(harness_factory):
    """slow_ar gets `cancel` for an id before the generation request with that id (two calls, no order between
    them): the request, when it comes, ends at once, cancelled, and the engine never runs it. A cancel for an id that
    already ended leaves nothing behind: that id's next request runs."""
    h = harness_factory()
    slow = h.models["slow_ar"].service
    assert one_final(_control(h, "early", "cancel")) is None
    first = h.request("slow_ar", slow_ar_inputs(h), "early")
    chunks, reason = _pull_to_end(h, first, "early")
    assert reason == FINISH_CODES["cancelled"] and sum(c.shape[0] for c in chunks) == 0
    assert slow.table.counts["opened"] == 0 and slow.engine.counts()["live"] == 0  # never admitted
    # the tombstone is used up: the same id runs now, and a cancel after its end leaves none
    chunks, reason = _pull_to_end(h, h.request("slow_ar", slow_ar_inputs(h, max_new_tokens=np.array([6], np.int32)),
                                               "early"), "early")
    assert reason == FINISH_CODES["length"] and sum(c.shape[0] for c in chunks) == 6
    assert one_final(_control(h, "early", "cancel")) is None
    chunks, reason = _pull_to_end(h, h.request("slow_ar", slow_ar_inputs(h, max_new_tokens=np.array([6], np.int32)),
                                               "early"), "early")
    assert reason == FINISH_CODES["length"], "a late cancel for an ended id cancelled its next request"
    quiet(h)


def test_a_cancel_from_s2pro_that_overtakes_the_generation_stops_it(harness_factory):
    """The client cancels while s2pro's generation call is still on its way to slow_ar: s2pro's supervisor sends the
    cancel, which reaches slow_ar first. The generation then ends at once instead of running its 300 frames for a
    request that has already ended."""
    h = harness_factory()
    slow_model = h.models["slow_ar"]
    execute, arrived, go = slow_model.execute, threading.Event(), threading.Event()

    def late_generation(requests):  # generation requests reach slow_ar only once `go` is set; the rest at once
        if any(r._inputs.get("control") is None for r in requests):
            arrived.set()
            go.wait(30)
        return execute(requests)

    slow_model.execute = late_generation
    req = h.request("s2pro", tts_inputs(max_new_tokens=300, ignore_eos=np.array([True])), "leaves-early")
    assert arrived.wait(30)
    req.cancelled = True
    wait_final(req, 10)  # the supervisor ends it while the generation call waits
    assert one_final(req) is None
    deadline = time.time() + 10
    while not h.models["slow_ar"].service.tombstones and time.time() < deadline:
        time.sleep(0.02)  # the cancel reached slow_ar (before its generation)
    go.set()
    quiet(h)
    slow = h.models["slow_ar"].service
    assert slow.table.counts["opened"] == 0, "the generation ran after its cancel"


# ---- 2 and 7. nothing waits forever on a model that does not answer -------------------------------
def test_a_model_that_stops_answering_ends_its_requests_and_costs_no_worker(harness_factory):
    """slow_ar stops answering (its calls never return, the model still reports ready). s2pro's supervisor, whose
    liveness check then gets no answer either, still ends the silent request with `unavailable` and reloads slow_ar;
    the worker left waiting in the dead call is replaced, so with a pool of one worker the next request is served."""
    h = harness_factory(max_concurrent_requests=1, stall_timeout_s=1)
    s2 = h.models["s2pro"].service
    s2.pool = WorkerPool(1, "s2pro-worker")  # one worker: a worker lost for good would stop the service
    silent = h.models["slow_ar"]
    silent.execute = lambda requests: None  # takes every request, answers none
    a = h.request("s2pro", tts_inputs(max_new_tokens=20), "a")
    wait_final(a, 20)
    err = one_final(a)
    assert err is not None and errors.parse(err.message()).code == "unavailable", err
    deadline = time.time() + 30
    while (h.models.get("slow_ar") is silent or s2.recovering) and time.time() < deadline:
        time.sleep(0.05)
    assert h.models["slow_ar"] is not silent, "slow_ar was not reloaded"
    b = wait_final(h.request("s2pro", tts_inputs("Served after the reload.", max_new_tokens=6), "b"), 30)
    assert one_final(b) is None, b.sender.error.message()
    assert sum(r.get("audio").size for r in b.sender.responses) > 0


def test_a_request_that_waits_for_a_worker_too_long_is_told_so(harness_factory):
    """A request that no worker picks up within stall_timeout_s ends with `unavailable` (the reason in its
    message), not after its whole deadline in silence."""
    h = harness_factory(max_concurrent_requests=2, stall_timeout_s=1, request_timeout_s=600)
    s2 = h.models["s2pro"].service
    s2.pool = WorkerPool(1, "s2pro-worker")
    hold = threading.Event()
    s2.pool.submit(hold.wait, 60)  # the one worker is busy with something that does not end
    r = wait_final(h.request("s2pro", tts_inputs(), "waits"), 20)  # the stall, not the 600 s deadline, ended it
    err = one_final(r)
    assert err is not None and errors.parse(err.message()).code == "unavailable" and "worker" in err.message()
    hold.set()


def test_worker_pool_replaces_a_worker_given_up():
    pool = WorkerPool(1, "w")
    stuck, release, ran = threading.Event(), threading.Event(), threading.Event()
    pool.submit(lambda: (stuck.set(), release.wait(30)))
    assert stuck.wait(5)
    pool.submit(ran.set)
    assert not ran.wait(0.3) and pool.queued == 1  # one worker, busy
    worker = next(t for t in threading.enumerate() if t.name == "w-0")
    assert pool.give_up(worker) and not pool.give_up(worker)
    assert ran.wait(5) and pool.size == 2
    release.set()  # the given-up worker comes back and leaves: one worker again
    deadline = time.time() + 5
    while pool.size != 1 and time.time() < deadline:
        time.sleep(0.01)
    assert pool.size == 1 and pool.max_workers == 1
    pool.shutdown()


# ---- 3. a final response is built once; a response not sent counts nothing ------------------------
class _Responder:
    def __init__(self):
        self.sent, self.in_send, self.release = [], threading.Event(), threading.Event()
        self.block_next = False

    def send(self, response, final):
        if self.block_next and not final:
            self.in_send.set()
            self.release.wait(10)
        self.sent.append((response, final))

    def is_cancelled(self):
        return False


def test_a_final_response_is_built_once_and_never_waits_for_a_send():
    table = RequestTable("t", lambda e: ("error", e.code))
    r = _Responder()
    rec = table.open("c", r)
    built = []
    r.block_next = True
    sender = threading.Thread(target=rec.send, args=(lambda: built.append("chunk") or "chunk",))
    sender.start()
    assert r.in_send.wait(5)
    ended = []  # finish while the chunk is being sent: it must not wait for that send
    finisher = threading.Thread(target=lambda: ended.append(rec.finish(lambda: built.append("final") or "final", "ok")))
    finisher.start()
    finisher.join(10)
    assert ended == [True], "finish waited for a send in progress"
    assert not rec.finish(lambda: built.append("final again") or "again", "ok")
    assert not rec.send(lambda: built.append("late") or "late")
    r.release.set()
    sender.join(5)
    assert built == ["chunk", "final"]  # nothing built for what was not sent
    assert r.sent == [("chunk", False), ("final", True)]  # the final after the chunk that was being sent
    assert rec.dropped == 2 and len(table) == 0


def test_a_cancelled_request_builds_its_final_response_once(harness_factory):
    """The client cancels; s2pro's supervisor ends the request while its worker is between two steps, and the worker
    then sees the cancel too. Exactly one final response is built (its time to first audio and duration are observed
    once in the metrics)."""
    h = harness_factory(chunk_frames=16, first_chunk_frames=2)
    model = h.models["s2pro"]
    svc = model.service
    finals = []
    make_final = svc.make_final
    svc.make_final = lambda stats, seq: finals.append(seq) or make_final(stats, seq)
    req = Request(tts_inputs(max_new_tokens=200, ignore_eos=np.array([True])), "cancels")

    def is_cancelled():  # the worker sees the cancel only after the supervisor has ended the request
        if threading.current_thread().name.startswith("s2pro-worker"):
            req.sender.done.wait(10)
        return True

    req.sender.is_cancelled = is_cancelled
    model.execute([req])
    wait_final(req, 20)
    assert one_final(req) is None
    quiet(h)
    assert len(finals) == 1, finals


# ---- 4. internal names are the server's own ------------------------------------------------------
def test_no_client_id_names_a_stream_downstream(harness_factory):
    """s2pro names a request's slow_ar stream and codec stream itself, never after the client's id: a client whose id
    is another request's internal name (or slow_ar's) cannot collide with it. The client's id still names the
    request in every model's log lines (Triton's request id of each call)."""
    h = harness_factory()
    seen = []
    bls = h.bls

    def recording(model, inputs, request_id, decoupled):  # the inputs that key a model's state (Triton's request id
        # is only a label for log lines: the client's id, on purpose)
        seen.append((model, *(inputs[k].as_numpy().reshape(-1)[0] for k in ("request_id", "stream_id", "codec_stream")
                              if k in inputs)))
        return bls(model, inputs, request_id, decoupled)

    h.bls = recording
    rs = [h.request("s2pro", tts_inputs(f"Named {i}.", max_new_tokens=6), cid) for i, cid in enumerate(["slow_ar", "slow_ar/1"])]
    for r in rs:
        assert one_final(wait_final(r)) is None
    names = {n.decode() if isinstance(n, bytes) else n for _, *ns in seen for n in ns}
    assert names and not any(n.startswith("slow_ar") for n in names), names
    quiet(h)


def test_a_callers_codec_stream_never_meets_slow_ars_own(harness_factory):
    """With the codec in slow_ar's loop, a request that names no codec stream gets one of slow_ar's own; a caller's
    stream named exactly like it is another stream: both requests decode their own audio, side by side."""
    h = harness_factory(codec_in_engine="true", engine_in_s2pro="false")  # slow_ar as its own model
    slow = h.models["slow_ar"].service
    assert slow.codec is not None
    inputs = slow_ar_inputs(h, max_new_tokens=np.array([12], np.int32))
    a = h.request("slow_ar", inputs, "a")
    own = next(iter(slow._states.values())).codec.sid  # the decoder's name for a's stream
    b = h.request("slow_ar", {**inputs, "codec_stream": np.array([own.encode()], object)}, "b")
    for req, rid in ((a, "a"), (b, "b")):
        chunks, reason = _pull_to_end(h, req, rid)
        assert reason == FINISH_CODES["length"] and sum(c.shape[0] for c in chunks) == 12
    assert not any(k.startswith("error") for k in slow.table.outcomes()), slow.table.outcomes()
    quiet(h)


# ---- one default per request field ---------------------------------------------------------------
def test_slow_ar_takes_its_configured_chunk_sizes_by_default(harness_factory):
    """A slow_ar request that names no chunk sizes gets the ones slow_ar is configured with (the settings' defaults:
    first_chunk_frames, chunk_frames), not a default of its parser's own. (Chunks of those sizes exactly: without
    adaptive chunks, which under load grow the first chunk to cover the second's making.)"""
    h = harness_factory(first_chunk_frames=3, chunk_frames=5, adaptive_chunks=False)
    inputs = slow_ar_inputs(h, max_new_tokens=np.array([13], np.int32))
    del inputs["first_chunk_frames"], inputs["chunk_frames"]
    chunks, reason = _pull_to_end(h, h.request("slow_ar", inputs, "sized"), "sized")
    sizes = [c.shape[0] for c in chunks if c.shape[0]]
    assert reason == FINISH_CODES["length"] and sum(sizes) == 13
    assert sizes == [3, 5, 5], sizes
    quiet(h)
