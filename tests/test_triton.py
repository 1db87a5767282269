"""End to end against a real tritonserver process (tiny checkpoint, CPU)."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from s2tts.client import AudioChunk, Final, S2ProClient, TTSError, TTSInput, read_metrics
from servers import cancelled_counts, cancelled_since, infer_inputs, settled

ROOT = Path(__file__).resolve().parents[1]
FRAME = 2048


def synth(server, **kw):
    with S2ProClient(server.grpc_url) as c:
        return c.synthesize(TTSInput(**kw))


def test_stream_in_order_with_final_stats(triton_server):
    with S2ProClient(triton_server.grpc_url) as c:
        events = list(c.stream(TTSInput(text="Streaming works in order.", seed=11, max_new_tokens=30, first_chunk_frames=3, chunk_frames=5)))
    chunks = [e for e in events if isinstance(e, AudioChunk)]
    finals = [e for e in events if isinstance(e, Final)]
    assert len(finals) == 1 and events[-1] is finals[0]
    stats = finals[0].stats
    assert [c.sequence for c in chunks] == list(range(len(chunks)))
    assert chunks and all(c.audio.size > 0 and c.sample_rate == 44100 for c in chunks)
    # the first chunk is small: 3 frames, or the next chunk length (5) when the measured pace is slow enough that
    # playback from 3 frames would run dry (adaptive_chunks; CPU paces vary, tests/test_request.py pins the rule)
    assert chunks[0].codes.shape[0] in (3, 5) and chunks[0].audio.size == chunks[0].codes.shape[0] * FRAME
    # later chunks: 3 (the first size) or 5 (the cap), as fast as the engine's pace allows (adaptive_chunks)
    assert all(c.codes.shape[0] in (3, 5) for c in chunks[1:-1])
    total = sum(c.audio.size for c in chunks)
    assert stats["frames"] * FRAME == total and stats["finish_reason"] in ("end", "length")
    assert stats["audio_seconds"] == pytest.approx(total / 44100, abs=1e-3)
    assert 0 < stats["ttfa_s"] <= stats["total_s"]
    assert np.abs(np.concatenate([c.audio for c in chunks])).max() > 1e-4  # not silent
    step = read_metrics(triton_server.metrics_url).get('s2tts_engine_step_seconds{model="slow_ar"}')
    assert step is not None and 0 < step < 5  # the pace the chunks follow is measured (and reported)


def test_each_model_process_starts_once(triton_server):
    """tritonserver runs with its config auto-completion off (the model configs are complete): the Python backend
    then starts one process per model instance, not first another per model that imports its model.py (torch
    included) only to ask for a completed config (what made a tiny server's start ~11 s instead of ~4 s)."""
    log = triton_server.log_path.read_text(errors="replace")
    assert '"auto-complete-config":"false"' in log.replace(" ", ""), log[-3000:]
    for name in ("s2pro_0_0", "s2pro_0_1", "slow_ar_0_0", "fast_ar_0_0", "dac_encoder_0_0", "dac_decoder_0_0"):
        assert log.count(f"TRITONBACKEND_ModelInstanceInitialize: {name}") == 1, name  # s2pro: two instances


def test_stream_equals_offline_cli(triton_server, tiny_ckpt, tmp_path):
    kw = dict(text="The same seed gives the same audio.", seed=1234, max_new_tokens=24, temperature=0.9, top_p=0.9, top_k=20)
    res = synth(triton_server, **kw)
    out = tmp_path / "cli.wav"
    cmd = [sys.executable, "-m", "s2tts.cli", "--checkpoint", str(tiny_ckpt), "--text", kw["text"], "--out", str(out),
           "--seed", "1234", "--max-new-tokens", "24", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "20", "--device", "cpu", "--dtype", "fp32"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    offline, sr = sf.read(out, dtype="float32")
    assert sr == 44100
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["frames"] == res.stats["frames"] and len(res.chunks) >= 2
    assert offline.shape == res.audio.shape
    np.testing.assert_allclose(res.audio, offline, atol=2e-4, rtol=0)


def test_concurrent_streams_match_alone(triton_server):
    from servers import assert_together_as_alone

    texts = ["First voice.", "Second, longer sentence here.", "Third one.", "Fourth request, also fine."]
    alone = assert_together_as_alone(triton_server, texts, [5, 6, 7, 8])
    assert not np.array_equal(alone[0].codes[:, :3], alone[1].codes[:, :3])


def test_later_chunks_come_in_group_reads(triton_server):
    """s2pro reads the later chunks of its requests from slow_ar in group reads (`pull_groups`, the default):
    streams made side by side arrive whole and in order, and the reads happen."""
    from concurrent.futures import ThreadPoolExecutor

    from servers import pipeline_calls

    url = triton_server.metrics_url
    before = settled(lambda: read_metrics(url), every_s=0.5, tries=40)
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda i: synth(triton_server, text=f"Read side by side, number {i}.", seed=20 + i,
                                              max_new_tokens=24, ignore_eos=True, first_chunk_frames=2,
                                              chunk_frames=2), range(4)))
    assert all(r.stats["frames"] == 24 and sum(c.audio.size for c in r.chunks) == 24 * FRAME for r in results)
    assert all([c.sequence for c in r.chunks] == list(range(len(r.chunks))) for r in results)
    later = sum(len(r.chunks) - 1 for r in results)
    after = settled(lambda: read_metrics(url), every_s=0.5, tries=40)
    reads = pipeline_calls(after, "slow_ar_next_group")[0] - pipeline_calls(before, "slow_ar_next_group")[0]
    waits = pipeline_calls(after, "slow_ar_next_chunk")[0] - pipeline_calls(before, "slow_ar_next_chunk")[0]
    assert waits >= later and reads > 0, (reads, later)


def test_a_group_read_takes_a_whole_engine_pass(triton_server):
    """slow_ar's side of group reads, read as s2pro reads them: four streams of 1-frame chunks opened in one group
    each get a chunk every engine pass, and a group read answers whole passes (one that comes in the middle of a
    pass waits for its end), so while all four run every answer after the first holds a chunk of each; every
    stream's codes come whole and in order, each with one final item."""
    import tritonclient.grpc as g

    from s2tts.frontend.prompt_builder import PromptBuilder
    from s2tts.serving.wire import decode_group

    prompts, group, n = PromptBuilder.from_dir(triton_server.settings["checkpoint"]), "test-group-reads", 100
    frames, finals, answers = {}, {}, []
    with g.InferenceServerClient(triton_server.grpc_url) as cl:
        for key in range(1, 5):
            p = prompts.build(f"Stream {key} of one group.")
            r = cl.infer("slow_ar", infer_inputs({
                "request_id": np.array([f"group-read-{key}".encode()], object), "input_ids": p.tokens.numpy().astype(np.int32),
                "input_codes": p.codes.numpy().astype(np.int32), "semantic_mask": p.semantic.numpy(),
                "max_new_tokens": np.array([n], np.int32), "ignore_eos": np.array([True]), "seed": np.array([key], np.int64),
                "first_chunk_frames": np.array([1], np.int32), "chunk_frames": np.array([1], np.int32),
                "pull_group": np.array([group.encode()], object), "pull_key": np.array([key], np.int64)}),
                client_timeout=60)
            frames[key] = r.as_numpy("codes").shape[0]  # the first chunk answers the submit
        read = {"request_id": np.array([group.encode()], object), "control": np.array([b"next_group"], object)}
        while len(finals) < 4:
            r = cl.infer("slow_ar", infer_inputs(read), client_timeout=60)
            items = decode_group(r.as_numpy("items"), r.as_numpy("stats"), r.as_numpy("error_text"))
            answers.append(({key for key, *_ in items}, any(reason for *_, reason, _, _ in items)))
            for key, f, _samples, reason, _stats, err in items:
                assert err is None and key not in finals, (key, err)
                frames[key] += f
                if reason:
                    finals[key] = reason
    assert frames == {k: n for k in range(1, 5)} and set(finals.values()) == {"length"}
    # the first answer may hold a pass made before the last stream's first chunk; from the first final on,
    # streams end one after another
    full = answers[1:[ended for _, ended in answers].index(True)]
    assert len(full) >= 4 and all(keys == {1, 2, 3, 4} for keys, _ in full), answers


def test_live_streams_keep_flowing_while_a_burst_waits_for_slots(triton_server):
    """8 long streams on the 8 slots, then 40 more requests that wait for a slot. Each waiting request holds a
    thread of the Python backend's pool in s2pro (its call to slow_ar waits there), and s2pro's responses and its
    next calls need a thread of that pool too: with the backend's default 32 threads the live streams went silent
    until the waiting calls got their slots (9.5 s of a 17 s stream here); the launcher sizes the pool for every
    request s2pro admits (`s2tts.server.python_backend_threads`).

    Checked by order, not by time (a 2-core machine can pause a stream for seconds while 40 requests arrive):
    once slow_ar reports all 40 waiting (its slots are then the live streams'), every live stream must still get 10
    more chunks; only when all have them do they stop (cancelled), which frees the slots the burst waits for. With
    the pool too small no chunk reaches a client while the burst waits: the live streams' 1500 frames end in
    slow_ar, the burst gets the slots, and its answers come before those chunks."""
    from concurrent.futures import ThreadPoolExecutor

    from s2tts.server import python_backend_threads

    assert python_backend_threads({}) >= 64 + 32 and python_backend_threads({"max_concurrent_requests": "200"}) == 232
    # this server got that pool (tritonserver logs each backend's configuration): with two s2pro instances, each
    # with a pool of its own, 40 waiting calls do not fill the default 32 of either; the burst below shows what a
    # full pool does (it fails with a pool of 12 a process)
    log = triton_server.log_path.read_text(errors="replace").replace(" ", "")
    assert f'"thread-pool-size":"{python_backend_threads(triton_server.settings)}"' in log, log[:3000]
    first_chunks, queued, stop_together = threading.Barrier(9), threading.Event(), threading.Barrier(8)
    waiting_key = 's2tts_engine_requests_waiting{model="slow_ar"}'
    ended: list[float] = []  # when each burst request was answered

    def live(i):
        after, n = [], 0  # when the chunks that came after the whole burst was queued arrived; chunks
        with S2ProClient(triton_server.grpc_url) as c:
            for ev in c.stream(TTSInput(text=f"Long stream {i}.", seed=i, max_new_tokens=1500, ignore_eos=True,
                                        first_chunk_frames=2, chunk_frames=2), timeout=300):
                if isinstance(ev, Final):
                    stop_together.abort()  # ended before its 10 chunks: the others need not wait for it
                    break
                if not isinstance(ev, AudioChunk):
                    continue
                n += 1
                if n == 1:
                    first_chunks.wait(timeout=120)
                elif queued.is_set():
                    after.append(time.monotonic())
                    if len(after) == 10:
                        try:
                            stop_together.wait(timeout=300)
                        except threading.BrokenBarrierError:
                            pass
                        break  # cancels the request: its slot goes to the burst
        return after

    def waiting(i):
        with S2ProClient(triton_server.grpc_url) as c:
            res = c.synthesize(TTSInput(text=f"Waiting request {i}.", seed=100 + i, max_new_tokens=4, ignore_eos=True),
                               timeout=300)
            ended.append(time.monotonic())
            return res

    with ThreadPoolExecutor(48) as ex:
        lives = [ex.submit(live, i) for i in range(8)]
        first_chunks.wait(timeout=120)  # every live stream has started: the burst finds the slots taken
        burst = [ex.submit(waiting, i) for i in range(40)]
        deadline, seen = time.monotonic() + 120, None
        while time.monotonic() < deadline and not queued.is_set():
            seen = read_metrics(triton_server.metrics_url).get(waiting_key)
            if seen == 40:
                queued.set()
            time.sleep(0.05)
        queued.set()  # (on a failure too: the live streams then end by the checks below)
        streams, rest = [f.result() for f in lives], [f.result() for f in burst]
    assert seen == 40, f"slow_ar never had the whole burst waiting (last seen {seen})"
    assert all(r.stats["frames"] == 4 and r.audio.size == 4 * FRAME for r in rest)
    first_end = min(ended)
    for after in streams:
        assert len(after) == 10 and after[-1] < first_end, (
            f"a live stream got {sum(t < first_end for t in after)} of its {len(after)} chunks after the burst was "
            "queued before the first burst request ended: it went silent while the burst waited")


def test_cancel_mid_stream(triton_server):
    """A client's cancel ends the request in s2pro and in the engine (both count it cancelled, not finished)."""
    before = cancelled_counts(triton_server)
    with S2ProClient(triton_server.grpc_url) as c:
        got = list(c.stream(TTSInput(text="Cancel me part way through.", seed=3, max_new_tokens=400, temperature=0.0,
                                     first_chunk_frames=2, chunk_frames=2), cancel_after_chunks=2))
    assert len(got) == 2
    assert cancelled_since(triton_server, before) == (1, 1)
    res = synth(triton_server, text="A following request completes.", seed=4, max_new_tokens=10)
    assert res.stats["finish_reason"] in ("end", "length") and res.audio.size == res.stats["frames"] * FRAME



def test_a_client_killed_mid_stream_frees_its_request(triton_server):
    """A client process killed while it streams (its connection drops, nothing cancelled): s2pro sees the stream
    cancelled, ends the request and frees the engine's slot, long before its 400 frames."""
    from servers import assert_killed_client_is_cancelled

    assert_killed_client_is_cancelled(triton_server, "killed-client-7")


@pytest.fixture
def stop_stream_calls(monkeypatch) -> list[bool]:
    """Every `stop_stream` of a tritonclient gRPC client in this test, as its `cancel_requests` (the call goes on)."""
    import tritonclient.grpc as grpcclient

    calls: list[bool] = []
    stop = grpcclient.InferenceServerClient.stop_stream
    monkeypatch.setattr(grpcclient.InferenceServerClient, "stop_stream",
                        lambda self, cancel_requests=False: (calls.append(cancel_requests), stop(self, cancel_requests))[1])
    return calls


def test_close_with_cancel_cancels_only_a_request_in_flight(triton_server, stop_stream_calls):
    """`S2ProClient.close(cancel=True)` (perf/soak.py after every request, the tests' clients) sends a cancel only
    for a request still in flight. A cancel for a stream whose request had already ended races Triton 24.10's gRPC
    frontend and keeps s2pro from unloading: 30 such streams from a worker thread, then a stop, waited the stop's
    whole grace and never ran s2pro's `finalize`."""
    ended = S2ProClient(triton_server.grpc_url)
    events = list(ended.stream(TTSInput(text="hello there friend", seed=1, max_new_tokens=8, ignore_eos=True)))
    assert isinstance(events[-1], Final) and events[-1].stats["frames"] == 8
    ended.close(cancel=True)  # ended: nothing to cancel
    assert stop_stream_calls == [False]
    before = cancelled_counts(triton_server)
    live = S2ProClient(triton_server.grpc_url)
    stream = live.stream(TTSInput(text="hello there friend", seed=2, max_new_tokens=400, ignore_eos=True,
                                  first_chunk_frames=2, chunk_frames=2), request_id="closed-in-flight")
    assert isinstance(next(stream), AudioChunk)
    live.close(cancel=True)  # in flight: cancelled
    assert stop_stream_calls == [False, True]
    assert cancelled_since(triton_server, before) == (1, 1)


def test_leaving_a_stream_early_cancels_its_request(triton_server, stop_stream_calls):
    """A caller that leaves `S2ProClient.stream()`'s loop before the end (`break`) cancels the request: the server
    ends it, and closing the client does not wait for its 3000 frames (it did: a stop without a cancel waits for
    the stream's end). Leaving at the Final event sends no cancel (the request has ended: a cancel would race it)."""
    before = cancelled_counts(triton_server)
    with S2ProClient(triton_server.grpc_url) as c:
        for n, ev in enumerate(c.stream(TTSInput(text="Leave me early.", seed=5, max_new_tokens=3000, ignore_eos=True,
                                                 first_chunk_frames=2, chunk_frames=2), request_id="left-early")):
            assert isinstance(ev, AudioChunk)
            if n == 1:
                break
        assert stop_stream_calls == [True]  # the loop's end closed the stream with a cancel
        res = c.synthesize(TTSInput(text="The same client goes on.", seed=6, max_new_tokens=6, ignore_eos=True))
        assert res.stats["frames"] == 6 and res.audio.size == 6 * FRAME
        for ev in c.stream(TTSInput(text="Left at its end.", seed=7, max_new_tokens=4, ignore_eos=True)):
            if isinstance(ev, Final):
                break
        assert stop_stream_calls == [True]  # left at the Final: no cancel (the stream closes with the client)
    assert cancelled_since(triton_server, before) == (1, 1)  # the one left early, not the one left at its Final


BAD = [  # (inputs, the input the error names, words of its message)
    (dict(text=""), "text", "text is empty"),
    (dict(text="x" * 100001), "text", "over the limit of 100000"),
    (dict(text="hi", reference_text="x" * 100001, reference_codes=np.zeros((10, 4), np.int32)), "reference_text",
     "reference_text is 100001 characters, over the limit of 100000"),
    (dict(text="hi", temperature=5.0), "temperature", "temperature=5.0 is out of range"),
    (dict(text="hi", top_p=0.0), "top_p", "top_p=0.0 is out of range"),
    (dict(text="hi", max_new_tokens=0), "max_new_tokens", "max_new_tokens=0 is out of range"),
    (dict(text="hi", chunk_frames=0), "chunk_frames", "chunk_frames=0 is out of range"),
    (dict(text="hi", seed=-5), "seed", "seed=-5 is out of range"),
    (dict(text="hi", reference_audio=np.zeros(0, np.float32), reference_sample_rate=16000, reference_text="x"), "reference_audio", "reference_audio is empty"),
    (dict(text="hi", reference_audio=np.full(1000, np.nan, np.float32), reference_sample_rate=16000, reference_text="x"), "reference_audio", "NaN"),
    (dict(text="hi", reference_audio=np.zeros(16000 * 31, np.float32), reference_sample_rate=16000, reference_text="x"), "reference_audio", "over the limit of 30"),
    (dict(text="hi", reference_audio=np.zeros(16000, np.float32), reference_sample_rate=16000), "reference_text", "needs its transcript"),
    (dict(text="hi", reference_audio=np.zeros(16000, np.float32), reference_text="x"), "reference_sample_rate", "needs reference_sample_rate"),
    (dict(text="hi", reference_codes=np.zeros((3, 4), np.int32), reference_text="x"), "reference_codes", "reference_codes must have shape"),
    (dict(text="hi <|im_end|>"), "text", "special token"),
]


@pytest.mark.parametrize("kw,param,msg", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_gets_clear_error(triton_server, kw, param, msg):
    with S2ProClient(triton_server.grpc_url, check_inputs=False) as c:  # the server's own checks
        with pytest.raises(TTSError, match=msg.replace("|", r"\|").replace("[", r"\[")) as ei:
            c.synthesize(TTSInput(**kw))
    assert ei.value.code == "invalid_argument" and ei.value.param == param  # the class, read without the prose
    assert triton_server.is_ready()


def _fast_inputs(dim, **bad):
    arrays = {"hidden": np.zeros((1, dim), np.float32), "code0": np.array([5], np.int32),
              "temperature": np.array([0.7], np.float32), "top_p": np.array([0.9], np.float32),
              "top_k": np.array([30], np.int32), "seed": np.array([1], np.int64), "step": np.array([0], np.int64)}
    return infer_inputs({**arrays, **bad})


FAST_BAD = [  # (the inputs changed, the input the error names, words of its message)
    (dict(code0=np.array([10**9], np.int32)), "code0", "semantic codes in [0, "),
    (dict(code0=np.array([-3], np.int32)), "code0", "semantic codes in [0, "),
    (dict(hidden=np.zeros((1, 7), np.float32)), "hidden", "hidden must be [rows, "),
    (dict(hidden=np.zeros((0, 7), np.float32)), "hidden", "at least one row"),
    (dict(hidden=np.zeros((2, 0), np.float32)), "hidden", "hidden must be [rows, "),
    (dict(temperature=np.array([np.nan], np.float32)), "temperature", "finite"),
    (dict(top_p=np.array([2.0], np.float32)), "top_p", "top_p=2.0 is out of range"),
    (dict(top_k=np.array([-4], np.int32)), "top_k", "top_k=-4 is out of range"),
    (dict(seed=np.array([-1], np.int64)), "seed", "seed=-1 is out of range"),
    (dict(step=np.array([-7], np.int64)), "step", "step must be >= 0"),
    (dict(seed=np.array([1, 2], np.int64)), "seed", "one value a row (1), got 2"),
]


def test_direct_calls_to_the_inner_models_get_clear_errors(triton_server, tiny_ckpt):
    """Triton serves slow_ar and fast_ar to any client, not only to s2pro. A token id or a code outside its table
    would be a device-side assert on a GPU (an error here on the CPU), which ends the model's process and every
    stream in it: such inputs, and other malformed ones, are refused as invalid_argument naming the input, and the
    server serves on."""
    import queue

    import tritonclient.grpc as g

    from s2tts import errors
    from s2tts.checkpoint_config import S2Config

    s2 = S2Config.from_dir(tiny_ckpt)
    with g.InferenceServerClient(triton_server.grpc_url) as cl:
        ok = cl.infer("fast_ar", _fast_inputs(s2.text.dim)).as_numpy("codes")
        assert ok.shape == (1, s2.num_codebooks - 1) and ok.min() >= 0
        for bad, param, words in FAST_BAD:
            with pytest.raises(Exception) as ei:
                cl.infer("fast_ar", _fast_inputs(s2.text.dim, **bad))
            err = errors.parse(ei.value.message())
            assert (err.code, err.param) == ("invalid_argument", param) and words in err.message, (bad, err.wire())

        answers: queue.Queue = queue.Queue()
        cl.start_stream(callback=lambda result, error: answers.put(error))
        for ids in ([1, s2.text.vocab_size], [-1, 2]):
            cl.async_stream_infer("slow_ar", infer_inputs({"input_ids": np.array(ids, np.int32)}))
            err = errors.parse(answers.get(timeout=60).message())
            assert (err.code, err.param) == ("invalid_argument", "input_ids"), err.wire()
            assert f"token ids in [0, {s2.text.vocab_size})" in err.message
        cl.stop_stream()
    res = synth(triton_server, text="The server serves on.", seed=3, max_new_tokens=5, ignore_eos=True)
    assert res.stats["frames"] == 5 and res.audio.size == 5 * FRAME


def test_client_refuses_bad_seeds_and_text_before_sending(triton_server):
    for seed in (-5, 2**63, 2**64 + 3):
        with S2ProClient(triton_server.grpc_url) as c, pytest.raises(TTSError, match="seed=") as ei:
            c.synthesize(TTSInput(text="hi", seed=seed))
        assert ei.value.code == "invalid_argument" and ei.value.param == "seed"
    assert synth(triton_server, text="Top seed is fine.", seed=2**63 - 1, max_new_tokens=3).stats["seed"] == 2**63 - 1
    for param, kw in (("text", dict(text="\ud800 alone")),
                      ("reference_text", dict(text="hi", reference_text="\udfff", reference_codes=np.zeros((10, 2), np.int32)))):
        with S2ProClient(triton_server.grpc_url) as c, pytest.raises(TTSError, match="lone UTF-16 surrogate") as ei:
            c.synthesize(TTSInput(**kw))  # half of a UTF-16 pair: no character, no UTF-8 for the wire
        assert ei.value.code == "invalid_argument" and ei.value.param == param


def test_voice_clone_with_reference_audio_and_codes(triton_server, tiny_ckpt):
    t = np.arange(int(44100 * 1.5)) / 44100
    ref = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    a = synth(triton_server, text="Cloned voice.", reference_audio=ref, reference_sample_rate=44100,
              reference_text="A humming tone.", seed=9, max_new_tokens=12)
    assert a.stats["prompt_tokens"] > synth(triton_server, text="Cloned voice.", seed=9, max_new_tokens=2).stats["prompt_tokens"] + 30
    import tritonclient.grpc as g

    cl = g.InferenceServerClient(triton_server.grpc_url)
    w = g.InferInput("waveform", [ref.size], "FP32")
    w.set_data_from_numpy(ref)
    r = g.InferInput("sample_rate", [1], "INT32")
    r.set_data_from_numpy(np.array([44100], np.int32))
    codes = cl.infer("dac_encoder", [w, r]).as_numpy("codes")
    assert codes.shape == (10, int(np.ceil(ref.size / FRAME)))
    b = synth(triton_server, text="Cloned voice.", reference_codes=codes, reference_text="A humming tone.", seed=9, max_new_tokens=12)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_allclose(a.audio, b.audio, atol=2e-4, rtol=0)


def test_perf_analyzer_streaming(triton_server, tmp_path):
    from s2tts.perf_tools import perf_analyzer_env, perf_analyzer_path

    pa = perf_analyzer_path()
    assert pa, "perf_analyzer (from the tritonclient==2.51.0 wheel) not found: run .ci/run's install step"
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [{"text": ["Benchmark this sentence."], "max_new_tokens": [6], "seed": [1]}]}))
    cmd = [str(pa), "-m", "s2pro", "-i", "grpc", "-u", triton_server.grpc_url, "--streaming", "--input-data", str(data),
           "--concurrency-range", "1:2:1", "--measurement-mode", "count_windows", "--measurement-request-count", "3",
           "--max-trials", "3", "--stability-percentage", "999"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=perf_analyzer_env())
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Concurrency: 2" in p.stdout and "throughput" in p.stdout.lower()


def _histogram(m: dict, name: str, model: str) -> tuple[float, float]:
    """(count, sum) of a histogram on /metrics."""
    return m.get(f'{name}_count{{model="{model}"}}', 0.0), m.get(f'{name}_sum{{model="{model}"}}', 0.0)


def test_speech_metrics_move_with_requests(triton_server):
    """Triton's /metrics carries the speech metrics (tritonserver's own endpoint, scraped from the running server):
    time to first audio and duration histograms, audio seconds and frames, KV-cache use, prefix-cache hits and
    misses, codec batch sizes, finish reasons, s2pro's calls out of its process."""
    url = triton_server.metrics_url

    def settle(pred, timeout=10.0):  # the models report from their ticks
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = read_metrics(url)
            if pred(m):
                return m
            time.sleep(0.2)
        return read_metrics(url)

    before = settled(lambda: read_metrics(url), every_s=0.5, tries=40)
    t = np.arange(44100) / 44100
    ref = (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    import tritonclient.grpc as g

    with g.InferenceServerClient(triton_server.grpc_url) as cl:
        w, sr = g.InferInput("waveform", [ref.size], "FP32"), g.InferInput("sample_rate", [1], "INT32")
        w.set_data_from_numpy(ref)
        sr.set_data_from_numpy(np.array([44100], np.int32))
        codes = cl.infer("dac_encoder", [w, sr]).as_numpy("codes")
    with S2ProClient(triton_server.grpc_url) as c:  # one new voice twice: a prefix-cache miss, then a hit
        results = [c.synthesize(TTSInput(text="Metrics, please.", reference_codes=codes, reference_text="A tone.",
                                         seed=seed, max_new_tokens=10)) for seed in (1, 2)]
    frames = sum(r.stats["frames"] for r in results)
    audio_s = sum(r.audio.size for r in results) / 44100
    ttfa = "s2tts_time_to_first_audio_seconds"
    ok = 's2tts_requests_finished_total{model="s2pro",outcome="ok"}'
    # (the outcome is counted when a request's record closes, which may be a tick after its first-audio observation)
    m = settle(lambda m: _histogram(m, ttfa, "s2pro")[0] >= _histogram(before, ttfa, "s2pro")[0] + 2
               and m.get('s2tts_frames_total{model="s2pro"}', 0) >= before.get('s2tts_frames_total{model="s2pro"}', 0) + frames
               and m.get(ok, 0) >= before.get(ok, 0) + 2)
    n0, s0 = _histogram(before, ttfa, "s2pro")
    n1, s1 = _histogram(m, ttfa, "s2pro")
    assert n1 == n0 + 2 and s1 - s0 == pytest.approx(sum(r.stats["ttfa_s"] for r in results), abs=0.05)
    d0, d1 = _histogram(before, "s2tts_request_duration_seconds", "s2pro"), _histogram(m, "s2tts_request_duration_seconds", "s2pro")
    assert d1[0] == d0[0] + 2 and d1[1] - d0[1] >= s1 - s0
    assert m[f'{ttfa}_bucket{{model="s2pro",le="+Inf"}}'] == n1  # a real histogram: buckets up to +Inf
    assert m['s2tts_frames_total{model="s2pro"}'] - before.get('s2tts_frames_total{model="s2pro"}', 0) == frames
    assert m['s2tts_audio_seconds_total{model="s2pro"}'] - before.get('s2tts_audio_seconds_total{model="s2pro"}', 0) \
        == pytest.approx(audio_s, abs=0.01)
    hits, misses = ('s2tts_engine_prefix_cache_hits_total{model="slow_ar"}', 's2tts_engine_prefix_cache_misses_total{model="slow_ar"}')
    assert m.get(misses, 0) >= before.get(misses, 0) + 1 and m.get(hits, 0) >= before.get(hits, 0) + 1
    assert m['s2tts_engine_slots_total{model="slow_ar"}'] == 8  # max_batch
    assert m['s2tts_engine_kv_capacity_tokens{model="slow_ar"}'] == 8 * 2048 and 's2tts_engine_kv_tokens{model="slow_ar"}' in m
    assert m['s2tts_engine_kv_blocks_used{model="slow_ar"}'] >= 1  # the cached voice prefix holds its blocks
    assert m['s2tts_engine_preemptions_total{model="slow_ar"}'] == 0
    b0, b1 = _histogram(before, "s2tts_codec_batch_size", "dac_decoder"), _histogram(m, "s2tts_codec_batch_size", "dac_decoder")
    assert b1[0] > b0[0] and b1[1] - b0[1] >= b1[0] - b0[0]  # each codec call decoded at least one stream
    assert m[ok] >= before.get(ok, 0) + 2

    from servers import pipeline_calls as calls

    # each request: one call for its first chunk, more for the later ones, a response sent per chunk and a final one
    # (each observed after its call returned: the final sends may reach /metrics a tick after the TTFA above)
    chunks = sum(len(r.chunks) for r in results)
    least = {"slow_ar_first_chunk": 2, "slow_ar_next_chunk": 1, "send": chunks + 2}
    m = settle(lambda m: all(calls(m, c)[0] - calls(before, c)[0] >= n for c, n in least.items()))
    for call, n in least.items():
        (n0, s0), (n1, s1) = calls(before, call), calls(m, call)
        assert n1 - n0 >= n and s1 > s0, (call, n1 - n0, n)


def test_dialogue_streams_segment_after_segment_seamlessly(triton_server, tiny_ckpt, tmp_path):
    """A two-speaker dialogue over chunk_length: s2pro speaks it batch after batch (upstream's turn batching), each
    with the earlier ones in context, through one codec stream: the streamed audio is one whole decode of all
    its codes."""
    from s2tts.codec.loading import load_codec_from_dir
    from s2tts.codec.stream import StreamDecoder
    from s2tts.frontend.segment import batches

    text = "".join(f"<|speaker:{i % 2}|>Line {i} of the dialogue, spoken in turn. " for i in range(6))
    n = len(batches(text, 64))
    assert n >= 3
    res = synth(triton_server, text=text, seed=2, max_new_tokens=4, ignore_eos=True, chunk_length=64)
    assert res.stats["frames"] == 4 * n == res.codes.shape[1] and res.stats["finish_reason"] == "length"
    codec = load_codec_from_dir(tiny_ckpt, "cpu", "fp32")
    whole = StreamDecoder(codec).decode_many([("k", "s", res.codes.T.astype(np.int64), True, True)], now=0.0)["k"]
    assert res.audio.shape == whole.shape
    np.testing.assert_allclose(res.audio, whole, atol=1e-4, rtol=0)
    # the offline CLI speaks it the same way: the same segments, context and codes
    out = tmp_path / "dialogue.wav"
    cmd = [sys.executable, "-m", "s2tts.cli", "--checkpoint", str(tiny_ckpt), "--text", text, "--out", str(out), "--seed", "2",
           "--max-new-tokens", "4", "--ignore-eos", "--chunk-length", "64", "--device", "cpu", "--dtype", "fp32"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    offline, _ = sf.read(out, dtype="float32")
    np.testing.assert_allclose(res.audio, offline, atol=2e-4, rtol=0)
    with pytest.raises(TTSError, match="chunk_length"):
        synth(triton_server, text="Too small.", chunk_length=4)


def test_a_text_session_over_grpc(triton_server):
    """A text session through tritonclient: one request opens it and streams its audio, others send the text word by
    word (each answered at once): the same codes and audio as the same segments sent as one text (seeded). The
    server has two s2pro processes: the text that reaches the one not holding the session is relayed to it."""
    relayed = "s2tts_session_text_relayed_total{model=\"s2pro\"}"
    before = read_metrics(triton_server.metrics_url).get(relayed, 0)
    text = "First sentence here. Second one follows."  # two segments at chunk_length=24, whole or in pieces
    sid, out = f"grpc-session-{time.monotonic_ns()}", {}
    common = dict(seed=9, max_new_tokens=6, ignore_eos=True, chunk_length=24)

    def listen():
        with S2ProClient(triton_server.grpc_url) as c:
            out["live"] = c.synthesize(TTSInput(text="", session_id=sid, text_event="open", **common), timeout=120)

    t = threading.Thread(target=listen)
    t.start()
    words = text.split(" ")
    with S2ProClient(triton_server.grpc_url) as c:
        deadline = time.time() + 30
        while True:  # until the session is open
            try:
                ack = c.synthesize(TTSInput(text=words[0] + " ", session_id=sid, text_event="text"))
                break
            except TTSError as e:
                assert e.code == "not_found" and time.time() < deadline, e
                time.sleep(0.05)
        assert ack.audio.size == 0 and ack.stats["session_id"] == sid
        for _ in range(24):  # no text: answered as text is (Triton hands these to either process)
            assert c.synthesize(TTSInput(text="", session_id=sid, text_event="text")).stats["session_id"] == sid
        for i, w in enumerate(words[1:], 1):
            last = i == len(words) - 1
            c.synthesize(TTSInput(text=w if last else w + " ", session_id=sid, text_event="end" if last else "text"))
    t.join(120)
    with S2ProClient(triton_server.grpc_url) as c:
        whole = c.synthesize(TTSInput(text=text, **common))
    live = out["live"]
    assert live.stats["frames"] == 12 and live.audio.size == 12 * FRAME
    np.testing.assert_array_equal(live.codes, whole.codes)  # the same segments in the same context
    np.testing.assert_allclose(live.audio, whole.audio, rtol=0, atol=1 / 32768)  # chunk boundaries: last bits
    deadline = time.time() + 10  # (counted from s2pro's next tick)
    while read_metrics(triton_server.metrics_url).get(relayed, 0) == before and time.time() < deadline:
        time.sleep(0.2)
    assert read_metrics(triton_server.metrics_url).get(relayed, 0) > before
    # every chunk says where it is: its segment and text, its frames' place in the audio (contiguous)
    for res in (live, whole):
        where = [c.segment for c in res.chunks]
        assert [w["frame"] for w in where] == np.cumsum([0] + [w["frames"] for w in where[:-1]]).tolist()
        assert all(w["frames"] * FRAME == c.audio.size for w, c in zip(where, res.chunks))
        assert {w["segment"]: w["text"] for w in where} == {0: "First sentence here.", 1: "Second one follows."}
        assert [sum(w["frames"] for w in where if w["segment"] == k) for k in (0, 1)] == [6, 6]
