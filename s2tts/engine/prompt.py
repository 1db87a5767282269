"""The engine's input: a prompt as token ids, with every codebook's codes at its semantic positions (built from
text and voice references outside the engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Prompt:
    tokens: torch.Tensor  # [T] int64
    codes: torch.Tensor  # [T, C] int64, meaningful where `semantic`
    semantic: torch.Tensor  # [T] bool
    prefix_len: int = 0  # tokens of the system turn (with the voice reference): shared by requests of one voice
    history_dropped: int = 0  # earlier turns left out so that the prompt fits (`build`'s max_tokens)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])
