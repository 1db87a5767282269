"""Triton, where it is installed, and what every kernel module asks of it: whether kernels can run, whether they
run in Triton's interpreter (the CPU tests), whether they may use inline PTX, operands laid out for row kernels, and
warm-up calls run side by side so that their kernels' first compiles overlap (`compile_ahead`)."""

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


COMPILE_THREADS = 8  # threads that run warm-up calls at once: Triton compiles a kernel mostly outside the GIL


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
