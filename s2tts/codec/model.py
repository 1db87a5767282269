"""The modded DAC codec of S2 Pro: 44.1 kHz mono audio <-> 10 codebooks at 21.5 Hz.

Plain PyTorch, gpt-fast style. Our own implementation of the architecture described
in the reference (`fish_speech/models/dac/modded_dac.py` + `rvq.py`, `dac.nn`);
module and parameter names reproduce the reference state-dict keys so an official
`codec.pth` loads (weight norm is folded into plain weights at load time).

    audio [B, 1, T] --encoder (causal convs, strides 2,4,8,8, window-512 transformer)-->
    z [B, D, T/512] --downsample x4 (causal conv + ConvNeXt)--> pre_module (window-128 transformer)
    --> semantic VQ (1 x 4096) + residual VQ (9 x 1024) --> codes [B, 10, T/2048]

    codes --embed--> post_module (window-128 transformer) --upsample x4--> decoder
    (causal transposed convs, strides 8,8,4,2) --> audio [B, 1, F*2048]

Every convolution is causal and both transformers are windowed-causal, so decoding
can stream exactly: each stateful module (a conv with left context, a transposed conv,
a transformer with its KV window) keeps its own left context in a `StreamState` that the
caller owns. `decode()` is `decode_stream()` of one chunk from a fresh (all-zero) state.

Shapes: B batch, C channels, T samples or frames, F codec frames, H heads, D head dim.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..ar import kernels as ar_kernels  # the AR's fused norm and SwiGLU serve the codec's transformers too
from ..gpu import jit
from ..gpu.timing import gpu_time_ms
from . import kernels

log = logging.getLogger("s2tts")

RESIDUAL_DILATIONS = (1, 3, 9)
RESIDUAL_KERNEL = 7
# On a GPU, the ConvNeXt blocks' depthwise convolutions and the window attention run in PyTorch's own kernels rather
# than cuDNN's, whose first call of each shape plans it (a cold start warms every shape the served calls decode):
# DEPTHWISE_CUDNN True, ATTENTION_BACKENDS None give cuDNN and PyTorch's own choice of attention back.
DEPTHWISE_CUDNN = False
ATTENTION_BACKENDS: Optional[tuple[str, ...]] = ("EFFICIENT_ATTENTION", "MATH")  # torch.nn.attention.SDPBackend names


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CodecConfig:
    """Hyper-parameters of the modded DAC. Defaults are the official `modded_dac_vq.yaml`.

    Everything but sample_rate, head_dim, windows, rope_base and norm_eps can be read from
    a state dict (`codec.loading.config_from_state_dict`).
    """

    sample_rate: int = 44100
    # encoder: conv k7 1->encoder_dim, then one block per rate doubling the channels
    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    encoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 4)  # per encoder block
    encoder_transformer_ffn_mult: int = 3  # intermediate = mult * block dim
    encoder_window: int = 512
    latent_dim: int = 1024
    # decoder: conv k7 latent->decoder_dim, then one block per rate halving the channels
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    # quantizer
    n_codebooks: int = 9  # residual codebooks
    codebook_size: int = 1024
    semantic_codebook_size: int = 4096
    codebook_dim: int = 8
    downsample_factor: tuple[int, ...] = (2, 2)
    convnext_mult: int = 4
    convnext_kernel: int = 7
    quantizer_pre_layers: int = 8
    quantizer_post_layers: int = 8
    quantizer_intermediate_size: int = 3072
    quantizer_window: int = 128
    # shared by all transformers (not derivable from tensor shapes)
    head_dim: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("encoder_rates", "encoder_transformer_layers", "decoder_rates", "downsample_factor"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if len(self.encoder_transformer_layers) != len(self.encoder_rates):
            raise ValueError("encoder_transformer_layers needs one entry per encoder rate")
        if math.prod(self.decoder_rates) != self.hop_length:
            raise ValueError(
                f"decoder rates {self.decoder_rates} upsample x{math.prod(self.decoder_rates)}, "
                f"but the encoder hop is {self.hop_length}"
            )

    @property
    def hop_length(self) -> int:
        return math.prod(self.encoder_rates)  # 512 samples per latent frame

    @property
    def frame_length(self) -> int:
        return self.hop_length * math.prod(self.downsample_factor)  # 2048 samples per codec frame

    @property
    def num_codebooks(self) -> int:
        return 1 + self.n_codebooks

    def encoder_block_dim(self, i: int) -> int:
        """Output channels of encoder block i (its residual units run at half of it)."""
        return self.encoder_dim * 2 ** (i + 1)

    def decoder_block_dims(self, i: int) -> tuple[int, int]:
        return self.decoder_dim // 2**i, self.decoder_dim // 2 ** (i + 1)


def full_codec_config() -> CodecConfig:
    """The official `modded_dac_vq.yaml` values."""
    return CodecConfig()


def tiny_codec_config() -> CodecConfig:
    """Same topology and strides (frame_length 2048), tiny widths, for tests."""
    return CodecConfig(
        encoder_dim=8,  # residual units at 8..64 channels, transformer at 128 (2 heads)
        encoder_transformer_layers=(0, 0, 0, 1),
        latent_dim=64,
        decoder_dim=64,  # 64 -> 32, 16, 8, 4
        codebook_size=32,
        semantic_codebook_size=64,
        quantizer_pre_layers=1,
        quantizer_post_layers=2,
        quantizer_intermediate_size=192,
    )


# --------------------------------------------------------------------------- streaming state


@dataclass
class StreamState:
    """Left context of every stateful decoder module, batch-first tensors keyed by module.

    Owned by the caller (one per request). `decode_stream` never modifies it in place;
    it returns a new state. States of equal keys can be stacked into a batch and split back.
    """

    tensors: dict[str, Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @staticmethod
    def stack(states: list["StreamState"]) -> "StreamState":
        keys = states[0].tensors.keys()
        if any(s.tensors.keys() != keys for s in states):
            raise ValueError("cannot stack stream states of different codecs")
        return StreamState({k: torch.cat([s.tensors[k] for s in states]) for k in keys})

    def split(self) -> list["StreamState"]:
        # clones: a request's state must not keep the whole batch's tensors alive
        return [StreamState({k: t[b : b + 1].clone() for k, t in self.tensors.items()}) for b in range(self.batch_size)]

    def to(self, device) -> "StreamState":
        return StreamState({k: t.to(device) for k, t in self.tensors.items()})


class _Step:
    """One call's view of a StreamState: reads the old contexts, collects the new ones."""

    def __init__(self, old: dict[str, Tensor], dest: Optional[dict[str, Tensor]] = None):
        self.old = old
        self.new: dict[str, Tensor] = {}
        self.dest = dest  # where the new state goes (tensors of its shapes), or None: fresh copies

    def left_context(self, key: str, x: Tensor, keep: int, act=None, act_bias=None) -> Tensor:
        # x [B, C, T] -> [B, C, ctx + T] (act(x + act_bias) when an activation is given; the context is stored
        # activated); remembers the last `keep` steps for the next call
        if act is not None:
            full = act(x, prefix=self.old[key], bias=act_bias)
        else:
            full = torch.cat([self.old[key], x], dim=-1)
        self.remember(key, full[..., full.shape[-1] - keep :])
        return full

    def remember(self, key: str, value: Tensor) -> None:
        """The new state's `key`: a copy (it must not keep the chunk's whole activation alive), into `dest` if
        given."""
        if self.dest is None:
            self.new[key] = value.clone()
        else:
            self.new[key] = self.dest[key].copy_(value)


# --------------------------------------------------------------------------- layers


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))
        self.fused = False  # one Triton kernel (see use_triton_kernels)

    def forward(self, x: Tensor, prefix: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
        """x [B, C, T] (+ `bias` [C], the bias of the convolution before, which then runs without it). With `prefix`
        [B, C, ctx]: that, then snake(x), along time (a convolution's left context joined)."""
        if self.fused:
            return kernels.snake(x, self.alpha, prefix, bias)
        if bias is not None:
            x = x + bias[:, None]
        y = x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)
        return y if prefix is None else torch.cat([prefix, y], dim=-1)


def conv1d_phases(x: Tensor, weight: Tensor, bias: Optional[Tensor], dilation: int) -> Tensor:
    """F.conv1d(x, weight, bias, dilation=dilation) (stride 1, no padding) as one undilated convolution over the
    `dilation` interleaved phases of x (output t = s * dilation + p reads only inputs of phase p), stacked along the
    batch: the same sums, at the cost of copying x in and the result out. cuDNN's heuristics can run a dilated
    convolution on a kernel without tensor cores, a large share of a chunk's convolution time."""
    B, C, T = x.shape
    d, k = dilation, weight.shape[-1]
    n_out = T - (k - 1) * d
    m = -(-T // d)
    if m * d != T:
        x = F.pad(x, (0, m * d - T))
    phases = x.reshape(B, C, m, d).permute(0, 3, 1, 2).reshape(B * d, C, m)
    y = F.conv1d(phases, weight, bias)  # [B * d, O, m - k + 1]
    return y.reshape(B, d, y.shape[1], y.shape[2]).permute(0, 2, 3, 1).reshape(B, y.shape[1], -1)[..., :n_out]


_PHASE_PLAN: dict[tuple, bool] = {}  # (input shape, weight shape, dilation, dtype, device) -> run as phases


def _phases_pay(x: Tensor, weight: Tensor, dilation: int) -> bool:
    """Whether `conv1d_phases` takes under 2/3 of the GPU time of the dilated convolution for this shape: timed once
    per shape on the device (three calls each after one to plan, queued behind a GPU sleep so that the time is the
    GPU's, not that of launching them, as in a CUDA graph), remembered. While a CUDA graph is being captured a shape
    not timed before keeps the dilated convolution (the graphs' warm-up calls, made before, time theirs)."""
    key = (tuple(x.shape), tuple(weight.shape), dilation, x.dtype, str(x.device))
    use = _PHASE_PLAN.get(key)
    if use is not None or not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return bool(use)
    times = []
    try:
        for fn in (lambda: F.conv1d(x, weight, None, 1, 0, dilation), lambda: conv1d_phases(x, weight, None, dilation)):
            fn()
            times.append(gpu_time_ms(fn, calls=3))
    except RuntimeError as e:  # e.g. no memory for the phases' copies: keep the dilated convolution
        log.warning("codec: could not time dilated convolution %s as phases (%s); it runs as one", key[0], e)
        times = [1.0, 1.0]
    use = _PHASE_PLAN[key] = times[1] < 2 / 3 * times[0]
    if use:
        log.info("codec: dilated convolution %s x %s (dilation %d) runs as phases: %.2f ms -> %.2f ms",
                 key[0], key[1], dilation, times[0] / 3, times[1] / 3)
    return use


def _fresh_states(modules: Iterable[nn.Module], batch: int, device, dtype) -> dict[str, Tensor]:
    """The initial (all-zero) stream state of these modules, keyed as a StreamState's."""
    tensors: dict[str, Tensor] = {}
    for m in modules:
        if hasattr(m, "init_state"):
            tensors.update(m.init_state(batch, device, dtype))
    return tensors


def _context_zeros(conv: nn.Module, batch: int, channels: int, device, dtype) -> Tensor:
    """A causal convolution's initial left context: [B, C, ctx] zeros, or [B, ctx, C] in a channels-last decoder."""
    shape = (batch, conv.context, channels) if conv.nwc_weight is not None else (batch, channels, conv.context)
    return torch.zeros(*shape, device=device, dtype=dtype)


class CausalConv1d(nn.Module):
    """Conv1d padded on the left by (kernel-1)*dilation+1-stride, and on the right so the
    last frame is complete. `weight_norm` only says how the reference stores the weight."""

    def __init__(self, c_in, c_out, kernel, stride=1, dilation=1, groups=1, weight_norm=True):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.context = (kernel - 1) * dilation + 1 - stride
        self.weight_norm = weight_norm
        self.state_key = ""
        self.to_one = False  # a Triton kernel for one output channel (see use_triton_kernels)
        self.phase_plan = False  # a dilated one: as `conv1d_phases` where that is faster (see use_triton_kernels)
        self.nwc_weight: Optional[Tensor] = None  # in a channels-last decoder (`Decoder.channels_last`)

    def init_state(self, batch, device, dtype) -> dict[str, Tensor]:
        if self.context == 0:
            return {}
        assert self.stride == 1, "only stride-1 convolutions can stream"
        return {self.state_key: _context_zeros(self, batch, self.conv.in_channels, device, dtype)}

    def forward(self, x: Tensor, step: Optional[_Step] = None, act: Optional["Snake"] = None,
                act_bias: Optional[Tensor] = None, bias: bool = True) -> Tensor:
        # x [B, C_in, T] -> [B, C_out, ceil(T / stride)]. `act`: the activation applied to x first (of x + `act_bias`,
        # the bias of the convolution before, left to this one); `bias=False`: the caller adds this one's bias
        if step is None:
            x = act(x, bias=act_bias) if act is not None else x
            right = -x.shape[-1] % self.stride
            x = F.pad(x, (self.context, right))
        elif self.context:
            x = step.left_context(self.state_key, x, self.context, act, act_bias)
        elif act is not None:
            x = act(x, bias=act_bias)
        if self.to_one:
            return kernels.conv_to_one(x, self.conv.weight, self.conv.bias, self.conv.dilation[0]).to(x.dtype)
        c = self.conv
        if self.phase_plan and _phases_pay(x, c.weight, c.dilation[0]):
            return conv1d_phases(x, c.weight, c.bias if bias else None, c.dilation[0])
        own = c.groups > 1 and x.is_cuda and not DEPTHWISE_CUDNN  # PyTorch's depthwise kernel, not cuDNN's
        with torch.backends.cudnn.flags(enabled=False) if own else contextlib.nullcontext():
            return F.conv1d(x, c.weight, c.bias if bias else None, c.stride, 0, c.dilation, c.groups)


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d keeping the first T*stride outputs (the tail k-stride is dropped)."""

    def __init__(self, c_in, c_out, kernel, stride, weight_norm=True):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.stride = stride
        self.context = math.ceil(kernel / stride) - 1  # input frames that reach into a new frame
        self.weight_norm = weight_norm
        self.state_key = ""
        self.nwc_weight: Optional[Tensor] = None  # in a channels-last decoder (`Decoder.channels_last`)

    def init_state(self, batch, device, dtype) -> dict[str, Tensor]:
        if self.context == 0:
            return {}
        return {self.state_key: _context_zeros(self, batch, self.conv.in_channels, device, dtype)}

    def forward(self, x: Tensor, step: Optional[_Step] = None, act: Optional["Snake"] = None,
                act_bias: Optional[Tensor] = None, bias: bool = True) -> Tensor:
        # x [B, C_in, T] -> [B, C_out, T * stride]; `act`, `act_bias`, `bias` as in CausalConv1d.forward
        n_out = x.shape[-1] * self.stride
        c = self.conv
        if step is None or self.context == 0:
            x = act(x, bias=act_bias) if act is not None else x
            return F.conv_transpose1d(x, c.weight, c.bias if bias else None, c.stride)[..., :n_out]
        x = step.left_context(self.state_key, x, self.context, act, act_bias)
        skip = self.context * self.stride
        return F.conv_transpose1d(x, c.weight, c.bias if bias else None, c.stride)[..., skip : skip + n_out]


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.ModuleList(
            [
                Snake(dim),
                CausalConv1d(dim, dim, RESIDUAL_KERNEL, dilation=dilation),
                Snake(dim),
                CausalConv1d(dim, dim, 1),
            ]
        )

    def forward(self, x: Tensor, step: Optional[_Step] = None, in_bias: Optional[Tensor] = None) -> Tensor:
        # [B, C, T]; `in_bias` [C]: the bias of the convolution that made x, left out of it (fused kernels only)
        snake1, conv1, snake2, conv2 = self.block
        if not snake1.fused:
            return x + conv2(conv1(x, step, act=snake1), step, act=snake2)
        # the kernels take each convolution's bias along: conv1's into snake2, conv2's (and in_bias) into the sum
        h = conv1(x, step, act=snake1, act_bias=in_bias, bias=False)
        y = conv2(h, step, act=snake2, act_bias=conv1.conv.bias, bias=False)
        return kernels.add_bias(x, y, conv2.conv.bias if in_bias is None else conv2.conv.bias + in_bias)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv -> LayerNorm -> MLP (GELU) -> gamma, residual."""

    def __init__(self, dim: int, mult: int, kernel: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel, groups=dim, weight_norm=False)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, mult * dim)
        self.pwconv2 = nn.Linear(mult * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, step: Optional[_Step] = None) -> Tensor:  # [B, C, T]
        h = self.dwconv(x, step).transpose(1, 2)  # [B, T, C]
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


# --------------------------------------------------------------------------- transformer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # the Triton kernel (see use_triton_kernels)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return ar_kernels.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-2))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


def rope_cos_sin(pos: Tensor, head_dim: int, base: float) -> Tensor:
    """pos [B, T] -> [B, T, D/2, 2] (cos, sin) rounded through bf16 as the reference's table is."""
    exponents = torch.arange(0, head_dim, 2, device=pos.device)[: head_dim // 2].float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    angles = pos.float()[..., None] * inv_freq  # [B, T, D/2]
    # torch.polar reproduces the reference's table bit for bit (cos()/sin() differ in rare bf16 roundings)
    rot = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([rot.real, rot.imag], dim=-1).to(torch.bfloat16).float()


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Interleaved pairs (2i, 2i+1). x [B, T, H, D], rope [B, T, D/2, 2]."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        self.wqkv = nn.Linear(dim, 3 * n_head * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)
        self.fused = False  # the Triton RoPE kernel (see use_triton_kernels)

    def forward(self, x, rope, mask, k_cache, v_cache):
        # x [B, T, dim]; rope [B, T, D/2, 2]; mask [B, 1, T, W-1+T]; caches [B, H, W-1, D]
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.n_head, self.head_dim).unbind(2)
        rotate = kernels.rope_pairs if self.fused else apply_rope
        q, k = rotate(q, rope), rotate(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        k = torch.cat([k_cache, k], dim=2)  # [B, H, W-1+T, D]
        v = torch.cat([v_cache, v], dim=2)
        own = q.is_cuda and ATTENTION_BACKENDS is not None
        with sdpa_kernel([getattr(SDPBackend, b) for b in ATTENTION_BACKENDS]) if own else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        keep = k_cache.shape[2]
        return self.wo(y), k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :]


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w13: Optional[Tensor] = None  # w1 | w3 as one weight, with the Triton SwiGLU (see use_triton_kernels)

    def fuse(self, on: bool) -> None:
        """Keep w1 and w3 in one [2 hidden, dim] tensor (the parameters become views of it) for one product."""
        if on and self.w13 is None:
            hidden = self.w1.out_features
            self.w13 = torch.cat([self.w1.weight.data, self.w3.weight.data])
            self.w1.weight.data, self.w3.weight.data = self.w13[:hidden], self.w13[hidden:]
        elif not on:
            self.w13 = None

    def forward(self, x: Tensor) -> Tensor:
        if self.w13 is not None:
            return self.w2(ar_kernels.silu_mul(F.linear(x, self.w13)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_head, head_dim, hidden, eps):
        super().__init__()
        self.attention = Attention(dim, n_head, head_dim)
        self.feed_forward = FeedForward(dim, hidden)
        self.ffn_norm = RMSNorm(dim, eps)
        self.attention_norm = RMSNorm(dim, eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def forward(self, x, rope, mask, k_cache, v_cache):  # x [B, T, dim]
        a, k_cache, v_cache = self.attention(self.attention_norm(x), rope, mask, k_cache, v_cache)
        if self.attention.fused:  # each scaled residual sum as one kernel
            h = torch.addcmul(x, a, self.attention_layer_scale.gamma)
            return torch.addcmul(h, self.feed_forward(self.ffn_norm(h)), self.ffn_layer_scale.gamma), k_cache, v_cache
        h = x + self.attention_layer_scale(a)
        out = h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))
        return out, k_cache, v_cache


class WindowTransformer(nn.Module):
    """Causal transformer where position t attends to positions (t-window, t], channels-first.

    Its state per stream: the absolute position `pos` [B] (RoPE is absolute, in bf16) and the
    keys/values of the last window-1 positions per layer. A fresh state has zero keys that the
    mask hides (they sit at negative positions). Long inputs run in chunks of `window` frames,
    so attention memory stays O(T * window).
    """

    def __init__(self, dim, n_layer, n_head, head_dim, hidden, window, rope_base, eps):
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(dim, n_head, head_dim, hidden, eps) for _ in range(n_layer))
        self.norm = RMSNorm(dim, eps)
        self.n_head, self.head_dim, self.window, self.rope_base = n_head, head_dim, window, rope_base
        self.state_key = ""

    def init_state(self, batch, device, dtype) -> dict[str, Tensor]:
        kv = (batch, self.n_head, self.window - 1, self.head_dim)
        state = {f"{self.state_key}.pos": torch.zeros(batch, dtype=torch.long, device=device)}
        for i in range(len(self.layers)):
            state[f"{self.state_key}.k{i}"] = torch.zeros(kv, device=device, dtype=dtype)
            state[f"{self.state_key}.v{i}"] = torch.zeros(kv, device=device, dtype=dtype)
        return state

    def forward(self, x: Tensor, step: Optional[_Step] = None) -> Tensor:
        # x [B, C, T] -> [B, C, T]
        old = step.old if step is not None else self.init_state(x.shape[0], x.device, x.dtype)
        key = self.state_key
        pos = old[f"{key}.pos"]
        ks = [old[f"{key}.k{i}"] for i in range(len(self.layers))]
        vs = [old[f"{key}.v{i}"] for i in range(len(self.layers))]
        x = x.transpose(1, 2)  # [B, T, C]
        outs = []
        for chunk in x.split(self.window, dim=1):
            y, ks, vs = self._chunk(chunk, pos, ks, vs)
            pos = pos + chunk.shape[1]
            outs.append(y)
        if step is not None:
            step.remember(f"{key}.pos", pos)
            for i in range(len(self.layers)):
                step.remember(f"{key}.k{i}", ks[i])
                step.remember(f"{key}.v{i}", vs[i])
        return torch.cat(outs, dim=1).transpose(1, 2)

    def _chunk(self, x, pos, ks, vs):
        # x [B, T, C]; pos [B] absolute position of x[:, 0]
        T, W = x.shape[1], self.window
        q_pos = pos[:, None] + torch.arange(T, device=x.device)  # [B, T]
        k_pos = pos[:, None] + torch.arange(-(W - 1), T, device=x.device)  # [B, W-1+T]
        qp, kp = q_pos[:, :, None], k_pos[:, None, :]
        mask = (kp <= qp) & (kp > qp - W) & (kp >= 0)  # [B, T, W-1+T]
        mask = mask[:, None]  # [B, 1, T, W-1+T], broadcast over heads
        rope = rope_cos_sin(q_pos, self.head_dim, self.rope_base)
        new_ks, new_vs = [], []
        for layer, k_cache, v_cache in zip(self.layers, ks, vs):
            x, k_cache, v_cache = layer(x, rope, mask, k_cache, v_cache)
            new_ks.append(k_cache)
            new_vs.append(v_cache)
        return self.norm(x), new_ks, new_vs


# --------------------------------------------------------------------------- encoder / decoder


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int, cfg: CodecConfig, n_layer: int):
        super().__init__()
        half = dim // 2
        blocks: list[nn.Module] = [ResidualUnit(half, d) for d in RESIDUAL_DILATIONS]
        blocks += [Snake(half), CausalConv1d(half, dim, 2 * stride, stride=stride)]
        if n_layer:
            blocks.append(
                WindowTransformer(
                    dim,
                    n_layer,
                    dim // cfg.head_dim,
                    cfg.head_dim,
                    cfg.encoder_transformer_ffn_mult * dim,
                    cfg.encoder_window,
                    cfg.rope_base,
                    cfg.norm_eps,
                )
            )
        self.block = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:  # [B, dim/2, T] -> [B, dim, T/stride]
        for m in self.block:
            x = m(x)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        blocks: list[nn.Module] = [CausalConv1d(1, cfg.encoder_dim, 7)]
        for i, (stride, n_layer) in enumerate(zip(cfg.encoder_rates, cfg.encoder_transformer_layers)):
            blocks.append(EncoderBlock(cfg.encoder_block_dim(i), stride, cfg, n_layer))
        top = cfg.encoder_block_dim(len(cfg.encoder_rates) - 1)
        blocks += [Snake(top), CausalConv1d(top, cfg.latent_dim, 3)]
        self.block = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:  # [B, 1, T] -> [B, latent, T/hop]
        for m in self.block:
            x = m(x)
        return x


class DecoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.block = nn.ModuleList(
            [Snake(c_in), CausalConvTranspose1d(c_in, c_out, 2 * stride, stride)]
            + [ResidualUnit(c_out, d) for d in RESIDUAL_DILATIONS]
        )

    def forward(self, x: Tensor, step: Optional[_Step] = None, in_bias: Optional[Tensor] = None) -> Tensor:
        # [B, c_in, T] -> [B, c_out, T*stride]; `in_bias` as in ResidualUnit.forward
        snake, up, *units = self.block
        if not snake.fused:
            x = up(x, step, act=snake)
            for unit in units:
                x = unit(x, step)
            return x
        x = up(x, step, act=snake, act_bias=in_bias, bias=False)
        x = units[0](x, step, in_bias=up.conv.bias)
        for unit in units[1:]:
            x = unit(x, step)
        return x


class Decoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
        for i, stride in enumerate(cfg.decoder_rates):
            layers.append(DecoderBlock(*cfg.decoder_block_dims(i), stride))
        last = cfg.decoder_block_dims(len(cfg.decoder_rates) - 1)[1]
        layers += [Snake(last), CausalConv1d(last, 1, 7)]  # (index n+3 is a parameter-free tanh)
        self.model = nn.ModuleList(layers)

    @property
    def channels_last(self) -> bool:
        """Whether it runs channels-last (`set_channels_last`)."""
        return self.model[0].nwc_weight is not None

    def set_channels_last(self, on: bool) -> None:
        """Run as `_forward_nwc` (Triton's `kernels.conv1d_nwc`; on a GPU, or under the Triton interpreter), or back
        as channels-first PyTorch convolutions. Its stream states change layout with it ([B, ctx, C] per causal
        convolution): make them after this. The channels-last weights are copies made here: load weights first."""
        for m in self.modules():
            if isinstance(m, CausalConv1d):
                m.nwc_weight = kernels.conv_weight_nwc(m.conv.weight.detach()) if on else None
            elif isinstance(m, CausalConvTranspose1d):
                m.nwc_weight = kernels.conv_transpose_weight_nwc(m.conv.weight.detach(), m.stride) if on else None

    def forward(self, x: Tensor, step: Optional[_Step] = None) -> Tensor:  # [B, latent, T] -> [B, 1, T*hop]
        if self.channels_last:
            return self._forward_nwc(x, step)
        conv_in, *blocks, snake, conv_out = self.model
        if snake.fused:  # conv_in's bias goes into the first block's activation
            x = blocks[0](conv_in(x, step, bias=False), step, in_bias=conv_in.conv.bias)
            blocks = blocks[1:]
        else:
            x = conv_in(x, step)
        for block in blocks:
            x = block(x, step)
        return torch.tanh(conv_out(x, step, act=snake))

    def _forward_nwc(self, z: Tensor, step: Optional[_Step]) -> Tensor:
        """`forward` over [B, T, C] activations, each convolution one `kernels.conv1d_nwc` with the bias, the
        residual sum and the next Snake in its epilogue, written straight after the next causal convolution's left
        context in that convolution's input buffer (no Snake, bias, residual or concatenation kernels, no layout
        transposes but the input's). A transposed convolution (kernel 2 x stride) is a two-tap convolution whose
        output step holds `stride` steps side by side (`kernels.conv_transpose_weight_nwc`). Each stateful
        convolution's left context is [B, ctx, C]."""
        if step is None:  # one call from a fresh state
            step = _Step(_fresh_states(self.modules(), z.shape[0], z.device, z.dtype))
        conv_in, *blocks, last_snake, conv_out = self.model
        B, T = z.shape[0], z.shape[-1]

        def buffer(conv: nn.Module, steps: int, channels: int) -> Tensor:
            # [B, ctx + steps, C]: the convolution's left context from the stream, rows for this call's input after
            buf = z.new_empty(B, conv.context + steps, channels)
            buf[:, : conv.context].copy_(step.old[conv.state_key])
            return buf

        def done(conv: nn.Module, buf: Tensor) -> Tensor:  # its input written: keep its last ctx steps
            step.remember(conv.state_key, buf[:, buf.shape[1] - conv.context :])
            return buf

        x_in = buffer(conv_in, T, z.shape[1])
        x_in[:, conv_in.context :].copy_(z.transpose(1, 2))
        done(conv_in, x_in)
        # every convolution's epilogue fills the next one's input buffer (after its left context)
        snake, up = blocks[0].block[0], blocks[0].block[1]
        up_in = buffer(up, T, up.conv.in_channels)
        kernels.conv1d_nwc(x_in, conv_in.nwc_weight, 1, conv_in.conv.bias, alpha=snake.alpha,
                           snake_out=up_in[:, up.context :])
        done(up, up_in)
        for i, block in enumerate(blocks):
            _, up, *units = block.block
            after = blocks[i + 1].block[:2] if i + 1 < len(blocks) else (last_snake, conv_out)
            c = up.conv.out_channels
            # the transposed convolution: x [B, T stride, C], and the first unit's Snake of it into its k7's input
            first = units[0].block
            h_in = buffer(first[1], T * up.stride, c)
            x = kernels.conv1d_nwc(up_in, up.nwc_weight, 1, up.conv.bias, alpha=first[0].alpha,
                                   snake_out=h_in[:, first[1].context :], raw=True)
            T *= up.stride
            x = x.view(B, T, c)
            for j, unit in enumerate(units):
                _, conv1, snake2, conv2 = unit.block
                done(conv1, h_in)
                # x + conv2(h), and the next Snake of it: the next unit's (x kept for its residual), or after the
                # block's last unit the next block's (or the last convolution's), whose input it is alone
                nxt_snake, nxt_conv = units[j + 1].block[:2] if j + 1 < len(units) else after
                nxt_in = buffer(nxt_conv, T, c)
                last = j + 1 == len(units)
                if kernels.res_unit_applies(c, h_in):  # the unit in one kernel (h stays on chip)
                    x = kernels.res_unit_nwc(h_in, conv1.nwc_weight, conv1.conv.dilation[0], conv1.conv.bias,
                                             snake2.alpha, conv2.nwc_weight, conv2.conv.bias, x, nxt_snake.alpha,
                                             nxt_in[:, nxt_conv.context :], raw=not last)
                else:
                    h = kernels.conv1d_nwc(h_in, conv1.nwc_weight, conv1.conv.dilation[0], conv1.conv.bias,
                                           alpha=snake2.alpha)
                    x = kernels.conv1d_nwc(h, conv2.nwc_weight, 1, conv2.conv.bias, residual=x, alpha=nxt_snake.alpha,
                                           snake_out=nxt_in[:, nxt_conv.context :], raw=not last)
                h_in = nxt_in
            up_in = done(after[1], h_in)
        return torch.tanh(kernels.conv1d_nwc(up_in, conv_out.nwc_weight, 1, conv_out.conv.bias).view(B, 1, T))


# --------------------------------------------------------------------------- quantizer


class VectorQuantize(nn.Module):
    """Factorised VQ: 1x1 in_proj to codebook_dim, cosine nearest neighbour, 1x1 out_proj."""

    def __init__(self, dim: int, size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Conv1d(dim, codebook_dim, 1)  # weight-normed in the reference (weight_g/_v)
        self.out_proj = nn.Conv1d(codebook_dim, dim, 1)
        self.codebook = nn.Embedding(size, codebook_dim)

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        # z [B, dim, T] -> codes [B, T], z_q [B, dim, T]
        e = self.in_proj(z)
        B, D, T = e.shape
        e = F.normalize(e.transpose(1, 2).reshape(B * T, D), dim=1)  # [BT, d]
        c = F.normalize(self.codebook.weight, dim=1)  # [N, d]
        dist = e.pow(2).sum(1, keepdim=True) - 2 * e @ c.t() + c.pow(2).sum(1, keepdim=True).t()
        codes = dist.neg().argmax(1).view(B, T)
        return codes, self.embed(codes)

    def embed(self, codes: Tensor) -> Tensor:  # [B, T] -> [B, dim, T]
        return self.out_proj(self.codebook(codes).transpose(1, 2))


class ResidualVQ(nn.Module):
    def __init__(self, dim: int, n: int, size: int, codebook_dim: int):
        super().__init__()
        self.size = size
        self.quantizers = nn.ModuleList(VectorQuantize(dim, size, codebook_dim) for _ in range(n))

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        # z [B, dim, T] -> codes [B, n, T], z_q [B, dim, T]
        codes, z_q, residual = [], torch.zeros_like(z), z
        for q in self.quantizers:
            c, z_i = q.quantize(residual)
            codes.append(c)
            z_q = z_q + z_i
            residual = residual - z_i
        return torch.stack(codes, dim=1), z_q

    def embed(self, codes: Tensor) -> Tensor:  # [B, n, T] -> [B, dim, T]
        z = self.quantizers[0].embed(codes[:, 0])
        for i in range(1, len(self.quantizers)):
            z = z + self.quantizers[i].embed(codes[:, i])
        return z


class Quantizer(nn.Module):
    """x4 causal downsample, window transformer, semantic VQ + residual VQ on what it misses."""

    table: Optional[Tensor] = None  # see fuse_embeddings

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        dim = cfg.latent_dim

        def transformer(n_layer):
            return WindowTransformer(
                dim,
                n_layer,
                dim // cfg.head_dim,
                cfg.head_dim,
                cfg.quantizer_intermediate_size,
                cfg.quantizer_window,
                cfg.rope_base,
                cfg.norm_eps,
            )

        self.semantic_quantizer = ResidualVQ(dim, 1, cfg.semantic_codebook_size, cfg.codebook_dim)
        self.quantizer = ResidualVQ(dim, cfg.n_codebooks, cfg.codebook_size, cfg.codebook_dim)
        convnext = lambda: ConvNeXtBlock(dim, cfg.convnext_mult, cfg.convnext_kernel)  # noqa: E731
        self.downsample = nn.ModuleList(
            nn.ModuleList([CausalConv1d(dim, dim, f, stride=f, weight_norm=False), convnext()])
            for f in cfg.downsample_factor
        )
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(dim, dim, f, f, weight_norm=False), convnext()])
            for f in reversed(cfg.downsample_factor)
        )
        self.pre_module = transformer(cfg.quantizer_pre_layers)
        self.post_module = transformer(cfg.quantizer_post_layers)

    def encode(self, z: Tensor) -> Tensor:  # [B, dim, T] -> codes [B, 1+n, T/4]
        for conv, block in self.downsample:
            z = block(conv(z))
        z = self.pre_module(z)
        semantic_codes, z_semantic = self.semantic_quantizer.quantize(z)
        residual_codes, _ = self.quantizer.quantize(z - z_semantic)
        return torch.cat([semantic_codes, residual_codes], dim=1)

    def fuse_embeddings(self, on: bool = True) -> None:
        """Decode the codes as one lookup: every codebook's entries through its 1x1 projection (bias included),
        computed once in fp32, in one table [all codebooks' entries, dim] in the codec's dtype; a frame's latent is the
        fp32 sum of its ten rows (ten lookups, transposes, projections and sums become one lookup and one sum).
        Computed from the weights at the time of the call: call it again after changing them."""
        if not on:
            self.table = self.offsets = self.limits = None
            return
        rows = []
        for q in [*self.semantic_quantizer.quantizers, *self.quantizer.quantizers]:
            w = q.out_proj.weight[:, :, 0].float()  # [dim, codebook_dim]
            rows.append(q.codebook.weight.float() @ w.T + q.out_proj.bias.float())
        sizes = [self.semantic_quantizer.size] + [self.quantizer.size] * len(self.quantizer.quantizers)
        self.table = torch.cat(rows).to(self.semantic_quantizer.quantizers[0].out_proj.weight.dtype)
        self.offsets = torch.tensor([0, *np.cumsum(sizes)[:-1]], device=self.table.device)[None, :, None]
        self.limits = torch.tensor(sizes, device=self.table.device)[None, :, None] - 1

    def decode(self, codes: Tensor, step: Optional[_Step] = None) -> Tensor:  # [B, 1+n, F] -> [B, dim, 4F]
        if self.table is not None:
            idx = torch.minimum(codes.clamp(min=0), self.limits) + self.offsets
            z = F.embedding(idx, self.table).sum(1, dtype=torch.float32).to(self.table.dtype).transpose(1, 2)
        else:
            semantic = codes[:, :1].clamp(0, self.semantic_quantizer.size - 1)
            residual = codes[:, 1:].clamp(0, self.quantizer.size - 1)
            z = self.semantic_quantizer.embed(semantic) + self.quantizer.embed(residual)
        z = self.post_module(z, step)
        for conv, block in self.upsample:
            z = block(conv(z, step), step)
        return z


# --------------------------------------------------------------------------- the codec


class DAC(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quantizer = Quantizer(config)
        self.decoder = Decoder(config)
        for name, m in self.named_modules():
            if hasattr(m, "state_key"):
                m.state_key = name

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def frame_length(self) -> int:
        return self.config.frame_length

    def _decode_path(self) -> Iterable[nn.Module]:
        for root in (self.quantizer.post_module, self.quantizer.upsample, self.decoder):
            yield from root.modules()

    def drop_encoding(self) -> "DAC":
        """Free what only encoding uses (the encoder, the quantizer's downsampling and pre-transformer; 207 M of S2
        Pro's 391 M parameters): a stream decoder never encodes."""
        self.encoder = self.quantizer.downsample = self.quantizer.pre_module = None
        return self

    def drop_decoding(self) -> "DAC":
        """Free what only decoding uses (the decoder, the quantizer's post-transformer and upsampling, the fused
        code table; 315 M of S2 Pro's 391 M parameters): a reference encoder never decodes."""
        self.decoder = self.quantizer.post_module = self.quantizer.upsample = None
        self.quantizer.table = None
        return self

    def _decoding(self) -> None:
        if self.decoder is None:
            raise RuntimeError("this codec was loaded to encode only (`drop_decoding`): load it again to decode")

    @torch.no_grad()
    def encode(self, audio: Tensor) -> Tensor:
        """audio [B, 1, T] (44.1 kHz mono) -> codes [B, 10, ceil(T / 2048)] int64."""
        if self.encoder is None:
            raise RuntimeError("this codec was loaded to decode only (`drop_encoding`): load it again to encode")
        if audio.ndim == 2:
            audio = audio[:, None]
        if audio.ndim != 3 or audio.shape[1] != 1:
            raise ValueError(f"encode expects audio [B, 1, T], got {tuple(audio.shape)}")
        p = next(self.encoder.parameters())
        audio = audio.to(device=p.device, dtype=p.dtype)
        audio = F.pad(audio, (0, -audio.shape[-1] % self.frame_length))
        return self.quantizer.encode(self.encoder(audio))

    def new_stream_state(self, batch: int = 1) -> StreamState:
        self._decoding()
        p = self.decoder.model[0].conv.weight
        return StreamState(_fresh_states(self._decode_path(), batch, p.device, p.dtype))

    @torch.no_grad()
    def decode_stream(self, codes: Tensor, state: StreamState,
                      dest: Optional[dict[str, Tensor]] = None) -> tuple[Tensor, StreamState]:
        """codes [B, 10, f] -> (audio [B, 1, f*2048], next state). Chunks join exactly. `dest`: tensors (keyed as
        the state) that the next state is written into, instead of new ones."""
        codes = self._check_codes(codes)
        if codes.shape[0] != state.batch_size:
            raise ValueError(f"codes have batch {codes.shape[0]} but the stream state has {state.batch_size}")
        if codes.shape[-1] == 0:
            p = self.decoder.model[0].conv.weight
            return torch.zeros(codes.shape[0], 1, 0, device=p.device, dtype=torch.float32), state
        step = _Step(state.tensors, dest)
        audio = self.decoder(self.quantizer.decode(codes, step), step)
        assert step.new.keys() == state.tensors.keys(), "stream state keys changed"
        return audio.float(), StreamState(step.new)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, 10, F] -> audio [B, 1, F*2048] float32. Out-of-range codes are clamped."""
        codes = self._check_codes(codes)
        return self.decode_stream(codes, self.new_stream_state(codes.shape[0]))[0]

    def _check_codes(self, codes: Tensor) -> Tensor:
        self._decoding()
        if codes.ndim == 2:
            codes = codes[None]
        if codes.ndim != 3 or codes.shape[1] != self.config.num_codebooks:
            raise ValueError(f"codes must be [B, {self.config.num_codebooks}, frames], got {tuple(codes.shape)}")
        return codes.to(device=self.decoder.model[0].conv.weight.device, dtype=torch.long)


def use_triton_kernels(codec: nn.Module, on: bool = True, channels_last: bool = True) -> None:
    """Run the streaming decoder's elementwise work as Triton kernels (on a GPU, or under the Triton interpreter in
    tests): every Snake activation as one kernel that also writes a causal convolution's left context next to its
    output and takes the previous convolution's bias along (five elementwise passes, a bias pass and a concatenation
    become one); the last convolution (to one channel: nothing for tensor-core tiles to fill); each dilated
    convolution timed against its phases (`conv1d_phases`) per shape on a GPU, the faster kept; the ten codebooks'
    embeddings as one lookup in a table of their projections (`Quantizer.fuse_embeddings`); and in the
    quantizer's transformers RMSNorm, RoPE, SwiGLU (w1 | w3 in one product) and the scaled residual sums. A call
    runs over a thousand kernels of a few microseconds each whatever its size: their number is most of what a small
    call costs. `channels_last` (with `on`): the decoder runs over [B, T, C] (`Decoder.set_channels_last`: one
    Triton convolution per convolution, the Snake, bias and residual sums in their epilogues; its stream states change
    layout: make them after this)."""
    if on and not jit.available():
        raise RuntimeError("the codec's Triton kernels need the `triton` package: install it, or run without them")
    for m in codec.modules():
        if isinstance(m, (Snake, RMSNorm, Attention)):
            m.fused = on
        if isinstance(m, FeedForward):
            m.fuse(on)
        if isinstance(m, CausalConv1d):
            m.to_one = on and m.conv.out_channels == 1 and m.stride == 1 and m.conv.groups == 1
            m.phase_plan = on and m.conv.dilation[0] > 1 and m.stride == 1 and m.conv.groups == 1
        if isinstance(m, Quantizer):
            m.fuse_embeddings(on)
        if isinstance(m, Decoder):
            m.set_channels_last(on and channels_last)




# --------------------------------------------------------------------------- random init


def make_codec(config: CodecConfig, seed: int) -> DAC:
    """Random weights, deterministic from `seed` (built on CPU), scaled so audio is audible."""
    gen = torch.Generator().manual_seed(seed)
    model = DAC(config)

    def normal_(t: Tensor, std: float):
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=gen) * std)

    final_conv = model.decoder.model[-1].conv
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
            w = m.weight
            if isinstance(m, nn.ConvTranspose1d):  # [in, out, k]: each output sees in * k/stride taps
                fan_in = w.shape[0] * w.shape[2] / m.stride[0]
            else:
                fan_in = w.shape[1] * w.shape[2]
            gain = 0.05 if m is final_conv else (0.5 if name.endswith("block.3.conv") else 1.0)
            normal_(w, gain / math.sqrt(fan_in))
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            normal_(m.weight, 1 / math.sqrt(m.weight.shape[1]))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            normal_(m.weight, 1.0)
        elif isinstance(m, (LayerScale, ConvNeXtBlock)):
            nn.init.constant_(m.gamma, 0.1)
    return model.eval().requires_grad_(False)




def codec_precision(dtype: str, tf32: bool) -> None:
    """Process-wide matmul/convolution precision for a codec process running fp32: `tf32=False` gives
    fp32-exact convolutions (within float32 rounding of the CPU's result), `tf32=True` lets cuDNN use TF32
    (faster for the decoder at large batches, the audio no longer exact)."""
    if dtype in ("fp32", "float32"):
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
