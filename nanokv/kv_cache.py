"""The paged KV cache: one pool of fixed-size blocks shared by all sequences.

Beside K and V, every slot of every KV head carries the metadata eviction
needs, laid out like the cache so kernels read it through the same block
tables: the original token position (int32) and an attention score (fp32),
and, when the cache is quantized (int8 or fp8), the scales of K and V.
One more buffer of the pool's shape is scratch, shared by all layers: the
raw attention logits a scored decode step keeps per slot and query head
until it knows each query's softmax denominator (kernels/decode_attention.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kernels import logits_scratch
from kernels.kv_store import QUANT_MAX
from nanokv.config import ModelConfig
from nanokv.prefix_cache import PrefixCache


@dataclass
class LayerCache:
    """Views of one layer's slice of the pool (layout documented in kernels/kv_store.py)."""
    k: torch.Tensor          # [num_blocks, num_kv_heads, block_size, head_dim]
    v: torch.Tensor          # [num_blocks, num_kv_heads, block_size, head_dim]
    positions: torch.Tensor  # [num_blocks, num_kv_heads, block_size] int32
    scores: torch.Tensor     # [num_blocks, num_kv_heads, block_size] float32
    logits: torch.Tensor     # [num_blocks, num_heads, block_size] float32 scratch, the same for every layer
    kv_scales: torch.Tensor | None   # [num_blocks, num_kv_heads, block_size, 2] float32; None unquantized


class KVCache:
    """The tensors of the pool, for all layers at once. dtype: the cache's (the model's,
    or int8 / fp8 e4m3 for a quantized cache, whose K and V carry scales)."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (model.num_layers, num_blocks, model.num_kv_heads, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        # Zeroed, not empty: attention reads whole blocks and masks the unused slots,
        # and 0 * NaN from uninitialised memory would still be NaN.
        self.k = torch.zeros(*shape, model.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.zeros(shape, dtype=torch.int32, device=device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=device)
        self.logits = logits_scratch(num_blocks, model.num_heads, block_size, device)
        quantized = dtype in QUANT_MAX
        self.kv_scales = torch.zeros(*shape, 2, device=device) if quantized else None

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self.k[i], self.v[i], self.positions[i], self.scores[i], self.logits,
                          None if self.kv_scales is None else self.kv_scales[i])

    @property
    def per_slot(self) -> tuple[torch.Tensor, ...]:
        """Every buffer [L, num_blocks, H, bs, ...] whose slots move with their pair (kernels/compact.py)."""
        scales = () if self.kv_scales is None else (self.kv_scales,)
        return (self.k, self.v, self.positions, self.scores, *scales)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Blocks src into dst, in every layer, their scores zeroed: a sequence's own copy of
        cached blocks that it will write into (eviction compacts them, scores accumulate)."""
        for per_slot in self.per_slot:   # K, V (and their scales), positions
            if per_slot is not self.scores:
                per_slot[:, dst] = per_slot[:, src]
        self.scores[:, dst] = 0.0

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Memory of one block: K and V (and their two fp32 scales if quantized), position and
        score in every layer, and the logits scratch."""
        kv = 2 * model.head_dim * dtype.itemsize
        metadata = 4 + 4 + (2 * 4 if dtype in QUANT_MAX else 0)
        logits = 4 * model.num_heads * block_size
        return model.num_layers * model.num_kv_heads * block_size * (kv + metadata) + logits


class BlockManager:
    """Hands out block ids from a free list and counts each block's references (a block of a
    cached prefix is shared by every sequence that starts with it). It only counts: it never
    touches tensors. With a PrefixCache, a cached block that no one holds any more is kept for
    a later hit, and reclaimed, least recently used first, only when the free list is empty:
    admission counts such blocks as free."""

    def __init__(self, num_blocks: int, block_size: int, cache: PrefixCache | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache = cache
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.reclaimable: OrderedDict[int, None] = OrderedDict()   # cached, unreferenced: oldest first
        self.ref_counts = [0] * num_blocks

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
