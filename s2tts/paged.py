"""Paged KV cache: every request's keys and values live in fixed-size blocks of one pool per stack.

A stack's pool holds `num_blocks` blocks of `block_size` token positions for every layer
(`[layers, blocks, K, block_size, D]`, one tensor for keys and one for values). A device block table
`[slots, max_blocks]` maps a slot's logical block i (positions i*block_size ...) to a physical block; the
attention (eager code and the Triton kernels) reads and writes through it. The table is one static
tensor whose contents change, so CUDA graphs captured over it stay valid.

Block 0 is the null block: it belongs to no request. Every table entry that is not a request's block
points at it, so the padding rows of a batch (the scratch slot, or positions past a prompt) write there
and never into another request's block.

`BlockPool` is the host-side bookkeeping: the free list, reference counts (a voice prefix's blocks are
shared by every request that uses it, see `PrefixCache`), and each slot's list of blocks. The slot layout
of before is the special case `block_size = max_seq_len` with one block per slot.
"""

from __future__ import annotations

import torch


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, slots: int, max_seq: int, device):
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks = blocks_for(max_seq, block_size)
        self.table = torch.zeros(slots, self.max_blocks, dtype=torch.int32, device=device)
        self._free = list(range(num_blocks - 1, 0, -1))
        self.refs = [0] * num_blocks
        self.owned: dict[int, list[int]] = {}  # slot -> its blocks, in logical order

    # ---- counting ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks a request may ever hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    # ---- allocation --------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool: {n} blocks asked, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def retain(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refs[b] <= 0:
                raise RuntimeError(f"KV block {b} retained while free")
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released twice")

    # ---- a slot's blocks ---------------------------------------------------------------------
    def assign(self, slot: int, blocks: list[int]) -> None:
        """Give `slot` these blocks (already counted for it) as its first logical blocks; the rest of its table
        row points at the null block."""
        if slot in self.owned:
            raise RuntimeError(f"slot {slot} still holds KV blocks")
        self.owned[slot] = list(blocks)
        row = torch.zeros(self.max_blocks, dtype=torch.int32)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.table[slot].copy_(row, non_blocking=True)

    def extend(self, grants: list[tuple[int, int]]) -> None:
        """Append one block to each (slot, block) pair's slot, in one table update."""
        if not grants:
            return
        idx = []
        for slot, block in grants:
            blocks = self.owned[slot]
            idx.append((slot, len(blocks), block))
            blocks.append(block)
        t = torch.tensor(idx, dtype=torch.int64).to(self.table.device, non_blocking=True)
        self.table[t[:, 0], t[:, 1]] = t[:, 2].to(torch.int32)

    def free_slot(self, slot: int) -> None:
        """Release the slot's blocks; its table row points at the null block again."""
        blocks = self.owned.pop(slot, None)
        if blocks is None:
            return
        self.release(blocks)
        self.table[slot].zero_()

    def holds(self, slot: int) -> int:
        return len(self.owned.get(slot, ()))
