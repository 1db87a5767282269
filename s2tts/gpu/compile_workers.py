"""Triton kernels compiled in worker processes, so that a start's compiles run on every core.

Threads compile side by side only where Triton's compiler lets go of the interpreter lock, so a start's many
compiles in one process share about one core for their Python part (perf/STATUS.md, "A cold start"). A worker
process compiles a kernel variant, and builds its launcher, into Triton's file cache (the folder the server's own
compiles use); the compile that asked for it, and its first launch, then find them there. Triton has no such pool
of its own (PyTorch's inductor has one for the kernels it generates, not for a package's `@triton.jit` functions),
hence this module.

`CompileWorkers.compile` asks a worker for one variant (a kernel a worker cannot reach by its module's name, or one
whose source differs there, compiles in this process as before). Run as a module, this is a worker: it reads
requests from its standard input and answers each on its standard output (its own prints go to standard error)."""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import shutil
import struct
import subprocess
import sys
import threading
from typing import BinaryIO

_LEN = struct.Struct("<Q")


def _write(f: BinaryIO, data: bytes) -> None:
    """One message (pickled bytes), its length first."""
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _send(f: BinaryIO, obj) -> None:
    _write(f, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(f: BinaryIO):
    """The next message, or EOFError when the other end has closed."""
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    data = f.read(_LEN.unpack(head)[0])
    return pickle.loads(data)


def python_executable() -> str:
    """The interpreter a worker runs on: this one, or, inside Triton's Python-backend stub (whose `sys.executable`
    is not a Python), the `python3` on PATH (the server puts its environment's first)."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python") and os.access(exe, os.X_OK):
        return exe
    return shutil.which("python3") or os.path.join(sys.base_prefix, "bin", "python3")


def request(src, target, options, env_vars) -> bytes | None:
    """One variant as a worker's request (pickled), or None when a worker could not compile it by name (a source
    that is not a module-level `@triton.jit` function, values that do not pickle)."""
    fn = getattr(src, "fn", None)
    module, name, key = getattr(fn, "module", None), getattr(fn, "__name__", None), getattr(fn, "cache_key", None)
    if not (module and name and key) or getattr(sys.modules.get(module), name, None) is not fn:
        return None
    try:
        return pickle.dumps((module, name, key, src.signature, src.constants, src.attrs, target, options, env_vars),
                            protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - unpicklable constants: compiled in this process
        return None


class CompileWorkers:
    """`n` worker processes; `compile` hands a variant to the next idle one. A worker that dies leaves its place to
    this process (its requests compile here). `modules`: imported by each worker as it starts (the kernel modules,
    so that their imports overlap the rest of the start)."""

    def __init__(self, n: int, modules: tuple[str, ...] = ()):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.procs = [subprocess.Popen([python_executable(), "-m", __name__, *modules], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env) for _ in range(n)]
        self.idle: queue.Queue = queue.Queue()
        for p in self.procs:
            self.idle.put(p)
        self.compiled = 0  # variants the workers compiled
        self.lock = threading.Lock()

    def compile(self, src, target, options, env_vars=None) -> bool:
        """Whether a worker compiled this variant into Triton's file cache (then the caller's own compile reads it
        there); False: compile it here."""
        req = request(src, target, options, env_vars)
        if req is None:
            return False
        p = self.idle.get()
        if p is None:  # a dead worker's place
            self.idle.put(None)
            return False
        try:
            _write(p.stdin, req)
            error = _recv(p.stdout)
        except (OSError, EOFError, pickle.UnpicklingError):
            p.kill()
            self.idle.put(None)
            return False
        self.idle.put(p)
        if error is None:
            with self.lock:
                self.compiled += 1
        return error is None

    def close(self) -> None:
        """End the workers without waiting for them (a compile still running in one is abandoned): each ends at the
        end of its input, reaped by a thread of its own, so that a start does not wait for their teardown."""
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        threading.Thread(target=self._reap, name="compile-workers-reap", daemon=True).start()

    def _reap(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()


def _compile(module, name, key, signature, constants, attrs, target, options, env_vars) -> None:
    import triton
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    if getattr(fn, "cache_key", None) != key:
        raise LookupError(f"{module}.{name} differs in this process")
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=options,
                            _env_vars=env_vars)
    try:  # its launcher too (a C module built with the C compiler, kept in the same cache): else the first launch
        # builds it, one after another at the graphs' capture. It needs the CUDA driver's library, not the GPU.
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - no driver library here: the first launch builds it
        pass


def serve(modules: list[str]) -> None:
    """A worker's loop: compile each request into Triton's file cache; answer None, or the error's text."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints (Triton's, the kernels') to standard error, away from the answers
    inp = os.fdopen(0, "rb")
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception:  # noqa: BLE001 - a request for it says why
            pass
    while True:
        try:
            req = _recv(inp)
        except EOFError:
            return
        try:
            _compile(*req)
            error = None
        except Exception as e:  # noqa: BLE001 - the asking process compiles it itself and reports what fails
            error = f"{type(e).__name__}: {e}"
        _send(out, error)


if __name__ == "__main__":
    serve(sys.argv[1:])
