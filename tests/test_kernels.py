"""The Triton kernels (decode attention, fused norm / RoPE / cache write / SwiGLU, the codec's Snake / residual /
last convolution) on the CPU through Triton's interpreter: each op against plain PyTorch, and the whole engine and
the codec with kernels on against off."""

import os

import pytest

from kernel_checks import BACKGROUND, ENV, GROUPS, Checks

pytest.importorskip("triton")


def test_kernels_match_pytorch_under_interpreter(request):
    started = request.config.stash.get(BACKGROUND, None)  # by conftest.py in this process
    if started is None and os.environ.get(ENV):  # by pytest-xdist's controller for its workers
        started = Checks(os.environ[ENV])
    checks = started or Checks.start()
    try:
        results = checks.wait()
    finally:
        if started is None:
            checks.stop()
    for rc, out, err in results:
        assert rc == 0, out[-3000:] + err[-3000:]
    printed = "".join(out for _, out, _ in results)
    assert all(f"{name} ok" in printed for group in GROUPS for name in group), printed
