"""The Triton kernels (decode attention, fused norm / RoPE / cache write / SwiGLU, the codec's Snake / residual /
last convolution) on the CPU through Triton's interpreter: each op against plain PyTorch, and the whole engine and
the codec with kernels on against off."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_match_pytorch_under_interpreter(tiny_ckpt):
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("interpreted_kernels.py")
    p = subprocess.run([sys.executable, str(script), str(tiny_ckpt)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ops ok" in p.stdout and "codec ok" in p.stdout and "engine ok" in p.stdout and "fp8 ok" in p.stdout
