"""Device and dtype names as settings spell them (`auto`, `cpu`, `cuda:N`; `bf16`, `fp16`, `fp32`)."""

from __future__ import annotations

import torch


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(table)}")
    return table[name]


def resolve_device(name: str | torch.device | None) -> torch.device:
    """'auto' (or None) picks cuda when available; anything else is passed to torch.device."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device: use device=cpu (or auto)")
    return dev
