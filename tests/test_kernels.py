"""The Triton kernels (decode attention, fused norm / RoPE / cache write / SwiGLU, the codec's Snake / residual /
last convolution) on the CPU through Triton's interpreter: each op against plain PyTorch, and the whole engine and
the codec with kernels on against off."""

import pytest

from kernel_checks import BACKGROUND, GROUPS, start_checks

pytest.importorskip("triton")


def test_kernels_match_pytorch_under_interpreter(tiny_ckpt, request):
    procs = request.config.stash.get(BACKGROUND, None) or start_checks(tiny_ckpt)
    outs = []
    for p in procs:
        p.wait(timeout=900)
        p.out.seek(0)
        p.err.seek(0)
        outs.append((p.out.read(), p.err.read()))
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    printed = "".join(out for out, _ in outs)
    assert all(f"{name} ok" in printed for group in GROUPS for name in group), printed

