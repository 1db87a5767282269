"""Host -> device copies that do not wait for the device.

A copy from pageable host memory into a CUDA tensor blocks the host until the stream's queued work is done (PyTorch
then synchronizes the stream). On the engine's and the codec's paths that would stop the device from being fed
ahead (`Engine.step_ahead`, a codec call queued behind a step): these go through page-locked memory instead, queued
on the current stream (PyTorch keeps the page-locked block until the copy has run). On a CPU they are plain copies.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor `t` on `device`, queued behind the current stream's work."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)` for a host `src`, queued behind the current stream's work where `dst` is on a GPU."""
    if dst.device.type != "cuda" or src.device.type != "cpu":
        return dst.copy_(src)
    return dst.copy_(src.pin_memory(), non_blocking=True)
