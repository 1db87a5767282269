"""The Triton kernels (decode attention, fused norm / RoPE / cache write / SwiGLU, the codec's Snake / residual /
last convolution) on the CPU through Triton's interpreter: each op against plain PyTorch, and the whole engine and
the codec with kernels on against off."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


# The checks of tests/interpreted_kernels.py in two processes that run at once (the interpreter runs a kernel's
# programs one after another in Python, on one core): about the same work in each
GROUPS = (("ops", "codec", "fp8"), ("engine", "invariant"))


def test_kernels_match_pytorch_under_interpreter(tiny_ckpt):
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("interpreted_kernels.py")
    procs = [subprocess.Popen([sys.executable, str(script), str(tiny_ckpt), *group], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for group in GROUPS]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    printed = "".join(out for out, _ in outs)
    assert all(f"{name} ok" in printed for group in GROUPS for name in group), printed
