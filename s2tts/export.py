"""ONNX graphs of the DAC codec and the fast AR, their manifest, their onnxruntime checks, and the
Triton glue the TensorRT variants' models use. The variants of the model repository themselves are
rendered by `s2tts.repository` (which reads the manifest written here).

    python build/export_onnx.py --checkpoint DIR --out build/onnx      # graphs + manifest.json + check report
    bash build/build_engines.sh build/onnx build/engines                # inside nvcr.io/nvidia/tritonserver:<yy.mm>-py3
    python -m s2tts.server --checkpoint DIR --set backend=tensorrt --set engine_dir=build/engines

Graphs (opset 18, TorchScript exporter, fp32 weights; TensorRT picks reduced-precision kernels
at build time). B batch, C codebooks (10), V residual codebook size, F frames, T samples:

| file                    | inputs                                                                  | outputs                        |
|-------------------------|-------------------------------------------------------------------------|--------------------------------|
| fast_ar.onnx            | hidden FP32 [B, dim], code0 INT32 [B], temperature FP32 [B], top_p FP32 [B], top_k INT32 [B], uniforms FP32 [B, C-1, V] | codes INT32 [B, C-1] |
| fast_ar_seeded.onnx     | as fast_ar, with seed INT64 [B], step INT64 [B] instead of uniforms     | codes INT32 [B, C-1]           |
| dac_decoder.onnx        | codes INT32 [B, C, F]                                                   | audio FP32 [B, F*2048]         |
| dac_decoder_stream.onnx | codes INT32 [B, C, F], state_<key> ...                                  | audio FP32 [B, F*2048], new_state_<key> ... |
| dac_encoder.onnx        | waveform FP32 [B, 1, T], T a multiple of 2048                           | codes INT32 [B, C, T/2048]     |

The fast-AR graph runs all C-1 codebooks with their sampling in one graph. Its random
numbers are those of `s2tts.sampling.uniform(seed, step, 1 + k, V)` for codebook k: either
given as `uniforms` (fast_ar.onnx; TensorRT has no integer XOR, so the counter hash is
computed beside it) or hashed in the graph (fast_ar_seeded.onnx; onnxruntime only).
Same inputs give the same codes as `InProcessFastAR`.

The codec graphs use an export-friendly windowed transformer (a precomputed RoPE table
instead of `torch.polar`, window-chunked attention as one gathered batch instead of a
Python loop over chunks); every other module is the codec's own.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .codec import _Step

log = logging.getLogger("s2tts")

OPSET = 18
FAST_AR_STREAM0 = 1  # codebook k of the fast AR draws from random stream 1 + k (see s2tts.sampling)
GRAPHS = ("fast_ar", "fast_ar_seeded", "dac_decoder", "dac_decoder_stream", "dac_encoder")
MANIFEST = "manifest.json"

# --------------------------------------------------------------------------- fast AR


def fast_ar_uniforms(seed: torch.Tensor, step: torch.Tensor, n_codebooks: int, vocab: int) -> torch.Tensor:
    """[B, n_codebooks, vocab]: the random numbers the fast AR's codebooks 1..n draw (the `uniforms` input)."""
    from .sampling import uniform

    return torch.stack([uniform(seed, step, FAST_AR_STREAM0 + k, vocab) for k in range(1, n_codebooks + 1)], dim=1)


def sample_from_uniforms(logits, temperature, top_p, top_k, u, vocab: int) -> torch.Tensor:
    """`s2tts.sampling.sample` with its random numbers given (u [B, V]); the same arithmetic,
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
    from .model import apply_rope

    a = layer.attention
    c = a.cfg
    if a.fused or a.decode_kernel or layer.fused:
        raise ValueError("export the plain PyTorch fast AR (not switched to the Triton kernels)")
    B, S, _ = x.shape
    q, k, v = a.wqkv(layer.attention_norm(x)).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
    q = q.view(B, S, c.n_head, c.head_dim)
    k = k.view(B, S, c.n_local_heads, c.head_dim)
    v = v.view(B, S, c.n_local_heads, c.head_dim)
    if c.qk_norm:
        q, k = a.q_norm(q), a.k_norm(k)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
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
        from .sampling import uniform

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
    from .codec import rope_cos_sin

    return rope_cos_sin(torch.arange(positions)[None], head_dim, base)[0]


def window_transformer(wt, x: torch.Tensor, step: _GraphStep | None, rope: torch.Tensor) -> torch.Tensor:
    """`WindowTransformer.forward` for export: x [B, C, T] -> [B, C, T]; step None = a fresh state.

    The input is cut into n chunks of L = min(T, window) positions (the same chunks as the
    codec's loop), padded to n*L; chunk c attends to its window-1 predecessors and itself,
    gathered as one [B, H, n, window-1+L, D] batch. Positions index `rope` (clamped to its length).
    """
    from .codec import apply_rope

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
        from .codec import WindowTransformer

        self.codec = codec
        tables = {}
        for name, m in codec.named_modules():
            if isinstance(m, WindowTransformer) and not name.startswith("quantizer.post_module"):
                tables[name] = _rope_table(m.head_dim, m.rope_base, max_positions)
        self.tables = tables  # plain dict: constants of the trace

    def forward(self, waveform):
        from .codec import EncoderBlock, WindowTransformer

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
    import warnings

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


@dataclass
class Profiles:
    """Shape ranges (min, opt, max) of the TensorRT optimisation profiles, written into the manifest.

    Frames/samples outside a profile are handled by the callers: `GraphStreamCodec` cuts a
    chunk into pieces of at most `stream_frames[2]` frames (streaming is exact, so the audio is
    the same), `dac_encoder` refuses references longer than `encoder_frames[2]` frames.
    """

    fast_ar_batch: tuple[int, int, int] = (1, 16, 64)
    stream_batch: tuple[int, int, int] = (1, 16, 64)
    stream_frames: tuple[int, int, int] = (1, 16, 32)
    decoder_batch: tuple[int, int, int] = (1, 1, 4)
    decoder_frames: tuple[int, int, int] = (1, 256, 1024)
    encoder_batch: tuple[int, int, int] = (1, 1, 4)
    encoder_frames: tuple[int, int, int] = (1, 256, 660)  # 660 frames = 30.6 s at 44.1 kHz


_TRITON_TYPES = {1: "TYPE_FP32", 6: "TYPE_INT32", 7: "TYPE_INT64", 9: "TYPE_BOOL", 10: "TYPE_FP16", 16: "TYPE_BF16", 11: "TYPE_FP64"}
_NP_TYPES = {"TYPE_FP32": np.float32, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_BOOL": np.bool_,
             "TYPE_FP16": np.float16, "TYPE_FP64": np.float64}


def graph_io(path: str | Path) -> dict:
    """{"inputs": [...], "outputs": [...]} of an ONNX file: name, Triton data type, dims (-1 = dynamic)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def describe(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            out.append({"name": v.name, "data_type": _TRITON_TYPES[t.elem_type], "dims": dims})
        return out

    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}


def _shape_sets(io: dict, sizes: dict[str, tuple[int, int, int]], axis_names: dict[str, dict[int, str]]) -> dict[str, dict[str, list[int]]]:
    """min/opt/max concrete shapes of every input, from the named dynamic axes."""
    out = {"min": {}, "opt": {}, "max": {}}
    for inp in io["inputs"]:
        for i, which in enumerate(("min", "opt", "max")):
            shape = []
            for ax, d in enumerate(inp["dims"]):
                if d >= 0:
                    shape.append(d)
                else:
                    shape.append(sizes[axis_names[inp["name"]][ax]][i])
            out[which][inp["name"]] = shape
    return out


def _trtexec_shapes(shapes: dict[str, list[int]]) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in shapes.items())


def export_all(checkpoint: str | Path, out: str | Path, graphs=GRAPHS, profiles: Profiles | None = None,
               model=None, codec=None, max_positions: int = 32768) -> dict:
    """Export the graphs of a checkpoint into `out` and write `out/manifest.json`; returns the manifest.

    `model` (an S2Model with at least the fast AR) and `codec` may be given to skip loading them.
    """
    from .checkpoint import codec_codebook_sizes, load_codec_from_dir, load_model

    checkpoint, out = Path(checkpoint), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = profiles or Profiles()
    unknown = sorted(set(graphs) - set(GRAPHS))
    if unknown:
        raise ValueError(f"unknown graph(s) {unknown}: choose from {list(GRAPHS)}")
    if model is None and any(g.startswith("fast_ar") for g in graphs):
        model = load_model(checkpoint, "cpu", "fp32", parts=("fast",))
    if codec is None and any(g.startswith("dac_") for g in graphs):
        codec = load_codec_from_dir(checkpoint, "cpu", "fp32")
    residual = codec.config.codebook_size if codec is not None else codec_codebook_sizes(checkpoint)[1]
    manifest = {"checkpoint": str(checkpoint.resolve()), "opset": OPSET, "torch": torch.__version__, "graphs": {}}
    gen = torch.Generator().manual_seed(0)
    B = 2  # trace batch (not 1: a size-1 axis can be specialised away)

    if model is not None:
        s2 = model.s2
        manifest.update(num_codebooks=s2.num_codebooks, residual_size=residual, dim=s2.audio.dim)
    if codec is not None:
        manifest.update(frame_length=codec.frame_length, sample_rate=codec.sample_rate, num_codebooks=codec.config.num_codebooks)

    for name in graphs:
        t0 = time.monotonic()
        path = out / f"{name}.onnx"
        if name.startswith("fast_ar"):
            s2 = model.s2
            frame = FastARFrame(model.fast, residual, seeded=name == "fast_ar_seeded")
            n = frame.n
            args = [torch.randn(B, s2.audio.dim, generator=gen), torch.randint(0, s2.codebook_size, (B,), generator=gen, dtype=torch.int32),
                    torch.full((B,), 0.8), torch.full((B,), 0.8), torch.full((B,), 30, dtype=torch.int32)]
            seed, step = torch.tensor([1, 2]), torch.tensor([0, 5])
            args += [seed, step] if frame.seeded else [fast_ar_uniforms(seed, step, n, residual)]
            names = frame.input_names()
            axes = {k: {0: "batch"} for k in names + ["codes"]}
            export_graph(frame, args, path, names, ["codes"], axes)
            sizes = {"batch": profiles.fast_ar_batch}
        elif name in ("dac_decoder", "dac_decoder_stream"):
            stream = name == "dac_decoder_stream"
            g = CodecDecoderGraph(codec, stream=stream, max_positions=max_positions)
            C = codec.config.num_codebooks
            args = [torch.randint(0, codec.config.codebook_size, (B, C, 3), generator=gen, dtype=torch.int32)]
            if stream:
                args += g.flatten_state(codec.new_stream_state(B))
            axes = {"codes": {0: "batch", 2: "frames"}, "audio": {0: "batch", 1: "samples"}}
            axes.update({k: {0: "batch"} for k in g.input_names()[1:] + g.output_names()[1:]})
            export_graph(g, args, path, g.input_names(), g.output_names(), axes)
            sizes = {"batch": profiles.stream_batch if stream else profiles.decoder_batch,
                     "frames": profiles.stream_frames if stream else profiles.decoder_frames}
        else:  # dac_encoder
            g = CodecEncoderGraph(codec, max_positions=max_positions // 2)
            args = [torch.randn(B, 1, 3 * codec.frame_length, generator=gen) * 0.1]
            axes = {"waveform": {0: "batch", 2: "samples"}, "codes": {0: "batch", 2: "frames"}}
            export_graph(g, args, path, ["waveform"], ["codes"], axes)
            fr = profiles.encoder_frames
            sizes = {"batch": profiles.encoder_batch, "samples": tuple(f * codec.frame_length for f in fr)}
        io = graph_io(path)
        entry = {"file": path.name, **io}
        axis_names = {k: {ax: n for ax, n in v.items()} for k, v in axes.items()}
        shapes = _shape_sets(io, sizes, axis_names)
        entry["profile"] = {"sizes": {k: list(v) for k, v in sizes.items()}, "shapes": shapes,
                            "trtexec": {w: _trtexec_shapes(s) for w, s in shapes.items()}}
        if name == "dac_decoder_stream":
            entry["state"] = [{"key": k, "input": state_tensor_name(k), "output": state_tensor_name(k, new=True),
                               "dims": list(g.state_shapes[k]), "data_type": "TYPE_INT64" if g.state_dtypes[k] == torch.long else "TYPE_FP32"}
                              for k in g.state_keys]
            entry["max_positions"] = max_positions
        manifest["graphs"][name] = entry
        log.info("exported %s in %.1f s", path, time.monotonic() - t0)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


def load_manifest(directory: str | Path) -> dict:
    f = Path(directory) / MANIFEST
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: export the graphs first (python build/export_onnx.py --checkpoint DIR --out {directory})")
    return json.loads(f.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- onnxruntime


def ort_session(path: str | Path, threads: int | None = None, providers=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=providers or ["CPUExecutionProvider"])


def ort_runner(path: str | Path, threads: int | None = None, providers=None) -> Callable[[dict], dict]:
    """A function {input name: array or tensor} -> {output name: numpy array} over an onnxruntime session."""
    sess = ort_session(path, threads, providers)
    names = [o.name for o in sess.get_outputs()]

    def run(inputs: dict) -> dict:
        feed = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in inputs.items()}
        return dict(zip(names, sess.run(names, feed)))

    return run


@dataclass
class _CodecInfo:
    num_codebooks: int
    frame_length: int
    sample_rate: int


class GraphStreamCodec:
    """A stand-in for the codec in `s2tts.codec_stream.StreamDecoder` whose `decode_stream` runs the
    exported streaming decoder graph through `run({name: tensor}) -> {name: array or tensor}`:
    onnxruntime in tests, a BLS call to `dac_decoder_trt` inside Triton.

    A chunk longer than `max_frames` or a batch larger than `max_batch` (the engine's profile) is
    cut into pieces that run one after the other through the state: the audio is the same.
    """

    def __init__(self, run: Callable[[dict], dict], manifest: dict, device="cpu", max_frames: int | None = None,
                 max_batch: int | None = None):
        spec = manifest["graphs"]["dac_decoder_stream"]
        self.run = run
        self.spec = spec
        self.state = spec["state"]
        self.config = _CodecInfo(manifest["num_codebooks"], manifest["frame_length"], manifest["sample_rate"])
        self.device = torch.device(device)
        sizes = spec["profile"]["sizes"]
        self.max_frames = max_frames or sizes["frames"][2]
        self.max_batch = max_batch or sizes["batch"][2]
        self.max_positions = spec.get("max_positions")
        self._anchor = torch.empty(0, device=self.device)

    def parameters(self):
        yield self._anchor

    @property
    def frame_length(self) -> int:
        return self.config.frame_length

    def new_stream_state(self, batch: int = 1):
        from .codec import StreamState

        out = {}
        for s in self.state:
            if s["key"].endswith(".pos"):
                out[s["key"]] = torch.zeros(batch, dtype=torch.long, device=self.device)
            else:
                out[s["key"]] = torch.zeros(batch, *s["dims"], dtype=torch.float32, device=self.device)
        return StreamState(out)

    @staticmethod
    def stack_states(states):
        from .codec import StreamState

        return StreamState.stack(states)

    @staticmethod
    def split_states(state):
        return state.split()

    def _piece(self, codes: torch.Tensor, tensors: dict) -> tuple[torch.Tensor, dict]:
        inputs = {"codes": codes.to(torch.int32)}
        for s in self.state:
            t = tensors[s["key"]]
            inputs[s["input"]] = t.reshape(t.shape[0], 1) if s["key"].endswith(".pos") else t
        outs = self.run(inputs)
        audio = torch.as_tensor(outs["audio"], device=self.device)
        new = {}
        for s in self.state:
            t = torch.as_tensor(outs[s["output"]], device=self.device)
            new[s["key"]] = t.reshape(-1) if s["key"].endswith(".pos") else t
        return audio, new

    def decode_stream(self, codes: torch.Tensor, state):
        """codes [B, C, f] -> (audio [B, 1, f*frame_length] float32, next state), as `DAC.decode_stream`."""
        from .codec import StreamState

        codes = torch.as_tensor(codes, device=self.device)
        if codes.ndim == 2:
            codes = codes[None]
        C = self.config.num_codebooks
        if codes.ndim != 3 or codes.shape[1] != C:
            raise ValueError(f"codes must be [B, {C}, frames], got {tuple(codes.shape)}")
        if codes.shape[0] != state.batch_size:
            raise ValueError(f"codes have batch {codes.shape[0]} but the stream state has {state.batch_size}")
        f = codes.shape[-1]
        if f == 0:
            return torch.zeros(codes.shape[0], 1, 0, device=self.device), state
        if self.max_positions:
            pos_key = next(s["key"] for s in self.state if s["key"].endswith(".pos"))
            if int(state.tensors[pos_key].max()) + f > self.max_positions:
                raise ValueError(f"stream longer than {self.max_positions} frames: the exported decoder's RoPE table ends there")
        audios, states = [], []
        for b0 in range(0, codes.shape[0], self.max_batch):
            tensors = {k: t[b0 : b0 + self.max_batch] for k, t in state.tensors.items()}
            pieces = []
            for f0 in range(0, f, self.max_frames):
                audio, tensors = self._piece(codes[b0 : b0 + self.max_batch, :, f0 : f0 + self.max_frames], tensors)
                pieces.append(audio)
            audios.append(torch.cat(pieces, dim=-1))
            states.append(StreamState(tensors))
        new_state = states[0] if len(states) == 1 else StreamState.stack(states)
        return torch.cat(audios)[:, None].float(), new_state

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        codes = torch.as_tensor(codes)
        if codes.ndim == 2:
            codes = codes[None]
        return self.decode_stream(codes, self.new_stream_state(codes.shape[0]))[0]


# --------------------------------------------------------------------------- checks


def relative_error(a, b) -> float:
    """||a - b|| / ||b|| (L2 over all elements), float64."""
    a = torch.as_tensor(np.asarray(a) if not isinstance(a, torch.Tensor) else a).double()
    b = torch.as_tensor(np.asarray(b) if not isinstance(b, torch.Tensor) else b).double()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# What the checks accept. Audio and states are fp32 graphs against fp32 PyTorch (measured ~3e-6);
# fast-AR codes must be identical (a flip needs two candidates within float rounding of each other);
# encoder codes are nearest-neighbour picks, where rounding can flip a near tie.
LIMITS = {"audio_rel": 1e-4, "state_rel": 1e-4, "fast_ar_row_mismatch": 0.0, "encoder_code_mismatch": 0.01}


@dataclass
class Check:
    graph: str
    metric: str
    value: float
    limit: float
    detail: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.value <= self.limit

    def line(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"{'ok  ' if self.ok else 'FAIL'} {self.graph:20s} {self.metric:22s} {self.value:.3g} (limit {self.limit:g}) {extra}"


def random_sampling_inputs(batch: int, dim: int, code0_size: int, seed: int = 0, scale: float = 3.0) -> dict:
    """Random fast-AR inputs: hidden states, code 0, and sampling settings across their ranges (top_k 0 = off)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(batch, dim, generator=g) * scale,
        "code0": torch.randint(0, code0_size, (batch,), generator=g, dtype=torch.int32),
        "temperature": torch.rand(batch, generator=g) * 1.5 + 0.05,
        "top_p": torch.rand(batch, generator=g) * 0.95 + 0.05,
        "top_k": torch.randint(0, 50, (batch,), generator=g, dtype=torch.int32),
        "seed": torch.randint(0, 2**62, (batch,), generator=g),
        "step": torch.randint(0, 4096, (batch,), generator=g),
    }


def reference_fast_ar(model, residual: int, x: dict) -> torch.Tensor:
    """Codes of the cached PyTorch fast AR (`InProcessFastAR`, the engine's own path) for the inputs x."""
    from .engine import InProcessFastAR

    B = x["hidden"].shape[0]
    p = next(model.fast.parameters())
    model.fast.setup_caches(B, p.dtype, p.device)
    with torch.inference_mode():
        return InProcessFastAR(model, residual)(x["hidden"].to(p.dtype), x["code0"].long(), x["temperature"], x["top_p"],
                                                x["top_k"].long(), x["seed"], x["step"])


def check_fast_ar(onnx_dir, model, residual: int, batch: int = 64, rounds: int = 2, seeded: bool = False) -> Check:
    name = "fast_ar_seeded" if seeded else "fast_ar"
    run = ort_runner(Path(onnx_dir) / f"{name}.onnx")
    n = model.s2.num_codebooks - 1
    rows = bad = codes_bad = 0
    for r in range(rounds):
        x = random_sampling_inputs(batch, model.s2.audio.dim, model.s2.codebook_size, seed=1000 + r)
        ref = reference_fast_ar(model, residual, x)
        feed = {k: x[k] for k in ("hidden", "code0", "temperature", "top_p", "top_k")}
        if seeded:
            feed.update(seed=x["seed"], step=x["step"])
        else:
            feed["uniforms"] = fast_ar_uniforms(x["seed"], x["step"], n, residual)
        got = torch.as_tensor(run(feed)["codes"]).long()
        diff = got != ref
        rows += batch
        bad += int(diff.any(dim=1).sum())
        codes_bad += int(diff.sum())
    return Check(name, "row mismatch rate", bad / rows, LIMITS["fast_ar_row_mismatch"],
                 {"rows": rows, "rows_differing": bad, "codes_differing": codes_bad})


def _random_codes(codec, batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cfg = codec.config
    semantic = torch.randint(0, cfg.semantic_codebook_size, (batch, 1, frames), generator=g)
    residual = torch.randint(0, cfg.codebook_size, (batch, cfg.n_codebooks, frames), generator=g)
    return torch.cat([semantic, residual], dim=1)


def check_decoder(onnx_dir, codec, batch: int = 2, frames: int = 24, seed: int = 0) -> Check:
    codes = _random_codes(codec, batch, frames, seed)
    with torch.inference_mode():
        ref = codec.decode(codes)[:, 0]
    got = ort_runner(Path(onnx_dir) / "dac_decoder.onnx")({"codes": codes.to(torch.int32)})["audio"]
    return Check("dac_decoder", "audio relative error", relative_error(got, ref), LIMITS["audio_rel"],
                 {"batch": batch, "frames": frames})


def check_stream_decoder(onnx_dir, codec, manifest: dict, batch: int = 2, chunks=(3, 1, 16, 20), seed: int = 1) -> list[Check]:
    """Decode a stream chunk by chunk through the graph (state carried out and back in) against `DAC.decode_stream`."""
    codes = _random_codes(codec, batch, sum(chunks), seed)
    stream = GraphStreamCodec(ort_runner(Path(onnx_dir) / "dac_decoder_stream.onnx"), manifest)
    st_ref, st = codec.new_stream_state(batch), stream.new_stream_state(batch)
    ref, got, f0 = [], [], 0
    with torch.inference_mode():
        for n in chunks:
            a, st_ref = codec.decode_stream(codes[:, :, f0 : f0 + n], st_ref)
            b, st = stream.decode_stream(codes[:, :, f0 : f0 + n], st)
            ref.append(a)
            got.append(b)
            f0 += n
    ref, got = torch.cat(ref, -1), torch.cat(got, -1)
    keys = [k for k in st_ref.tensors if not k.endswith(".pos")]
    pos_equal = all(torch.equal(st.tensors[k].cpu(), st_ref.tensors[k].cpu()) for k in st_ref.tensors if k.endswith(".pos"))
    state_err = max(relative_error(st.tensors[k], st_ref.tensors[k]) for k in keys)
    detail = {"batch": batch, "chunks": "+".join(map(str, chunks))}
    return [Check("dac_decoder_stream", "audio relative error", relative_error(got, ref), LIMITS["audio_rel"], detail),
            Check("dac_decoder_stream", "state relative error", state_err if pos_equal else math.inf, LIMITS["state_rel"],
                  {"positions_equal": pos_equal, "tensors": len(st_ref.tensors)})]


def _decoded_audio(codec, batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    """[B, 1, frames*frame_length] of decoded random codes: audio the codec's own encoder maps to clear codes."""
    with torch.inference_mode():
        return codec.decode(_random_codes(codec, batch, frames, seed)).float()


def check_encoder(onnx_dir, codec, batch: int = 2, frames: int = 24, seed: int = 2) -> Check:
    audio = _decoded_audio(codec, batch, frames, seed)
    with torch.inference_mode():
        ref = codec.encode(audio)
    got = torch.as_tensor(ort_runner(Path(onnx_dir) / "dac_encoder.onnx")({"waveform": audio})["codes"]).long()
    if got.shape != ref.shape:
        return Check("dac_encoder", "code mismatch rate", math.inf, LIMITS["encoder_code_mismatch"], {"shape": tuple(got.shape)})
    return Check("dac_encoder", "code mismatch rate", float((got != ref).float().mean()), LIMITS["encoder_code_mismatch"],
                 {"batch": batch, "frames": frames, "codes": ref.numel()})


def check_exports(onnx_dir, checkpoint=None, model=None, codec=None, graphs=None) -> list[Check]:
    """Every exported graph in `onnx_dir` run by onnxruntime (CPU) against the PyTorch modules."""
    from .checkpoint import load_codec_from_dir, load_model

    manifest = load_manifest(onnx_dir)
    checkpoint = checkpoint or manifest["checkpoint"]
    graphs = graphs or list(manifest["graphs"])
    if model is None and any(g.startswith("fast_ar") for g in graphs):
        model = load_model(checkpoint, "cpu", "fp32", parts=("fast",))
    if codec is None and any(g.startswith("dac_") for g in graphs):
        codec = load_codec_from_dir(checkpoint, "cpu", "fp32")
    out = []
    for g in graphs:
        if g in ("fast_ar", "fast_ar_seeded"):
            out.append(check_fast_ar(onnx_dir, model, manifest["residual_size"], seeded=g == "fast_ar_seeded"))
        elif g == "dac_decoder":
            out.append(check_decoder(onnx_dir, codec))
        elif g == "dac_decoder_stream":
            out += check_stream_decoder(onnx_dir, codec, manifest)
        elif g == "dac_encoder":
            out.append(check_encoder(onnx_dir, codec))
    return out


# --------------------------------------------------------------------------- TensorRT parser lint

_F, _I, _L, _B = ("FLOAT", "FLOAT16", "BFLOAT16"), ("INT32",), ("INT64",), ("BOOL",)
# onnx-tensorrt docs/operators.md for TensorRT 10.0 (types of the data input), for the operators a
# PyTorch export of these modules can produce. Only TensorRT's parser can say more.
_TRT10 = {
    **{op: _F for op in ("Clip", "Conv", "ConvTranspose", "CumSum", "Erf", "LayerNormalization", "Log", "MatMul",
                         "Pow", "Reciprocal", "Sigmoid", "Sin", "Cos", "Softmax", "Sqrt", "Tanh", "Exp", "Floor", "Gelu")},
    **{op: _F + _I + _L for op in ("Add", "ArgMax", "Div", "Equal", "Greater", "GreaterOrEqual", "IsNaN", "Less",
                                   "LessOrEqual", "Max", "Min", "Mod", "Mul", "Neg", "Pad", "Range", "ReduceL2",
                                   "ReduceMean", "ReduceSum", "ReduceMax", "Sub", "TopK", "Abs")},
    **{op: _F + _I + _L + _B for op in ("Concat", "ConstantOfShape", "Expand", "Gather", "GatherElements", "Identity",
                                       "Reshape", "Shape", "Slice", "Split", "Squeeze", "Transpose", "Trilu",
                                       "Unsqueeze", "Where", "Cast", "Tile", "Flatten")},
    **{op: _B for op in ("And", "Or", "Xor", "Not")},
    "Constant": _F + _I + _L + _B,
}
_TRT10_UNSUPPORTED = {"BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "NonZero", "Unique",
                      "SplitToSequence", "ConcatFromSequence", "SequenceAt", "SequenceConstruct", "StringNormalizer"}
_TRT10_CONSTANT_INPUTS = {"Slice": 3, "Squeeze": 1, "Unsqueeze": 1, "ReduceMean": 1, "ReduceSum": 1, "ReduceL2": 1,
                          "ReduceMax": 1, "Pad": 3, "CumSum": 1, "TopK": 1}


def tensorrt_lint(path: str | Path) -> list[str]:
    """Problems TensorRT 10's ONNX parser would have with the graph, judged from onnx-tensorrt's
    operator table: unsupported operators, unsupported data types, inputs that must be constants.
    An empty list is necessary, not sufficient, for `trtexec --onnx` to succeed."""
    import onnx
    from onnx import shape_inference

    model = shape_inference.infer_shapes(onnx.load(str(path)))
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.input, *g.output]}
    types.update({t.name: t.data_type for t in g.initializer})
    constants = {t.name for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant":
            constants.update(n.output)
            types[n.output[0]] = n.attribute[0].t.data_type if n.attribute and n.attribute[0].HasField("t") else 0
    problems = set()
    for n in g.node:
        op = n.op_type
        if op in _TRT10_UNSUPPORTED:
            problems.add(f"{op}: not supported by TensorRT")
            continue
        if op not in _TRT10:
            problems.add(f"{op}: not in the checked operator list")
            continue
        data = n.input[1] if op == "Where" else (n.input[0] if n.input else "")
        if data:
            tname = onnx.TensorProto.DataType.Name(types.get(data, 0))
            if tname not in _TRT10[op]:
                problems.add(f"{op}: data type {tname} not supported")
        k = _TRT10_CONSTANT_INPUTS.get(op)
        if k is not None and len(n.input) > k and n.input[k] and n.input[k] not in constants:
            problems.add(f"{op}: input {k} must be a constant")
        if op == "TopK":
            kv = next((onnx.numpy_helper.to_array(c.attribute[0].t) for c in g.node if c.op_type == "Constant" and c.output[0] == n.input[1]), None)
            if kv is not None and int(np.asarray(kv).reshape(-1)[0]) >= 3840:
                problems.add("TopK: K must be less than 3840")
    return sorted(problems)


# --------------------------------------------------------------------------- Triton glue


def to_triton_tensor(name: str, t: torch.Tensor):
    """A pb_utils.Tensor of a torch tensor: through DLPack (no copy) on the GPU, as numpy on the CPU."""
    import triton_python_backend_utils as pb_utils

    t = t.contiguous()
    if t.is_cuda:
        return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(t))
    return pb_utils.Tensor(name, t.numpy())


def triton_bls_runner(model_name: str, output_names: list[str], device="cuda") -> Callable[[dict], dict]:
    """A function {input name: torch tensor} -> {output name: torch tensor on `device`} calling
    `model_name` by BLS from inside a Python-backend model (tensors stay on the GPU)."""
    import triton_python_backend_utils as pb_utils

    device = torch.device(device)
    kwargs = {}
    if device.type == "cuda" and hasattr(pb_utils, "PreferredMemory"):
        kwargs["preferred_memory"] = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device.index or 0)

    def run(inputs: dict) -> dict:
        tensors = [to_triton_tensor(k, torch.as_tensor(v).to(device)) for k, v in inputs.items()]
        resp = pb_utils.InferenceRequest(model_name=model_name, inputs=tensors, requested_output_names=list(output_names),
                                         **kwargs).exec()
        if resp.has_error():
            raise RuntimeError(f"{model_name}: {resp.error().message()}")
        out = {}
        for n in output_names:
            t = pb_utils.get_output_tensor_by_name(resp, n)
            out[n] = torch.utils.dlpack.from_dlpack(t.to_dlpack()).to(device)
        return out

    return run
