"""The engine's GPU kernels, written in Triton (the codec's: s2tts/codec/kernels.py).

`decode_attention`: one query token per request against that request's keys in the paged
KV cache (s2tts/engine/paged.py: each key's block looked up in the request's row of the block
table), reading only the request's own keys (its length comes from a device tensor, so
the kernel runs inside a CUDA graph whose lengths change every step). One
program per (request, KV head) serves the query heads of that GQA group together, with
an online softmax over key tiles.

Runs on CPU only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.

Programmatic dependent launch (`dependent_launch`, where `pdl_supported`: Hopper and newer): within it the decode
step's kernels are launched so that each may start while the one before it finishes; every such kernel waits
(`_pdl_wait`) for its predecessor to complete before it touches memory the step writes, and the small-rows product
(`gemv_small`) loads its first weight tile before that wait (weights are never written during a step). A kernel
after one that does not take part waits as usual.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..gpu.jit import compiling_only, tl, triton, unit_rows

# whether this thread's launches of the decode step's kernels use programmatic dependent launch (`dependent_launch`):
# a thread's own, so that a pass's mode never reaches another thread's launches (a codec's, a warm-up's)
_LAUNCH = threading.local()


def launching_dependent() -> bool:
    """Whether this thread is within `dependent_launch(True)`."""
    return getattr(_LAUNCH, "pdl", False)


@contextlib.contextmanager
def dependent_launch(on: bool):
    """Within it, this thread launches the decode step's kernels with programmatic dependent launch when `on` (the
    caller checked `pdl_supported`); outside (the codec's calls, other passes) as usual. Kernels captured in a CUDA
    graph keep the way they were launched then."""
    before, _LAUNCH.pdl = launching_dependent(), bool(on)
    try:
        yield
    finally:
        _LAUNCH.pdl = before


def pdl_supported(device) -> bool:
    """Whether the device and Triton support programmatic dependent launch (compute capability 9.0 or newer, a
    launcher that takes `launch_pdl`): a kernel launched so runs and finishes."""
    if triton is None or device is None or torch.device(device).type != "cuda":
        return False
    if torch.cuda.get_device_capability(device) < (9, 0) or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    try:  # a Triton whose launcher takes `launch_pdl`
        x = torch.zeros(1, device=device)
        _pdl_probe_kernel[(1,)](x, PDL=True, launch_pdl=True)
        torch.cuda.synchronize(device)
        return float(x[0]) == 1.0
    except Exception:  # noqa: BLE001 - any failure means: launch as usual
        return False


def _pdl() -> dict:
    """The arguments of a launch of a kernel that takes part in programmatic dependent launch: its PDL constant (the
    waits it compiles in) and, with it on, the launch option."""
    return {"PDL": True, "launch_pdl": True} if launching_dependent() else {"PDL": False}


if triton is not None:

    @triton.jit
    def _pdl_wait(PDL: tl.constexpr):
        """With PDL: let the next kernel launch now (it waits for this one's end itself), and wait for the kernel
        before this one to complete and its writes to be visible. Call before any access to memory the step writes."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def _pdl_probe_kernel(X, PDL: tl.constexpr):
        _pdl_wait(PDL)
        tl.store(X, 1.0)

    @triton.jit
    def _split_keys(length, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
        """Keys per split of a row of `length` keys: whole tiles, at least MIN_SPLIT."""
        return tl.maximum(tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT)

    @triton.jit
    def _decode_attention_kernel(
        Q, K, V, O, Table, Slots, Lens, MidO, MidML, scale,
        stride_qb, stride_qh,
        stride_kb, stride_kh, stride_kl,
        stride_vb, stride_vh, stride_vl,
        stride_ob, stride_oh, stride_t, stride_len,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
        SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, KV_TOGETHER: tl.constexpr, LEN_ADD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (row b, KV head, split): the split's share of the row's keys (whole tiles of BLOCK_N, at least
        MIN_SPLIT keys). A row that one split covers is finished here (result straight to O, as with SPLITS=1);
        otherwise each split's unnormalised sum and its (max, sum of weights) go to MidO/MidML for
        `_decode_combine_kernel`. KV_TOGETHER: a tile's values are read beside its keys, before its scores. The row's
        length is Lens[b] + LEN_ADD."""
        _pdl_wait(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(Slots + b).to(tl.int64)
        length = tl.load(Lens + b * stride_len) + LEN_ADD
        per = _split_keys(length, SPLITS, BLOCK_N, MIN_SPLIT)
        direct = (length <= per).to(tl.int32)  # one split holds the whole row
        lo = sp * per
        hi = tl.minimum(lo + per, length)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        gmask = g < GROUP
        heads = kvh * GROUP + g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        row_table = Table + slot * stride_t
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < hi
            blk = tl.load(row_table + n // BS, mask=nmask, other=0).to(tl.int64)  # each key's physical block
            off = n % BS
            k = tl.load(K + blk[:, None] * stride_kb + kvh * stride_kh + off[:, None] * stride_kl + d[None, :],
                        mask=nmask[:, None], other=0.0)
            if KV_TOGETHER:
                v = tl.load(V + blk[:, None] * stride_vb + kvh * stride_vh + off[:, None] * stride_vl + d[None, :],
                            mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if not KV_TOGETHER:
                v = tl.load(V + blk[:, None] * stride_vb + kvh * stride_vh + off[:, None] * stride_vl + d[None, :],
                            mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m = m_new
        out = acc / l_sum[:, None]
        if SPLITS == 1:
            tl.store(O + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                     mask=gmask[:, None])
        else:
            finish = gmask & (g * 0 + direct * (sp == 0).to(tl.int32) > 0)
            tl.store(O + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                     mask=finish[:, None])
            H = tl.num_programs(1) * GROUP
            mid = (b * H + heads) * SPLITS + sp  # [GROUP_PAD]
            split = gmask & (g * 0 + direct == 0)
            tl.store(MidO + mid[:, None] * D + d[None, :], acc, mask=split[:, None])
            tl.store(MidML + mid * 2, m, mask=split)
            tl.store(MidML + mid * 2 + 1, l_sum, mask=split)

    @triton.jit
    def _decode_combine_kernel(MidO, MidML, O, Lens, stride_ob, stride_oh, stride_len, H, D: tl.constexpr,
                               SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, LEN_ADD: tl.constexpr,
                               PDL: tl.constexpr):
        """Program (row b, head h): the softmax-weighted sum of the splits' partial results (rows that one split
        finished are left alone)."""
        _pdl_wait(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.load(Lens + b * stride_len) + LEN_ADD
        per = _split_keys(length, SPLITS, BLOCK_N, MIN_SPLIT)
        sp = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        used = sp * per < length  # splits that held keys (the others wrote nothing)
        base = (b * H + h) * SPLITS + sp
        m = tl.load(MidML + base * 2, mask=used, other=float("-inf"))
        l_sum = tl.load(MidML + base * 2 + 1, mask=used, other=0.0)
        acc = tl.load(MidO + base[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        m_all = tl.max(m, axis=0)
        w = tl.where(used, tl.exp(m - m_all), 0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(O + b * stride_ob + h * stride_oh + d, out.to(O.dtype.element_ty), mask=d * 0 + length > per)


# `decode_attention`'s tiling: keys a tile, warps a program, Triton's software-pipeline stages for its tile loop (2:
# one tile loaded ahead; the output bits do not depend on it), and whether a tile's values are read beside its keys;
# the tiling that read the slow AR's keys fastest on a GPU (perf/STATUS.md). A cache of fewer positions than a tile
# takes `short_keys_config`.
DECODE_ATTENTION_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2, "kv_together": 0}


SHORT_KEYS = True  # `short_keys_config` in use (perf/bench_engine.py's variants turn it off: short_keys=0)


def short_keys_config(max_keys: int, rows: int) -> dict | None:
    """`decode_attention`'s tiling for rows that never hold more than `max_keys` keys (the fast AR's: its
    num_codebooks + 1 positions) when that is under one default tile: tiles of max(16, next power of two) keys
    rather than 64 mostly masked, and past 4 rows one warp a program, a tile's values read beside its keys, no
    pipeline: a call for the fast AR's few keys takes a fraction of the default tiling's time, with the same output
    bits. None: the default tiling."""
    block_n = max(16, triton.next_power_of_2(max_keys)) if triton is not None else 64
    if not SHORT_KEYS or block_n >= DECODE_ATTENTION_CONFIG["block_n"]:
        return None
    if rows <= 4:
        return {"block_n": block_n}
    return {"block_n": block_n, "num_warps": 1, "kv_together": 1, "num_stages": 1}


def decode_attention(q: torch.Tensor, cache, slots: torch.Tensor, lengths: torch.Tensor, block_n: int | None = None,
                     splits: int = 1, min_split: int = 1024, config: dict | None = None,
                     lengths_add: int = 0) -> torch.Tensor:
    """q [B, H, D]; `cache` a paged KVCache (k/v [blocks, K, block_size, D], table [slots, max_blocks]); slots [B];
    lengths [B] (keys 0..len-1 are visible; with `lengths_add`, 0..len+lengths_add-1: a row's position and 1, without
    a kernel to add them) -> [B, H, D].

    `splits` > 1 (a power of two): each row's keys are shared among up to that many programs per KV head (at least
    `min_split` keys each), whose partial results are then combined (flash-decoding), so a long context is read by
    many programs at once rather than by one; a row that fits one split is done as with `splits=1`. A row's result
    depends on its own length only, never on its neighbours. `config`: `DECODE_ATTENTION_CONFIG`'s keys to override
    (`block_n` too)."""
    if triton is None:
        raise RuntimeError("decode_attention needs the `triton` package")
    cfg = dict(DECODE_ATTENTION_CONFIG, **(config or {}))
    block_n = block_n or cfg["block_n"]
    B, H, D = q.shape
    k, v, table = cache.k, cache.v, cache.table
    n_kv = k.shape[1]
    group = H // n_kv
    q = q.contiguous()
    out = torch.empty_like(q)
    if splits > 1:
        mid_o = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        mid_ml = torch.empty(B, H, splits, 2, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_ml = out
    _decode_attention_kernel[(B, n_kv, splits)](
        q, k, v, out, table, slots, lengths, mid_o, mid_ml, D ** -0.5,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), table.stride(0), lengths.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=D, BLOCK_N=block_n, BS=cache.block_size,
        SPLITS=splits, MIN_SPLIT=min_split, KV_TOGETHER=bool(cfg["kv_together"]), LEN_ADD=lengths_add,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_pdl(),
    )
    if splits > 1:
        _decode_combine_kernel[(B, H)](mid_o, mid_ml, out, lengths, out.stride(0), out.stride(1), lengths.stride(0), H,
                                       D=D, SPLITS=splits, BLOCK_N=block_n, MIN_SPLIT=min_split, LEN_ADD=lengths_add,
                                       num_warps=1, **_pdl())
    return out


# ---- fused elementwise kernels of the decode step -------------------------------------------
# Each reproduces the rounding of the plain PyTorch code it replaces (s2tts/ar/model.py): the layer norms
# (`RMSNorm`) in float32, cast to the activation dtype, then multiplied by the weight in that dtype; the q/k norms
# (`HeadNorm`, in `_rope_pairs`) multiplied by the weight in float32 too, rounded once.

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, Y, R, W, O, H, stride_x, stride_y, stride_o, stride_h, eps, N: tl.constexpr,
                         BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)  # read before the wait: no kernel writes weights
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if ADD:  # h = x + y (rounded to the activation dtype), written out as the new residual
            x = (x.to(tl.float32) + tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
            tl.store(H + row * stride_h + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
        tl.store(O + row * stride_o + cols, (normed * w).to(O.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu(g, u, dtype):
        """silu(g) * u of a product's outputs g, u (float32, not yet rounded) in `dtype`, rounded where the two
        kernels (product, then `silu_mul`) round: the same bits either way."""
        g = g.to(dtype).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (s * u.to(dtype).to(tl.float32)).to(dtype)

    @triton.jit
    def _silu_mul_kernel(GU, O, stride_gu, stride_o, I: tl.constexpr, STEP: tl.constexpr, UP: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(GU + row * stride_gu + cols * STEP, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + cols * STEP + UP, mask=mask, other=0.0).to(tl.float32)
        tl.store(O + row * stride_o + cols, _swiglu(g, u, O.dtype.element_ty), mask=mask)
    @triton.jit
    def _rope_pairs(xe, xo, we, wo, cos, sin, inv, QK_NORM: tl.constexpr, dt: tl.constexpr):
        """A head's pairs (even, odd), float32: normed (QK_NORM: times inv, times the weight, rounded to dt once, as
        `torch.nn.functional.rms_norm`: model.HeadNorm) and rotated -> (even, odd) float32, not yet rounded
        (`_qk_rope_cache_kernel` and `_rope_attend_short_kernel` round them as they store them: the same bits)."""
        if QK_NORM:
            xe = (xe * inv * we).to(dt).to(tl.float32)
            xo = (xo * inv * wo).to(dt).to(tl.float32)
        return xe * cos - xo * sin, xo * cos + xe * sin

    @triton.jit
    def _qk_rope_cache_kernel(QKV, QW, KW, ROPE, Pos, Slots, Table, QO, KC, VC, stride_qkv, stride_qo_b, stride_qo_h,
                              stride_cb, stride_ch, stride_cl, stride_t, eps,
                              H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                              BS: tl.constexpr, PDL: tl.constexpr):
        """One program per (row, head): heads < H are query heads (-> QO); the rest are KV heads
        (k normed + rotated, and v, written into the paged cache at the row's slot and position). The norm weights
        are read before the wait for the kernel before (no kernel writes them)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        half = tl.arange(0, D // 2)
        is_q = h < H
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if QK_NORM:
            if is_q:
                we = tl.load(QW + 2 * half).to(tl.float32)
                wo = tl.load(QW + 2 * half + 1).to(tl.float32)
            else:
                we = tl.load(KW + 2 * half).to(tl.float32)
                wo = tl.load(KW + 2 * half + 1).to(tl.float32)
        else:
            we = tl.zeros([D // 2], tl.float32)
            wo = we
        if PDL:
            tl.extra.cuda.gdc_wait()
        pos = tl.load(Pos + b).to(tl.int64)
        col = h * D  # q heads first, then k heads in the fused qkv projection
        base = QKV + b * stride_qkv + col
        xe = tl.load(base + 2 * half).to(tl.float32)
        xo = tl.load(base + 2 * half + 1).to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(xe * xe, axis=0) + tl.sum(xo * xo, axis=0)) / D + eps)  # used with QK_NORM only
        cos = tl.load(ROPE + pos * D + 2 * half)
        sin = tl.load(ROPE + pos * D + 2 * half + 1)
        re, ro = _rope_pairs(xe, xo, we, wo, cos, sin, inv, QK_NORM, QO.dtype.element_ty)
        if is_q:
            out = QO + b * stride_qo_b + h * stride_qo_h
            tl.store(out + 2 * half, re.to(QO.dtype.element_ty))
            tl.store(out + 2 * half + 1, ro.to(QO.dtype.element_ty))
        else:
            kvh = h - H
            slot = tl.load(Slots + b).to(tl.int64)
            blk = tl.load(Table + slot * stride_t + pos // BS).to(tl.int64)
            dst = blk * stride_cb + kvh * stride_ch + (pos % BS) * stride_cl
            tl.store(KC + dst + 2 * half, re.to(KC.dtype.element_ty))
            tl.store(KC + dst + 2 * half + 1, ro.to(KC.dtype.element_ty))
            d = tl.arange(0, D)
            v = tl.load(QKV + b * stride_qkv + (H + KVH) * D + kvh * D + d)
            tl.store(VC + dst + d, v)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm(x) (or, with `residual`, h = residual + x and rms_norm(h), returning (h, normed)). x: [..., N]."""
    shape = x.shape
    x2 = unit_rows(x.reshape(-1, shape[-1]))
    N = shape[-1]
    out = torch.empty_like(x2)
    if residual is not None:
        r2 = unit_rows(residual.reshape(-1, N))
        h = torch.empty_like(x2)
        _rms_norm_kernel[(x2.shape[0],)](r2, x2, h, weight, out, h, r2.stride(0), x2.stride(0), out.stride(0), h.stride(0),
                                         eps, N=N, BLOCK=triton.next_power_of_2(N), ADD=True, num_warps=8,
                                         **_pdl())
        return h.reshape(shape), out.reshape(shape)
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0,
                                     eps, N=N, BLOCK=triton.next_power_of_2(N), ADD=False, num_warps=8,
                                     **_pdl())
    return out.reshape(shape)


def silu_mul(gate_up: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """[..., 2I] (gate | up; with `interleaved`, gate i at 2i and up i at 2i+1) -> silu(gate) * up, [..., I]."""
    shape = gate_up.shape
    I = shape[-1] // 2
    g2 = unit_rows(gate_up.reshape(-1, 2 * I))
    out = torch.empty(g2.shape[0], I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(I, BLOCK))](g2, out, g2.stride(0), out.stride(0), I=I,
                                                            STEP=2 if interleaved else 1, UP=1 if interleaved else I,
                                                            BLOCK=BLOCK, num_warps=4, **_pdl())
    return out.reshape(*shape[:-1], I)


def qk_rope_cache(qkv, q_w, k_w, rope, pos, slots, cache, n_head: int, n_kv: int, head_dim: int, eps: float,
                  qk_norm: bool) -> torch.Tensor:
    """One token per row. qkv [B, (H+2K)*D]; rope [L, D/2, 2] float32; pos/slots [B]; `cache` a paged KVCache.
    Returns q [B, H, D] (normed, rotated); writes rotated k and v into the cache at (slot, pos)."""
    B = qkv.shape[0]
    q = torch.empty(B, n_head, head_dim, dtype=qkv.dtype, device=qkv.device)
    dummy = q if q_w is None else q_w
    k_cache, v_cache, table = cache.k, cache.v, cache.table
    assert k_cache.stride() == v_cache.stride()
    _qk_rope_cache_kernel[(B, n_head + n_kv)](
        qkv, q_w if q_w is not None else dummy, k_w if k_w is not None else dummy, rope, pos, slots, table, q, k_cache,
        v_cache, qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        table.stride(0), eps, H=n_head, KVH=n_kv, D=head_dim, QK_NORM=qk_norm, BS=cache.block_size, num_warps=1,
        **_pdl())
    return q


# ---- q/k norm + RoPE + cache write + attention in one kernel, for caches of a few positions -------------
# The fast AR's passes after its first: one token a row, at most `num_codebooks + 1` keys a row. The two kernels
# (`qk_rope_cache`, then `decode_attention` in its short tiling) become one program per (row, KV head) that makes
# its heads' q, the new key and value, writes them to the cache and attends over the row's keys, the new one taken
# from registers: 32 launches fewer a decode step, a shorter step from a few rows on. At 1 and 2 rows its 8 programs,
# each with a longer dependent chain, lose to the two kernels' 40 + 8 overlapping under dependent launch, hence from
# ROPE_ATTEND_MIN_ROWS rows.

ROPE_ATTEND_SHORT = True  # `Attention._fused` uses `rope_attend_short` where it can (bench_engine: rope_attend=0)
ROPE_ATTEND_MIN_ROWS = 5  # ... in passes of at least this many rows

if triton is not None:

    @triton.jit
    def _rope_attend_short_kernel(QKV, QW, KW, ROPE, Pos, Slots, Table, O, KC, VC, stride_qkv, stride_ob, stride_oh,
                                  stride_cb, stride_ch, stride_cl, stride_t, stride_pos, eps, scale,
                                  H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                                  GROUP_PAD: tl.constexpr, QK_NORM: tl.constexpr, BS: tl.constexpr,
                                  BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        """Program (row b, KV head g): q of heads g*GROUP.. (normed, rotated), the row's new key (normed, rotated) and
        value written to the cache at (slot, pos), then softmax attention of those heads over keys 0..pos (at most
        BLOCK_N; the new key and value from registers, the others from the cache), as `_decode_attention_kernel`
        computes it over one tile."""
        b = tl.program_id(0)
        g = tl.program_id(1)
        half = tl.arange(0, D // 2)
        i = tl.arange(0, GROUP_PAD)
        imask = i < GROUP
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if QK_NORM:  # weights: read before the wait (no kernel writes them)
            qwe = tl.load(QW + 2 * half).to(tl.float32)
            qwo = tl.load(QW + 2 * half + 1).to(tl.float32)
            kwe = tl.load(KW + 2 * half).to(tl.float32)
            kwo = tl.load(KW + 2 * half + 1).to(tl.float32)
        else:
            qwe = tl.zeros([D // 2], tl.float32)
            qwo = qwe
            kwe = qwe
            kwo = qwe
        if PDL:
            tl.extra.cuda.gdc_wait()
        pos = tl.load(Pos + b * stride_pos).to(tl.int64)
        slot = tl.load(Slots + b).to(tl.int64)
        cos = tl.load(ROPE + pos * D + 2 * half)
        sin = tl.load(ROPE + pos * D + 2 * half + 1)
        dt = O.dtype.element_ty
        row = QKV + b * stride_qkv
        # the new key and value
        ke = tl.load(row + (H + g) * D + 2 * half).to(tl.float32)
        ko = tl.load(row + (H + g) * D + 2 * half + 1).to(tl.float32)
        kinv = 1.0 / tl.sqrt((tl.sum(ke * ke, axis=0) + tl.sum(ko * ko, axis=0)) / D + eps)
        ke, ko = _rope_pairs(ke, ko, kwe, kwo, cos, sin, kinv, QK_NORM, dt)
        k_new = tl.reshape(tl.join(ke.to(dt), ko.to(dt)), [D])  # the pairs interleaved again
        d = tl.arange(0, D)
        v_new = tl.load(row + (H + KVH + g) * D + d)
        blk_new = tl.load(Table + slot * stride_t + pos // BS).to(tl.int64)
        dst = blk_new * stride_cb + g * stride_ch + (pos % BS) * stride_cl
        tl.store(KC + dst + d, k_new.to(KC.dtype.element_ty))
        tl.store(VC + dst + d, v_new)
        # the group's queries [GROUP_PAD, D]
        heads = g * GROUP + i
        qe = tl.load(row + heads[:, None] * D + 2 * half[None, :], mask=imask[:, None], other=0.0).to(tl.float32)
        qo = tl.load(row + heads[:, None] * D + 2 * half[None, :] + 1, mask=imask[:, None], other=0.0).to(tl.float32)
        qinv = 1.0 / tl.sqrt((tl.sum(qe * qe, axis=1) + tl.sum(qo * qo, axis=1)) / D + eps)
        qe, qo = _rope_pairs(qe, qo, qwe[None, :], qwo[None, :], cos[None, :], sin[None, :], qinv[:, None], QK_NORM, dt)
        q = tl.reshape(tl.join(qe.to(dt), qo.to(dt)), [GROUP_PAD, D])
        # keys 0..pos: the earlier ones from the cache, the new one from registers
        n = tl.arange(0, BLOCK_N)
        old = n < pos
        blk = tl.load(Table + slot * stride_t + n // BS, mask=old, other=0).to(tl.int64)
        at = blk[:, None] * stride_cb + g * stride_ch + (n % BS)[:, None] * stride_cl + d[None, :]
        new = (n == pos)[:, None]
        k = tl.where(new, k_new[None, :].to(KC.dtype.element_ty), tl.load(KC + at, mask=old[:, None], other=0.0))
        v = tl.where(new, v_new[None, :], tl.load(VC + at, mask=old[:, None], other=0.0))
        sc = tl.dot(q.to(k.dtype), tl.trans(k)).to(tl.float32) * scale
        sc = tl.where((n <= pos)[None, :], sc, float("-inf"))
        m = tl.max(sc, axis=1)
        p = tl.exp(sc - m[:, None])
        out = tl.dot(p.to(v.dtype), v).to(tl.float32) / tl.sum(p, axis=1)[:, None]
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(dt), mask=imask[:, None])


def rope_attend_short(qkv, q_w, k_w, rope, pos, slots, cache, n_head: int, n_kv: int, head_dim: int, eps: float,
                      qk_norm: bool, config: dict) -> torch.Tensor:
    """`qk_rope_cache` then `decode_attention(..., lengths=pos, lengths_add=1, config=config)` in one kernel, for
    one token a row over caches whose rows never hold more keys than the tiling's one tile (`config`: a
    `short_keys_config`; its keys a tile and warps, so the same sums), the fast AR's after its first call (a row's
    earlier positions must be in the cache before the call, which rules out one stream's two first positions in
    one call). qkv [B, (H+2K)*D]; pos [B] (strided allowed); slots [B] -> attention output [B, H, D]; writes the
    rows' keys and values into the cache."""
    if triton is None:
        raise RuntimeError("rope_attend_short needs the `triton` package")
    cfg = dict(DECODE_ATTENTION_CONFIG, **config)
    if cfg["block_n"] > 64:
        raise ValueError(f"rope_attend_short takes tiles of at most 64 keys, not {cfg['block_n']}")
    B = qkv.shape[0]
    out = torch.empty(B, n_head, head_dim, dtype=qkv.dtype, device=qkv.device)
    k_cache, v_cache, table = cache.k, cache.v, cache.table
    assert k_cache.stride() == v_cache.stride()
    group = n_head // n_kv
    _rope_attend_short_kernel[(B, n_kv)](
        qkv, q_w if q_w is not None else out, k_w if k_w is not None else out, rope, pos, slots, table, out,
        k_cache, v_cache, qkv.stride(0), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), table.stride(0), pos.stride(0), eps, head_dim ** -0.5, H=n_head, KVH=n_kv, D=head_dim,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), QK_NORM=qk_norm, BS=cache.block_size,
        BLOCK_N=cfg["block_n"], num_warps=cfg["num_warps"], **_pdl())
    return out


# ---- sampling -----------------------------------------------------------------------------
# The same function as s2tts.ar.sampling._choose (top-p from the un-tempered softmax, rank >= top_k
# masked, rank 0 kept, tempered softmax, exponential race with counter-based noise), one program
# per row instead of ~40 small kernels. The integer hash is the same, so are the random numbers.

if triton is not None:

    @triton.jit
    def _mix32(h):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _sort_desc(x, r, BLOCK: tl.constexpr, KEY16: tl.constexpr):
        """Logits x [BLOCK] (r = arange(BLOCK)) sorted descending, ties lowest index first -> (sorted, order). KEY16:
        the values are bf16 (their low 16 bits zero): the value's 16 bits and the index's 16 in one int32 (half a
        sort's data); else 64-bit (value, index) pairs."""
        if KEY16:
            b16 = x.to(tl.int32, bitcast=True) >> 16
            key = b16 ^ ((b16 >> 15) & 0x7FFF)  # integers that order as the bf16 values do
            packed = tl.sort((key << 16) | (BLOCK - 1 - r), descending=True)
            key = packed >> 16
            xs = ((key ^ ((key >> 15) & 0x7FFF)) << 16).to(tl.float32, bitcast=True)
            order = BLOCK - 1 - (packed & 0xFFFF)
        else:
            bits = x.to(tl.int32, bitcast=True)
            key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # integers that order as the floats do
            packed = tl.sort((key.to(tl.int64) << 32) | (BLOCK - 1 - r).to(tl.int64), descending=True)
            key = (packed >> 32).to(tl.int32)
            xs = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            order = BLOCK - 1 - (packed & 0xFFFFFFFF).to(tl.int32)
        return xs, order

    @triton.jit
    def _draw(x, r, V, t, top_p, top_k, seed, step, stream):
        """The rank drawn from descending-sorted logits x [BLOCK] (`s2tts.ar.sampling._choose`): top-p from the
        un-tempered softmax, rank >= top_k masked, rank 0 kept, tempered softmax, exponential race with the
        counter-based noise of (seed, step, stream, rank)."""
        valid = r < V
        e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
        cum = tl.cumsum(e / tl.sum(e, axis=0), axis=0)
        k = tl.maximum(top_k.to(tl.int32), 1)  # 0: greedy, as upstream
        remove = ((cum > top_p) | (r >= k)) & (r != 0)
        remove = remove | (r >= V)
        s = tl.where(remove, float("-inf"), x / tl.maximum(t, 1e-5))
        e2 = tl.exp(s - tl.max(s, axis=0))
        probs = e2 / tl.sum(e2, axis=0)
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        step = (step & 0xFFFFFFFF).to(tl.uint32)
        h = _mix32(lo * 0x9E3779B1 + _mix32(hi + 0x632BE5AB))
        h = _mix32(h + step * 0x7FEB352D + stream.to(tl.uint32) * 0x68E31DA4)
        h = _mix32(h + r.to(tl.uint32) * 0x1B873593 + 0x2545F491)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(remove, -1.0, probs / (-tl.log(u)))
        return tl.argmax(score, axis=0)

    # Compiled once per (BLOCK, SORT): `stream` is a plain argument and the per-row inputs are not specialised on
    # their alignment. With `stream` a constant (it was), each of the fast AR's nine codebooks and the slow AR's two
    # draws, times the aligned and unaligned step rows of the sampling graphs, compiled a kernel of its own: 22
    # compiles of ~2.7 s (the in-kernel sort) at a server's first start on a GPU, 55 of its 110 s.
    @triton.jit(do_not_specialize=["T", "P", "K", "Seed", "Step", "Out", "stream"])
    def _choose_kernel(SL, T, P, K, Seed, Step, Out, stride, V, stream, BLOCK: tl.constexpr, SORT: tl.constexpr,
                       KEY16: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)
        row = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        x = tl.load(SL + row * stride + r, mask=r < V, other=float("-inf")).to(tl.float32)
        if SORT:  # unsorted logits: sorted in the program
            x, order = _sort_desc(x, r, BLOCK, KEY16)
        choice = _draw(x, r, V, tl.load(T + row), tl.load(P + row), tl.load(K + row), tl.load(Seed + row),
                       tl.load(Step + row), stream)
        if SORT:
            choice = tl.sum(tl.where(r == choice, order, 0), axis=0)
        tl.store(Out + row, choice.to(tl.int64))


SORT_IN_KERNEL = 2048  # `choose(..., sort=True)` up to this many logits a row (the fast AR's 1024); torch.sort above
SORT_KEY16 = True  # bf16 logits sorted as 32-bit keys (16 bits of value, 16 of index) rather than 64-bit ones


def choose(logits, temperature, top_p, top_k, seed, step, stream: int, sort: bool = False) -> torch.Tensor:
    """Rank index sampled from each row of descending-sorted logits [B, V] -> [B] int64. `sort`: the logits are
    not sorted; the kernel sorts each row itself (V <= SORT_IN_KERNEL) and returns the sampled logit's index (what
    torch.sort, this and a gather give, in one kernel instead of a radix sort's several); bf16 logits are sorted
    as 32-bit (value, index) keys (`SORT_KEY16`), others as 64-bit ones. Logits of any float dtype, read as float32."""
    B, V = logits.shape
    if sort and V > SORT_IN_KERNEL:
        raise ValueError(f"choose(sort=True) takes rows of at most {SORT_IN_KERNEL} logits, not {V}")
    sl = unit_rows(logits)
    # a warm-up that only compiles (`gpu.jit.compile_only`) runs no kernel: its draws are rank 0, an index in range
    out = (torch.zeros if compiling_only() else torch.empty)(B, dtype=torch.int64, device=sl.device)
    _choose_kernel[(B,)](sl, temperature.float().contiguous(), top_p.float().contiguous(), top_k.contiguous(),
                         seed.contiguous(), step.contiguous(), out, sl.stride(0), V, stream,
                         BLOCK=triton.next_power_of_2(V), SORT=sort,
                         KEY16=SORT_KEY16 and sort and logits.dtype == torch.bfloat16, num_warps=8 if V > 2048 else 4,
                         **_pdl())
    return out


# ---- row-invariant matrix products ---------------------------------------------------------
# cuBLAS picks its tiling (and split of K) by the number of rows, so in bf16 a row's result changes with the rows
# beside it. This kernel tiles by the weight's shape alone: 16 rows a tile, BLOCK_N output columns x BLOCK_K, the K
# range split between SPLIT programs when there are too few column tiles to fill the GPU, partial sums added in a
# fixed order. A row's result is then the same whatever rows are beside it (`batch_invariant`). At 1-16 rows it
# streams the weights about as fast as cuBLAS; the row tiles of one column tile run next to each other, so at more
# rows they read the weight tile from L2.

GEMV_ROWS = 16  # `linear`'s default: the kernel up to this many rows, cuBLAS above
GEMV_CONFIG = {"programs": 264, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "max_block_m": 128,
               "swap": 0}
GEMV_FP8_CONFIG = dict(GEMV_CONFIG)  # the same kernel with FP8 weights (`linear(..., scale=)`)

if triton is not None:

    @triton.jit
    def _gemv_kernel(X, W, S, Y, P, M, N, K, K_PER, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                     SCALED: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr):
        # SWAP: the tile is computed as (W x^T)^T, the weight tile as the product's left operand (as stored, no
        # transpose of the big tile; the rows of x are the small side of the tensor-core product)
        _pdl_wait(PDL)
        pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k0 = pid_s * K_PER
        for k in range(k0, k0 + K_PER, BLOCK_K):
            rk = k + tl.arange(0, BLOCK_K)
            x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            if SCALED:  # FP8 weight: widened to the activations' type in registers
                w = w.to(X.dtype.element_ty)
            if SWAP:
                if IEEE:
                    acc += tl.dot(w, tl.trans(x), input_precision="ieee")
                else:
                    acc += tl.dot(w, tl.trans(x))
            else:
                if IEEE:
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w))
        if SWAP:
            if SCALED:  # the weight row's scale, after the sum (a split's partial sum is scaled alike)
                acc = acc * tl.load(S + rn, mask=rn < N, other=0.0)[:, None]
            mask = (rn[:, None] < N) & (rm[None, :] < M)
            if SPLIT == 1:
                tl.store(Y + rm[None, :] * stride_ym + rn[:, None], acc.to(Y.dtype.element_ty), mask=mask)
            else:
                tl.store(P + pid_s * M * N + rm[None, :] * N + rn[:, None], acc, mask=mask)
        else:
            if SCALED:
                acc = acc * tl.load(S + rn, mask=rn < N, other=0.0)[None, :]
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            if SPLIT == 1:
                tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)
            else:
                tl.store(P + pid_s * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)

    @triton.jit
    def _split_sum_kernel(P, Y, M, N, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(P + s * M * N + offs, mask=mask, other=0.0)
        tl.store(Y + (offs // N) * stride_ym + offs % N, acc.to(Y.dtype.element_ty), mask=mask)


def gemv_plan(N: int, K: int, config: dict | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT, K_PER) for a [N, K] weight: enough programs to keep every SM streaming
    (config["programs"], two per SM of a 132-SM GPU), from the weight's shape alone. `config`: GEMV_CONFIG's form."""
    config = GEMV_CONFIG if config is None else config
    programs, block_n, block_k = config["programs"], config["block_n"], config["block_k"]
    tiles = -(-N // block_n)
    split = 1
    while tiles * split < programs and K // (2 * split) >= 4 * block_k:
        split *= 2
    k_per = -(-K // (split * block_k)) * block_k
    return block_n, block_k, split, k_per


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_matmul_available(device: torch.device) -> bool:
    """Whether cuBLAS multiplies FP8 x FP8 on this device (`torch._scaled_mm`: compute capability 8.9 or newer)."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")
            and torch.cuda.get_device_capability(device) >= (8, 9))


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, M, K, stride_xm, stride_qm, FP8: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row m of the padded rows): scale = max(|x[m]|, 1e-12) / FP8, q[m] = clamp(x[m] / scale) in FP8;
        rows past M (padding) are zeros. In float32, the numbers of the torch ops it replaces."""
        row = tl.program_id(0)
        k = tl.arange(0, BLOCK)
        width = tl.where(row < M, K, 0)  # a padding row reads nothing
        x = tl.load(X + row.to(tl.int64) * stride_xm + k, mask=k < width, other=0.0).to(tl.float32)
        # as torch's ops: a tensor over a number is a product with its reciprocal, over a tensor a rounded division
        s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) * (1.0 / FP8)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8), FP8)
        q = q.to(Q.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(Q + row.to(tl.int64) * stride_qm + k, q, mask=k < K)
        tl.store(S + row, s)


def quantize_rows_fp8(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [rows, K], fp32 scale [rows, 1]): each row scaled so that its largest magnitude is
    FP8's largest (x ~= q * scale), in one kernel; `rows` >= M pads with zero rows (the least scale)."""
    if triton is None:
        raise RuntimeError("quantize_rows_fp8 needs the `triton` package")
    M, K = x.shape
    rows = M if rows is None else rows
    x = unit_rows(x)
    q = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    _quantize_rows_kernel[(rows,)](x, q, s, M, K, x.stride(0), q.stride(0), FP8=FP8_MAX, BLOCK=block,
                                   num_warps=8 if block >= 4096 else 4)
    return q, s


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] (FP8) * scale[N, None]).T -> [..., N] in x's dtype by cuBLAS's FP8 tensor-core
    product: each row of x quantized to FP8 with a scale of its own (|x| max / FP8_MAX, `quantize_rows_fp8`). For
    many rows, where the product is compute-bound; not row-invariant (cuBLAS tiles by the row count)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    # rows padded to a multiple of 16 (a pass of 513 rows broke a CUDA graph's capture)
    x8, xs = quantize_rows_fp8(x2, -(-M // 16) * 16)
    y = torch._scaled_mm(x8, weight.t(), scale_a=xs, scale_b=scale.float()[None, :], out_dtype=x.dtype)
    return y[:M].reshape(*x.shape[:-1], weight.shape[0])


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (float8_e4m3fn [N, K], fp32 scale [N]): each output row scaled so that its largest magnitude
    is FP8's largest (weight ~= w8 * scale[:, None]; an all-zero row gets scale 1)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def linear(x: torch.Tensor, weight: torch.Tensor, max_rows: int = GEMV_ROWS, scale: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N] (as F.linear without bias): the row-invariant kernel up to `max_rows`
    rows, cuBLAS above (or without Triton). With `scale` [N] (fp32), `weight` is FP8 (e4m3), column n of the result
    is multiplied by scale[n], and the kernel takes every number of rows (the weight is widened in registers, never
    in memory: half the bytes of bf16 a call), in GEMV_FP8_CONFIG's tiling."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], weight.shape[0]
    if scale is None and (triton is None or M > max_rows or M == 0):
        return torch.nn.functional.linear(x, weight)
    if triton is None:
        raise RuntimeError("FP8 weights are multiplied by a Triton kernel: install the `triton` package")
    if M == 0:
        return x.new_empty(*x.shape[:-1], N)
    x2 = unit_rows(x2)
    cfg = GEMV_CONFIG if scale is None else GEMV_FP8_CONFIG
    bn, bk, split, k_per = gemv_plan(N, K, cfg)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    p = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    bm = max(16, min(cfg["max_block_m"], triton.next_power_of_2(M)))
    _gemv_kernel[(-(-M // bm), -(-N // bn), split)](
        x2, weight, y if scale is None else scale, y, p, M, N, K, k_per, x2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, IEEE=x.dtype == torch.float32, SCALED=scale is not None,
        SWAP=bool(cfg["swap"]), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_pdl())
    if split > 1:
        block = 1024
        _split_sum_kernel[(-(-M * N // block),)](p, y, M, N, y.stride(0), SPLIT=split, BLOCK=block, **_pdl())
    return y.reshape(*x.shape[:-1], N)


# ---- products of a few rows ---------------------------------------------------------------------
# A decode step at one stream multiplies one row (two in the fast AR's first call) by every weight: pure weight
# streaming. Tensor-core tiles are 16 rows wide, so the kernel above reads its weight tile into a 16-row product;
# this one multiplies in float32 registers, a few output columns per program, all of K in BLOCK_K-wide lanes
# summed at the end, one launch without a split-K pass. Not row-invariant across row counts (`batch_invariant`
# keeps `linear`).

GEMV_SMALL_ROWS = 2  # `gemv_small` takes up to this many rows; the model sends it its products of so many
# Tiling, the fastest in the decode step: 2 columns a program, 512 lanes along K at any row count, 2 warps, 4 weight
# tiles in flight (Triton's software pipeline). At one row it beats cuBLAS, at 2 it is even, at 4 cuBLAS is faster:
# hence products of up to 2 rows only (a stream's own, and the fast AR's first call of one stream). Its many small
# programs each read their first weight tile before waiting for the kernel before (dependent launch): wider tiles,
# faster alone (perf/bench_products.py's `small` forms), make the step slower.
GEMV_SMALL_CONFIG = {"block_n": 2, "block_k": 512, "num_warps": 2, "num_stages": 4}
# A layer's SwiGLU in the last step of its w1 | w3 product where `gemv_small` makes that product (the weight's gate
# and up rows interleaved, a program's two columns a pair): one kernel fewer a layer at one or two rows
SWIGLU_IN_PRODUCT = True

if triton is not None:

    @triton.jit
    def _gemv_small_kernel(X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SCALED: tl.constexpr,
                           SWIGLU: tl.constexpr, PDL: tl.constexpr):
        """Program (tile of BLOCK_N output columns): y[m, n] = sum over k of x[m, k] w[n, k] for the M <= BLOCK_M
        rows, each product in float32, summed along K in BLOCK_K lanes, then across the lanes. The first weight tile
        is read before the wait for the previous kernel (weights are not written by the step), the others through
        Triton's software pipeline, STAGES tiles in flight. SWIGLU: columns 2i and 2i+1 are gate i and up i, and
        the program stores silu(gate) * up in column i of Y ([M, N / 2])."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        mmask = rm[:, None] < M
        w_ptr = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        w = tl.load(w_ptr, mask=nmask[:, None] & (rk[None, :] < K), other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=mmask & (rk[None, :] < K), other=0.0)
        acc = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            kk = k + rk
            w = tl.load(w_ptr + k, mask=nmask[:, None] & (kk[None, :] < K), other=0.0)
            x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=mmask & (kk[None, :] < K), other=0.0)
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        y = tl.sum(acc, axis=2)
        if SCALED:  # FP8 weight: the output row's scale after the sum
            y = y * tl.load(S + rn, mask=nmask, other=0.0)[None, :]
        if SWIGLU:
            g, u = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
            ri = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(Y + rm[:, None] * stride_ym + ri[None, :], _swiglu(g, u, Y.dtype.element_ty),
                     mask=mmask & (ri[None, :] < N // 2))
        else:
            tl.store(Y + rm[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty), mask=mmask & nmask[None, :])


def gemv_small(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
               swiglu: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N] for at most GEMV_SMALL_ROWS rows (F.linear's function; with `scale`
    [N] fp32, `weight` is FP8 e4m3 and column n is multiplied by scale[n], as `linear`). `swiglu`: the weight's
    rows are gate and up interleaved (`model.FeedForward.fuse_weights`), and the result is
    `silu_mul(product, interleaved=True)` [..., N / 2], made in the product's last step (one kernel fewer)."""
    if triton is None:
        raise RuntimeError("gemv_small needs the `triton` package")
    K = x.shape[-1]
    x2 = unit_rows(x.reshape(-1, K))
    M, N = x2.shape[0], weight.shape[0]
    if not 0 < M <= GEMV_SMALL_ROWS:
        raise ValueError(f"gemv_small takes 1 to {GEMV_SMALL_ROWS} rows, not {M}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    cfg = GEMV_SMALL_CONFIG
    bm = triton.next_power_of_2(M)
    bn = cfg["block_n"]
    bk = max(16, min(cfg["block_k"], triton.next_power_of_2(K)))
    if swiglu and (N % 2 or bn % 2):
        raise ValueError(f"gemv_small(swiglu=True) needs an even number of weight rows and of columns a program "
                         f"(GEMV_SMALL_CONFIG['block_n']), not {N} and {bn}")
    n_out = N // 2 if swiglu else N
    y = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    _gemv_small_kernel[(-(-N // bn),)](x2, weight, y if scale is None else scale, y, M, N, K, x2.stride(0),
                                      weight.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                      STAGES=cfg["num_stages"], SCALED=scale is not None, SWIGLU=swiglu,
                                      num_warps=cfg["num_warps"], **_pdl())
    return y.reshape(*x.shape[:-1], n_out)
