"""Run by tests/test_kernels.py in subprocesses with TRITON_INTERPRET=1 (Triton kernels on the CPU)."""
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from s2tts.ar import kernels  # noqa: E402
from s2tts.codec import kernels as codec_kernels  # noqa: E402
from s2tts.ar.loading import load_model  # noqa: E402
from s2tts.engine import Engine, EngineConfig  # noqa: E402
from s2tts.frontend.prompt_builder import PromptBuilder  # noqa: E402
from s2tts.ar.sampling import SamplingParams  # noqa: E402


def fixed_order_dot() -> None:
    """Make the interpreter's `tl.dot` sum each product in one order on every machine.

    The interpreter runs `tl.dot` as numpy's matmul, whose summation order belongs to the BLAS build and the CPU: an
    AMD EPYC's OpenBLAS kernel summed a row differently by its place in the tile, so a row alone and the same row
    beside others differed in the last bit there and nowhere else. A GPU's tile sums in an order set by the kernel's
    tiling alone. Here every output element is numpy's sum of its K products (elementwise numpy, no BLAS), in an
    order set by K alone: the same bits on any CPU and at any place in any tile, so the checks below test the
    kernels' tiles and masks, not the machine's BLAS."""
    from triton.runtime import interpreter as ti

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):  # FP8 operands widen exactly to fp16
            a_data = ti._convert_float(a_data, a.dtype, ti.tl.float16, None).view(np.float16)
            b_data = ti._convert_float(b_data, b.dtype, ti.tl.float16, None).view(np.float16)
        acc = d.data.dtype
        prods = a_data.astype(acc)[..., :, :, None] * b_data.astype(acc)[..., None, :, :]  # [..., M, K, N]
        # numpy's own reduction over K: an order fixed by the shapes, the same on every CPU (no BLAS)
        return ti.TensorHandle(np.add.reduce(prods, axis=-2) + d.data, d.dtype.scalar)

    ti.InterpreterBuilder.create_dot = create_dot


def nearest_casts() -> None:
    """Make the interpreter's float32 -> bf16 and float32 -> FP8 (e4m3) casts round to nearest, ties to even, as a
    GPU's do.

    The interpreter drops the low 16 bits of a bf16 cast (rounds toward zero) and misrounds FP8 casts by up to a
    power of two: a kernel that rounds would give other bits under it than on a GPU and than PyTorch's casts, which
    round to nearest even. Here the cast is PyTorch's."""
    from triton.runtime import interpreter as ti

    cast_impl, fp_to_fp = ti.InterpreterBuilder.cast_impl, ti.InterpreterBuilder.create_fp_to_fp
    torch_types = {ti.tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),
                   ti.tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8)}

    def nearest(src, dst_type):
        to, bits, np_bits = torch_types[dst_type.scalar]
        data = np.asarray(src.data, dtype=np.float32)
        wide = torch.from_numpy(np.ascontiguousarray(data).reshape(-1))
        return ti.TensorHandle(wide.to(to).view(bits).numpy().view(np_bits).reshape(data.shape), dst_type.scalar)

    def cast(self, src, dst_type):
        if src.dtype.scalar == ti.tl.float32 and dst_type.scalar == ti.tl.bfloat16:
            return nearest(src, dst_type)
        return cast_impl(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # (FP8 casts; a kernel asks for ties to even)
        if src.dtype.scalar == ti.tl.float32 and dst_type.scalar == ti.tl.float8e4nv:
            return nearest(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    ti.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    ti.InterpreterBuilder.cast_impl = cast


fixed_order_dot()
nearest_casts()
# `gemv_small` in wider column tiles than a GPU's (each column's sum is the same in any tile width; check_ops runs
# the GPU's width too): the interpreter pays per program (256 columns: one program a product of the tiny model; 32 cost
# the engine check 12-24 s more, 2 nearly 200 s)
SMALL_BLOCK_N = 256
GPU_SMALL_BLOCK_N = kernels.GEMV_SMALL_CONFIG["block_n"]
kernels.GEMV_SMALL_CONFIG["block_n"] = SMALL_BLOCK_N


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_ops():
    torch.manual_seed(0)
    # decode attention over a paged cache vs plain softmax attention, ragged lengths, GQA 4:1, blocks of 8
    # scattered through the pool (and one block size that is not a power of two)
    from s2tts.ar.model import KVCache

    B, H, KV, D, S = 3, 8, 2, 16, 5
    q = torch.randn(B, H, D)
    slots, lens = torch.tensor([4, 0, 2]), torch.tensor([1, 17, 40])
    for BS in (8, 10):
        nb = -(-40 // BS)
        kpool, vpool = torch.randn(S * nb + 1, KV, BS, D), torch.randn(S * nb + 1, KV, BS, D)
        table = (torch.randperm(S * nb) + 1).reshape(S, nb).int()
        k = kpool[table.long()].transpose(1, 2).reshape(S, KV, nb * BS, D)  # each slot's keys in logical order
        v = vpool[table.long()].transpose(1, 2).reshape(S, KV, nb * BS, D)
        # 4 splits of at least 16 keys: length 1 and 17 fit one split (finished there), 40 takes three (combined);
        # with at least 8 keys each, 17 takes two and 40 three
        # (and each tiling choice of DECODE_ATTENTION_CONFIG: values read beside the keys, other pipeline stages)
        for splits, least, cfg in ((1, 1, None), (4, 16, None), (4, 8, None), (1, 1, {"kv_together": 1}),
                                   (4, 8, {"kv_together": 1, "num_stages": 1, "num_warps": 8})):
            out = kernels.decode_attention(q, KVCache(kpool, vpool, table, BS), slots, lens, block_n=16, splits=splits,
                                           min_split=least, config=cfg)
            for b in range(B):
                kk = k[slots[b], :, : lens[b]].repeat_interleave(H // KV, 0)
                vv = v[slots[b], :, : lens[b]].repeat_interleave(H // KV, 0)
                ref = torch.softmax((q[b][:, None] @ kk.transpose(1, 2))[:, 0] * D ** -0.5, -1)[:, None] @ vv
                assert rel(out[b], ref[:, 0]) < 1e-5, ("attention", BS, splits, least, cfg, b, rel(out[b], ref[:, 0]))
            # lengths given as positions (a strided column, as the step's) and the 1 the kernel adds: the same bits
            posc = torch.stack([lens - 1, lens], dim=1)[:, 0]
            assert posc.stride(0) == 2
            again = kernels.decode_attention(q, KVCache(kpool, vpool, table, BS), slots, posc, block_n=16,
                                             splits=splits, min_split=least, config=cfg, lengths_add=1)
            assert torch.equal(again, out), ("lengths_add", BS, splits, least, cfg)
    # rows that never hold more than a short tile's keys (the fast AR's) in the tiling `short_keys_config` gives:
    # the same outputs as the default tiling
    assert kernels.short_keys_config(40, 1) is None and kernels.short_keys_config(11, 1) == {"block_n": 16}
    assert kernels.short_keys_config(11, 64)["num_warps"] == 1
    lens11 = lens.clamp(max=11)
    for rows in (1, 3):
        cache = KVCache(kpool, vpool, table, BS)
        want = kernels.decode_attention(q[:rows], cache, slots[:rows], lens11[:rows], splits=1)
        got = kernels.decode_attention(q[:rows], cache, slots[:rows], lens11[:rows], splits=1,
                                       config=kernels.short_keys_config(11, 64 if rows == 3 else rows))
        assert rel(got, want) < 1e-6, rows
    # q/k norm + RoPE + cache write + attention in one kernel (the fast AR's later calls): the outputs and cache
    # writes of the two kernels it replaces, with and without the q/k norm, at 1 and 3 rows (both tilings)
    from s2tts.ar.model import rope_table

    rope = rope_table(16, D, 10000.0)
    qkv = torch.randn(B, (H + 2 * KV) * D)
    qw, kw = torch.rand(D) + 0.5, torch.rand(D) + 0.5
    posr = torch.tensor([3, 10, 0])
    for norm in (True, False):
        for rows in (1, 3):
            caches = []
            for _ in range(2):
                kp, vp = kpool.clone(), vpool.clone()
                caches.append(KVCache(kp, vp, table, BS))
            a = (qw, kw) if norm else (None, None)
            q1 = kernels.qk_rope_cache(qkv[:rows], *a, rope, posr[:rows], slots[:rows], caches[0], H, KV, D, 1e-6, norm)
            want = kernels.decode_attention(q1, caches[0], slots[:rows], posr[:rows], splits=1, lengths_add=1,
                                            config=kernels.short_keys_config(11, rows))
            got = kernels.rope_attend_short(qkv[:rows], *a, rope, posr[:rows], slots[:rows], caches[1], H, KV, D,
                                            1e-6, norm, kernels.short_keys_config(11, rows))
            assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v), (norm, rows)
            assert rel(got, want) < 1e-6, ("rope_attend_short", norm, rows, rel(got, want))
    # ... in bf16 and fp16: upstream's bits (q/k normed by `torch.nn.RMSNorm`, rounded once after the weight, as the
    # model's `HeadNorm`; then RoPE), the q that `qk_rope_cache` returns and the key both kernels write. Values k/8
    # (|k| <= 64): their squares sum exactly in any order, so the kernels' mean square is torch's to the bit
    from s2tts.ar.model import RMSNorm, apply_rope

    for dt in (torch.bfloat16, torch.float16):
        x = (torch.randint(-64, 65, (B, (H + 2 * KV) * D)) / 8).to(dt)
        wq, wk = (torch.rand(D) * 1.5 + 0.25).to(dt), (torch.rand(D) * 1.5 + 0.25).to(dt)
        r = rope[posr][:, None]  # [B, 1, D/2, 2]

        def reference(norm_type):
            outs = []
            for w, cols, heads in ((wq, slice(0, H * D), H), (wk, slice(H * D, (H + KV) * D), KV)):
                m = norm_type(D, 1e-6).to(dt)
                m.weight.data = w
                outs.append(apply_rope(m(x[:, cols].reshape(B, 1, heads, D)), r)[:, 0])
            return outs

        with torch.no_grad():
            want_q, want_k = reference(torch.nn.RMSNorm)
            twice_q, twice_k = reference(RMSNorm)  # the layer norms' two roundings
        assert not torch.equal(twice_q, want_q) and not torch.equal(twice_k, want_k)  # the inputs tell the two apart
        caches = [KVCache(kpool.to(dt), vpool.to(dt), table, BS) for _ in range(2)]
        got_q = kernels.qk_rope_cache(x, wq, wk, rope, posr, slots, caches[0], H, KV, D, 1e-6, True)
        assert torch.equal(got_q, want_q), (dt, int((got_q != want_q).sum()))
        out = kernels.rope_attend_short(x, wq, wk, rope, posr, slots, caches[1], H, KV, D, 1e-6, True,
                                        kernels.short_keys_config(11, B))
        blk, off = table[slots, posr // BS].long(), posr % BS
        for c in caches:
            assert torch.equal(c.k[blk, :, off], want_k), dt
            assert torch.equal(c.v[blk, :, off], x[:, (H + KV) * D :].reshape(B, KV, D)), dt
        ref = kernels.decode_attention(got_q, caches[0], slots, posr, splits=1, lengths_add=1,
                                       config=kernels.short_keys_config(11, B))
        assert rel(out, ref) < 1e-6, ("rope_attend_short", dt, rel(out, ref))
    # rms norm (+ residual add) and silu*mul against the module code
    from s2tts.ar.model import RMSNorm

    x, y, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    m = RMSNorm(64, 1e-6)
    m.weight.data = w
    assert rel(kernels.rms_norm(x, w, 1e-6), m(x)) < 1e-6
    h, n = kernels.rms_norm(y, w, 1e-6, residual=x)
    assert rel(h, x + y) < 1e-7 and rel(n, m(x + y)) < 1e-6
    gu = torch.randn(3, 2 * 48)
    assert rel(kernels.silu_mul(gu), torch.nn.functional.silu(gu[:, :48]) * gu[:, 48:]) < 1e-6
    assert rel(kernels.silu_mul(gu, interleaved=True), torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2]) < 1e-6
    # the SwiGLU in the product's last step (gate / up rows interleaved): the bits of the product, then silu_mul,
    # in bf16 and fp32, FP8 weights too; the model's MLP with its w1 | w3 interleaved gives the unfused MLP's result
    wg, xg = torch.randn(2 * 40, 300) / 17, torch.randn(2, 300)
    wg8, sg = kernels.quantize_fp8(wg)
    for bn in (GPU_SMALL_BLOCK_N, SMALL_BLOCK_N):
        kernels.GEMV_SMALL_CONFIG["block_n"] = bn
        for dt in (torch.float32, torch.bfloat16):
            for m in (1, 2):
                xs, ws = xg[:m].to(dt), wg.to(dt)
                want = kernels.silu_mul(kernels.gemv_small(xs, ws), interleaved=True)
                got = kernels.gemv_small(xs, ws, swiglu=True)
                assert got.shape == (m, 40) and torch.equal(got, want), (bn, dt, m)
                want = kernels.silu_mul(kernels.gemv_small(xs, wg8, scale=sg), interleaved=True)
                assert torch.equal(kernels.gemv_small(xs, wg8, scale=sg, swiglu=True), want), (bn, dt, m)
    kernels.GEMV_SMALL_CONFIG["block_n"] = SMALL_BLOCK_N
    try:
        kernels.gemv_small(xg[:1], wg[:79], swiglu=True)
        raise AssertionError("gemv_small(swiglu=True) took an odd number of rows")
    except ValueError as e:
        assert "even" in str(e)
    from types import SimpleNamespace

    from s2tts.ar.model import FeedForward, KernelLinear, _kernel_linears

    ff = FeedForward(SimpleNamespace(dim=300, intermediate_size=40))
    ff.w1.weight.data, ff.w3.weight.data = wg[:40].clone(), wg[40:].clone()
    with torch.no_grad():
        plain = ff(xg)
        ff.fuse_weights()
        assert torch.equal(ff.w13.weight[1::2], wg[40:]) and rel(ff(xg), plain) < 1e-6
        list(_kernel_linears(ff))
        ff.fused, ff.w13.small = True, True
        assert isinstance(ff.w13, KernelLinear) and rel(ff(xg[:1]), plain[:1]) < 1e-6
    # products of a few rows (`gemv_small`): 1 and 2 rows, K not a multiple of the lanes nor N of the column tile, a
    # strided row view (the fast AR's last position), FP8 weights with their scale; more rows are refused
    w, x = torch.randn(37, 1500), torch.randn(4, 2, 1500)
    w8, scale = kernels.quantize_fp8(w)
    for m, bn in ((1, GPU_SMALL_BLOCK_N), (2, SMALL_BLOCK_N), (2, GPU_SMALL_BLOCK_N)):
        kernels.GEMV_SMALL_CONFIG["block_n"] = bn
        assert rel(kernels.gemv_small(x[:m, -1], w), x[:m, -1] @ w.T) < 1e-6, m
        assert rel(kernels.gemv_small(x[:m, -1], w8, scale=scale), x[:m, -1] @ (w8.float() * scale[:, None]).T) < 1e-6
    kernels.GEMV_SMALL_CONFIG["block_n"] = SMALL_BLOCK_N
    try:
        kernels.gemv_small(torch.randn(kernels.GEMV_SMALL_ROWS + 1, 1500), w)
        raise AssertionError("gemv_small took too many rows")
    except ValueError as e:
        assert "rows" in str(e)
    # sampling: the kernel draws the same ranks as the PyTorch code (same hash, same masks)
    from s2tts.ar.sampling import _choose

    for V in (65, 1024, 4097):
        B = 6
        sl = torch.randn(B, V).sort(-1, descending=True).values * 3
        t = torch.tensor([0.0, 0.5, 0.8, 1.0, 1.5, 0.8])
        p_ = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.95, 1.0])
        k = torch.tensor([0, 30, 30, 5, 0, 1])
        seed = torch.tensor([1, 2**40 + 3, 5, 7, 11, 13])
        same = 0
        for st in range(20):
            step = torch.full((B,), st)
            a = _choose(sl, t, p_, k, seed, step, st % 12, kernel=False)
            b = _choose(sl, t, p_, k, seed, step, st % 12, kernel=True)
            same += int((a == b).sum())
        assert same >= 20 * B - 1, (V, same)  # a float near-tie may flip at most once
    # rows the kernel sorts itself (the fast AR's): the index the sort + kernel + gather path gives, exact ties too
    from s2tts.ar.sampling import sample

    for V in (65, 300):
        B = 6
        lg = torch.randn(B, 512)[:, :V] * 3  # a strided view, as the fast AR's sliced logits are
        lg[1, 5] = lg[1, 7]
        t = torch.tensor([0.0, 0.5, 0.8, 1.0, 1.5, 0.8])
        p_ = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.95, 1.0])
        k = torch.tensor([0, 30, 30, 5, 0, 1])
        seed = torch.tensor([1, 2**40 + 3, 5, 7, 11, 13])
        for st in range(4 if V < 128 else 2):  # (the interpreter's sort of 512 keys is slow: two draws at 300)
            step = torch.full((B,), st)
            a = sample(lg, t, p_, k, seed, step, 3 + st, kernel=False)
            b = sample(lg, t, p_, k, seed, step, 3 + st, kernel=True)
            assert torch.equal(a, b), (V, st, a, b)
        # bf16 logits (the fast AR's on a GPU; ties are common at 8 bits of mantissa), sorted as 32-bit keys: the
        # index of the stable float32 sort of the same values, every row's top two tied (the draw's noise is by
        # rank: the other order would change the rows that keep rank 0 only). One step: the interpreter's sort is slow
        lb = (lg * 4).to(torch.bfloat16)
        lb[:, 5] = lb[:, 7] = lb.max(-1).values + 1
        a = sample(lb.float(), t, p_, k, seed, step, 3, kernel=False)
        assert torch.equal(sample(lb, t, p_, k, seed, step, 3, kernel=False), a) and a[0] == 5
        assert torch.equal(sample(lb, t, p_, k, seed, step, 3, kernel=True), a), V
    # the slow AR's code-0 draw with the end token masked inside `sample_semantic` (the runner's call): what the
    # masked logits give, the RAS draw taken where the first is among the recent codes; fp32 logits and bf16-valued
    # ones. Distinct values: the CPU's sort breaks ties in no fixed order
    from s2tts.ar.sampling import sample_semantic

    V, end = 200, 199
    allow = torch.tensor([True, False, True, False, True, True])
    for lg in (torch.randn(B, V) * 3, (torch.stack([torch.randperm(V) for _ in range(B)]) * 0.0625).bfloat16().float()):
        lg[:, end] = lg.max(-1).values + 1  # the end token on top: where it is not allowed the draw must skip it
        masked = lg.masked_fill((torch.arange(V) == end)[None, :] & ~allow[:, None], float("-inf"))
        step = torch.full((B,), 5)
        empty = torch.full((B, 10), -1)
        first = sample_semantic(masked, empty, t, p_, k, seed, step)
        recent = empty.clone()
        recent[::2, 3] = first[::2]  # rows 0, 2, 4 just drew it: their RAS draw is taken
        want = sample_semantic(masked, recent, t, p_, k, seed, step)
        got = sample_semantic(lg, recent, t, p_, k, seed, step, end_index=end, allow_end=allow, kernel=True)
        assert torch.equal(got, want) and (got[~allow] != end).all() and (got[allow & (k == 0)] == end).all(), (got, want)
    print("ops ok")


def check_engine(ckpt):
    """The whole engine with every Triton kernel on (paged cache, blocks of 8, keys split between up to 4 programs by
    both of the runner's rules;
    every token a row of one pass, padded to a row bucket, prompts prefilled 16 tokens a step beside the decode rows)
    gives the logits and codes of the plain PyTorch path over the slot layout (decode rows as a batch, each prompt
    as a sequence, all of it at once)."""
    pb = PromptBuilder.from_dir(ckpt)
    prompts = [pb.build(t) for t in ("Kernel check one.", "A second, longer kernel check prompt.")]
    results = []
    for kern in (False, True):
        model = load_model(ckpt, "cpu", "fp32")
        eng = Engine(model, 32, EngineConfig(max_batch=4, max_seq_len=128, cuda_graphs=False, decode_kernel=kern,
                                             fused_kernels=kern, kv_block_tokens=8 if kern else 0, decode_splits=4 if kern else None, row_buckets=kern, max_prefill_tokens=16 if kern else 512))
        ways = []
        if kern:  # rows' keys split by both rules: past 53 keys of the longest row (`decode_splits`, parts of at
            # least 16), and in passes of up to 16 rows (FEW_ROWS, parts of at least 8; its 20-row passes not split).
            # A real server: past 2048 keys in parts of at least 1024, and passes of up to 4 rows in parts of 32.
            r = eng.runner
            r.SPLIT_FROM, r.min_split, r.FEW_ROWS, r.FEW_ROWS_MIN_SPLIT = 53, 16, 16, 8
            use_split = r._use_split
            r._use_split = lambda way: ways.append(way) or use_split(way)
        tilings, attention = [], kernels.decode_attention  # the fast AR's rows in the short-keys tiling
        short_rows = []  # rows of the passes in the short tiling

        def counted_attention(q, *a, **k):
            tilings.append(k.get("config"))
            if k.get("config"):
                short_rows.append(q.shape[0])
            return attention(q, *a, **k)

        kernels.decode_attention = counted_attention
        small, gemv_small = [], kernels.gemv_small
        kernels.gemv_small = lambda *a, **k: small.append(a[0].numel() // a[0].shape[-1]) or gemv_small(*a, **k)
        # the fast AR's later calls: norm, RoPE, attention in one kernel from 2 rows here (a server: from 5), its 1-row
        # passes in the two kernels
        joined, rope_attend, min_rows = [], kernels.rope_attend_short, kernels.ROPE_ATTEND_MIN_ROWS
        kernels.rope_attend_short = lambda *a, **k: joined.append(a[0].shape[0]) or rope_attend(*a, **k)
        kernels.ROPE_ATTEND_MIN_ROWS = 2
        mixed, inner = [], eng.runner._slow_pass
        eng.runner._slow_pass = lambda dec, ch, first: mixed.append(bool(dec and ch)) or inner(dec, ch, first)
        logits = {}
        eng.logits_hook = lambda ids, lg: [logits.setdefault(i, []).append(lg[j].clone()) for j, i in enumerate(ids)]
        frames = {f"r{i}": [] for i in range(2)}
        step = 0
        while step < 3 or eng.has_work():
            if step in (0, 2):  # the second arrives while the first decodes
                i = step // 2
                eng.submit(f"r{i}", prompts[i], SamplingParams(seed=i, max_new_tokens=5, ignore_end=True))
            for o in eng.step():
                frames[o.request_id].append(o.codes)
            step += 1
        assert any(mixed) and eng.runner.flat == kern, mixed  # prompt rows beside decode rows (with the kernel: as rows)
        assert not kern or {(4, 16), (4, 8), (1, 16)} <= set(ways), sorted(set(ways))
        kernels.gemv_small = gemv_small
        kernels.decode_attention = attention
        kernels.rope_attend_short, kernels.ROPE_ATTEND_MIN_ROWS = rope_attend, min_rows
        assert (joined and min(joined) == 2) if kern else not joined, joined[:4]
        assert not kern or 1 in short_rows, short_rows  # 1-row passes: the two kernels
        assert (None in tilings and {"block_n": 16} in tilings) if kern else not tilings, tilings[:4]
        # the kernels' products of up to GEMV_SMALL_ROWS rows (decode passes, the fast AR) in `gemv_small`, the others not
        assert (small and set(small) <= set(range(1, kernels.GEMV_SMALL_ROWS + 1))) if kern else not small, sorted(set(small))
        results.append(({k: np.concatenate(v) for k, v in frames.items()}, logits))
    (c0, l0), (c1, l1) = results
    for rid in c0:
        np.testing.assert_array_equal(c0[rid], c1[rid])
        assert c0[rid].shape == (5, 10)
        for a, b in zip(l0[rid], l1[rid]):
            assert rel(b, a) < 1e-5, rel(b, a)
    print("engine ok")


def check_invariant(ckpt):
    """batch_invariant with the kernels: every matrix product row-invariant (a row alone and beside others gives the
    same bits, any row count), passes scheduled as usual (no padding, prompts beside decode rows), and a request's
    codes the same alone and beside others."""
    # Tiles grow with the rows (16 to 128): a row must give the same bits in any of them (fixed_order_dot makes the
    # interpreter's tile product sum in one order, as a GPU's does).
    torch.manual_seed(1)
    w, x = torch.randn(40, 48), torch.randn(37, 48)
    w8, scale = kernels.quantize_fp8(w)
    assert w8.dtype == torch.float8_e4m3fn and rel(w8.float() * scale[:, None], w) < 0.05
    for swap in (0, 1):  # the tile as x W^T or as (W x^T)^T
        kernels.GEMV_CONFIG["swap"] = kernels.GEMV_FP8_CONFIG["swap"] = swap
        full = kernels.linear(x, w, 64)
        assert rel(full, x @ w.T) < 1e-6, swap
        assert all(torch.equal(kernels.linear(x[i : i + 1], w, 64)[0], full[i]) for i in (0, 15, 16, 36))
        # FP8 weights (a scale per output row): the product of the widened weight, at any row count, rows invariant
        full8 = kernels.linear(x, w8, scale=scale)
        assert rel(full8, x @ (w8.float() * scale[:, None]).T) < 1e-6
        assert all(torch.equal(kernels.linear(x[i : i + 1], w8, scale=scale)[0], full8[i]) for i in (0, 15, 16, 36))
    kernels.GEMV_CONFIG["swap"] = kernels.GEMV_FP8_CONFIG["swap"] = 0
    # the activations' quantization of cuBLAS's FP8 product (`fp8_matmul`) in one kernel: the numbers of the torch
    # operations it replaced on a GPU, bit for bit (where a tensor over a number is a product with its float32
    # reciprocal), rows padded with zeros
    for rows, k, dt in ((3, 300, torch.bfloat16), (5, 1500, torch.float32)):
        xq = torch.randn(rows, k).to(dt) * 3
        xq[1] = 0  # an all-zero row: the least scale
        q8, qs = kernels.quantize_rows_fp8(xq, 16)
        want_s = xq.abs().amax(1, keepdim=True).float().clamp(min=1e-12) * torch.tensor(1 / kernels.FP8_MAX)
        want_q = (xq.float() / want_s).clamp(-kernels.FP8_MAX, kernels.FP8_MAX).to(torch.float8_e4m3fn)
        assert q8.shape == (16, k) and qs.shape == (16, 1) and torch.equal(qs[:rows], want_s), (rows, dt)
        assert torch.equal(q8[:rows].view(torch.uint8), want_q.view(torch.uint8)), (rows, dt)
        assert not q8[rows:].view(torch.uint8).any() and torch.all(qs[rows:] > 0)
    pb = PromptBuilder.from_dir(ckpt)
    prompts = [pb.build(t) for t in ("Invariant one.", "The second one, a little longer.")]
    model = load_model(ckpt, "cpu", "fp32")

    def run(ids):
        eng = Engine(model, 32, EngineConfig(max_batch=4, max_seq_len=128, cuda_graphs=False, decode_kernel=True,
                                             fused_kernels=True, batch_invariant=True, max_prefill_tokens=16))
        assert not eng.runner.apart and model.slow.layers[0].attention.wqkv.invariant_rows > 0
        out, step = {i: [] for i in ids}, 0
        while step < 2 * len(ids) or eng.has_work():
            if step % 2 == 0 and step // 2 < len(ids):
                i = ids[step // 2]
                eng.submit(str(i), prompts[i], SamplingParams(seed=7 + i, max_new_tokens=4, ignore_end=True))
            made = eng.step()
            for o in made:
                out[int(o.request_id)].append(o.codes)
            # a frame of the first while the second's prompt is still being filled: prompt rows beside decode rows
            beside.append(len(ids) > 1 and bool(out[ids[0]]) and any(o.request_id == str(ids[0]) for o in made)
                          and step >= 2 and not out[ids[1]])
            step += 1
        return {i: np.concatenate(v) for i, v in out.items()}

    joined, rope_attend, min_rows = [], kernels.rope_attend_short, kernels.ROPE_ATTEND_MIN_ROWS
    kernels.rope_attend_short = lambda *a, **k: joined.append(a[0].shape[0]) or rope_attend(*a, **k)
    kernels.ROPE_ATTEND_MIN_ROWS = 1
    beside = []
    together = run([0, 1])  # the second arrives while the first decodes: its prompt rows beside the decode rows
    assert any(beside), beside
    kernels.rope_attend_short, kernels.ROPE_ATTEND_MIN_ROWS = rope_attend, min_rows
    assert not joined, joined
    for i in range(2):
        np.testing.assert_array_equal(together[i], run([i])[i])
    # the fast AR's attention in one tiling at any row count, never the joined kernel (its warps follow the rows)
    fa = model.fast.layers[0].attention
    assert fa.rows_invariant and fa._tiling(64) == fa._tiling(1) == {"block_n": 16}, fa._tiling(64)
    Engine(model, 32, EngineConfig(max_batch=4, max_seq_len=128, cuda_graphs=False, decode_kernel=True))
    assert model.slow.layers[0].attention.wqkv.invariant_rows == 0  # an engine without it puts them back
    assert not fa.rows_invariant and fa._tiling(64)["num_warps"] == 1
    print("invariant ok")


def check_codec(ckpt):
    """The codec's kernels (Snake with a joined left context and a folded bias, the biased residual sum, the
    convolution to one channel, RoPE; the channels-last convolution with its epilogues, and a transposed
    convolution in its form) against PyTorch, and the codec (its transformers' norms, SwiGLU and scaled residual
    sums too) streaming, decoding and encoding with them, its decoder channels-first and channels-last, against
    without."""
    import torch.nn.functional as F

    from s2tts.codec.loading import load_codec_from_dir
    from s2tts.codec.model import use_triton_kernels

    def snake_ref(v, alpha):  # the Snake of v, alpha broadcast along v's channels
        return v + torch.sin(alpha * v).pow(2) / (alpha + 1e-9)

    torch.manual_seed(0)
    wide = torch.randn(2, 5, 40)
    x = wide[..., 3:37]  # unit stride along time only, as a transposed convolution's trimmed output is
    a, bias, prefix = torch.rand(1, 5, 1) + 0.2, torch.randn(5), torch.randn(2, 5, 6)
    xb = x + bias[:, None]
    ref = snake_ref(xb, a)
    assert rel(codec_kernels.snake(x, a, prefix, bias), torch.cat([prefix, ref], -1)) < 1e-6
    assert rel(codec_kernels.snake(x.contiguous(), a), snake_ref(x, a)) < 1e-6
    y = torch.randn(2, 5, 34)
    assert rel(codec_kernels.add_bias(x, y, bias), x + y + bias[:, None]) < 1e-6
    for dil in (1, 3):
        w, b = torch.randn(1, 5, 7), torch.randn(1)
        assert rel(codec_kernels.conv_to_one(wide, w, b, dil), F.conv1d(wide, w, b, dilation=dil)) < 1e-6
    # the channels-last convolution (the decoder's): taps, dilations, 1x1, output channels not a multiple of the
    # tile, input channels in 32s, 16s and fewer (masked), one output channel; bias + residual, and their Snake
    # returned, or written after a left context with the sum also returned
    for c_in, c_out, k, dil, t in ((32, 48, 7, 3, 37), (48, 16, 1, 1, 20), (8, 40, 7, 9, 70), (4, 1, 7, 1, 30)):
        xi, w = torch.randn(2, c_in, t), torch.randn(c_out, c_in, k) / (c_in * k) ** 0.5
        b, al = torch.randn(c_out), torch.rand(c_out) + 0.5
        plain = F.conv1d(xi, w, dilation=dil)
        res = torch.randn_like(plain)
        summed = plain + b[:, None] + res
        full = snake_ref(summed, al[:, None])
        wn, xt = codec_kernels.conv_weight_nwc(w), xi.transpose(1, 2)
        assert rel(codec_kernels.conv1d_nwc(xt, wn, dil).transpose(1, 2), plain) < 1e-6
        got = codec_kernels.conv1d_nwc(xt, wn, dil, bias=b, residual=res.transpose(1, 2), alpha=al)
        assert rel(got.transpose(1, 2), full) < 1e-6
        buf = torch.full((2, 5 + plain.shape[-1], c_out), 7.0)
        raw = codec_kernels.conv1d_nwc(xt, wn, dil, b, res.transpose(1, 2), al, snake_out=buf[:, 5:], raw=True)
        assert rel(raw.transpose(1, 2), summed) < 1e-6 and rel(buf[:, 5:].transpose(1, 2), full) < 1e-6
        assert torch.equal(buf[:, :5], torch.full_like(buf[:, :5], 7.0))  # the left context's rows untouched
        assert codec_kernels.conv1d_nwc(xt, wn, dil, alpha=al, snake_out=buf[:, 5:]) is None
    # in each tiling that a GPU's choice by shape (`conv_nwc_tiling`) makes for the decoder's convolutions at 1, 8
    # and 64 streams on 132 multiprocessors
    shapes = ((32, 1024, 1536, 7), (32, 1536, 6144, 2), (256, 768, 768, 7), (256, 768, 768, 1), (2048, 384, 384, 7),
              (2048, 384, 384, 1), (2048, 384, 768, 2), (8192, 192, 192, 7), (8192, 192, 192, 1), (8192, 192, 192, 2),
              (16384, 96, 96, 1), (16384, 96, 96, 7))
    tilings = {tuple(sorted(codec_kernels.conv_nwc_tiling(b * t, ci, co, k, 132).items()))
               for b in (1, 8, 64) for t, ci, co, k in shapes}
    assert len(tilings) >= 8, tilings
    # float32 (the fallback decoder): no 128 x 256 tiles (their pipeline would not fit an SM's shared memory), and
    # its residual units as two convolutions on a GPU
    assert all(codec_kernels.conv_nwc_tiling(b * t, ci, co, k, 132, 4).get("block_co", 128) <= 128
               for b in (1, 8, 64) for t, ci, co, k in shapes)
    assert codec_kernels.res_unit_applies(192, torch.zeros(1, dtype=torch.float32))  # on the CPU (interpreted)
    assert not codec_kernels.res_unit_applies(384, torch.zeros(1, dtype=torch.float16))
    # 320 output channels: a 256-wide tile's second one is partly masked
    xi, w = torch.randn(2, 64, 40), torch.randn(320, 64, 3) / (64 * 3) ** 0.5
    b, al = torch.randn(320), torch.rand(320) + 0.5
    summed = F.conv1d(xi, w, b, dilation=2)
    full = snake_ref(summed, al[:, None])
    tiling = dict(codec_kernels.CONV_NWC_CONFIG)
    for t in tilings:
        codec_kernels.CONV_NWC_CONFIG.update(tiling, **dict(t))
        got = codec_kernels.conv1d_nwc(xi.transpose(1, 2), codec_kernels.conv_weight_nwc(w), 2, bias=b, alpha=al)
        assert rel(got.transpose(1, 2), full) < 1e-6, t
    codec_kernels.CONV_NWC_CONFIG.update(tiling)
    # a residual unit in one kernel (`res_unit_nwc`) against its two convolutions: channels in 32s (a partial
    # power-of-two tile), in 16s, and masked (40); dilation 3; y returned or not
    unit_tiling = dict(codec_kernels.RES_UNIT_CONFIG)
    for C, tile in ((96, 64), (48, 16), (40, 64)):
        codec_kernels.RES_UNIT_CONFIG.update(block_n=tile)
        h_in = torch.randn(2, 30, C)
        w7, w1 = torch.randn(C, C, 7) / (7 * C) ** 0.5, torch.randn(C, C, 1) / C ** 0.5
        b7, b1, a2, a3 = torch.randn(C), torch.randn(C), torch.rand(C) + 0.5, torch.rand(C) + 0.5
        w7n, w1n = codec_kernels.conv_weight_nwc(w7), codec_kernels.conv_weight_nwc(w1)
        x = torch.randn(2, 12, C)
        hh = codec_kernels.conv1d_nwc(h_in, w7n, 3, b7, alpha=a2)
        ref_s = torch.empty(2, 12, C)
        ref_y = codec_kernels.conv1d_nwc(hh, w1n, 1, b1, residual=x, alpha=a3, snake_out=ref_s, raw=True)
        want = x + F.conv1d(snake_ref(F.conv1d(h_in.transpose(1, 2), w7, b7, dilation=3), a2[:, None]), w1,
                            b1).transpose(1, 2)
        assert rel(ref_y, want) < 1e-5
        for raw in (True, False):
            buf = torch.full((2, 4 + 12, C), 7.0)
            y = codec_kernels.res_unit_nwc(h_in, w7n, 3, b7, a2, w1n, b1, x, a3, buf[:, 4:], raw=raw)
            assert (y is None) != raw and torch.equal(buf[:, :4], torch.full_like(buf[:, :4], 7.0))
            assert rel(buf[:, 4:], ref_s) < 1e-6, (C, raw)
            if raw:
                assert rel(y, ref_y) < 1e-6, C
    codec_kernels.RES_UNIT_CONFIG.update(unit_tiling)
    for c_in, c_out, stride in ((16, 8, 2), (32, 24, 4)):  # a transposed convolution as two taps, bias per channel
        xi, w, b = torch.randn(2, c_in, 9), torch.randn(c_in, c_out, 2 * stride) / (2 * c_in) ** 0.5, torch.randn(c_out)
        ctx = torch.randn(2, c_in, 1)  # the input step before (a stream's left context)
        ref = F.conv_transpose1d(torch.cat([ctx, xi], -1), w, b, stride)[..., stride : stride * 10]
        got = codec_kernels.conv1d_nwc(torch.cat([ctx, xi], -1).transpose(1, 2),
                                       codec_kernels.conv_transpose_weight_nwc(w, stride), bias=b)
        assert rel(got.reshape(2, 9 * stride, c_out).transpose(1, 2), ref) < 1e-6

    from s2tts.codec.model import apply_rope, rope_cos_sin

    qkv = torch.randn(2, 5, 3, 4, 16)  # [B, T, q|k|v, H, D]: q and k are strided views, as the codec's are
    rope = rope_cos_sin(torch.arange(7, 12)[None].expand(2, 5), 16, 10000.0)
    assert rel(codec_kernels.rope_pairs(qkv[:, :, 1], rope), apply_rope(qkv[:, :, 1], rope)) < 1e-6

    def varied_snakes(codec, seed=None):  # the tiny checkpoint's alphas are ones
        for name, p in codec.named_parameters():
            if name.endswith("alpha"):
                p.data.uniform_(0.3, 2.0, generator=None if seed is None else torch.Generator().manual_seed(seed))
        return codec

    codec = varied_snakes(load_codec_from_dir(ckpt, "cpu", "fp32"))
    cfg = codec.config
    codes = torch.cat([torch.randint(0, cfg.semantic_codebook_size, (2, 1, 6)),
                       torch.randint(0, cfg.codebook_size, (2, cfg.n_codebooks, 6))], 1)
    wav = torch.randn(2, 1, cfg.frame_length * 3) * 0.3
    got = {}
    # the interpreter's time is per program: long tiles along time for the decoder (the default tiling's masks
    # and partial tiles are checked above)
    tiling = dict(codec_kernels.CONV_NWC_CONFIG)
    codec_kernels.CONV_NWC_CONFIG.update(block_t=4096, block_co=128)
    unit_tiling = dict(codec_kernels.RES_UNIT_CONFIG)
    codec_kernels.RES_UNIT_CONFIG.update(block_t=4096)
    with torch.inference_mode():
        for mode in ("off", "channels_first", "channels_last"):
            use_triton_kernels(codec, mode != "off", channels_last=mode == "channels_last")
            for B in (1, 2):  # one stream: its size-1 dimensions give reshapes views of other strides
                if mode == "channels_first" and B == 1:  # channels-first decoding is only bench_codec's baseline
                    got[mode, B] = (None, None, codec.encode(wav[:B]))  # (a reference clip: one stream)
                    continue
                st, parts = codec.new_stream_state(B), []
                for sl in (slice(0, 2), slice(2, 3), slice(3, 6)):
                    audio, st = codec.decode_stream(codes[:B, :, sl], st)
                    parts.append(audio)
                # (the encoder has no channels-last form: encoded once with the kernels)
                got[mode, B] = (torch.cat(parts, -1), codec.decode(codes[:B]),
                                codec.encode(wav[:B]) if mode != "channels_last" else None)
    use_triton_kernels(codec, False)
    assert codec.new_stream_state(1).tensors["decoder.model.0"].shape[1:] == (cfg.latent_dim, 6)  # [B, C, ctx] again
    for B in (1, 2):
        for mode in ("channels_first", "channels_last") if B == 2 else ("channels_last",):
            off, on = got["off", B], got[mode, B]
            assert rel(on[0], off[0]) < 1e-5 and rel(on[1], off[1]) < 1e-5, (mode, B)
            assert rel(on[0], on[1]) < 1e-5  # chunks join without seams
    for B in (1, 2):  # the encoder, with the kernels
        assert torch.equal(got["channels_first", B][2], got["off", B][2])

    # the served path channels-last, as dac_decoder runs it: fp16 streams in the slot pool; a chunk that overflows
    # fp16 decoded again by the fp32 fallback (channels-last too) from the stream's previous [B, ctx, C] states
    from test_codec_stream import HOT as hot, _overflowing_codec  # a code whose fp16 activations overflow

    from s2tts.codec.stream import StreamDecoder

    half, wide = (varied_snakes(_overflowing_codec(ckpt, dt), seed=1) for dt in ("fp16", "fp32"))
    for c in (half, wide):
        use_triton_kernels(c, True)
    assert half.decoder.channels_last and wide.decoder.channels_last
    gen = np.random.default_rng(2)
    streams = {k: np.concatenate([gen.integers(0, hot, (1, 4)), gen.integers(0, cfg.codebook_size, (cfg.n_codebooks, 4))])
               for k in ("cool", "hot")}
    streams["hot"][0, 3] = hot  # in its second (last) chunk of 2 frames
    dec = StreamDecoder(half, fallback=wide, pool_size=4)
    parts = {k: [] for k in streams}
    for i in range(2):
        out = dec.decode_many([(k, k, c[:, 2 * i : 2 * i + 2].T, i == 0, i == 1) for k, c in streams.items()], now=i)
        for k, audio in out.items():
            assert isinstance(audio, np.ndarray), audio
            parts[k].append(audio)
    assert dec.redone == 1 and not dec.states and sorted(dec.pool.free) == [0, 1, 2, 3]
    for k, c in streams.items():
        with torch.inference_mode():
            whole = wide.decode(torch.as_tensor(c)[None])[0, 0].numpy()
        audio = np.concatenate(parts[k])
        assert np.isfinite(audio).all() and audio.shape == whole.shape
        assert np.abs(audio - whole).max() < 0.05 * np.abs(whole).max(), k
    codec_kernels.CONV_NWC_CONFIG.update(tiling)
    codec_kernels.RES_UNIT_CONFIG.update(unit_tiling)
    print("codec ok")


def check_fp8(ckpt):
    """FP8 weights (`ar_weights=fp8`): the engine with the kernels (every layer matrix through `kernels.linear`, the
    weight widened in registers) gives the logits and codes of the PyTorch path (the weight widened in memory)."""
    from s2tts.ar.model import Fp8Linear

    prompt = PromptBuilder.from_dir(ckpt).build("Eight bits a weight.")
    results = []
    for kern in (False, True):
        model = load_model(ckpt, "cpu", "fp32", weights="fp8")
        eng = Engine(model, 32, EngineConfig(max_batch=2, max_seq_len=128, cuda_graphs=False, decode_kernel=kern,
                                             fused_kernels=kern, kv_block_tokens=8 if kern else 0))
        assert model.fast.layers[0].feed_forward.w13.kernel == kern and isinstance(model.slow.layers[0].attention.wo, Fp8Linear)
        logits = []
        eng.logits_hook = lambda ids, lg: logits.append(lg[0].clone())
        codes, _ = eng.generate(prompt, SamplingParams(seed=3, max_new_tokens=6, ignore_end=True))
        results.append((codes, logits))
    (c0, l0), (c1, l1) = results
    np.testing.assert_array_equal(c0, c1)
    assert len(l0) == len(l1) == 6 and all(rel(b, a) < 1e-5 for a, b in zip(l0, l1))
    print("fp8 ok")


CHECKS = {"ops": lambda ckpt: check_ops(), "codec": check_codec, "engine": check_engine, "invariant": check_invariant,
          "fp8": check_fp8}

if __name__ == "__main__":  # interpreted_kernels.py CKPT [check ...] (default: all)
    for name in sys.argv[2:] or CHECKS:
        CHECKS[name](sys.argv[1])
