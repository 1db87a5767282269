"""FP8 weights (`ar_weights=fp8`): what changes in the model, how close it stays, and a server that serves with it.
Its speed is measured on a GPU (perf/STATUS.md); the kernels' path is checked under the Triton interpreter
(tests/interpreted_kernels.py: check_fp8)."""

import numpy as np
import pytest
import torch

from s2tts.ar.loading import load_model
from s2tts.frontend.prompt_builder import PromptBuilder
from s2tts.ar.model import Fp8Linear

from servers import assert_together_as_alone


def _logits(model, prompt):
    x = model.embed(prompt.tokens[None], prompt.codes[None], prompt.semantic[None])
    with torch.inference_mode():
        return model.slow(x, torch.arange(len(prompt))[None])[1][0]


def test_fp8_weights_are_the_layer_matrices_only(tiny_ckpt):
    plain = load_model(tiny_ckpt, "cpu", "fp32")
    fp8 = load_model(tiny_ckpt, "cpu", "fp32", weights="fp8")
    for stack in (fp8.slow.stack, fp8.fast.stack):
        for layer in stack.layers:
            mats = [layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2]
            assert all(isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn for m in mats)
    # embeddings, norms and heads as loaded
    assert torch.equal(fp8.slow.head, plain.slow.head) and fp8.fast.output.weight.dtype == torch.float32
    assert torch.equal(fp8.fast.embeddings.weight, plain.fast.embeddings.weight)
    # each matrix within FP8's rounding of the original, a scale per output row
    w = plain.slow.layers[0].attention.wo.weight
    q = fp8.slow.layers[0].attention.wo
    deq = q.weight.float() * q.scale[:, None]
    assert q.scale.shape == (w.shape[0],) and float((deq - w).norm() / w.norm()) < 0.05
    assert float(deq.abs().amax(1).sub(w.abs().amax(1)).abs().max()) < 1e-6  # each row's largest value is exact
    prompt = PromptBuilder.from_dir(tiny_ckpt).build("How close is eight bits?")
    a, b = _logits(plain, prompt), _logits(fp8, prompt)
    err = float((a - b).norm() / a.norm())
    assert 0 < err < 0.1, err


def test_fp8_many_rows_take_the_widened_weight_where_cublas_has_no_fp8(tiny_ckpt):
    """With the kernels on, passes of more than `kernel_rows` rows (prompts) leave the row kernel: cuBLAS's FP8
    product on a GPU that has one, else the weight widened (here, on the CPU; the kernel is never reached, so no
    Triton is needed). batch_invariant raises `kernel_rows` so that every pass stays on the kernel, in one tiling
    (`wide_rows` None: no wide tiling above WIDE_ROWS rows)."""
    from s2tts.ar.model import use_invariant_linears

    torch.manual_seed(0)
    w = torch.randn(48, 32)
    lin = Fp8Linear(w)
    lin.kernel = True
    x = torch.randn(Fp8Linear.KERNEL_ROWS + 1, 32)
    ref = x @ (lin.weight.float() * lin.scale[:, None]).T
    assert float((lin(x) - ref).norm() / ref.norm()) < 1e-6
    model = load_model(tiny_ckpt, "cpu", "fp32", weights="fp8")
    mats = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert mats and all(m.kernel_rows == Fp8Linear.KERNEL_ROWS and m.wide_rows == Fp8Linear.WIDE_ROWS for m in mats)
    use_invariant_linears(model, 1000)  # batch_invariant: one tiling of the kernel for every pass
    assert all(m.kernel_rows == 1000 and m.wide_rows is None for m in mats)
    use_invariant_linears(model, 0)
    assert all(m.kernel_rows == Fp8Linear.KERNEL_ROWS and m.wide_rows == Fp8Linear.WIDE_ROWS for m in mats)


def test_fp8_weights_value_is_checked(tiny_ckpt):
    with pytest.raises(ValueError, match="'dtype' .* or 'fp8'"):
        load_model(tiny_ckpt, "cpu", "fp32", weights="fp4")


def test_server_serves_with_fp8_weights(fault_server):
    fp8_server = fault_server  # conftest.py: the fault tests' server, on FP8 weights
    solo = assert_together_as_alone(fp8_server, ["Eight bits, first.", "And a second request, a bit longer."],
                                    [5, 6], max_new_tokens=14)
    assert "ar_weights=fp8" in fp8_server.log_tail(100000)
    for r in solo:
        frames = r.codes.shape[1]  # [codebooks, frames]; a request may end before its limit
        assert r.codes.shape[0] == 10 and 1 <= frames <= 14 and r.audio.size == frames * 2048
        assert np.abs(r.audio).max() > 1e-4
