"""How a start compiles the GPU's kernels (`gpu.jit`, `gpu.compile_workers`): each variant once however many threads
launch it, in worker processes, and warm-ups that only compile (none on a CPU)."""

from __future__ import annotations

import threading

import pytest


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


def _probe_source():
    """A real kernel variant (`ar.kernels._pdl_probe_kernel`, PDL off) for an H100/H200 target, and its options."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from s2tts.ar import kernels

    src = ASTSource(kernels._pdl_probe_kernel, {"X": "*fp32", "PDL": "constexpr"}, {(1,): False})
    return src, GPUTarget("cuda", 90, 32), {"num_warps": 1}


def test_a_worker_process_compiles_a_variant_into_the_cache_this_process_reads(tmp_path, monkeypatch):
    """`gpu.compile_workers`: a worker compiles a real kernel (for sm_90; Triton compiles without a GPU) into
    Triton's file cache, and this process's own compile of the same variant then compiles nothing: it finds the
    worker's there. A source no worker can reach by name, and a worker that has died, leave the compile here."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import compiler

    from s2tts.gpu.compile_workers import CompileWorkers

    staged = []  # a compile in this process that misses the cache adds its stages (ttir ... cubin)
    real_stages = CUDABackend.add_stages
    monkeypatch.setattr(CUDABackend, "add_stages", lambda self, *a, **k: staged.append(1) or real_stages(self, *a, **k))
    src, target, options = _probe_source()
    workers = CompileWorkers(1, ("s2tts.ar.kernels",))
    try:
        assert workers.compile(src, target, options)
        cubins = sorted(p.name for p in (tmp_path / "cache").rglob("*.cubin"))
        assert cubins == ["_pdl_probe_kernel.cubin"], cubins
        kernel = compiler.compile(src, target=target, options=options)
        assert kernel.asm["cubin"] and kernel.name == "_pdl_probe_kernel" and staged == []

        from s2tts.gpu import jit  # the guard every kernel's first launch compiles through hands it to the workers

        monkeypatch.setattr(jit, "_WORKERS", workers)
        assert jit._OneCompileAKey(compiler.compile)(src, target=target, options={"num_warps": 8}).name
        assert staged == [] and workers.compiled == 2
        monkeypatch.setattr(jit, "_WORKERS", None)

        class Elsewhere:  # not a module-level kernel: no worker can find it
            fn = object()
        assert not workers.compile(Elsewhere(), target, options)
        workers.procs[0].kill()
        workers.procs[0].wait()
        assert not workers.compile(src, target, {"num_warps": 2})  # its place is taken by this process
        assert not workers.compile(src, target, {"num_warps": 4})  # and stays so
        assert workers.compiled == 2
        compiler.compile(src, target=target, options={"num_warps": 2})  # not in the cache: compiled here
        assert staged == [1]
    finally:
        workers.close()
    for p in workers.procs:  # each ends once its input has
        assert p.wait(timeout=120) is not None
