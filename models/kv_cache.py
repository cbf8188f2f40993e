"""The paged KV cache's tensors: one pool of fixed-size blocks shared by all sequences.

A block holds block_size tokens of every layer and KV head. It is made of
L x Hkv *pages*, one per (layer, KV head), and the kernels address pages
(KV-Compress, Sec. 4.2.1): each (sequence, layer, KV head) has its own page
table and context length, so after per-head eviction heads hold different
numbers of pairs. Page `(layer * num_blocks + block) * Hkv + head` is block's
own page for that head (a layer's pages lie together, as a per-layer pool
would), and those make the whole page table of a sequence whose heads all
hold the same pairs (which blocks are free: nanokv/engine/block_manager.py).

Beside K and V, every slot carries the metadata eviction needs: the original
token position (int32) and an attention score (fp32), and, when the cache is
quantized (int8 or fp8), the scales of K and V. One more buffer is scratch,
shared by all layers: the raw attention logits a scored decode step keeps per
slot and query head until it knows each query's softmax denominator
(kernels/attention/decode.py); only the Triton kernels use it, and only they get it.
"""
from __future__ import annotations

import numpy as np
import torch

import kernels
from kernels import QUANT_MAX
from models.config import ModelConfig


class KVCache:
    """The tensors of the pool (layout documented in kernels/kv_store.py), all layers in one.
    dtype: the cache's (the model's, or int8 / fp8 e4m3 for a quantized cache, whose K and V
    carry scales)."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_kv_heads = model.num_layers, model.num_kv_heads
        self.num_blocks, self.block_size = num_blocks, block_size
        self.block_bytes = self.bytes_per_block(model, block_size, dtype, device)
        shape = (model.num_layers * num_blocks * model.num_kv_heads, block_size)
        # Zeroed, not empty: attention reads whole pages and masks the unused slots,
        # and 0 * NaN from uninitialised memory would still be NaN.
        self.k = torch.zeros(*shape, model.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.zeros(shape, dtype=torch.int32, device=device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=device)
        self.logits = kernels.logits_scratch(shape[0], model.num_heads // model.num_kv_heads, block_size, device)
        quantized = dtype in QUANT_MAX
        self.kv_scales = torch.zeros(*shape, 2, device=device) if quantized else None
        layers = torch.arange(self.num_layers, device=device)[:, None, None]
        heads = torch.arange(self.num_kv_heads, device=device)[None, :, None]
        self._page_offsets = (layers * num_blocks * self.num_kv_heads + heads).int()   # [L, Hkv, 1]
        self._slot_offsets = self._page_offsets[..., 0].long()[:, None, :] * block_size   # [L, 1, Hkv]

    def pages(self, blocks: torch.Tensor) -> torch.Tensor:
        """Block ids [..., nb] -> their pages [..., L, Hkv, nb]: each head's page table."""
        return blocks.to(torch.int32)[..., None, None, :] * self.num_kv_heads + self._page_offsets

    def batch_pages(self, blocks: torch.Tensor) -> torch.Tensor:
        """Block ids [B, nb] -> the step's page tables [L, B, Hkv, nb], layer first as the
        kernels read them, built in one allocation."""
        return (blocks.to(torch.int32) * self.num_kv_heads)[None, :, None] + self._page_offsets[:, None]

    def first_slots(self, blocks: np.ndarray, rows: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Each token's slot in the first page of its block (layer 0, KV head 0), on the host: the
        index-th slot [T] of the sequence whose block ids are row rows[t] of blocks [B, nb]. The
        same in every pool of the model."""
        block = blocks[rows, index // self.block_size].astype(np.int64)
        return block * (self.num_kv_heads * self.block_size) + index % self.block_size

    def token_slots(self, first: torch.Tensor) -> torch.Tensor:
        """Where tokens' pairs go in every layer and KV head [L, T, Hkv] (int64) when each head
        holds its pairs in its blocks' own pages: each token's first_slots [T] in this pool."""
        return first[None, :, None] + self._slot_offsets

    @property
    def per_slot(self) -> tuple[torch.Tensor, ...]:
        """Every buffer [num_pages, bs, ...] whose slots move with their pair (kernels/compact.py)."""
        scales = () if self.kv_scales is None else (self.kv_scales,)
        return (self.k, self.v, self.positions, self.scores, *scales)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Blocks src into dst, every page, their scores zeroed: a sequence's own copy of
        cached blocks that it will write into (eviction compacts them, scores accumulate)."""
        device = self.k.device
        src_pages, dst_pages = (self.pages(kernels.from_host(b, device)).flatten().long() for b in (src, dst))
        for per_slot in self.per_slot:   # K, V (and their scales), positions
            if per_slot is not self.scores:
                per_slot[dst_pages] = per_slot[src_pages]
        self.scores.index_fill_(0, dst_pages, 0.0)

    def move_pages(self, tables: torch.Tensor, old_blocks: list[int], new_blocks: list[int]) -> torch.Tensor:
        """Page tables whose pages lay in old_blocks, with each old_blocks[i] now new_blocks[i]
        (pages of other blocks unchanged): a swapped sequence's own tables, back on the device."""
        device = tables.device
        where = torch.arange(self.num_blocks, device=device)
        where[torch.tensor(old_blocks, device=device)] = torch.tensor(new_blocks, device=device)
        block = (tables.long() // self.num_kv_heads) % self.num_blocks
        return (tables + (where[block] - block) * self.num_kv_heads).to(tables.dtype)

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device) -> int:
        """Memory of one block: K and V (and their two fp32 scales if quantized), position,
        score and (Triton) the logits scratch of its G query heads, in every page."""
        kv = 2 * model.head_dim * dtype.itemsize
        metadata = 4 + 4 + (2 * 4 if dtype in QUANT_MAX else 0)
        logits = kernels.scratch_bytes_per_slot(model.num_heads // model.num_kv_heads, device)
        return model.num_layers * model.num_kv_heads * block_size * (kv + metadata + logits)


class HostKVCache:
    """The host tier: whole blocks of the pool in host memory (pinned when the pool is on CUDA),
    each with everything its slots carry (KVCache.per_slot). Host block b holds, per buffer,
    the block's L x Hkv pages: [num_blocks, L, Hkv, bs, ...]. Which host blocks are free:
    nanokv/engine/block_manager.py.

    For decoding from the host with partial recomputation (models/host_stream.py) it also
    keeps the layer inputs of the first positions of every running sequence, by the row of
    its block table: layer_inputs [rows, L, positions, hidden] in the model's dtype.

    What a step decoding from the host reads of one layer is gathered into staging buffers
    (stage_layer), two sets that alternate between even and odd layers as the pool's
    staging pages do, each as large as one layer of the whole tier; they are allocated at the
    first such step and reused by every one after, pinned like the tier, so the transfer
    leaves from them directly."""

    def __init__(self, cache: KVCache, num_blocks: int, layer_inputs: tuple[int, ...] = (0, 0, 0, 0),
                 dtype: torch.dtype = torch.float32):
        self.cache, self.num_blocks = cache, num_blocks
        pinned = cache.k.device.type == "cuda"
        self.per_slot = tuple(torch.zeros(num_blocks, cache.num_layers, cache.num_kv_heads, *buffer.shape[1:],
                                          dtype=buffer.dtype, pin_memory=pinned) for buffer in cache.per_slot)
        self.layer_inputs = torch.zeros(layer_inputs, dtype=dtype, pin_memory=pinned)
        self._staging: list[tuple[torch.Tensor, ...]] = []   # per half: a buffer per per_slot, then the inputs'
        self._transferred: list[torch.cuda.Event | None] = [None, None]   # per half: its last transfer's end

    @staticmethod
    def bytes_per_block(cache: KVCache) -> int:
        """A host block: every per-slot buffer's pages of one block (no scratch)."""
        return cache.num_layers * cache.num_kv_heads * sum(b[0].nbytes for b in cache.per_slot)

    def _pages(self, device_blocks: list[int]) -> torch.Tensor:
        """[n, L, Hkv]: the pages of device_blocks, block first as the host tier holds them."""
        return self.cache.pages(torch.tensor(device_blocks, device=self.cache.k.device)).permute(2, 0, 1)

    def save(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy the pool's device_blocks into host_blocks: per buffer, one gather on the device
        into a contiguous tensor and one transfer."""
        pages = self._pages(device_blocks)
        rows = torch.tensor(host_blocks)
        for host, buffer in zip(self.per_slot, self.cache.per_slot):
            host[rows] = buffer[pages].cpu()

    def load(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host_blocks into the pool's device_blocks: per buffer, one gather on the host
        and one transfer."""
        pages = self._pages(device_blocks)
        rows = torch.tensor(host_blocks)
        for host, buffer in zip(self.per_slot, self.cache.per_slot):
            buffer[pages] = self.to_device(host[rows])

    def stage_layer(self, half: int, layer: int, blocks: torch.Tensor,
                    inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Layer's pages of host blocks (per buffer [n, Hkv, bs, ...]) and its kept layer inputs
        at inputs = (rows, positions) ([P, hidden], None for no positions), on the pool's device:
        gathered on the host into half's staging buffers, then one transfer each. On CUDA the
        transfers are issued on the current stream; half's buffers are written again only
        after they have left."""
        staging = self._staging_buffers(half)
        if self._transferred[half] is not None:
            self._transferred[half].synchronize()
        L, pages, staged_inputs = self.cache.num_layers, [], None
        if len(blocks):   # host block b's layer is row b * L + layer of [num_blocks * L, Hkv, bs, ...]
            for host, out in zip(self.per_slot, staging):
                pages.append(self.to_device(torch.index_select(host.flatten(0, 1), 0, blocks * L + layer,
                                                               out=out[:len(blocks)])))
        rows, positions = inputs
        if len(positions):   # [rows * L * positions, hidden]
            at = (rows * L + layer) * self.layer_inputs.shape[2] + positions
            staged_inputs = self.to_device(torch.index_select(self.layer_inputs.flatten(0, 2), 0, at,
                                                              out=staging[-1][:len(at)]))
        if self.cache.k.device.type == "cuda":
            self._transferred[half] = torch.cuda.current_stream().record_event()
        return pages, staged_inputs

    def _staging_buffers(self, half: int) -> tuple[torch.Tensor, ...]:
        """half's staging buffers: a layer of every host block per buffer, and a layer of every
        kept input; allocated (both halves) the first time, outside inference mode like the
        tier, so that they can be written in it and out of it."""
        if not self._staging:
            pinned = self.cache.k.device.type == "cuda"
            rows, _, positions, hidden = self.layer_inputs.shape
            with torch.inference_mode(False):
                self._staging = [tuple(torch.empty(self.num_blocks, *host.shape[2:], dtype=host.dtype,
                                                   pin_memory=pinned) for host in self.per_slot)
                                 + (torch.empty(rows * positions, hidden, dtype=self.layer_inputs.dtype,
                                                pin_memory=pinned),) for _ in range(2)]
        return self._staging[half]

    def to_device(self, staged: torch.Tensor) -> torch.Tensor:
        """A tensor gathered on the host, on the pool's device (on CUDA through pinned memory,
        so that the host need not wait for the transfer; a pinned one, as the staging buffers
        are, is not copied again)."""
        device = self.cache.k.device
        return (staged.pin_memory() if device.type == "cuda" else staged).to(device, non_blocking=True)
