"""Sampling: temperature, top-p, top-k and repetition-aware sampling (RAS), batched.

Random numbers are counter-based: uniform(seed, step, stream, index) is a hash, so a
request's samples depend only on its own seed and step, never on what else is in the
batch or on the device. No host synchronisation, no torch.Generator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..settings import REQUEST_FIELDS as _F, SCHEMA as _S, check_field
from . import kernels

# Streams of random numbers per step: 0 = slow AR sample, 1 = slow AR RAS resample,
# 1 + k = fast AR codebook k.
STREAM_SLOW, STREAM_RAS = 0, 1

RAS_WINDOW = 10
RAS_TEMPERATURE = 1.0
RAS_TOP_P = 0.9

_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding 32-bit values (low bits survive wrap-around)."""
    h = h & _M32
    h = (h ^ (h >> 16)) * 0x85EBCA6B & _M32
    h = (h ^ (h >> 13)) * 0xC2B2AE35 & _M32
    return h ^ (h >> 16)


def uniform(seed: torch.Tensor, step: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """[B, n] uniforms in (0, 1), a pure function of (seed[b], step[b], stream, index)."""
    idx = torch.arange(n, device=seed.device, dtype=torch.int64)
    lo, hi = seed & _M32, (seed >> 32) & _M32
    h = _mix32(lo * 0x9E3779B1 + _mix32(hi + 0x632BE5AB))
    h = _mix32(h + step * 0x7FEB352D + stream * 0x68E31DA4)
    h = _mix32(h[:, None] + idx[None, :] * 0x1B873593 + 0x2545F491)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _choose(sorted_logits, temperature, top_p, top_k, seed, step, stream: int, kernel: bool) -> torch.Tensor:
    """Rank sampled from descending-sorted logits [B, V] (see `sample`)."""
    if kernel:
        return kernels.choose(sorted_logits, temperature, top_p, top_k, seed, step, stream)
    B, V = sorted_logits.shape
    cum = sorted_logits.softmax(-1).cumsum(-1)
    rank = torch.arange(V, device=sorted_logits.device)[None, :]
    k = top_k.clamp_min(1)[:, None]  # top_k=0: only rank 0 survives (greedy), as upstream
    remove = (cum > top_p[:, None]) | (rank >= k)
    remove[:, 0] = False
    scaled = sorted_logits / temperature.clamp_min(1e-5)[:, None]
    probs = scaled.masked_fill(remove, float("-inf")).softmax(-1)
    q = -torch.log(uniform(seed, step, stream, V))  # Exp(1) noise per rank
    return torch.argmax(probs / q, dim=-1)


def sample(logits, temperature, top_p, top_k, seed, step, stream: int, kernel: bool = False) -> torch.Tensor:
    """logits [B, V] (any float dtype, sampled as float32); temperature/top_p [B] float; top_k [B] int (0 = greedy,
    as upstream); seed/step [B] int64 -> [B].

    As the reference: sort (equal logits: the lowest index first); top-p mask from the softmax of the un-tempered
    logits, and rank >= top_k masked; rank 0 always kept; then divide by max(T, 1e-5), softmax, exponential-race sample.
    `kernel`: the same function as one Triton kernel per row (GPU), which also sorts rows of up to
    `kernels.SORT_IN_KERNEL` logits itself (the fast AR's).
    """
    if kernel:
        if logits.shape[-1] <= kernels.SORT_IN_KERNEL:
            return kernels.choose(logits, temperature, top_p, top_k, seed, step, stream, sort=True)
    sorted_logits, order = logits.float().sort(dim=-1, descending=True, stable=True)  # ties: lowest index first
    choice = _choose(sorted_logits, temperature, top_p, top_k, seed, step, stream, kernel)
    return order.gather(-1, choice[:, None]).squeeze(-1)


def sample_semantic(logits, recent, temperature, top_p, top_k, seed, step, kernel: bool = False,
                    end_index: int | None = None, allow_end: torch.Tensor | None = None) -> torch.Tensor:
    """Slow-AR sample with RAS: if the sampled code is among the request's recent codes
    (`recent` [B, W], -1 = empty), take a second sample drawn at T 1.0 / top-p 0.9 (one sort for both).
    `allow_end` [B] bool with `end_index`: the end token's column masked in the rows where it is False. `kernel`:
    the draws in the sampling kernel (the sort stays torch's radix sort, faster than one program sorting the 4,097
    logits in the kernel)."""
    if allow_end is not None:
        end_col = torch.arange(logits.shape[-1], device=logits.device) == end_index
        logits = logits.masked_fill(end_col[None, :] & ~allow_end[:, None], float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    first = order.gather(-1, _choose(sorted_logits, temperature, top_p, top_k, seed, step, STREAM_SLOW, kernel)[:, None])[:, 0]
    ras_t = torch.full_like(temperature, RAS_TEMPERATURE)
    ras_p = torch.full_like(top_p, RAS_TOP_P)
    second = order.gather(-1, _choose(sorted_logits, ras_t, ras_p, top_k, seed, step, STREAM_RAS, kernel)[:, None])[:, 0]
    repeated = (recent == first[:, None]).any(dim=-1)
    return torch.where(repeated, second, first)


@dataclass
class SamplingParams:
    """Per-request generation settings; `validate()` explains what to change."""

    temperature: float = _F["temperature"].default
    top_p: float = _F["top_p"].default
    top_k: int = _F["top_k"].default
    max_new_tokens: int = _S["default_max_new_tokens"].default
    seed: int | None = None
    ignore_end: bool = False  # never sample the end token (benchmarks with random weights)

    def validate(self, max_new_tokens_limit: int | None = None) -> "SamplingParams":
        """Each field against its range in `s2tts.settings.REQUEST_FIELDS` (S2Error invalid_argument, a ValueError)."""
        limits = {"max_new_tokens_limit": max_new_tokens_limit}
        for name in ("temperature", "top_p", "top_k", "max_new_tokens", "seed"):
            check_field(name, getattr(self, name), limits)
        return self
