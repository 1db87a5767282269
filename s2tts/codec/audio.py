"""Audio into the codec: any rate and channel count -> mono at the codec's sample rate."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def _kaiser(u: Tensor, beta: float) -> Tensor:
    """Kaiser window evaluated at u in [-1, 1] (0 outside)."""
    inside = u.abs() < 1
    arg = beta * torch.sqrt((1 - u.pow(2)).clamp(min=0))
    return torch.where(inside, torch.special.i0(arg) / torch.special.i0(torch.tensor(beta, dtype=u.dtype)), 0)


def resample(
    wav: Tensor,
    orig_sr: int,
    new_sr: int,
    zero_crossings: int = 16,
    rolloff: float = 0.945,
    beta: float = 8.6,
) -> Tensor:
    """Band-limited resampling of wav [..., T] -> [..., ceil(T * new_sr / orig_sr)].

    Kaiser-windowed sinc, cutoff `rolloff` x the lower Nyquist, `zero_crossings` lobes per side.
    Output sample n sits at input time n * orig / new; its taps come from one of `new`
    (gcd-reduced) phases, so the filter bank is computed once and gathered per block.
    """
    if orig_sr <= 0 or new_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {new_sr}")
    if not wav.is_floating_point():
        wav = wav.float()
    if orig_sr == new_sr:
        return wav.clone()
    g = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // g, new_sr // g
    *lead, T = wav.shape
    x = wav.reshape(-1, T)
    out_len = -(-T * new // orig)

    cutoff = rolloff * min(1.0, new / orig)  # fraction of the input Nyquist
    half = zero_crossings / cutoff  # filter half-width in input samples
    taps = 2 * math.ceil(half)
    # filter bank [new, taps]: phase p = output n mod new, fractional position (n*orig mod new)/new
    frac = (torch.arange(new, dtype=torch.float64) * orig % new) / new
    d = frac[:, None] + (taps // 2 - 1) - torch.arange(taps, dtype=torch.float64)  # t - tap position
    bank = cutoff * torch.sinc(cutoff * d) * _kaiser(d / half, beta)
    bank = bank.to(device=x.device, dtype=x.dtype)

    pad = taps
    xp = F.pad(x, (pad, pad))
    offsets = torch.arange(taps, device=x.device)
    out = []
    block = max(1, 2**20 // taps)
    for start in range(0, out_len, block):
        n = torch.arange(start, min(out_len, start + block), device=x.device)
        first = n * orig // new - (taps // 2 - 1) + pad  # index of the first tap in xp
        frames = xp[:, first[:, None] + offsets]  # [N, n, taps]
        out.append((frames * bank[n % new]).sum(-1))
    return torch.cat(out, dim=-1).reshape(*lead, out_len)


def prepare_audio(wav, sample_rate: int, target_sr: int) -> Tensor:
    """Any waveform -> float32 mono [1, 1, T] at target_sr.

    Accepts [T], [T, C] (soundfile layout) or [C, T] (the shorter axis is taken as channels),
    numpy or torch, float or integer PCM (scaled to [-1, 1]).
    """
    if isinstance(wav, np.ndarray):
        if wav.dtype.kind == "i":
            scale = float(np.iinfo(wav.dtype).max) + 1
            wav = wav.astype(np.float32) / scale
        wav = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32))
    elif isinstance(wav, Tensor):
        if not wav.is_floating_point():
            wav = wav.float() / (float(torch.iinfo(wav.dtype).max) + 1) if wav.dtype != torch.bool else wav.float()
        wav = wav.float()
    else:
        raise ValueError(f"audio must be a numpy array or a torch tensor, got {type(wav).__name__}")
    if wav.numel() == 0:
        raise ValueError(f"audio is empty (shape {tuple(wav.shape)})")
    while wav.ndim > 2 and wav.shape[0] == 1:
        wav = wav[0]
    if wav.ndim == 2:
        channels_first = wav.shape[0] <= wav.shape[1]
        wav = wav.mean(dim=0 if channels_first else 1)
    if wav.ndim != 1:
        raise ValueError(f"audio must be [samples], [samples, channels] or [channels, samples], got {tuple(wav.shape)}")
    if not torch.isfinite(wav).all():
        raise ValueError("audio contains NaN or infinite samples")
    if int(sample_rate) <= 0:
        raise ValueError(f"sample rate must be positive, got {sample_rate}")
    wav = resample(wav, int(sample_rate), int(target_sr))
    return wav.float()[None, None]
