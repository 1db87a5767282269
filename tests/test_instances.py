"""Several s2pro instances in one server (`s2pro_instances`): one admission limit for all of them, held by the kernel
for each process (a process that dies frees its slots), and text sessions served whichever instance the text
reaches (relayed to the one that holds the session). The shared pieces alone (`s2tts.frontend.instances`, across
real processes), the settings' rule, then s2pro's real model.py as two instances on the fake Triton."""

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from fake_triton import one_final, quiet, tts_inputs, wait_final
from s2tts import errors, settings
from s2tts.errors import S2Error
from s2tts.frontend.instances import ReloadGate, SessionRelay, SharedLoad, SharedSlots, run_dir
from s2tts.repository import render_repository


def test_slots_and_loads_are_shared_between_processes_and_dropped_when_one_dies(tmp_path):
    path = tmp_path / "slots"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from s2tts.frontend.instances import SharedLoad, SharedSlots
        s = SharedSlots({str(path)!r}, 3)
        load = SharedLoad({str(tmp_path)!r}, 2)
        load.publish([2, 0])
        print(s.take(), s.take(), flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert sorted(map(int, child.stdout.readline().split())) == [0, 1]
        load = SharedLoad(tmp_path, 2)
        load.publish([0, 1])
        assert load.others() == [2, 0]  # the other process's requests on each engine, not this one's
        mine = SharedSlots(path, 3)
        a = mine.take()
        assert a == 2 and mine.take() is None  # the other process holds two of the three
        mine.give(a)
        assert mine.take() == 2  # given back: free again
        child.kill()  # the kernel drops a dead process's locks: its two slots are free; its loads no longer count
        child.wait(10)
        assert load.others() == [0, 0]
        again = SharedLoad(tmp_path, 2)  # its row is free for the next instance, which starts at zero
        assert again.row != load.row and load.others() == [0, 0]
        assert sorted([mine.take(), mine.take()]) == [0, 1] and mine.take() is None and mine.held() == 3
        mine.close()
    finally:
        child.kill()


def test_a_session_has_one_owner_and_text_reaches_it_from_anywhere(tmp_path):
    got = []

    def answer(sid, event, text):
        if sid == "ended":
            raise S2Error("invalid_argument", f"text session {sid!r}: it has ended", "session_id")
        got.append((sid, event, text))
        return {"session_id": sid, "pending_chars": len(text)}

    d = run_dir(str(tmp_path / "model"), base=str(tmp_path))
    assert d == run_dir(str(tmp_path / "model"), base=str(tmp_path))  # the same server and model: the same place
    owner, other = SessionRelay(d, answer), SessionRelay(d, lambda *a: pytest.fail("not the owner"))
    try:
        assert owner.claim("s1") and owner.claim("ended")
        assert not other.claim("s1")  # open in a live instance
        assert other.relay("s1", "text", "Hello there. ") == {"session_id": "s1", "pending_chars": 13}
        assert got == [("s1", "text", "Hello there. ")] and other.relayed == 1 and owner.served == 1
        with pytest.raises(S2Error) as e:  # the owner's error, as it raised it
            other.relay("ended", "text", "more")
        assert e.value.code == "invalid_argument" and e.value.param == "session_id"
        assert other.relay("nobody", "text", "x") is None  # open nowhere
        owner.release("s1")
        assert other.relay("s1", "text", "x") is None and other.claim("s1")  # ended: anyone may open it again
    finally:
        owner.close()
        other.close()
    third = SessionRelay(d, answer)
    try:  # the sessions of an instance that has gone are no one's
        assert third.relay("ended", "text", "x") is None and third.claim("ended")
    finally:
        third.close()


def test_instances_follow_the_engines_unless_set(tiny_ckpt, tmp_path):
    def resolve(**kw):
        return settings.resolve({"checkpoint": str(tiny_ckpt), **kw})

    assert resolve(device="cpu")["s2pro_instances"] == 1
    assert resolve(device="cpu,cpu")["s2pro_instances"] == 2  # one s2pro process per engine
    assert resolve(device="cpu,cpu", s2pro_instances="3")["s2pro_instances"] == 3
    assert resolve(device="cpu", engine_in_s2pro="true")["s2pro_instances"] == 1
    with pytest.raises(S2Error) as e:
        resolve(device="cpu", engine_in_s2pro="true", s2pro_instances="2")
    assert e.value.param == "s2pro_instances"
    repo = render_repository(tmp_path / "repo", {"checkpoint": str(tiny_ckpt), "device": "cpu,cpu"})
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in (repo / "s2pro" / "config.pbtxt").read_text()


def _b(s: str):
    return np.array([s.encode()], dtype=object)


def test_a_text_session_is_served_whichever_instance_its_text_reaches(harness_factory):
    """The session opens on instance 0 (its audio streams from there); its text goes to instance 1, which relays it:
    the same codes as the whole text sent at once."""
    h = harness_factory(s2pro_instances=2)
    first, second = (m.service for m in h.instances["s2pro"])
    live = h.request("s2pro", tts_inputs("", seed=5, max_new_tokens=6, ignore_eos=np.array([True]),
                                         chunk_length=np.array([24], np.int32), session_id=_b("x1"),
                                         text_event=_b("open")), "live", instance=0)
    assert "x1" in first.sessions

    def send(event, text, instance=1):
        r = wait_final(h.request("s2pro", {"text": _b(text), "session_id": _b("x1"), "text_event": _b(event)},
                                 f"x1-{event}", instance=instance), 30)
        return one_final(r), r

    twin = wait_final(h.request("s2pro", tts_inputs("", session_id=_b("x1"), text_event=_b("open")), "twin",
                                instance=1), 10)
    assert errors.parse(one_final(twin).message()).code == "already_exists"  # open in the other instance
    for piece in ["First ", "sentence ", "here. ", "Second one "]:
        err, ack = send("text", piece)
        assert err is None
    assert json.loads(ack.sender.responses[-1].get("stats")[0])["pending_chars"] >= len("Second one ")
    assert send("end", "follows.")[0] is None
    assert second.relay.relayed == 5 and first.relay.served == 5
    assert one_final(wait_final(live, 60)) is None
    assert json.loads(live.sender.responses[-1].get("stats")[0])["frames"] == 12
    whole = wait_final(h.request("s2pro", tts_inputs("First sentence here. Second one follows.", seed=5,
                                                     max_new_tokens=6, ignore_eos=np.array([True]),
                                                     chunk_length=np.array([24], np.int32)), "whole", instance=1), 60)
    assert one_final(whole) is None
    codes = [np.concatenate([r.get("codes") for r in q.sender.responses if not r.has_error()]) for q in (live, whole)]
    np.testing.assert_array_equal(*codes)
    err, _ = send("text", "Too late.")  # ended: open nowhere
    assert errors.parse(err.message()).code == "not_found"
    again = h.request("s2pro", tts_inputs("", session_id=_b("x1"), text_event=_b("open"), max_new_tokens=4,
                                          ignore_eos=np.array([True])), "again", instance=1)
    assert send("end", "Now here.", instance=0)[0] is None  # the other way round
    assert one_final(wait_final(again, 60)) is None and first.relay.relayed == 1
    quiet(h)
    deadline = time.time() + 10  # (a session leaves its table when its worker ends, after the final response)
    while (first.sessions or second.sessions or list((first.relay.dir / "sessions").iterdir())) \
            and time.time() < deadline:
        time.sleep(0.02)
    assert first.sessions == {} and second.sessions == {}
    assert not list((first.relay.dir / "sessions").iterdir())  # no session left claimed


def test_the_admission_limit_counts_every_instance(harness_factory):
    h = harness_factory(s2pro_instances=2, max_concurrent_requests=2)
    long = dict(max_new_tokens=1500, ignore_eos=np.array([True]))
    a = h.request("s2pro", tts_inputs("One long request.", **long), "a", instance=0)
    b = h.request("s2pro", tts_inputs("Another long one.", **long), "b", instance=0)
    c = wait_final(h.request("s2pro", tts_inputs("Refused here.", **long), "c", instance=1), 10)
    err = errors.parse(one_final(c).message())
    assert err.code == "unavailable" and "max_concurrent_requests" in err.message
    a.cancelled = True
    assert one_final(wait_final(a, 30)) is None
    d = h.request("s2pro", tts_inputs("Admitted now.", max_new_tokens=4), "d", instance=1)
    assert one_final(wait_final(d, 60)) is None
    b.cancelled = True
    assert one_final(wait_final(b, 30)) is None
    deadline = time.time() + 10
    while any(m.service.slots.held() for m in h.instances["s2pro"]) and time.time() < deadline:
        time.sleep(0.05)
    assert [m.service.slots.held() for m in h.instances["s2pro"]] == [0, 0]
    quiet(h)


def test_a_dead_model_is_reloaded_once_for_every_instance(harness_factory):
    """Both instances have a request on slow_ar when it dies: each ends its own with `unavailable`; one reloads it, the
    other finds it reloaded (a second reload would end what the fresh model serves)."""
    h = harness_factory(s2pro_instances=2, stall_timeout_s=1)
    long = dict(max_new_tokens=1500, ignore_eos=np.array([True]))
    reqs = [h.request("s2pro", tts_inputs("Long enough.", **long), f"r{k}", instance=k) for k in (0, 1)]
    deadline = time.time() + 30
    while not all(r.sender.responses for r in reqs):
        assert time.time() < deadline
        time.sleep(0.01)
    load = h.load

    def slow_load(name):  # a reload that takes a while (a real one takes seconds): both instances see the fault first
        time.sleep(1.0 if name == "slow_ar" else 0)
        load(name)

    h.load = slow_load
    h.pb.load_model = lambda model_name, config="", files=None: slow_load(model_name)
    h.kill("slow_ar")
    for r in reqs:
        assert errors.parse(one_final(wait_final(r, 30)).message()).code == "unavailable"
    services = [m.service for m in h.instances["s2pro"]]
    deadline = time.time() + 60
    while time.time() < deadline and ("slow_ar" not in h.models or "slow_ar" in h.dead
                                      or any(s.recovering for s in services)):
        time.sleep(0.05)
    assert h.calls.count(("slow_ar", "load")) == 2 and h.calls.count(("slow_ar", "unload")) == 1
    for k in (0, 1):
        assert one_final(wait_final(h.request("s2pro", tts_inputs("After.", max_new_tokens=4), f"n{k}",
                                              instance=k))) is None


def test_a_model_is_busy_only_while_an_instance_reloads_it(tmp_path):
    """Every request checks whether another instance is reloading each model: checks from many threads and two
    instances at once never see one another as a reload (a check that took the lock exclusively did, refusing requests
    as 'restarting' under load); during a reload every other instance sees it."""
    import threading

    d = run_dir(str(tmp_path / "model"), base=str(tmp_path))
    gates = [ReloadGate(d, within_s=10.0) for _ in range(2)]
    seen = []

    def check(g):
        seen.append(sum(g.busy("slow_ar") for _ in range(1500)))

    threads = [threading.Thread(target=check, args=(gates[k % 2],)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [0] * 6
    inside, release = threading.Event(), threading.Event()

    def reload():
        inside.set()
        assert release.wait(30)

    gated = threading.Event()
    t = threading.Thread(target=gates[0].run, args=("slow_ar", reload, time.time(), gated))
    t.start()
    assert inside.wait(10) and gated.is_set()  # the gate was seen before the reload began
    assert gates[1].busy("slow_ar") and not gates[1].busy("slow_ar_1")
    # a second instance that comes meanwhile says at once that the reload is seen by all, then waits for its end
    waiting = threading.Event()
    t2 = threading.Thread(target=gates[1].run, args=("slow_ar", lambda: pytest.fail("reloaded twice"),
                                                      time.time() - 60, waiting))
    t2.start()
    assert waiting.wait(10) and t2.is_alive()
    release.set()
    t.join(10)
    t2.join(10)
    assert not gates[1].busy("slow_ar")
    assert not gates[1].run("slow_ar", lambda: pytest.fail("reloaded twice"), time.time())  # just done: no second


def test_placements_in_two_instances_take_turns(tmp_path):
    """Two requests arriving together in two instances: the second placement waits for the first, then sees it (else
    both would read empty engines and pick the same one)."""
    import threading

    a, b = SharedLoad(tmp_path, 2), SharedLoad(tmp_path, 2)
    order, inside, go = [], threading.Event(), threading.Event()

    def first():
        with a.placing():
            inside.set()
            order.append("a placing")
            assert go.wait(10)
            a.publish([1, 0])

    def second():
        with b.placing():
            order.append(("b sees", b.others()))

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    u = threading.Thread(target=second)
    u.start()
    time.sleep(0.2)
    assert order == ["a placing"]  # b waits for a's placement to end
    go.set()
    t.join(10)
    u.join(10)
    assert order == ["a placing", ("b sees", [1, 0])]


def test_the_engine_follows_the_slowest_instance_pace(harness_factory):
    """Each s2pro process reports the pipeline's pace of its own streams: slow_ar keeps each reporter's and follows
    the slowest recent one (not whichever reported last); one gone quiet stops counting."""
    h = harness_factory()
    slow = h.models["slow_ar"].service
    slow.control("pace=0.2", "s2pro~aaa")
    slow.control("pace=0.5", "s2pro~bbb")
    slow.control("pace=0.3", "s2pro~aaa")
    assert slow.load.reported()[0] == 0.5 and slow.load.pace() >= 0.5
    slow.load.report_ttl_s = 0.05
    time.sleep(0.1)
    slow.control("pace=0.3", "s2pro~aaa")
    assert slow.load.reported()[0] == 0.3 and set(slow.load.reports) == {"s2pro~aaa"}
    s2 = h.models["s2pro"].service  # and s2pro reports under its own name
    s2._send_pace(0.25)
    assert slow.load.reports[s2.prefix][0] == 0.25
