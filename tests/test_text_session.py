"""Text sessions: text that arrives in pieces, spoken as it becomes speakable, in one audio stream. The
buffer's rules (`s2tts.frontend.session`) alone, then s2pro's real model.py on the fake Triton: the audio of a text
sent word by word equals the audio of the same segments sent as one text (seeded, fp32), the first audio leaves
before the text has ended, a cancel and an idle session end cleanly and free everything, bad session requests get
clear errors."""

import json
import time

import numpy as np
import pytest

from fake_triton import one_final, quiet, tts_inputs, wait_final
from s2tts import errors
from s2tts.frontend.session import SessionEnded, TextSession

TWO = "First sentence here. Second one follows."  # with chunk_length=24: these two segments, in a whole text too


def _b(s: str):
    return np.array([s.encode()], dtype=object)


def test_the_buffer_releases_sentences_flushes_and_the_rest_at_the_end():
    s = TextSession(chunk_length=60)
    assert s.take(0.01) == (None, False)
    for word in "Hello there, how are".split():
        s.push(word + " ")
    assert s.take(0.01) == (None, False)  # no sentence end yet
    s.push("you? I am")
    assert s.take(0.01) == ("Hello there, how are you?", False)  # a sentence end followed by a space
    assert s.take(0.01) == (None, False)
    s.push(" fine", "flush")  # speak what there is now
    assert s.take(0.01) == ("I am fine", False)
    s.push("x" * 50 + " " + "y" * 30)  # past chunk_length: cut at the space
    assert s.take(0.01) == ("x" * 50, False)
    s.push(" and the end.", "end")
    assert s.take(0.01) == ("y" * 30 + " and the end.", True)
    assert s.take(0.01) == (None, True)
    with pytest.raises(SessionEnded):
        s.push("more")


def _open(h, sid, client, text="", **kw):
    kw.setdefault("chunk_length", np.array([24], np.int32))
    return h.request("s2pro", tts_inputs(text, seed=5, max_new_tokens=6, ignore_eos=np.array([True]),
                                         session_id=_b(sid), text_event=_b("open"), **kw), client)


def _send(h, sid, event, text=""):
    r = wait_final(h.request("s2pro", {"text": _b(text), "session_id": _b(sid), "text_event": _b(event)},
                             f"{sid}-{event}"), 30)
    return one_final(r), r


def _codes(req) -> np.ndarray:
    return np.concatenate([r.get("codes") for r in req.sender.responses if not r.has_error()])


def _audio(req) -> np.ndarray:
    return np.concatenate([r.get("audio") for r in req.sender.responses if not r.has_error()])


def test_a_text_sent_in_pieces_sounds_as_the_whole_text(harness_factory):
    h = harness_factory()
    live = _open(h, "s1", "live")
    for piece in ["First ", "sentence ", "here. "]:
        err, _ = _send(h, "s1", "text", piece)
        assert err is None
    deadline = time.time() + 30  # the first sentence is speakable: its audio comes before the text has ended
    while not any(r.get("audio").size for r in live.sender.responses if not r.has_error()) and time.time() < deadline:
        time.sleep(0.01)
    assert not live.sender.done.is_set() and _audio(live).size > 0
    err, ack = _send(h, "s1", "text", "Second one ")
    assert err is None and json.loads(ack.sender.responses[-1].get("stats")[0])["pending_chars"] >= len("Second one ")
    assert _send(h, "s1", "end", "follows.")[0] is None
    assert one_final(wait_final(live, 60)) is None
    stats = json.loads(live.sender.responses[-1].get("stats")[0])
    assert stats["frames"] == 12 and stats["finish_reason"] == "length"  # two segments of 6 frames
    whole = wait_final(h.request("s2pro", tts_inputs(TWO, seed=5, max_new_tokens=6, ignore_eos=np.array([True]),
                                                     chunk_length=np.array([24], np.int32)), "whole"), 60)
    assert one_final(whole) is None
    # the same segments in the same context: the same codes; the same audio in one stream (the codec's float sums
    # differ in the last bits with where chunks end, which follows the measured pace: within a 16-bit step)
    np.testing.assert_array_equal(_codes(live), _codes(whole))
    np.testing.assert_allclose(_audio(live), _audio(whole), rtol=0, atol=1 / 32768)
    quiet(h)


def test_session_errors_and_endings(harness_factory):
    h = harness_factory(session_idle_timeout_s=0.5)
    err, _ = _send(h, "nobody", "text", "Hello.")  # no such session
    assert errors.parse(err.message()).code == "not_found"
    live = _open(h, "s2", "a")
    deadline = time.time() + 10
    while "s2" not in h.models["s2pro"].service.sessions and time.time() < deadline:
        time.sleep(0.01)
    twin = wait_final(_open(h, "s2", "b"), 10)  # the same session id twice
    assert errors.parse(one_final(twin).message()).code == "already_exists"
    bad = wait_final(h.request("s2pro", tts_inputs("Hi.", session_id=_b("s2"), text_event=_b("shout")), "c"), 10)
    assert errors.parse(one_final(bad).message()).param == "text_event"
    alone = wait_final(h.request("s2pro", tts_inputs("Hi.", text_event=_b("text")), "d"), 10)
    assert errors.parse(one_final(alone).message()).param == "text_event"
    # no text for session_idle_timeout_s: the session ends with what it had spoken (nothing here), cleanly
    assert one_final(wait_final(live, 30)) is None
    assert json.loads(live.sender.responses[-1].get("stats")[0])["finish_reason"] == "end"
    err, _ = _send(h, "s2", "text", "Too late.")
    assert errors.parse(err.message()).code == "not_found"
    # a client's cancel mid-session ends it at once and frees everything
    live = _open(h, "s3", "e", text="Speak this sentence now. ")
    deadline = time.time() + 30
    while not live.sender.responses and time.time() < deadline:
        time.sleep(0.01)
    live.cancelled = True
    assert one_final(wait_final(live, 30)) is None
    assert json.loads(live.sender.responses[-1].get("stats")[0])["finish_reason"] == "cancelled"
    # text waiting to be spoken is bounded by max_text_chars (each piece is checked against it too)
    live = _open(h, "s4", "f")
    limit = h.models["s2pro"].service.v["max_text_chars"]
    piece = "word " * (limit * 6 // 50)  # 60% of the limit
    deadline = time.time() + 10
    while _send(h, "s4", "text", piece)[0] is not None and time.time() < deadline:  # until the session is open
        time.sleep(0.01)
    err, _ = _send(h, "s4", "text", piece)
    assert errors.parse(err.message()).code == "resource_exhausted"
    live.cancelled = True
    assert one_final(wait_final(live, 30)) is None
    quiet(h)
    assert h.models["s2pro"].service.sessions == {}
