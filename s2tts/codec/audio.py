"""Audio into the codec: any rate and channel count -> mono at the codec's sample rate."""

from __future__ import annotations

import math

import numpy as np
import soxr
import torch
from torch import Tensor


def resample(wav: Tensor, orig_sr: int, new_sr: int) -> Tensor:
    """Band-limited resampling of wav [..., T] -> [..., ceil(T * new_sr / orig_sr)], in step with the input (libsoxr's
    very-high-quality linear-phase filter); the input is taken as silent beyond its ends."""
    if orig_sr <= 0 or new_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {new_sr}")
    if not wav.is_floating_point():
        wav = wav.float()
    if orig_sr == new_sr:
        return wav.clone()
    *lead, T = wav.shape
    out_len = -(-T * new_sr // orig_sr)
    dtype = np.float64 if wav.dtype == torch.float64 else np.float32  # soxr's float types
    # soxr gives round(T * new / orig) samples; a few more silent input samples give the ceil's last one
    x = np.zeros((T + math.ceil(orig_sr / new_sr) + 1, math.prod(lead)), dtype)  # soxr's layout: [T, channels]
    x[:T] = wav.detach().reshape(-1, T).T.cpu().numpy()
    y = soxr.resample(x, orig_sr, new_sr, quality="VHQ")[:out_len]
    return torch.from_numpy(np.ascontiguousarray(y.T)).to(wav.device, wav.dtype).reshape(*lead, out_len)


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
