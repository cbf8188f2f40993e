"""Which KV blocks are free, and who holds each, on the device and in the host tier: the
block manager only counts, it never touches tensors (the tensors are models/kv_cache.py's)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from nanokv.engine.prefix_cache import PrefixCache


def take(free: list[int], reclaimable: OrderedDict[int, None], reclaim: Callable[[int], None]) -> int:
    """A free block, else the least recently used reclaimable one, whose contents reclaim lets go."""
    if free:
        return free.pop()
    block = reclaimable.popitem(last=False)[0]
    reclaim(block)
    return block


class BlockManager:
    """Hands out block ids from a free list and counts each block's references (a block of a
    cached prefix is shared by every sequence that starts with it). It only counts: it never
    touches tensors. With a PrefixCache, a cached block that no one holds any more is kept for
    a later hit, and reclaimed, least recently used first, only when the free list is empty:
    admission counts such blocks as free.

    The host tier's blocks are held by one swapped-out sequence each, or hold a cached block
    spilled from the device (reclaimed the same way, after the free ones). A reclaimed cached
    device block spills to the host tier when it has a block to give; the copies to make
    before the step are taken by the scheduler (take_spills)."""

    def __init__(self, num_blocks: int, block_size: int, cache: PrefixCache | None = None,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache = cache
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.reclaimable: OrderedDict[int, None] = OrderedDict()   # cached, unreferenced: oldest first
        self.ref_counts = [0] * num_blocks
        self.num_host_blocks = num_host_blocks   # the host tier (models/kv_cache.py HostKVCache)
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.host_reclaimable: OrderedDict[int, None] = OrderedDict()   # spilled cached blocks: oldest first
        self.host_holds: dict[int, int] = {}   # cached host blocks this step reads, and by how many
        self.spills: list[tuple[int, int]] = []   # (device block, host block) to copy before the step

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
        blocks = [take(self.free_blocks, self.reclaimable, self._spill) for _ in range(n)]
        for block in blocks:
            self.ref_counts[block] = 1
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

    def _spill(self, block: int) -> None:
        """A reclaimed cached block: to the host tier if it has a block to give, else forgotten."""
        if self.num_host_free:
            host = self.allocate_host(1)[0]
            self.cache.spill(block, host)
            self.spills.append((block, host))
            self.host_reclaimable[host] = None
        else:
            self.cache.forget(block)

    @property
    def num_host_free(self) -> int:
        return len(self.free_host_blocks) + len(self.host_reclaimable)

    def allocate_host(self, n: int) -> list[int]:
        """n host blocks: free ones, then spilled cached ones, least recently used first."""
        if n > self.num_host_free:
            raise RuntimeError(f"asked for {n} host blocks, only {self.num_host_free} free")
        return [take(self.free_host_blocks, self.host_reclaimable, self._reclaim_host) for _ in range(n)]

    def _reclaim_host(self, block: int) -> None:
        """A spilled cached block reclaimed, perhaps in the step that spills it: that copy is off."""
        self.cache.forget_host(block)
        self.spills = [spill for spill in self.spills if spill[1] != block]

    def hold_host(self, blocks: list[int]) -> None:
        """Cached host blocks a step reads (a block once per reader): none is reclaimed until
        as many release_host."""
        for block in blocks:
            self.host_reclaimable.pop(block, None)
            self.host_holds[block] = self.host_holds.get(block, 0) + 1

    def release_host(self, blocks: list[int]) -> None:
        """Drop a hold on each of blocks (or a swapped sequence's): one no one holds goes back,
        if still cached, among the reclaimable (the most recently used), else to the free list."""
        for block in blocks:
            holds = self.host_holds.pop(block, 0) - 1
            if holds > 0:
                self.host_holds[block] = holds
            elif self.cache is not None and self.cache.holds_host(block):
                self.host_reclaimable[block] = None
            else:
                self.free_host_blocks.append(block)

    def take_spills(self) -> list[tuple[int, int]]:
        spills, self.spills = self.spills, []
        return spills
