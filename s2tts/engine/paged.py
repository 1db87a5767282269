"""Paged KV cache bookkeeping: which blocks of the pool each request's keys and values live in.

A stack's pool (`ar.model.Stack.setup_caches`) holds `num_blocks` blocks of `block_size` token positions for every
layer, and a device block table `[slots, max_blocks]` maps a slot's logical block i (positions i*block_size ...)
to a physical block; the attention (eager code and the Triton kernels) reads and writes through it. The table is
one static tensor whose contents change, so CUDA graphs captured over it stay valid.

Block 0 is the null block: it belongs to no request. Every table entry that is not a request's block points at
it, so the padding rows of a batch (the scratch slot, or positions past a prompt) write there and never into
another request's block.

`BlockPool` is host-side only (plain Python and numpy, no device): the free list, reference counts (a voice
prefix's blocks are shared by every request that uses it, see `PrefixCache`), each slot's blocks, a host copy of
the block table with the rows changed since the last `take_changes`, and the block copies asked for meanwhile.
The model runner applies both to the device before its next pass (`ModelRunner.apply`), so the scheduler that
owns the pool never touches the device.
"""

from __future__ import annotations

import numpy as np


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, slots: int, max_seq: int):
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks = blocks_for(max_seq, block_size)
        self.table = np.zeros((slots, self.max_blocks), dtype=np.int32)  # host copy of the device table
        self._dirty: set[int] = set()  # slots whose table row changed since take_changes
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies asked for since take_changes
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

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Ask for the contents of blocks src[i] to be copied into dst[i] before the next pass (which has not
        written any of them since the last one)."""
        self._copies.extend(zip(src, dst))

    # ---- a slot's blocks ---------------------------------------------------------------------
    def assign(self, slot: int, blocks: list[int]) -> None:
        """Give `slot` these blocks (already counted for it) as its first logical blocks; the rest of its table
        row points at the null block."""
        if slot in self.owned:
            raise RuntimeError(f"slot {slot} still holds KV blocks")
        self.owned[slot] = list(blocks)
        self.table[slot] = 0
        self.table[slot, : len(blocks)] = blocks
        self._dirty.add(slot)

    def extend(self, grants: list[tuple[int, int]]) -> None:
        """Append one block to each (slot, block) pair's slot."""
        for slot, block in grants:
            blocks = self.owned[slot]
            self.table[slot, len(blocks)] = block
            blocks.append(block)
            self._dirty.add(slot)

    def free_slot(self, slot: int) -> None:
        """Release the slot's blocks; its table row points at the null block again."""
        blocks = self.owned.pop(slot, None)
        if blocks is None:
            return
        self.release(blocks)
        self.table[slot] = 0
        self._dirty.add(slot)

    def holds(self, slot: int) -> int:
        return len(self.owned.get(slot, ()))

    # ---- what the device must learn ----------------------------------------------------------
    def take_changes(self) -> tuple[list[tuple[int, int]], list[int]]:
        """-> (block copies asked for, slots whose row changed) since the last call; the caller copies first, then
        writes those rows of `table` into the device table."""
        copies, self._copies = self._copies, []
        rows, self._dirty = sorted(self._dirty), set()
        return copies, rows
