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
