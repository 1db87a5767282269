"""KV cache of prompt prefixes (the system turn that carries a voice's reference codes).

Requests that clone the same voice share the first `prompt.prefix_len` tokens. Their keys and
values, for every slow-AR layer, are kept here after the first request prefills them; a later
request copies them into its own cache slot and prefills only the rest of its prompt. LRU under
a byte budget; entries are keyed by a hash of the prefix's tokens and codes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .prompt import Prompt


@dataclass
class PrefixEntry:
    k: torch.Tensor  # [layers, K, P, D]
    v: torch.Tensor
    length: int

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = 32):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def key(self, prompt: Prompt) -> str | None:
        n = prompt.prefix_len
        if self.max_bytes <= 0 or n < self.min_tokens or n >= len(prompt):
            return None
        h = hashlib.sha1(prompt.tokens[:n].numpy().tobytes())
        h.update(prompt.codes[:n].numpy().tobytes())
        return f"{n}:{h.hexdigest()}"

    def get(self, key: str | None) -> PrefixEntry | None:
        if key is None:
            return None
        e = self.entries.get(key)
        if e is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return e

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        if key in self.entries:
            return
        e = PrefixEntry(k, v, k.shape[2])
        if e.nbytes > self.max_bytes:
            return
        self.entries[key] = e
        self.bytes += e.nbytes
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
