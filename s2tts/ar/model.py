"""The S2 Pro dual-AR transformer: a Qwen3-shaped slow AR and a 4-layer fast AR.

Plain PyTorch, gpt-fast style: KV pools allocated once (`setup_caches`; paged, see
s2tts/engine/paged.py), positions passed as tensors, so the decode step has fixed shapes. Nothing here
knows about serving.

Shapes: B batch, S tokens, H query heads, K kv heads, D head dim, C codebooks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint_config import ARConfig, S2Config
from ..gpu.transfer import upload
from . import kernels


class RMSNorm(nn.Module):
    """The layers' and the stacks' final norm, as upstream's own RMSNorm: normed in float32, rounded to the input's
    dtype, then multiplied by the weight in that dtype (two roundings)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # Triton kernel (see use_triton_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class HeadNorm(nn.Module):
    """The per-head q/k norm (qk_norm), as upstream's `torch.nn.RMSNorm`: `torch.nn.functional.rms_norm`, normed
    and multiplied by the weight in float32, rounded once to the input's dtype. The Triton kernels that norm q/k
    round as it does (`kernels.qk_rope_cache`, `kernels.rope_attend_short`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():  # the ONNX export (opset 18 has no RMS norm): rms_norm's own ops, spelled out
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_table(seq_len: int, head_dim: int, base: float) -> torch.Tensor:
    """[seq_len, head_dim/2, 2] (cos, sin), rounded through bf16 as the reference stores it; computed on the CPU
    whatever the default device (a module built on the meta device gets real values, which the loader then moves)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")[: head_dim // 2] / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device="cpu"), freqs)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    return table.to(torch.bfloat16).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of pairs (2i, 2i+1). x: [B, S, H, D]; rope: [B, S, D/2, 2]."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    rope = rope.unsqueeze(2)  # broadcast over heads
    cos, sin = rope[..., 0], rope[..., 1]
    out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


class KVCache:
    """One layer's view of its stack's paged KV pool (s2tts/engine/paged.py): k/v [blocks, K, block_size, D] and the
    stack's block table [slots, max_blocks]; position p of a slot is row p % block_size of its block
    table[slot, p // block_size]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, block_size: int):
        self.k, self.v, self.table, self.block_size = k, v, table, block_size

    def write(self, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots [B], pos [B, S], k/v [B, S, K, D]
        blk = self.table[slots[:, None], pos // self.block_size].long()
        off = pos % self.block_size
        self.k[blk, :, off] = k
        self.v[blk, :, off] = v

    def read(self, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1 of each slot: [B, K, length, D] each (a gathered copy)."""
        nb = -(-length // self.block_size)
        blocks = self.table[slots, :nb].long()  # [B, nb]
        B, (_, K, bs, D) = slots.shape[0], self.k.shape
        k = self.k[blocks].transpose(1, 2).reshape(B, K, nb * bs, D)[:, :, :length]
        v = self.v[blocks].transpose(1, 2).reshape(B, K, nb * bs, D)[:, :, :length]
        return k, v


def attend(q, k, v, q_pos, kv_len_max: int):
    """Causal attention of q [B, H, S, D] over k/v [B, K, kv_len_max, D].

    Key j is visible to the query at position p when j <= p; this also hides cache
    rows beyond a request's length, whatever garbage they hold.
    """
    key_pos = torch.arange(kv_len_max, device=q.device)
    mask = key_pos[None, None, None, :] <= q_pos[:, None, :, None]  # [B, 1, S, L]
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, cfg: ARConfig):
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.dim, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.wo = nn.Linear(cfg.q_size, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = HeadNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = HeadNorm(cfg.head_dim, cfg.norm_eps)
        self.cache: KVCache | None = None
        self.decode_kernel = False  # use the Triton decode-attention kernel for one-token steps (set by the engine)
        self.decode_splits = 1  # programs sharing one row's keys in that kernel (set by the engine per step)
        self.decode_min_split = 1024  # keys each of them takes at least
        self.max_keys: int | None = None  # the most keys a row can hold (its cache's positions; set with the cache)
        self.rows_invariant = False  # batch_invariant: one attention tiling at any row count (set by the engine)
        self.fused = False  # fused q/k norm + RoPE + cache write kernel (see use_triton_kernels)
        self.rope: torch.Tensor | None = None  # the stack's table, set by use_triton_kernels

    def _tiling(self, rows: int) -> dict | None:
        """The decode-attention kernel's tiling for a pass of `rows` rows over this layer's cache (None: its default;
        `kernels.short_keys_config` for a cache of fewer positions than a tile, the fast AR's; with `rows_invariant`
        its one-row tiling at any row count: a row's sums do not change with the rows beside it)."""
        return kernels.short_keys_config(self.max_keys, 1 if self.rows_invariant else rows) if self.max_keys else None

    def _fused(self, x, pos, slots, kv_len_max):
        """Cached path with the fused q/k-norm + RoPE + cache-write kernel (every token is a row), then the
        decode-attention kernel over each row's keys (the fast AR's first call: two rows a stream, at positions 0
        and 1), or without it plain attention over the cache. One token a row over a cache of a few positions (the
        fast AR's later calls) in passes of `kernels.ROPE_ATTEND_MIN_ROWS` rows or more: both in one kernel
        (`kernels.rope_attend_short`)."""
        c = self.cfg
        B, S, _ = x.shape
        qkv = self.wqkv(x).reshape(B * S, -1)
        short = self._tiling(B * S)  # a cache of a few positions (the fast AR's): its tiling
        if (S == 1 and short is not None and self.decode_kernel and kernels.ROPE_ATTEND_SHORT
                and B >= kernels.ROPE_ATTEND_MIN_ROWS and not self.rows_invariant and self.decode_splits == 1):
            out = kernels.rope_attend_short(qkv, self.q_norm.weight if c.qk_norm else None,
                                            self.k_norm.weight if c.qk_norm else None, self.rope, pos.reshape(-1),
                                            slots, self.cache, c.n_head, c.n_local_heads, c.head_dim, c.norm_eps,
                                            c.qk_norm, short)
            return self.wo(out.reshape(B, S, c.q_size))
        rows_slot = slots if S == 1 else slots.repeat_interleave(S)
        q = kernels.qk_rope_cache(qkv, self.q_norm.weight if c.qk_norm else None,
                                  self.k_norm.weight if c.qk_norm else None, self.rope, pos.reshape(-1), rows_slot,
                                  self.cache, c.n_head, c.n_local_heads, c.head_dim, c.norm_eps, c.qk_norm)
        if self.decode_kernel:  # each token a row: its slot's keys up to its own position (all written above)
            out = kernels.decode_attention(q, self.cache, rows_slot, pos.reshape(-1), splits=self.decode_splits,
                                   min_split=self.decode_min_split, config=short, lengths_add=1)
            return self.wo(out.reshape(B, S, c.q_size))
        kc, vc = self.cache.read(slots, kv_len_max)
        out = attend(q.view(B, S, c.n_head, c.head_dim).transpose(1, 2), kc, vc, pos, kv_len_max)
        return self.wo(out.transpose(1, 2).reshape(B, S, c.q_size))

    def heads(self, x, rope):
        """x [B, S, dim] -> q [B, S, n_head, D], k and v [B, S, n_local_heads, D]: projected, q/k normed (qk_norm)
        and rotated; the plain PyTorch path (the exported graphs use it too)."""
        c = self.cfg
        B, S, _ = x.shape
        q, k, v = self.wqkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(B, S, c.n_head, c.head_dim)
        k = k.view(B, S, c.n_local_heads, c.head_dim)
        v = v.view(B, S, c.n_local_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def takes_rope(self, S: int, slots) -> bool:
        """Whether a pass of S tokens a row reads the rotations the stack gathers (`rope`); the fused path reads
        its table by position itself."""
        return not (self.fused and slots is not None and (S > 1 or self.decode_kernel))

    def forward(self, x, rope, pos, slots, kv_len_max: int | None):
        """x [B, S, dim]; rope [B, S, D/2, 2] (None where `takes_rope` says it is not read); pos [B, S]; slots [B]
        or None (no cache: plain causal)."""
        c = self.cfg
        B, S, _ = x.shape
        if not self.takes_rope(S, slots):
            return self._fused(x, pos, slots, kv_len_max)
        q, k, v = self.heads(x, rope)
        if slots is None:
            out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, S)
        elif S == 1 and self.decode_kernel:
            self.cache.write(slots, pos, k, v)
            out = kernels.decode_attention(q[:, 0], self.cache, slots, pos[:, 0], splits=self.decode_splits,
                                   min_split=self.decode_min_split, config=self._tiling(B), lengths_add=1)
            return self.wo(out.reshape(B, 1, c.q_size))
        else:
            self.cache.write(slots, pos, k, v)
            kc, vc = self.cache.read(slots, kv_len_max)
            out = attend(q.transpose(1, 2), kc, vc, pos, kv_len_max)
        return self.wo(out.transpose(1, 2).reshape(B, S, c.q_size))


class FeedForward(nn.Module):
    def __init__(self, cfg: ARConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)
        self.fused = False

    def fuse_weights(self) -> None:
        """Replace w1 and w3 by one [2I, dim] projection (one GEMM instead of two), their rows interleaved: row 2i
        is w1's row i (gate), row 2i+1 w3's (up). A program of the product that makes columns 2i and 2i+1 can then
        store silu(gate) * up itself (`kernels.gemv_small(..., swiglu=True)`)."""
        if hasattr(self, "w13"):
            return
        w = torch.stack([self.w1.weight, self.w3.weight], dim=1).flatten(0, 1)
        self.w13 = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        self.w13.weight = nn.Parameter(w, requires_grad=False)
        del self.w1, self.w3

    def forward(self, x):
        if not hasattr(self, "w13"):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.fused:
            gated = getattr(self.w13, "gated", None)
            return self.w2(gated(x) if gated else kernels.silu_mul(self.w13(x), interleaved=True))
        gu = self.w13(x)
        return self.w2(F.silu(gu[..., 0::2]) * gu[..., 1::2])


class Block(nn.Module):
    def __init__(self, cfg: ARConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.fused = False

    def forward(self, x, rope, pos, slots, kv_len_max):
        if self.fused:
            x, delta = self.pending(x, None, rope, pos, slots, kv_len_max)
            return x + delta
        h = x + self.attention(self.attention_norm(x), rope, pos, slots, kv_len_max)
        return h + self.feed_forward(self.ffn_norm(h))

    def pending(self, x, delta, rope, pos, slots, kv_len_max):
        """The fused kernels' form: the block's input is x + delta (delta None: x), its output (h, ffn) with the last
        residual sum left to the next norm, which adds and normalises in one kernel (`Stack.run`)."""
        if delta is None:
            normed = self.attention_norm(x)
        else:
            x, normed = kernels.rms_norm(delta, self.attention_norm.weight, self.attention_norm.eps, residual=x)
        a = self.attention(normed, rope, pos, slots, kv_len_max)
        h, f = kernels.rms_norm(a, self.ffn_norm.weight, self.ffn_norm.eps, residual=x)
        return h, self.feed_forward(f)


class Stack(nn.Module):
    """Shared by both ARs: layers + final norm + rope table + caches."""

    def __init__(self, cfg: ARConfig, rope_len: int):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.register_buffer("rope", rope_table(rope_len, cfg.head_dim, cfg.rope_base), persistent=False)

    def setup_caches(self, slots: int, max_seq: int, dtype, device, block_size: int | None = None,
                     num_blocks: int | None = None) -> None:
        """One paged KV pool for every layer (s2tts/engine/paged.py), `num_blocks` blocks of `block_size` positions,
        and a device block table `self.block_table` [slots, max_blocks] covering `max_seq` positions, all pointing
        at the null block 0: the blocks are handed out by the caller (`ModelRunner.apply`). Without `block_size`:
        one block of `max_seq` positions per slot, slot s holding block s + 1 for good."""
        c = self.cfg
        fixed = block_size is None
        if fixed:
            block_size, num_blocks = max_seq, slots + 1
        self.block_size, self.num_blocks = block_size, num_blocks
        self.block_table = torch.zeros(slots, -(-max_seq // block_size), dtype=torch.int32, device=device)
        if fixed:
            self.block_table[:, 0] = torch.arange(1, slots + 1, dtype=torch.int32, device=device)
        shape = (c.n_layer, num_blocks, c.n_local_heads, block_size, c.head_dim)
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        for li, layer in enumerate(self.layers):
            layer.attention.cache = KVCache(self.k_pool[li], self.v_pool[li], self.block_table, block_size)
            layer.attention.max_keys = max_seq

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block src -> dst for each (src, dst) in order (a later copy may read what an earlier one wrote), in
        every layer (keys and values)."""
        i = 0
        while i < len(copies):  # runs of copies that read no block the run writes, and write each block once
            run, dsts = [], set()
            while i < len(copies) and copies[i][0] not in dsts and copies[i][1] not in dsts:
                run.append(copies[i])
                dsts.add(copies[i][1])
                i += 1
            s = upload(torch.tensor([a for a, _ in run]), self.k_pool.device)
            d = upload(torch.tensor([b for _, b in run]), self.k_pool.device)
            self.k_pool[:, d] = self.k_pool[:, s]
            self.v_pool[:, d] = self.v_pool[:, s]

    def run(self, x, pos, slots=None, kv_len_max=None):
        """x [B, S, dim] -> final-normed hidden [B, S, dim]."""
        S = x.shape[1]
        rope = self.rope[pos] if any(layer.attention.takes_rope(S, slots) for layer in self.layers) else None
        if self.norm.fused:  # each residual sum joins the next norm's kernel

            delta = None
            for layer in self.layers:
                x, delta = layer.pending(x, delta, rope, pos, slots, kv_len_max)
            return kernels.rms_norm(delta, self.norm.weight, self.norm.eps, residual=x)[1]
        for layer in self.layers:
            x = layer(x, rope, pos, slots, kv_len_max)
        return self.norm(x)


class _OnStack(nn.Module):
    """An AR over a `Stack` (`self.stack`): its layers and final norm, as the checkpoint names them."""

    @property
    def layers(self):
        return self.stack.layers

    @property
    def norm(self):
        return self.stack.norm


class SlowAR(_OnStack):
    """The Qwen3-shaped decoder. Parameter names follow `text_model.model.*` of the checkpoint."""

    def __init__(self, s2: S2Config):
        super().__init__()
        self.s2 = s2
        cfg = s2.text
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.stack = Stack(cfg, cfg.max_seq_len)
        # Output head restricted to the semantic tokens + <|im_end|> (tied to the embeddings);
        # built by `build_head()` after the weights are loaded.
        self.register_buffer("head", torch.empty(0), persistent=False)

    def build_head(self) -> None:
        s2, w = self.s2, self.embeddings.weight
        self.head = torch.cat([w[s2.semantic_start_id : s2.semantic_end_id + 1], w[s2.im_end_id : s2.im_end_id + 1]]).detach()

    @property
    def end_index(self) -> int:
        """Index of <|im_end|> in the restricted logits (the semantic codes come first)."""
        return self.s2.num_semantic

    def embed(self, tokens, codes, semantic, codebook_embeddings: nn.Embedding):
        """Input embeddings. tokens [B, S]; codes [B, S, C]; semantic [B, S] bool.

        Semantic positions: (emb(token) + sum_i codebook_emb(code_i + i*codebook_size)) / sqrt(C+1).
        """
        s2 = self.s2
        x = self.embeddings(tokens)
        offsets = torch.arange(s2.num_codebooks, device=codes.device) * s2.codebook_size
        cb = codebook_embeddings(codes.clamp(0, s2.codebook_size - 1) + offsets).sum(dim=-2)
        sem = ((x + cb) * s2.embed_scale).to(x.dtype)
        return torch.where(semantic[..., None], sem, x)

    def forward(self, x, pos, slots=None, kv_len_max=None):
        """x [B, S, dim] embeddings -> (hidden [B, S, dim] final-normed, logits [B, S, num_semantic+1])."""
        h = self.stack.run(x, pos, slots, kv_len_max)
        return h, self.logits(h)

    head_rows = 0  # use_invariant_linears: the head through the row-invariant kernel up to this many rows
    # use_triton_kernels: the head through that kernel at any number of rows (cuBLAS is several times slower on its
    # odd 4097 columns)
    head_kernel = False

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., dim] -> float32 logits over the semantic codes + <|im_end|>."""
        if self.head_rows or self.head_kernel:
            rows = h.numel() // h.shape[-1] if self.head_kernel else self.head_rows
            return kernels.linear(h, self.head, rows).float()
        return F.linear(h, self.head).float()


class FastAR(_OnStack):
    """Predicts codes 1..C-1 of a frame from the slow AR's final-normed hidden and code 0.

    Parameter names follow `audio_decoder.*` of the checkpoint (`codebook_embeddings` lives here too,
    although it feeds the slow AR's input).
    """

    def __init__(self, s2: S2Config):
        super().__init__()
        self.s2 = s2
        cfg = s2.audio
        self.codebook_embeddings = nn.Embedding(s2.num_codebooks * s2.codebook_size, s2.text.dim)
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.stack = Stack(cfg, s2.num_codebooks + 1)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def setup_caches(self, batch: int, dtype, device) -> None:
        self.stack.setup_caches(batch, self.s2.num_codebooks + 1, dtype, device)

    def generate(self, hidden, code0, sample_fn, residual_size: int):
        """hidden [B, dim], code0 [B] -> codes [B, C-1].

        `sample_fn(logits [B, V], k)` samples codebook k (1-based) from logits restricted to the
        `residual_size` valid residual codes. Position 0 takes the hidden, position k takes the embedding
        of code k-1 and predicts code k; the first call processes positions 0 and 1 together.
        """
        B = hidden.shape[0]
        dev = hidden.device
        slots = torch.arange(B, device=dev)
        x = torch.stack([hidden, self.embeddings(code0)], dim=1)
        pos = torch.arange(2, device=dev).repeat(B, 1)  # contiguous: its layers' kernels read it without a copy
        codes = []
        for k in range(1, self.s2.num_codebooks):
            h = self.stack.run(x, pos, slots, kv_len_max=k + 1)
            logits = self.output(h[:, -1])[:, :residual_size]  # the model's dtype: `sample_fn` reads it as float32
            code = sample_fn(logits, k)
            codes.append(code)
            x = self.embeddings(code)[:, None]
            pos = torch.full((B, 1), k + 1, device=dev, dtype=torch.long)
        return torch.stack(codes, dim=1)


class KernelLinear(nn.Linear):
    """nn.Linear whose products of few rows run in Triton kernels: with `invariant_rows` (batch_invariant) every
    product of up to that many rows in the row-invariant kernel (`kernels.linear`: a row's result does not depend on
    the rows beside it); otherwise, with `small`, products of up to `kernels.GEMV_SMALL_ROWS` rows in
    `kernels.gemv_small` (a decode step at one or two streams). cuBLAS for the rest, and with neither (nn.Linear's
    function either way)."""

    invariant_rows = 0
    small = False

    def forward(self, x):
        if self.invariant_rows:
            return kernels.linear(x, self.weight, self.invariant_rows)
        small = self.small_form(x)
        if small is not None:
            return kernels.gemv_small(x, small[0], scale=small[1])
        return F.linear(x, self.weight)

    def small_form(self, x) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, FP8 scale or None) when the product of `x` runs in `kernels.gemv_small`, else None."""
        few = not self.invariant_rows and self.small and _few_rows(x, self.in_features)
        return (self.weight, None) if few else None

    def gated(self, x):
        """silu(gate) * up of a gate / up interleaved weight (`FeedForward.fuse_weights`): `_gated`."""
        return _gated(self, x)


def _few_rows(x, in_features: int) -> bool:
    """Whether `x` holds 1 to `kernels.GEMV_SMALL_ROWS` rows of `in_features` (`gemv_small`'s products)."""
    return 0 < x.numel() <= kernels.GEMV_SMALL_ROWS * in_features


def _gated(linear, x):
    """silu(gate) * up of `linear`'s gate / up interleaved weight: in the product's kernel where `gemv_small` makes
    the product (`kernels.SWIGLU_IN_PRODUCT`; `linear.small_form`), else the product, then `kernels.silu_mul`."""
    small = linear.small_form(x) if kernels.SWIGLU_IN_PRODUCT else None
    if small is not None:
        return kernels.gemv_small(x, small[0], scale=small[1], swiglu=True)
    return kernels.silu_mul(linear(x), interleaved=True)


def _kernel_linears(model: nn.Module):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.__class__ = KernelLinear
            yield m


def use_invariant_linears(model: nn.Module, max_rows: int) -> None:
    """Every matrix product of both ARs (and the slow AR's head) row-invariant up to `max_rows` rows (GPU, or the
    Triton interpreter); 0 turns it off."""
    for m in _kernel_linears(model):
        m.invariant_rows = max_rows
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.kernel_rows = max(max_rows, Fp8Linear.KERNEL_ROWS)
            m.invariant = bool(max_rows)
            m.keep_dense(m.kernel and not m.invariant)
        if isinstance(m, SlowAR):
            m.head_rows = max_rows


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight is FP8 (e4m3) with a scale per output row (`kernels.quantize_fp8`):
    half the bytes of bf16 that a decode step reads. With `kernel` (GPU, or the Triton interpreter) each pass takes
    the faster form for its rows (`fp8_at`): the FP8 weight widened in registers, in `kernels.gemv_small` at one row
    and in `kernels.linear` from 3 to `FP8_ROWS` rows; at 2 rows (where both FP8 kernels are slower than bf16's
    `gemv_small`) and up to `KERNEL_ROWS` rows the same weight widened once to the layer's dtype (`dense`, kept
    beside it: 1.5 times bf16's weight memory in all), as a `KernelLinear` multiplies it; above, cuBLAS's FP8
    product. Without `kernel` the weight is widened in memory for each product."""

    FP8_ROWS = 16  # up to this many rows the FP8 kernels (cuBLAS's bf16 product is as fast from 24 on)
    KERNEL_ROWS = 256  # above this many rows (prompt passes) cuBLAS's FP8 product

    @classmethod
    def fp8_at(cls, rows: int) -> bool:
        """Whether a pass of `rows` rows multiplies by the FP8 weight (with the kernels, not batch_invariant)."""
        return rows == 1 or 2 < rows <= cls.FP8_ROWS

    def __init__(self, weight: torch.Tensor):
        super().__init__()

        w8, scale = kernels.quantize_fp8(weight)
        self.out_features, self.in_features = w8.shape
        self.dtype = weight.dtype  # the activations' (and `dense`'s)
        self.weight = nn.Parameter(w8, requires_grad=False)
        self.register_buffer("scale", scale)
        self.register_buffer("dense", None, persistent=False)
        self.kernel = False
        self.kernel_rows = self.KERNEL_ROWS  # use_invariant_linears raises it: every pass through the kernel
        self.invariant = False  # and sets this: one form, no `gemv_small` (its sums are not row-invariant), no `dense`

    def keep_dense(self, on: bool) -> None:
        """Keep (or drop) `dense`, the FP8 weight widened to the layer's dtype: the same function, in cuBLAS."""
        if not on:
            self.dense = None
        elif self.dense is None:
            self.dense = (self.weight.float() * self.scale[:, None]).to(self.dtype)

    def forward(self, x):
        small = self.small_form(x)
        if small is not None:
            return kernels.gemv_small(x, small[0], scale=small[1])
        rows = x.numel() // self.in_features
        if self.kernel and (self.fp8_at(rows) if not self.invariant else rows <= self.kernel_rows):
            return kernels.linear(x, self.weight, scale=self.scale)
        if self.dense is not None and rows <= self.kernel_rows:
            return F.linear(x, self.dense)
        # many rows (prompt passes): the product is compute-bound, where cuBLAS's FP8 product (the activations in
        # FP8 too, a scale per row) is faster than either; where there is none, the weight widened.
        if self.kernel and kernels.fp8_matmul_available(x.device):
            return kernels.fp8_matmul(x, self.weight, self.scale)
        return F.linear(x, self.dense if self.dense is not None else
                        (self.weight.float() * self.scale[:, None]).to(x.dtype))

    def small_form(self, x) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """As `KernelLinear.small_form`: the FP8 weight and its scale where `fp8_at` says so, else `dense` (there is
        none under batch_invariant: its sums are not row-invariant)."""
        if not (self.kernel and not self.invariant and _few_rows(x, self.in_features)):
            return None
        if self.fp8_at(x.numel() // self.in_features):
            return self.weight, self.scale
        return None if self.dense is None else (self.dense, None)

    def gated(self, x):
        """As `KernelLinear.gated`."""
        return _gated(self, x)


def use_fp8_weights(model: nn.Module) -> None:
    """Every matrix of both ARs' layers (q|k|v, o, w1|w3, w2) as FP8 with a scale per output row (`Fp8Linear`);
    embeddings, norms and the output heads stay as loaded. On a GPU each keeps its `dense` form from the start (the
    kernels' default there), so that what a server sizes its KV pool from holds it. Not undone: load the model
    again for the original."""
    for m in list(model.modules()):
        if isinstance(m, FeedForward):
            m.fuse_weights()
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        for owner, name in ((block.attention, "wqkv"), (block.attention, "wo"), (block.feed_forward, "w13"),
                            (block.feed_forward, "w2")):
            lin = getattr(owner, name)
            if isinstance(lin, nn.Linear):
                fp8 = Fp8Linear(lin.weight.data)
                setattr(owner, name, fp8)
                del lin
                fp8.keep_dense(fp8.weight.is_cuda)


def use_triton_kernels(model: nn.Module, on: bool = True) -> None:
    """Switch the decode path to the fused Triton kernels (GPU; or the Triton interpreter in tests).

    Fuses w1/w3 into one projection (kept afterwards: it computes the same function either way).
    """
    for m in model.modules():
        if isinstance(m, FeedForward):
            m.fuse_weights()
        if isinstance(m, Stack):
            for layer in m.layers:
                layer.attention.rope = m.rope
        if isinstance(m, (RMSNorm, Attention, FeedForward, Block)):
            m.fused = on
        if isinstance(m, SlowAR):
            m.head_kernel = on
        if isinstance(m, Fp8Linear):
            m.kernel = on
            m.keep_dense(on and not m.invariant)
    for m in _kernel_linears(model):  # products of a few rows (a decode step at a few streams) in `gemv_small`
        m.small = on


class S2Model(nn.Module):
    def __init__(self, s2: S2Config):
        super().__init__()
        self.s2 = s2
        self.slow = SlowAR(s2)
        self.fast = FastAR(s2)

    def embed(self, tokens, codes, semantic):
        return self.slow.embed(tokens, codes, semantic, self.fast.codebook_embeddings)
