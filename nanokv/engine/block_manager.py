"""Which KV blocks are free, and who holds each: the block manager only counts, it never
touches tensors (the tensors are models/kv_cache.py's)."""
from __future__ import annotations

from collections import OrderedDict

from nanokv.engine.prefix_cache import PrefixCache


class BlockManager:
    """Hands out block ids from a free list and counts each block's references (a block of a
    cached prefix is shared by every sequence that starts with it). It only counts: it never
    touches tensors. With a PrefixCache, a cached block that no one holds any more is kept for
    a later hit, and reclaimed, least recently used first, only when the free list is empty:
    admission counts such blocks as free."""

    def __init__(self, num_blocks: int, block_size: int, cache: PrefixCache | None = None,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache = cache
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.reclaimable: OrderedDict[int, None] = OrderedDict()   # cached, unreferenced: oldest first
        self.ref_counts = [0] * num_blocks
        # The host tier (models/kv_cache.py HostKVCache): its blocks have one holder each.
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.reclaimable)

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, only {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self.free_blocks:
                block = self.free_blocks.pop()
            else:
                block = self.reclaimable.popitem(last=False)[0]
                self.cache.forget(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take one more reference to each of blocks (cached ones, found by a prefix match)."""
        for block in blocks:
            self.reclaimable.pop(block, None)
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of blocks. One no one holds goes back to the free list,
        or, if cached, to the reclaimable ones, the last block first: a prefix's tail is
        reclaimed before its head, which more prompts share."""
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"KV block {block} freed more often than it was taken")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.cache is not None and self.cache.holds(block):
                    self.reclaimable[block] = None
                else:
                    self.free_blocks.append(block)

    def allocate_host(self, n: int) -> list[int]:
        if n > len(self.free_host_blocks):
            raise RuntimeError(f"asked for {n} host blocks, only {len(self.free_host_blocks)} free")
        return [self.free_host_blocks.pop() for _ in range(n)]

    def free_host(self, blocks: list[int]) -> None:
        self.free_host_blocks += reversed(blocks)
