"""Triton, where it is installed, and what every kernel module asks of it: whether kernels can run, whether they
run in Triton's interpreter (the CPU tests), whether they may use inline PTX, and operands laid out for row kernels."""

from __future__ import annotations

import os

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
