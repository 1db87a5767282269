"""Triton, where it is installed, and what every kernel module asks of it: whether kernels can run, whether they
run in Triton's interpreter (the CPU tests), whether they may use inline PTX, operands laid out for row kernels,
warm-ups whose launches only compile, queued side by side (`compile_only`), those compiles in worker processes
(`compile_workers`), and each kernel variant compiled once however many threads launch it first
(`one_compile_a_key`)."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from .device import resolve_device

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
            workers = _WORKERS
            if workers is not None and target is not None:  # then the compile below reads the worker's from the cache
                workers.compile(src, target, options, kwargs.get("_env_vars"))
            return self.compile_fn(src, target=target, options=options, **kwargs)


_WORKERS = None  # the CompileWorkers of `compile_workers`, while one is open
COMPILE_THREADS = 16  # threads that queue `compile_only`'s compiles (a variant each), and the most worker processes
COMPILE_WORKERS = None  # `compile_workers`' processes: None, a core each (at most COMPILE_THREADS); 0: none


@contextlib.contextmanager
def compile_workers(device):
    """Within it, the kernels this process compiles for `device` (a setting's, `auto` too; on a GPU, elsewhere
    nothing changes) compile in COMPILE_WORKERS worker processes (`gpu.compile_workers`), so that a start's compiles
    use every core. Each worker imports the kernel modules (PyTorch with them) and lives until the end of the block.
    -> the `CompileWorkers`, or None."""
    global _WORKERS
    n = COMPILE_WORKERS
    if n is None:
        n = min(COMPILE_THREADS, max(1, len(os.sched_getaffinity(0))))
    if triton is None or interpreted() or resolve_device(device).type != "cuda" or _WORKERS is not None or n < 1:
        yield None
        return
    from .compile_workers import CompileWorkers

    workers = CompileWorkers(n, ("s2tts.ar.kernels", "s2tts.codec.kernels"))
    _WORKERS = workers
    try:
        yield workers
    finally:
        _WORKERS = None
        workers.close()


def one_compile_a_key() -> None:
    """Install `_OneCompileAKey` (once a process) where a kernel's first launch takes its compiler from
    (`triton.compiler.compile`); the interpreter compiles nothing."""
    if triton is None or interpreted():
        return
    import triton.compiler as compiler

    if not isinstance(compiler.compile, _OneCompileAKey):
        compiler.compile = _OneCompileAKey(compiler.compile)


one_compile_a_key()  # before any kernel of this package launches (each takes its compiler at its first launch)


_COMPILING_ONLY = threading.local()  # `on` in the thread running `compile_only`'s calls


def compiling_only() -> bool:
    """Whether this thread is running `compile_only`'s calls (its Triton launches compile, run nothing)."""
    return getattr(_COMPILING_ONLY, "on", False)


def compile_only(calls: list[Callable[[], object]], threads: int = COMPILE_THREADS) -> None:
    """Run each of `calls` once, in this thread, with every Triton kernel launch of this thread turned into its
    compile alone (no kernel runs), the compiles queued to `threads` threads (Triton's `AsyncCompileMode`: each
    variant once) so that a call never waits for one; returns once every variant has compiled. What the calls
    compute is garbage, so only for calls whose results steer no host decision and reach nothing that checks their
    values; a kernel whose output indexes others (`ar.kernels.choose`: sampling's draws) gives zeros meanwhile
    (`compiling_only`). Other threads launch as usual; one such window at a time. Without a GPU (or in the
    interpreter) nothing compiles: the calls are not run."""
    if triton is None or interpreted() or not calls or not torch.cuda.is_available():
        return
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def compile_here(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=warmup or compiling_only(), **kwargs)

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="compile-only") as pool:
        with triton.AsyncCompileMode(pool):  # its end waits for every compile it queued
            JITFunction.run, _COMPILING_ONLY.on = compile_here, True
            try:
                for fn in calls:
                    fn()
            finally:
                JITFunction.run, _COMPILING_ONLY.on = run, False
