"""The codec's Triton kernels (`codec.model.use_triton_kernels`): the Snake activation with a causal
convolution's left context and the previous convolution's bias, a biased residual sum, the convolution to one
channel, the quantizer transformers' RoPE, and the decoder in channels-last layout (`conv1d_nwc`, each call tiled by
its shape; `res_unit_nwc`, a residual unit in one kernel). The engine's kernels (attention, norms, sampling,
products) are s2tts/ar/kernels.py's; both take Triton and its helpers from `s2tts.gpu.jit`.

Runs on CPU only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import functools

import torch

from ..gpu.jit import ptx, triton, unit_rows

if triton is not None:
    import triton.language as tl

    # The codec's elementwise kernels take lengths and strides that change with every chunk length, decoder stage
    # and dilation: left unspecialized, each compiles once per tile size rather than once per divisibility of every
    # length (what a server's first start spent most of its codec warm-up on; their loads are offset by the context
    # and by per-row strides, so the divisibility bought no wider accesses)
    _LENGTHS = ["C", "T", "CTX", "T_out", "stride_xb", "stride_xc", "stride_yb", "stride_yc", "stride_pr", "stride_or",
                "stride_ob"]

    def _unspecialized(fn):
        import inspect

        names = [n for n in inspect.signature(fn).parameters if n in _LENGTHS]
        return triton.jit(do_not_specialize=names)(fn)

    @_unspecialized
    def _snake_kernel(X, P, A, Bias, O, C, T, CTX, stride_xb, stride_xc, stride_pr, stride_or, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
        """Program (row b*C + c, tile of the output's CTX + T columns): columns before CTX copy the row's prefix,
        the rest are snake(x + bias[c]) with snake(v) = v + sin(a v)^2 / (a + 1e-9) of channel c's alpha, in
        float32. x needs unit stride along time only."""
        row = tl.program_id(0).to(tl.int64)
        c = row % C
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        a = tl.load(A + c).to(tl.float32)
        in_x = (cols >= CTX) & (cols < CTX + T)
        x = tl.load(X + (row // C) * stride_xb + c * stride_xc + cols - CTX, mask=in_x, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(Bias + c).to(tl.float32)
        y = _snake_f32(x, a, False)  # (the precise sine)
        pre = tl.load(P + row * stride_pr + cols, mask=cols < CTX, other=0.0).to(tl.float32)
        tl.store(O + row * stride_or + cols, tl.where(cols < CTX, pre, y).to(O.dtype.element_ty), mask=cols < CTX + T)

    @_unspecialized
    def _add_bias_kernel(X, Y, Bias, O, C, T, stride_xb, stride_xc, stride_yb, stride_yc, BLOCK: tl.constexpr):
        """Program (row b*C + c, tile of T): out = x + y + bias[c] (x and y with unit stride along time)."""
        row = tl.program_id(0).to(tl.int64)
        b, c = row // C, row % C
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = t < T
        x = tl.load(X + b * stride_xb + c * stride_xc + t, mask=m, other=0.0).to(tl.float32)
        y = tl.load(Y + b * stride_yb + c * stride_yc + t, mask=m, other=0.0).to(tl.float32)
        out = x + y + tl.load(Bias + c).to(tl.float32)
        tl.store(O + row * T + t, out.to(O.dtype.element_ty), mask=m)

    @_unspecialized
    def _conv_to_one_kernel(X, W, Bias, O, C, T_out, stride_xb, stride_xc, stride_ob, K: tl.constexpr,
                            DIL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
        """Program (row b, tile of outputs): out[t] = bias + sum over channels c and taps k of w[c, k] x[c, t + k DIL],
        in float32 (a convolution to one channel: nothing for tensor-core tiles to fill)."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T_out
        acc = tl.zeros([BLOCK_T], tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cmask = c < C
            for k in tl.static_range(K):
                w = tl.load(W + c * K + k, mask=cmask, other=0.0).to(tl.float32)
                x = tl.load(X + b * stride_xb + c[:, None] * stride_xc + (t + k * DIL)[None, :],
                            mask=cmask[:, None] & tmask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(x * w[:, None], axis=0)
        acc += tl.load(Bias).to(tl.float32)
        tl.store(O + b * stride_ob + t, acc, mask=tmask)

    @triton.jit
    def _rope_pairs_kernel(X, R, O, H, stride_xr, stride_xh, stride_rr, D2: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row = b*T + t, head): the pairs (2i, 2i+1) of x rotated by the row's (cos, sin) table, in float32."""
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        m = i < D2
        base = X + row * stride_xr + h * stride_xh
        x0 = tl.load(base + 2 * i, mask=m, other=0.0).to(tl.float32)
        x1 = tl.load(base + 2 * i + 1, mask=m, other=0.0).to(tl.float32)
        c = tl.load(R + row * stride_rr + 2 * i, mask=m, other=0.0)
        sn = tl.load(R + row * stride_rr + 2 * i + 1, mask=m, other=0.0)
        out = O + (row * H + h) * (2 * D2)
        tl.store(out + 2 * i, (x0 * c - x1 * sn).to(O.dtype.element_ty), mask=m)
        tl.store(out + 2 * i + 1, (x1 * c + x0 * sn).to(O.dtype.element_ty), mask=m)



def _tile(n: int) -> tuple[int, int]:
    block = min(1024, max(16, triton.next_power_of_2(n)))
    return block, 4 if block >= 512 else 1


def snake(x: torch.Tensor, alpha: torch.Tensor, prefix: torch.Tensor | None = None,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The codec's Snake activation of x [B, C, T] (plus `bias` [C] per channel, the bias of the convolution before
    it, when given; alpha [1, C, 1]) in one pass; with `prefix` [B, C, ctx] (a causal convolution's left context,
    already activated) the result is [B, C, ctx + T]: the prefix, then snake(x), written together so the
    convolution needs no concatenation."""
    B, C, T = x.shape
    x = unit_rows(x)
    ctx = 0 if prefix is None else prefix.shape[-1]
    out = torch.empty(B, C, ctx + T, dtype=x.dtype, device=x.device)
    p = x if prefix is None else prefix.contiguous()
    block, warps = _tile(ctx + T)
    _snake_kernel[(B * C, triton.cdiv(ctx + T, block))](x, p, alpha, alpha if bias is None else bias, out, C, T, ctx,
                                                        x.stride(0), x.stride(1), ctx, ctx + T,
                                                        HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps)
    return out


def add_bias(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + y + bias[c] for x, y [B, C, T] in one pass (a residual joined with a convolution run without its bias)."""
    B, C, T = x.shape
    x, y = unit_rows(x), unit_rows(y)
    out = torch.empty(B, C, T, dtype=y.dtype, device=y.device)
    block, warps = _tile(T)
    _add_bias_kernel[(B * C, triton.cdiv(T, block))](x, y, bias, out, C, T, x.stride(0), x.stride(1), y.stride(0),
                                                     y.stride(1), BLOCK=block, num_warps=warps)
    return out


def conv_to_one(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    """conv1d of x [B, C, T] (already padded) with weight [1, C, K] and bias [1], no padding -> float32 [B, 1, T_out]."""
    B, C, T = x.shape
    K = weight.shape[-1]
    T_out = T - (K - 1) * dilation
    x = x.contiguous()
    out = torch.empty(B, 1, T_out, dtype=torch.float32, device=x.device)
    block_t = min(512, max(16, triton.next_power_of_2(T_out)))
    _conv_to_one_kernel[(B, triton.cdiv(T_out, block_t))](x, weight.contiguous(), bias, out, C, T_out, x.stride(0),
                                                          x.stride(1), out.stride(0), K=K, DIL=dilation, BLOCK_C=16,
                                                          BLOCK_T=block_t, num_warps=4)
    return out



# ---- the codec's decoder in channels-last layout -----------------------------------------------------------------
# cuDNN runs the decoder's fp16 convolutions on channels-last kernels and transposes every channels-first input and
# output around them, a large share of a call's kernel time. A convolution over [B, T, C] is an implicit GEMM whose
# rows are (batch row, time step) pairs: each tap's input tile is the same rows shifted by tap x dilation, every row C
# contiguous values (aligned loads, unlike a shifted window along time in [B, C, T], where a Triton kernel is slower
# than cuDNN). On the decoder's shapes it is faster than cuDNN's channels-first convolutions with their transposes.

CONV_NWC_CONFIG = {"block_t": 128, "block_co": 128, "block_ci": 32, "num_warps": 4, "num_stages": 3}
CONV_NWC_BY_SHAPE = True  # on a GPU, each call's tiling from its shape (`conv_nwc_tiling`); False: CONV_NWC_CONFIG's


def conv_nwc_tiling(rows: int, c_in: int, c_out: int, taps: int, sms: int, itemsize: int = 2) -> dict:
    """Overrides of CONV_NWC_CONFIG for a convolution of `rows` output rows (batch rows x steps) on `sms`
    multiprocessors, the fastest of sweeps of the decoder's calls at 1 and 64 streams x 8 frames on a 132-SM GPU:
    tiles of 64 x 64 or 32 x 32 where 128 x 128 tiles would not make a wave of programs. Else: convolutions of
    several taps into 256 output channels, or 192, in 128 x 256 tiles of eight warps taking 64 input channels a step
    (their input read once for 256 outputs, where 128 x 128 tiles read it twice); one-tap ones from 384 channels in
    64 x 128 tiles; the rest 128 x 128 (64 input channels a step from 384), narrower where 192 or 96 output
    channels would leave a 128-wide tile a third or a quarter empty. `itemsize`: bytes of a value; 128 x 256 tiles
    only for 2-byte ones (float32's three pipeline stages of them would need 288 KB of shared memory, more than an
    SM has: the fp32 fallback decoder's calls)."""
    def programs(t):
        return -(-rows // t) * -(-c_out // t)

    if programs(128) < sms:
        return {"block_t": 64, "block_co": 64} if programs(64) >= sms else {"block_t": 32, "block_co": 32}
    wide = itemsize <= 2 and c_in % 64 == 0 and (c_out % 256 == 0 or (taps > 2 and c_out % 256 == 192))
    if taps > 1 and wide:
        return {"block_co": 256, "block_ci": 64, "num_warps": 8}
    if taps == 1 and c_in >= 384 and c_in % 64 == 0:
        return {"block_t": 64, "block_ci": 64}
    if c_in >= 384 and c_in % 64 == 0:
        return {"block_ci": 64}
    if c_out % 128 == 64:
        if taps == 1 and c_in % 64 == 0 and itemsize <= 2:  # (four stages of float32 tiles: 192 KB)
            return {"block_co": 64, "block_ci": 64, "num_stages": 4}
        return {"block_t": 64, "block_co": 64} if taps <= 2 else {"block_co": 64}
    if c_out % 64 == 32 and taps == 1:
        return {"block_co": 32}
    return {}


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# How the channels-last convolutions multiply float32 values on a GPU (the fp32 decoder that redoes a chunk that
# overflowed fp16): "tf32x3" (three TF32 tensor-core products: float32's range and near its precision) or "ieee" (exact
# products on the CUDA cores: several times slower). The interpreter multiplies exactly.
FP32_CONV_PRECISION = "tf32x3"


def _conv_precision(x: torch.Tensor) -> str:
    """tl.dot's input_precision for a convolution over x's values (for 2-byte values it changes nothing)."""
    if x.dtype != torch.float32:
        return "tf32"
    return FP32_CONV_PRECISION if x.is_cuda else "ieee"

if triton is not None:

    @triton.jit(do_not_specialize=["M", "T_in", "T_out"])
    def _conv1d_nwc_kernel(X, W, Bias, Res, Alpha, O, S, M, T_in, T_out, C_in, C_pad, C_out, PERIOD, stride_sb,
                           KS: tl.constexpr, DIL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr,
                           BLOCK_CI: tl.constexpr, MASK_CI: tl.constexpr, HAS_BIAS: tl.constexpr,
                           HAS_RES: tl.constexpr, RAW: tl.constexpr, SNAKE: tl.constexpr, PREC: tl.constexpr,
                           FAST_SIN: tl.constexpr):
        """Program (tile of BLOCK_T output rows of the B x T_out (batch row, step) pairs, tile of BLOCK_CO output
        channels), x [B, T_in, C_in] contiguous, w [KS x C_in, C_out] (`conv_weight_nwc`): acc[b, t, co] = sum over
        taps k and channels ci of x[b, t + k DIL, ci] w[k C_in + ci, co] (+ bias[co % PERIOD]) (+ res[b, t, co]) in
        float32; RAW: acc to o [B, T_out, C_out] (contiguous); SNAKE: the Snake of alpha[co % PERIOD] of it to S at
        b stride_sb + t C_out + co, its sine the GPU's approximate one (FAST_SIN) or the precise one. The reduction
        steps through each tap's C_pad channels (C_in rounded up to BLOCK_CI, the rest masked when MASK_CI) BLOCK_CI
        at a time; unmasked along the channels (C_in a multiple of BLOCK_CI) the loads stay vectorised (a mask along
        them made the decoder's convolutions many times slower)."""
        pid_m, pid_co = tl.program_id(0), tl.program_id(1)
        m = (pid_m * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        co = pid_co * BLOCK_CO + tl.arange(0, BLOCK_CO)
        mmask = m < M
        b = m // T_out
        t = m - b * T_out
        rows = (b * T_in + t) * C_in  # the first tap's input row of each output row
        comask = co < C_out
        acc = _conv_nwc_sums(X, W, rows, mmask, co, comask, C_in, C_out, C_pad, KS, DIL, BLOCK_T, BLOCK_CO, BLOCK_CI,
                             MASK_CI, PREC)
        ch = co % PERIOD
        if HAS_BIAS:
            acc += tl.load(Bias + ch, mask=comask, other=0.0).to(tl.float32)[None, :]
        mask = mmask[:, None] & comask[None, :]
        out = m[:, None] * C_out + co[None, :]
        if HAS_RES:
            acc += tl.load(Res + out, mask=mask, other=0.0).to(tl.float32)
        if RAW:
            tl.store(O + out, acc.to(O.dtype.element_ty), mask=mask)
        if SNAKE:
            a = tl.load(Alpha + ch, mask=comask, other=1.0).to(tl.float32)[None, :]
            acc = _snake_f32(acc, a, FAST_SIN)
            tl.store(S + (b * stride_sb + t * C_out)[:, None] + co[None, :], acc.to(S.dtype.element_ty), mask=mask)

    @triton.jit
    def _conv_nwc_sums(X, W, rows, mmask, co, comask, C_in, C_out, C_pad, KS: tl.constexpr, DIL: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr, MASK_CI: tl.constexpr,
                       PREC: tl.constexpr):
        """The implicit GEMM of a channels-last convolution, float32 [BLOCK_T, BLOCK_CO]: sum over taps k and input
        channels ci of x[row + k DIL C_in + ci] w[(k C_in + ci) C_out + co] (`rows`: each output row's first tap's
        input offset), stepping through each tap's C_pad channels BLOCK_CI at a time (masked past C_in when
        MASK_CI; unmasked the loads stay vectorised)."""
        r = tl.arange(0, BLOCK_CI)
        acc = tl.zeros((BLOCK_T, BLOCK_CO), dtype=tl.float32)
        for r0 in tl.range(0, KS * C_pad, BLOCK_CI):
            k = r0 // C_pad
            ci = r0 - k * C_pad + r
            xp = X + (rows + k * DIL * C_in)[:, None] + ci[None, :]
            wp = W + (k * C_in + ci)[:, None] * C_out + co[None, :]
            if MASK_CI:
                cimask = ci < C_in
                x = tl.load(xp, mask=mmask[:, None] & cimask[None, :], other=0.0)
                w = tl.load(wp, mask=cimask[:, None] & comask[None, :], other=0.0)
            else:
                x = tl.load(xp, mask=mmask[:, None], other=0.0)
                w = tl.load(wp, mask=comask[None, :], other=0.0)
            acc += tl.dot(x, w, input_precision=PREC)
        return acc

    @triton.jit
    def _snake_f32(x, a, FAST_SIN: tl.constexpr):
        """Snake of float32 x with alpha a: x + sin(a x)^2 / (a + 1e-9); FAST_SIN: the GPU's approximate sine after
        reduction to [-pi, pi] (the precise one, in kernels of few resident warps, costs more than their
        products)."""
        if not FAST_SIN:
            s = tl.sin(a * x)
        else:
            z = a * x
            z = z - 6.283185307179586 * tl.floor(z * 0.15915494309189535 + 0.5)
            s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [z], dtype=tl.float32, is_pure=True,
                                          pack=1)
        return x + s * s * (1.0 / (a + 1e-9))

    @triton.jit(do_not_specialize=["M", "T_in", "T_out"])
    def _res_unit_nwc_kernel(H, W7, B7, A2, W1, B1, Res, A3, O, S, M, T_in, T_out, C, C_pad, stride_sb,
                             KS: tl.constexpr, DIL: tl.constexpr, CP: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_CI: tl.constexpr, MASK_CI: tl.constexpr, BLOCK_N: tl.constexpr, RAW: tl.constexpr,
                             PREC: tl.constexpr, FAST_SIN: tl.constexpr):
        """Program (tile of BLOCK_T output rows of the B x T_out (batch row, step) pairs), every channel (C of them,
        CP = C rounded up to a power of two): a residual unit of the decoder in one pass, h [B, T_in, C] the Snake of
        its input after the k7 convolution's left context, w7 [KS x C, C] and w1 [C, C] (`conv_weight_nwc`):
        u = snake_a2(conv7(h) + b7) stays on chip (float32 sums, rounded to h's dtype as the unfused path stores it),
        then y = res + conv1(u) + b1 in float32, BLOCK_N output channels at a time: to o (RAW) and its Snake of a3 to
        S at b stride_sb + t C + co. The padding channels (C..CP) hold zeros throughout. The first product steps
        through each tap's C_pad channels (C rounded up to BLOCK_CI, the rest masked when MASK_CI)."""
        pid = tl.program_id(0)
        m = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        mmask = m < M
        b = m // T_out
        t = m - b * T_out
        rows = (b * T_in + t) * C
        cc = tl.arange(0, CP)
        cmask = cc < C
        acc = _conv_nwc_sums(H, W7, rows, mmask, cc, cmask, C, C, C_pad, KS, DIL, BLOCK_T, CP, BLOCK_CI, MASK_CI, PREC)
        acc += tl.load(B7 + cc, mask=cmask, other=0.0).to(tl.float32)[None, :]
        a2 = tl.load(A2 + cc, mask=cmask, other=1.0).to(tl.float32)[None, :]
        u = _snake_f32(acc, a2, FAST_SIN).to(H.dtype.element_ty)
        for n0 in tl.static_range(0, CP, BLOCK_N):
            co = n0 + tl.arange(0, BLOCK_N)
            comask = co < C
            w1 = tl.load(W1 + cc[:, None] * C + co[None, :], mask=cmask[:, None] & comask[None, :], other=0.0)
            y = tl.dot(u, w1, input_precision=PREC)
            mask = mmask[:, None] & comask[None, :]
            out = m[:, None] * C + co[None, :]
            y += tl.load(B1 + co, mask=comask, other=0.0).to(tl.float32)[None, :]
            y += tl.load(Res + out, mask=mask, other=0.0).to(tl.float32)
            if RAW:
                tl.store(O + out, y.to(O.dtype.element_ty), mask=mask)
            a3 = tl.load(A3 + co, mask=comask, other=1.0).to(tl.float32)[None, :]
            y = _snake_f32(y, a3, FAST_SIN)
            tl.store(S + (b * stride_sb + t * C)[:, None] + co[None, :], y.to(S.dtype.element_ty), mask=mask)


def conv_weight_nwc(weight: torch.Tensor) -> torch.Tensor:
    """A conv1d weight [C_out, C_in, K] laid out for `conv1d_nwc`: [K x C_in, C_out] (tap-major rows)."""
    c_out, c_in, k = weight.shape
    return weight.permute(2, 1, 0).reshape(k * c_in, c_out).contiguous()


def conv_transpose_weight_nwc(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """A conv_transpose1d weight [C_in, C_out, 2 stride] laid out for `conv1d_nwc` as a two-tap convolution whose
    output step m holds the transposed convolution's outputs m stride + p (p < stride) side by side: [2 C_in,
    stride x C_out], output column p C_out + c. Output m stride + p reads input m (kernel tap p) and input m - 1 (tap
    p + stride): the first tap of the two-tap convolution is input m - 1. Its [B, T, stride C_out] result viewed as
    [B, T stride, C_out] is the transposed convolution's, without its first input's left context."""
    c_in, c_out, k = weight.shape
    if k != 2 * stride:
        raise ValueError(f"conv_transpose_weight_nwc: a kernel of {k} taps at stride {stride} (it takes 2 x stride)")
    w = torch.stack([weight[..., stride:], weight[..., :stride]])  # [2, C_in, C_out, stride]
    return w.permute(0, 1, 3, 2).reshape(2 * c_in, stride * c_out).contiguous()


def conv1d_nwc(x: torch.Tensor, weight: torch.Tensor, dilation: int = 1, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, alpha: torch.Tensor | None = None,
               snake_out: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor | None:
    """F.conv1d(x^T, w, bias, stride 1, no padding, dilation)^T in channels-last layout: x [B, T, C_in] ->
    [B, T - (K - 1) dilation, C_out], with `weight` = conv_weight_nwc(w) ([K x C_in, C_out]) (or
    conv_transpose_weight_nwc's form); then + `residual` ([B, T_out, C_out]), in float32, rounded once to x's dtype.
    `bias` and `alpha` hold C_out values, or a divisor of C_out of them repeated along the output channels (a
    transposed convolution's outputs side by side). With `alpha` ([C_out], a Snake's) the result is its Snake,
    returned, or written into `snake_out` (any view whose batch rows are each T_out x C_out contiguous values, e.g.
    the rows after a causal convolution's left context in its input buffer); then the raw result is also returned if
    `raw`, else None. Dtypes as x's (float32: the precise sine, the products as FP32_CONV_PRECISION says; fp16 / bf16
    on a GPU: the approximate sine after reduction to [-pi, pi])."""
    if triton is None:
        raise RuntimeError("conv1d_nwc needs the `triton` package")
    B, T, C_in = x.shape
    KC, C_out = weight.shape
    if KC % C_in:
        raise ValueError(f"conv1d_nwc: weight {tuple(weight.shape)} is not conv_weight_nwc of a weight with {C_in} "
                         "input channels")
    taps = KC // C_in
    T_out = T - (taps - 1) * dilation
    if T_out < 1:
        raise ValueError(f"conv1d_nwc: {T} steps are too few for {taps} taps at dilation {dilation}")
    period = {t.numel() for t in (bias, alpha) if t is not None}
    if len(period) > 1 or any(C_out % p for p in period):
        raise ValueError(f"conv1d_nwc: bias and alpha need the same number of values, a divisor of {C_out}")
    period = period.pop() if period else C_out
    M = B * T_out
    cfg = CONV_NWC_CONFIG
    if CONV_NWC_BY_SHAPE and x.is_cuda:
        cfg = {**cfg, **conv_nwc_tiling(M, C_in, C_out, taps, _sms(x.device), x.element_size())}
    block_ci = cfg["block_ci"] if C_in % cfg["block_ci"] == 0 else 16
    x = x.contiguous()
    out = S = None  # out: what is returned (the sum, or its Snake when that goes nowhere else); S: the Snake's
    if alpha is None or snake_out is None or raw:
        out = torch.empty(B, T_out, C_out, dtype=x.dtype, device=x.device)
    if alpha is not None:
        S = out if snake_out is None else snake_out
        if S.shape[0] != B or S[0].numel() != T_out * C_out or not S[0].is_contiguous():
            raise ValueError(f"conv1d_nwc: snake_out {tuple(S.shape)} does not hold {B} batch rows of {T_out} x "
                             f"{C_out} contiguous values")
    res = None if residual is None else residual.contiguous()
    block_t = min(cfg["block_t"], max(16, triton.next_power_of_2(M)))
    block_co = min(cfg["block_co"], max(16, triton.next_power_of_2(C_out)))
    grid = (triton.cdiv(M, block_t), triton.cdiv(C_out, block_co))
    _conv1d_nwc_kernel[grid](x, weight, weight if bias is None else bias, weight if res is None else res,
                             weight if alpha is None else alpha.reshape(-1), x if out is None else out,
                             x if S is None else S, M, T, T_out, C_in, triton.cdiv(C_in, block_ci) * block_ci, C_out,
                             period, 0 if S is None else S.stride(0), KS=taps, DIL=dilation, BLOCK_T=block_t,
                             BLOCK_CO=block_co, BLOCK_CI=block_ci, MASK_CI=C_in % block_ci != 0,
                             HAS_BIAS=bias is not None, HAS_RES=res is not None, RAW=out is not None and out is not S,
                             SNAKE=alpha is not None, PREC=_conv_precision(x),
                             FAST_SIN=x.dtype != torch.float32 and ptx(x),
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


RES_UNIT_MAX_CHANNELS = 192  # residual units of at most this many channels run as one kernel (`res_unit_nwc`)
RES_UNIT_CONFIG = {"block_t": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
RES_UNIT_BY_SHAPE = True  # on a GPU, `res_unit_tiling`'s overrides of RES_UNIT_CONFIG


def res_unit_applies(channels: int, x: torch.Tensor) -> bool:
    """Whether a residual unit of `channels` channels over activations like x runs as `res_unit_nwc`: up to
    RES_UNIT_MAX_CHANNELS, and on a GPU for 2-byte values only (float32's tiles of all the unit's channels would
    need more shared memory and registers than an SM has: the fp32 fallback decoder keeps two convolutions there;
    the interpreter on a CPU runs it in float32, as the tests check it)."""
    return channels <= RES_UNIT_MAX_CHANNELS and (x.element_size() <= 2 or not x.is_cuda)


def res_unit_tiling(rows: int, channels: int, sms: int) -> dict:
    """Overrides of RES_UNIT_CONFIG for a residual unit of `rows` output rows on `sms` multiprocessors, from a sweep
    at 8 and 64 streams x 8 frames on a 132-SM GPU: four warps for up to 128
    channels (eight for 192: its 128 x 256 sums), 64-row tiles where 128-row ones would not make a wave."""
    cfg = {} if channels > 128 else {"num_warps": 4}
    if -(-rows // 128) < sms:
        cfg["block_t"] = 64
    return cfg


def res_unit_nwc(h: torch.Tensor, w7: torch.Tensor, dilation: int, b7: torch.Tensor, a2: torch.Tensor,
                 w1: torch.Tensor, b1: torch.Tensor, residual: torch.Tensor, a3: torch.Tensor, snake_out: torch.Tensor,
                 raw: bool = False) -> torch.Tensor | None:
    """One residual unit of the channels-last decoder in one kernel: y = residual + conv1(snake_a2(conv7(h) + b7)) + b1
    with h [B, T_in, C] (the Snake of the unit's input after the dilated convolution's left context), w7 and w1 in
    `conv_weight_nwc`'s form ([KS x C, C], [C, C]), residual [B, T_out, C]; snake_a3(y) written into `snake_out` (as
    `conv1d_nwc`'s), y returned if `raw` (else None). The same sums and roundings as `conv1d_nwc` twice (the inner
    activation rounded to h's dtype), without its round trip through memory."""
    if triton is None:
        raise RuntimeError("res_unit_nwc needs the `triton` package")
    B, T_in, C = h.shape
    KC = w7.shape[0]
    if KC % C or w7.shape[1] != C or tuple(w1.shape) != (C, C):
        raise ValueError(f"res_unit_nwc: weights {tuple(w7.shape)} and {tuple(w1.shape)} do not fit {C} channels")
    taps = KC // C
    T_out = T_in - (taps - 1) * dilation
    if T_out < 1 or tuple(residual.shape) != (B, T_out, C):
        raise ValueError(f"res_unit_nwc: residual {tuple(residual.shape)} against {B} x {T_out} x {C}")
    if snake_out.shape[0] != B or snake_out[0].numel() != T_out * C or not snake_out[0].is_contiguous():
        raise ValueError(f"res_unit_nwc: snake_out {tuple(snake_out.shape)} does not hold {B} batch rows of {T_out} x "
                         f"{C} contiguous values")
    M = B * T_out
    cfg = RES_UNIT_CONFIG
    if RES_UNIT_BY_SHAPE and h.is_cuda:
        cfg = {**cfg, **res_unit_tiling(M, C, _sms(h.device))}
    cp = max(16, triton.next_power_of_2(C))
    block_ci = 64 if C % 64 == 0 else 32 if C % 32 == 0 else 16
    h, res = h.contiguous(), residual.contiguous()
    out = torch.empty(B, T_out, C, dtype=h.dtype, device=h.device) if raw else None
    block_t = min(cfg["block_t"], max(16, triton.next_power_of_2(M)))
    _res_unit_nwc_kernel[(triton.cdiv(M, block_t),)](
        h, w7, b7, a2.reshape(-1), w1, b1, res, a3.reshape(-1), h if out is None else out, snake_out, M, T_in, T_out,
        C, triton.cdiv(C, block_ci) * block_ci, snake_out.stride(0), KS=taps, DIL=dilation, CP=cp, BLOCK_T=block_t,
        BLOCK_CI=block_ci, MASK_CI=C % block_ci != 0, BLOCK_N=min(cfg["block_n"], cp), RAW=raw,
        PREC=_conv_precision(h), FAST_SIN=h.dtype != torch.float32 and ptx(h), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out


def rope_pairs(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of interleaved pairs (2i, 2i+1): x [B, T, H, D] (unit stride along D), rope [B, T, D/2, 2]
    float32 (cos, sin) -> contiguous [B, T, H, D] in x's dtype."""
    B, T, H, D = x.shape
    if x.stride(-1) != 1 or x.stride(0) != T * x.stride(1):
        x = x.contiguous()
    rope = rope.contiguous()
    out = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    _rope_pairs_kernel[(B * T, H)](x, rope, out, H, x.stride(1), x.stride(2), rope.stride(1), D2=D // 2,
                                   BLOCK=triton.next_power_of_2(D // 2), num_warps=1)
    return out
