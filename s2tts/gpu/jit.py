"""Triton, where it is installed, and what every kernel module asks of it: whether kernels can run, whether they
run in Triton's interpreter (the CPU tests), whether they may use inline PTX, operands laid out for row kernels, and
warm-ups whose launches only compile, queued side by side (`compile_only`), warm-up calls run side by side so that
their kernels' first compiles overlap (`compile_ahead`), and each kernel variant compiled once however many threads
launch it first (`one_compile_a_key`)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without the triton package
    triton = tl = None


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1: no inline PTX there)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def ptx(x: torch.Tensor) -> bool:
    """Whether a kernel on x's device compiles inline PTX: an NVIDIA GPU (not ROCm's), outside the interpreter."""
    return x.is_cuda and torch.version.hip is None and not interpreted()


def unit_rows(x2: torch.Tensor) -> torch.Tensor:
    """An operand of a row kernel with unit stride along its last dimension (a copy only if it has not; reshape may
    return a view that has not: a [1, T, C] transpose of [1, C, T] reshapes to [T, C] with strides (1, T))."""
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _OneCompileAKey:
    """`triton.compiler.compile` made to compile a kernel variant once when several threads launch it at the same
    time: Triton's JIT compiles on every thread that finds a variant missing from its in-memory cache, so warm-ups
    side by side compiled the kernels they share several times over (perf/STATUS.md, "A cold start"). A second
    thread waits for the first's compile, then reads its result from Triton's file cache; other variants compile
    side by side as before."""

    def __init__(self, compile_fn: Callable):
        self.compile_fn, self.locks, self.lock = compile_fn, {}, threading.Lock()

    @staticmethod
    def key(src, target, options) -> str | None:
        try:
            return f"{src.hash()}|{target!r}|{sorted((options or {}).items())!r}"
        except Exception:  # noqa: BLE001 - a source without a hash (IR text): compiled as Triton would
            return None

    def __call__(self, src, target=None, options=None, **kwargs):
        key = self.key(src, target, options)
        if key is None:
            return self.compile_fn(src, target=target, options=options, **kwargs)
        with self.lock:
            lock = self.locks.setdefault(key, threading.Lock())
        with lock:
            return self.compile_fn(src, target=target, options=options, **kwargs)


def one_compile_a_key() -> None:
    """Install `_OneCompileAKey` (once a process) where a kernel's first launch takes its compiler from
    (`triton.compiler.compile`); the interpreter compiles nothing."""
    if triton is None or interpreted():
        return
    import triton.compiler as compiler

    if not isinstance(compiler.compile, _OneCompileAKey):
        compiler.compile = _OneCompileAKey(compiler.compile)


one_compile_a_key()  # before any kernel of this package launches (each takes its compiler at its first launch)


COMPILE_THREADS = 8  # threads that run warm-up calls at once: Triton compiles a kernel mostly outside the GIL


def compile_only(calls: list[Callable[[], object]], threads: int = 2 * COMPILE_THREADS) -> None:
    """Run each of `calls` once, in this thread, with every Triton kernel launch turned into its compile alone (no
    kernel runs), the compiles queued to `threads` threads (Triton's `AsyncCompileMode`: each variant once) so that
    a call never waits for one; returns once every variant has compiled. What the calls compute is garbage, so only
    for calls whose results steer no host decision and reach nothing that checks their values (the codec's decode;
    not sampling). No other thread of the process may launch a Triton kernel meanwhile: the switch is Triton's
    `JITFunction.run`, process-wide. Without a GPU (or in the interpreter) nothing compiles: the calls are not run."""
    if triton is None or interpreted() or not calls or not torch.cuda.is_available():
        return
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="compile-only") as pool:
        with triton.AsyncCompileMode(pool):  # its end waits for every compile it queued
            JITFunction.run = compile_instead
            try:
                for fn in calls:
                    fn()
            finally:
                JITFunction.run = run


def compile_ahead(calls: list[tuple[int, Callable[[], object]]], budget: int, device: torch.device | None = None,
                  threads: int = COMPILE_THREADS) -> int:
    """Run each `(weight, fn)` of `calls` once, up to `threads` at a time and at most `budget` weight in flight (a
    call heavier than the budget runs alone), so that the first compiles of the Triton kernels they launch (seconds
    each, one after another on one thread) happen side by side; what they compute is thrown away. `device`: made
    current in each thread. A call that raises (out of memory, say) is left to the caller's own warm-up, which
    runs every shape again. -> the calls that raised."""
    cond, state = threading.Condition(), {"weight": 0, "failed": 0}

    def run(weight: int, fn: Callable[[], object]) -> None:
        with cond:
            cond.wait_for(lambda: state["weight"] == 0 or state["weight"] + weight <= budget)
            state["weight"] += weight
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            fn()
        except Exception:  # noqa: BLE001 - the caller's warm-up runs this shape again and reports what fails
            with cond:
                state["failed"] += 1
        finally:
            with cond:
                state["weight"] -= weight
                cond.notify_all()

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="compile-ahead") as pool:
        for f in [pool.submit(run, w, fn) for w, fn in calls]:
            f.result()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return state["failed"]
