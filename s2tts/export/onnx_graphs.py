"""The exported graphs as PyTorch modules: the fast AR's whole frame with its sampling (`FastARFrame`; its random
numbers as `s2tts.ar.sampling`'s), the codec's streaming decoder and encoder with an export-friendly windowed
transformer, and `export_graph` (one module -> one checked ONNX file). The graphs and their inputs are listed in
`s2tts/export/__init__.py`."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ar.sampling import uniform
from ..codec.model import (
    EncoderBlock,
    WindowTransformer,
    _Step,
    apply_rope,
    rope_cos_sin,
)

OPSET = 18
FAST_AR_STREAM0 = 1  # codebook k of the fast AR draws from random stream 1 + k (see s2tts.ar.sampling)
GRAPHS = ("fast_ar", "fast_ar_seeded", "dac_decoder", "dac_decoder_stream", "dac_encoder")

# --------------------------------------------------------------------------- fast AR


def fast_ar_uniforms(seed: torch.Tensor, step: torch.Tensor, n_codebooks: int, vocab: int) -> torch.Tensor:
    """[B, n_codebooks, vocab]: the random numbers the fast AR's codebooks 1..n draw (the `uniforms` input)."""
    return torch.stack([uniform(seed, step, FAST_AR_STREAM0 + k, vocab) for k in range(1, n_codebooks + 1)], dim=1)


def sample_from_uniforms(logits, temperature, top_p, top_k, u, vocab: int) -> torch.Tensor:
    """`s2tts.ar.sampling.sample` with its random numbers given (u [B, V]); the same arithmetic,
    written for export (TopK with a constant k instead of sort, no in-place writes)."""
    sorted_logits, order = logits.topk(vocab, dim=-1)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.ones_like(top_k))[:, None]  # 0: greedy, as upstream (Where: TensorRT's
    # operator table has no INT32 Clip)
    remove = ((cum > top_p[:, None]) | (rank >= k)) & (rank > 0)
    scaled = sorted_logits / temperature.clamp_min(1e-5)[:, None]
    probs = scaled.masked_fill(remove, float("-inf")).softmax(-1)
    choice = torch.argmax(probs / -torch.log(u), dim=-1, keepdim=True)
    return order.gather(-1, choice).squeeze(-1)


def _repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, K, L, D] -> [B, K*rep, L, D], as repeat_interleave(rep, dim=1)."""
    if rep == 1:
        return x
    B, K, L, D = x.shape
    return x[:, :, None].expand(B, K, rep, L, D).reshape(B, K * rep, L, D)


def _fast_block(layer, x, rope, cache, mask):
    """One fast-AR block over x [B, S, dim] with a functional KV cache ((k, v) [B, K, s, D] or None);
    mask [S, L] bool or None (all keys visible)."""
    a = layer.attention
    c = a.cfg
    if a.fused or a.decode_kernel or layer.fused:
        raise ValueError("export the plain PyTorch fast AR (not switched to the Triton kernels)")
    B, S, _ = x.shape
    q, k, v = (t.transpose(1, 2) for t in a.heads(layer.attention_norm(x), rope))
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
    rep = c.n_head // c.n_local_heads
    out = F.scaled_dot_product_attention(q, _repeat_heads(k, rep), _repeat_heads(v, rep), attn_mask=mask)
    h = x + a.wo(out.transpose(1, 2).reshape(B, S, c.q_size))
    return h + layer.feed_forward(layer.ffn_norm(h)), (k, v)


class FastARFrame(nn.Module):
    """One frame of the fast AR, sampling included: (hidden, code0, sampling inputs) -> codes [B, C-1].

    The KV cache is carried as tensors from step to step (positions 0..C-1, the loop over
    codebooks unrolled), so the graph has no in-place writes and no cache buffers. With
    `seeded` the random numbers are hashed from seed/step inside; otherwise they are an input.
    """

    def __init__(self, fast, residual_size: int, seeded: bool = False):
        super().__init__()
        self.fast = fast
        self.vocab = int(residual_size)
        self.seeded = seeded
        self.n = fast.s2.num_codebooks - 1

    def input_names(self) -> list[str]:
        tail = ["seed", "step"] if self.seeded else ["uniforms"]
        return ["hidden", "code0", "temperature", "top_p", "top_k", *tail]

    def forward(self, hidden, code0, temperature, top_p, top_k, *noise):
        if self.seeded:
            seed, step = noise
            draw = lambda k: uniform(seed, step, FAST_AR_STREAM0 + k, self.vocab)  # noqa: E731
        else:
            (uniforms,) = noise
            draw = lambda k: uniforms[:, k - 1]  # noqa: E731
        fast, stack = self.fast, self.fast.stack
        dtype = fast.output.weight.dtype
        x = torch.stack([hidden.to(dtype), fast.embeddings(code0)], dim=1)
        caches = [None] * len(stack.layers)
        start, codes = 0, []
        for k in range(1, self.n + 1):
            # the first step holds positions 0 and 1 of an empty cache (causal); later ones see every key
            S = 2 if k == 1 else 1
            mask = torch.ones(2, 2, dtype=torch.bool, device=x.device).tril() if k == 1 else None
            rope = stack.rope[start : start + S][None]  # [1, S, D/2, 2]: positions are constants
            h = x
            for i, layer in enumerate(stack.layers):
                h, caches[i] = _fast_block(layer, h, rope, caches[i], mask)
            logits = fast.output(stack.norm(h)[:, -1]).float()[:, : self.vocab]
            code = sample_from_uniforms(logits, temperature.float(), top_p.float(), top_k, draw(k), self.vocab)
            codes.append(code)
            x = fast.embeddings(code)[:, None]
            start += S
        return torch.stack(codes, dim=1).to(torch.int32)


# --------------------------------------------------------------------------- codec


def state_tensor_name(key: str, new: bool = False) -> str:
    """Graph tensor name of a decoder state entry: `quantizer.post_module.k0` -> `state_quantizer_post_module_k0`."""
    return ("new_state_" if new else "state_") + re.sub(r"[^A-Za-z0-9_]", "_", key)


class _GraphStep(_Step):
    """The codec's stream step over graph tensors (the new state is a graph output: no copy)."""

    def remember(self, key: str, value: torch.Tensor) -> None:
        self.new[key] = value


def _rope_table(head_dim: int, base: float, positions: int) -> torch.Tensor:
    """[positions, D/2, 2], bit-identical to the codec's `rope_cos_sin` at those positions."""
    return rope_cos_sin(torch.arange(positions)[None], head_dim, base)[0]


def window_transformer(wt, x: torch.Tensor, step: _GraphStep | None, rope: torch.Tensor) -> torch.Tensor:
    """`WindowTransformer.forward` for export: x [B, C, T] -> [B, C, T]; step None = a fresh state.

    The input is cut into n chunks of L = min(T, window) positions (the same chunks as the
    codec's loop), padded to n*L; chunk c attends to its window-1 predecessors and itself,
    gathered as one [B, H, n, window-1+L, D] batch. Positions index `rope` (clamped to its length).
    """
    key, W, H, D = wt.state_key, wt.window, wt.n_head, wt.head_dim
    xt = x.transpose(1, 2)
    B, T, C = xt.shape
    dev = x.device
    if step is None:
        pos = torch.zeros_like(xt[:, 0, 0], dtype=torch.long)
        zeros = xt.new_zeros((B, H, W - 1, D))
        ks, vs = [zeros] * len(wt.layers), [zeros] * len(wt.layers)
    else:
        pos = step.old[f"{key}.pos"].reshape(-1)
        ks = [step.old[f"{key}.k{i}"] for i in range(len(wt.layers))]
        vs = [step.old[f"{key}.v{i}"] for i in range(len(wt.layers))]
    t = torch.as_tensor(T, device=dev)
    L = torch.minimum(t, torch.full_like(t, W))  # (integer clamp would export as Clip, which TensorRT parses for floats only)
    n = torch.div(t + L - 1, L, rounding_mode="floor")
    Tp = n * L
    xp = torch.cat([xt, xt.new_zeros((B, Tp - T, C))], dim=1)  # [B, Tp, C]
    q_pos = pos[:, None] + torch.arange(Tp, device=dev)[None, :]
    rope_q = rope[torch.minimum(q_pos, torch.full_like(q_pos, rope.shape[0] - 1))]  # [B, Tp, D/2, 2]
    j = torch.arange(W - 1 + L, device=dev)
    i = torch.arange(L, device=dev)
    starts = torch.arange(n, device=dev) * L  # kext index of each chunk's first key
    idx = starts[:, None] + j[None, :]  # [n, W-1+L] keys of chunk c in kext
    # query i of chunk c sits at kext index W-1+starts[c]+i; key j of the chunk at starts[c]+j
    band = (j[None, :] >= i[:, None]) & (j[None, :] <= i[:, None] + (W - 1))  # [L, W-1+L]
    real = (pos[:, None, None] + starts[None, :, None] + j[None, None, :]) >= W - 1  # [B, n, W-1+L]
    mask = (band[None, None] & real[:, :, None, :])[:, None]  # [B, 1, n, L, W-1+L]
    h = xp
    new = {}
    for li, layer in enumerate(wt.layers):
        a = layer.attention
        q, k, v = a.wqkv(layer.attention_norm(h)).view(B, Tp, 3, H, D).unbind(2)
        q, k = apply_rope(q, rope_q), apply_rope(k, rope_q)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, Tp, D]
        kext, vext = torch.cat([ks[li], k], dim=2), torch.cat([vs[li], v], dim=2)  # [B, H, W-1+Tp, D]
        new[f"{key}.k{li}"], new[f"{key}.v{li}"] = kext[:, :, T : T + W - 1], vext[:, :, T : T + W - 1]
        qc = q.reshape(B, H, n, L, D)
        y = F.scaled_dot_product_attention(qc, kext[:, :, idx], vext[:, :, idx], attn_mask=mask)
        y = y.reshape(B, H, Tp, D).transpose(1, 2).reshape(B, Tp, H * D)
        h = h + layer.attention_layer_scale(a.wo(y))
        h = h + layer.ffn_layer_scale(layer.feed_forward(layer.ffn_norm(h)))
    out = wt.norm(h)[:, :T]
    if step is not None:
        new[f"{key}.pos"] = (pos + T).reshape(step.old[f"{key}.pos"].shape)
        step.new.update(new)
    return out.transpose(1, 2)


def _clamp_int(x: torch.Tensor, hi: int) -> torch.Tensor:
    """clamp(x, 0, hi) as Max/Min (ONNX Clip on integers does not parse in TensorRT)."""
    return torch.minimum(torch.maximum(x, torch.zeros_like(x)), torch.full_like(x, hi))


class CodecDecoderGraph(nn.Module):
    """codes [B, C, F] (+ the flattened stream state) -> audio [B, F*frame_length] (+ the new state).

    `stream=False`: whole-sequence decode from a fresh state (= `DAC.decode`).
    `stream=True`: one chunk of a stream (= `DAC.decode_stream`); the state's entries are
    inputs `state_<key>` and outputs `new_state_<key>` in `state_keys` order; the
    transformer position `<...>.pos` is carried as [B, 1] int64.
    """

    def __init__(self, codec, stream: bool, max_positions: int = 32768):
        super().__init__()
        self.codec = codec
        self.stream = stream
        state = codec.new_stream_state(1)
        self.state_keys = list(state.tensors)
        self.state_shapes = {k: tuple(t.shape[1:]) or (1,) for k, t in state.tensors.items()}
        self.state_dtypes = {k: t.dtype for k, t in state.tensors.items()}
        pm = codec.quantizer.post_module
        self.register_buffer("rope", _rope_table(pm.head_dim, pm.rope_base, max_positions), persistent=False)

    def input_names(self) -> list[str]:
        return ["codes"] + ([state_tensor_name(k) for k in self.state_keys] if self.stream else [])

    def output_names(self) -> list[str]:
        return ["audio"] + ([state_tensor_name(k, new=True) for k in self.state_keys] if self.stream else [])

    def forward(self, codes, *state):
        q, dec = self.codec.quantizer, self.codec.decoder
        step = _GraphStep(dict(zip(self.state_keys, state))) if self.stream else None
        codes = codes.long()
        z = q.semantic_quantizer.embed(_clamp_int(codes[:, :1], q.semantic_quantizer.size - 1))
        z = z + q.quantizer.embed(_clamp_int(codes[:, 1:], q.quantizer.size - 1))
        z = window_transformer(q.post_module, z, step, self.rope)
        for conv, block in q.upsample:
            z = block(conv(z, step), step)
        audio = dec(z.to(dec.model[0].conv.weight.dtype), step).float()[:, 0]
        if not self.stream:
            return audio
        return (audio, *[step.new[k] for k in self.state_keys])

    def flatten_state(self, state) -> list[torch.Tensor]:
        """StreamState -> the graph's state inputs (in `state_keys` order)."""
        return [state.tensors[k].reshape(-1, *self.state_shapes[k]) for k in self.state_keys]


class CodecEncoderGraph(nn.Module):
    """waveform [B, 1, T] (T a multiple of the frame length) -> codes [B, C, T/frame_length] int32 (= `DAC.encode`)."""

    def __init__(self, codec, max_positions: int = 16384):
        super().__init__()

        self.codec = codec
        tables = {}
        for name, m in codec.named_modules():
            if isinstance(m, WindowTransformer) and not name.startswith("quantizer.post_module"):
                tables[name] = _rope_table(m.head_dim, m.rope_base, max_positions)
        self.tables = tables  # plain dict: constants of the trace

    def forward(self, waveform):
        q = self.codec.quantizer
        x = waveform.to(q.pre_module.norm.weight.dtype)
        for m in self.codec.encoder.block:
            subs = m.block if isinstance(m, EncoderBlock) else [m]
            for sub in subs:
                x = window_transformer(sub, x, None, self.tables[sub.state_key]) if isinstance(sub, WindowTransformer) else sub(x)
        for conv, block in q.downsample:
            x = block(conv(x))
        x = window_transformer(q.pre_module, x, None, self.tables[q.pre_module.state_key])
        semantic, z_semantic = q.semantic_quantizer.quantize(x)
        residual, _ = q.quantizer.quantize(x - z_semantic)
        return torch.cat([semantic, residual], dim=1).to(torch.int32)


# --------------------------------------------------------------------------- export


_XOR_REGISTERED = False


def _register_integer_xor() -> None:
    """Let the TorchScript exporter write integer `^` as ONNX BitwiseXor (opset 18); by itself it only
    knows boolean Xor and fails on integers. Registered once (re-registering after an unregister does
    not take effect in torch 2.13); boolean xor still becomes Xor."""
    global _XOR_REGISTERED
    if _XOR_REGISTERED:
        return
    from torch.onnx import register_custom_op_symbolic

    def xor(g, a, b):
        return g.op("Xor" if a.type().scalarType() == "Bool" else "BitwiseXor", a, b)

    for name in ("aten::bitwise_xor", "aten::__xor_"):  # `torch.bitwise_xor` and the `^` operator
        register_custom_op_symbolic(name, xor, OPSET)
    _XOR_REGISTERED = True


def export_graph(module: nn.Module, args, path: str | Path, input_names, output_names, dynamic_axes) -> Path:
    """torch module -> checked ONNX file (TorchScript exporter, opset 18, constants folded)."""
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _register_integer_xor()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about shapes turned into constants we mean, deprecation notices
        torch.onnx.export(module.eval(), tuple(args), str(path), dynamo=False, opset_version=OPSET,
                          input_names=list(input_names), output_names=list(output_names),
                          dynamic_axes=dynamic_axes, do_constant_folding=True)
    onnx.checker.check_model(str(path))
    return path
