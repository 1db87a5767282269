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
    Triton is needed). batch_invariant raises `kernel_rows` so that every pass stays on the kernel."""
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
    assert mats and all(m.kernel_rows == Fp8Linear.KERNEL_ROWS and not m.invariant for m in mats)
    use_invariant_linears(model, 1000)  # batch_invariant: the kernel for every pass
    assert all(m.kernel_rows == 1000 and m.invariant for m in mats)
    use_invariant_linears(model, 0)
    assert all(m.kernel_rows == Fp8Linear.KERNEL_ROWS and not m.invariant for m in mats)


def test_fp8_passes_take_the_faster_form(tiny_ckpt, monkeypatch):
    """With the kernels on, a pass multiplies by the FP8 weight at one row (`gemv_small`) and from 3 to `FP8_ROWS`
    rows (`kernels.linear`), and otherwise, up to `KERNEL_ROWS`, by `dense`, the FP8 weight widened once to the
    layer's dtype (`gemv_small` at 2 rows, cuBLAS above): the same function either way. batch_invariant keeps one
    form (the kernel) and no copy; without the kernels there is no copy either."""
    from s2tts.ar import kernels
    from s2tts.ar.model import use_invariant_linears, use_triton_kernels

    calls = []

    def product(name):
        def run(x, w, *a, scale=None, **k):
            calls.append((name, x.shape[0], w.dtype))
            return x @ (w.float() * (scale[:, None] if scale is not None else 1)).T
        return run

    monkeypatch.setattr(kernels, "linear", product("linear"))
    monkeypatch.setattr(kernels, "gemv_small", product("small"))
    model = load_model(tiny_ckpt, "cpu", "fp32", weights="fp8")
    mats = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert all(m.dense is None for m in mats)  # on a CPU, no copy until the kernels are on
    use_triton_kernels(model)
    lin = model.slow.layers[0].attention.wo
    assert all(m.dense is not None and m.dense.dtype == torch.float32 for m in mats)
    want = lin.weight.float() * lin.scale[:, None]
    assert float((lin.dense - want).abs().max()) == 0.0 and "dense" not in "".join(model.state_dict())
    f8, dense = torch.float8_e4m3fn, torch.float32
    for rows, form in ((1, ("small", f8)), (2, ("small", dense)), (3, ("linear", f8)),
                       (Fp8Linear.FP8_ROWS, ("linear", f8)), (Fp8Linear.FP8_ROWS + 1, None),
                       (Fp8Linear.KERNEL_ROWS, None)):
        calls.clear()
        x = torch.randn(rows, lin.in_features)
        ref = x @ want.T
        assert float((lin(x) - ref).norm() / ref.norm()) < 1e-6, rows
        assert calls == ([(form[0], rows, form[1])] if form else []), rows  # none: cuBLAS (F.linear)
    w13 = model.slow.layers[0].feed_forward.w13  # the SwiGLU in gemv_small's last step in either form
    for rows, weight in ((1, f8), (2, dense)):
        calls.clear()
        x = torch.randn(rows, w13.in_features)
        w13.gated(x)
        assert calls == [("small", rows, weight)], rows
    use_invariant_linears(model, 1000)
    assert all(m.dense is None for m in mats)
    for rows in (1, 2, Fp8Linear.FP8_ROWS + 1):
        calls.clear()
        lin(torch.randn(rows, lin.in_features))
        assert calls == [("linear", rows, f8)]  # one form at every row count
    use_invariant_linears(model, 0)
    assert all(m.dense is not None for m in mats)
    use_triton_kernels(model, False)
    assert all(m.dense is None for m in mats)


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
