"""KV cache of prompt prefixes (the system turn that carries a voice's reference codes), by block reference.

Requests that clone the same voice share the first `prompt.prefix_len` tokens. After the first such
request prefills them, an entry here holds that request's full KV blocks of the prefix by reference
(s2tts/engine/paged.py counts references) and a private copy of the last, partial block (the request goes on
writing its own tokens into that one). A later request of the voice starts with the entry's full blocks
in its block table (shared, never written: it writes only positions past the prefix) and its own copy
of the partial block, and prefills only the rest of its prompt.

LRU under a byte budget (every block an entry holds counts, shared or not); entries are keyed by a hash of
the prefix's tokens and codes. A block goes back to the pool when its last holder lets go.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from .prompt import Prompt


@dataclass
class PrefixEntry:
    blocks: list[int]  # the prefix's full blocks (shared), then a private copy of its partial last block if any
    length: int  # tokens


class PrefixCache:
    def __init__(self, max_bytes: int, pool, block_bytes: int, min_tokens: int = 32):
        """Entries hold blocks of `pool` (a BlockPool), `block_bytes` each; the partial blocks are copied through
        the pool (`BlockPool.copy`: done on the device before the next pass)."""
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.pool, self.block_bytes = pool, block_bytes
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.held = 0  # blocks held by entries
        self.hits = self.misses = 0

    @property
    def bytes(self) -> int:
        return self.held * self.block_bytes

    def key(self, prompt: Prompt) -> str | None:
        n = prompt.prefix_len
        if self.max_bytes < self.block_bytes or n < self.min_tokens or n >= len(prompt):
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

    def attach(self, e: PrefixEntry) -> list[int]:
        """The blocks a request of this prefix starts with: the full ones shared, a fresh copy of the partial one.
        The caller has checked that the pool has a free block for the copy."""
        full, rest = divmod(e.length, self.pool.block_size)
        shared = e.blocks[:full]
        self.pool.retain(shared)
        if not rest:
            return list(shared)
        own = self.pool.alloc(1)
        self.pool.copy([e.blocks[full]], own)
        return shared + own

    def put(self, key: str, blocks: list[int], length: int) -> None:
        """Keep the prefix of `length` tokens held by a request's `blocks` (nothing if it does not fit the budget
        or the pool has no block for the partial copy)."""
        if key in self.entries:
            return
        full, rest = divmod(length, self.pool.block_size)
        n = full + (1 if rest else 0)
        if n * self.block_bytes > self.max_bytes:
            return
        while self.entries and (self.held + n) * self.block_bytes > self.max_bytes:
            self._evict_one()
        if rest and self.pool.free == 0:
            return
        shared = blocks[:full]
        self.pool.retain(shared)
        own = []
        if rest:
            own = self.pool.alloc(1)
            self.pool.copy([blocks[full]], own)
        self.entries[key] = PrefixEntry(shared + own, length)
        self.held += n

    def evict_until(self, free_blocks: int) -> None:
        """Drop least recently used entries until the pool has `free_blocks` free (or no entry is left)."""
        while self.entries and self.pool.free < free_blocks:
            self._evict_one()

    def clear(self) -> None:
        while self.entries:
            self._evict_one()

    def _evict_one(self) -> None:
        _, e = self.entries.popitem(last=False)
        self.pool.release(e.blocks)
        self.held -= len(e.blocks)
