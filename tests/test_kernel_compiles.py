"""`gpu.jit.compile_ahead`: warm-up calls run side by side within a weight budget, each once, a failing one counted
and left to the caller (the GPU's kernels' first compiles overlap this way; here plain functions stand for them)."""

from __future__ import annotations

import threading

from s2tts.gpu.jit import compile_ahead


def test_calls_run_once_side_by_side_within_the_budget():
    lock, state, ran = threading.Lock(), {"weight": 0, "most": 0}, []
    together = threading.Barrier(2, timeout=30)  # the two light calls pass it only if they run at once

    def call(name, weight, meet=False):
        def fn():
            with lock:
                state["weight"] += weight
                state["most"] = max(state["most"], state["weight"])
            try:
                if meet:
                    together.wait()
                ran.append(name)
            finally:
                with lock:
                    state["weight"] -= weight
        return weight, fn

    calls = [call("a", 3, meet=True), call("b", 3, meet=True), call("heavy", 50)] + [call(f"c{i}", 4) for i in range(8)]
    assert compile_ahead(calls, budget=10, threads=4) == 0
    assert sorted(ran) == sorted(["a", "b", "heavy"] + [f"c{i}" for i in range(8)])
    assert state["most"] == 50  # the heavy call ran alone; the light ones never passed the budget together
    assert state["weight"] == 0


def test_a_failing_call_is_counted_and_the_rest_run():
    ran = []

    def boom():
        raise MemoryError("out of memory")

    calls = [(1, boom), (1, lambda: ran.append(1)), (1, boom), (1, lambda: ran.append(2))]
    assert compile_ahead(calls, budget=2, threads=2) == 2
    assert sorted(ran) == [1, 2]


def test_light_calls_never_pass_the_budget_together():
    lock, state = threading.Lock(), {"weight": 0, "most": 0}

    def fn(w):
        def run():
            with lock:
                state["weight"] += w
                state["most"] = max(state["most"], state["weight"])
            threading.Event().wait(0.01)
            with lock:
                state["weight"] -= w
        return w, run

    assert compile_ahead([fn(3) for _ in range(12)], budget=7, threads=6) == 0
    assert 3 <= state["most"] <= 6


class _Source:
    """Stands for Triton's ASTSource: a kernel variant named by its hash."""

    def __init__(self, h):
        self.h = h

    def hash(self):
        return self.h


def test_one_compile_a_key_compiles_a_variant_once_at_a_time_and_others_beside_it():
    """Two threads launching one variant: the second compiles only after the first's compile ended (then Triton
    reads it from its file cache); another variant compiles beside the first."""
    from s2tts.gpu.jit import _OneCompileAKey

    events, hold, entered = [], threading.Event(), {k: threading.Event() for k in ("a1", "a2", "b")}
    lock = threading.Lock()

    def fake_compile(src, target=None, options=None, who=None):
        with lock:
            events.append(("enter", who))
        entered[who].set()
        if who == "a1":
            assert hold.wait(30)
        with lock:
            events.append(("exit", who))
        return (src.hash(), target, options["num_warps"])

    compile = _OneCompileAKey(fake_compile)
    out = {}

    def run(who, h):
        out[who] = compile(_Source(h), target="cuda:90", options={"num_warps": 4}, who=who)

    threads = {"a1": threading.Thread(target=run, args=("a1", "k"))}
    threads["a1"].start()
    assert entered["a1"].wait(30)
    threads["a2"] = threading.Thread(target=run, args=("a2", "k"))
    threads["a2"].start()
    threads["b"] = threading.Thread(target=run, args=("b", "other"))
    threads["b"].start()
    assert entered["b"].wait(30)  # another variant compiles while a1 holds its key
    assert not entered["a2"].is_set()
    hold.set()
    for t in threads.values():
        t.join(30)
    assert events.index(("enter", "a2")) > events.index(("exit", "a1"))
    assert out == {"a1": ("k", "cuda:90", 4), "a2": ("k", "cuda:90", 4), "b": ("other", "cuda:90", 4)}
    # the same source with other options is another variant: its own lock
    assert compile.key(_Source("k"), "cuda:90", {"num_warps": 8}) != compile.key(_Source("k"), "cuda:90", {"num_warps": 4})
    assert compile.key(object(), "cuda:90", {}) is None  # no hash: compiled as Triton would, unguarded


def test_compile_only_runs_nothing_where_nothing_compiles():
    """On the CPU (no Triton, or its interpreter) `compile_only` has no kernel to compile: the calls, which on a GPU
    run with their launches turned into compiles, are not run at all (their values would be garbage)."""
    from s2tts.gpu.jit import compile_only

    ran = []
    compile_only([lambda: ran.append(1)])
    assert ran == []
