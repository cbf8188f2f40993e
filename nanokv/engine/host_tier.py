"""The runner's side of the host tier (kv_offload_gb): how many blocks it holds on this rank,
the pool's staging blocks that sequences decoding from it read their offloaded blocks
through (decode_from_host), KVPR's split of those blocks into recomputed and copied ones, the
layer inputs kept for recomputing, and each step's traffic with it (models/host_stream.py
runs that traffic, layer by layer, beside the forward pass)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

import kernels
from models import Decoder, HostKVCache, HostStream, KVCache
from nanokv.config import EngineConfig
from nanokv.engine.offload_costs import PositionCost, best_split
from nanokv.engine.sequence import Sequence

STAGING_SHARE = 0.25      # of the pool, at most, stages K/V decoded from the host tier


class HostTier:
    def __init__(self, config: EngineConfig, model: Decoder, kv_cache: KVCache, dtype: torch.dtype,
                 kv_dtype: torch.dtype, link_and_device: tuple[float, float] | None):
        """This rank's part of the host tier of kv_offload_gb (the same number of blocks on every
        rank, each holding its own KV heads), and for decoding from it the pool's staging blocks
        (the last ones: their L pages each stage one offloaded block, in two halves, each
        enough for every host block, 2/L of the tier, but at most STAGING_SHARE of the pool)
        and the layer inputs of the first input_positions positions of every running sequence,
        as many as KVPR's split may recompute at max_model_len (at most half of the tier).
        link_and_device: what KVPR's split weighs (offload_costs.py)."""
        shape, bs, shard, device = model.config, config.block_size, model.shard, kv_cache.k.device
        self.config, self.block_size, self.device = config, bs, device
        budget = int(config.kv_offload_gb * 1e9) // shard.size
        self.split: Callable[[int], int] = lambda s: 0   # of s offloaded positions, how many to recompute
        if config.decode_from_host and config.partial_recompute:
            cost = PositionCost.of(shape, dtype, kv_dtype, kv_dtype in kernels.QUANT_MAX, *link_and_device)
            self.split = lambda s: best_split(s, cost)
        per_position = config.max_num_seqs * shape.num_layers * shape.hidden_size * dtype.itemsize
        self.input_positions = min(self.split(config.max_model_len), budget // 2 // per_position) // bs * bs
        block_bytes = HostKVCache.bytes_per_block(kv_cache)
        num_blocks = shard.min((budget - self.input_positions * per_position) // block_bytes, device)
        if config.kv_offload_gb and not num_blocks:
            raise ValueError(f"kv_offload_gb={config.kv_offload_gb} holds no KV block (one takes "
                             f"{block_bytes} bytes): give more, or 0 for no host tier")
        staging = 0
        if config.decode_from_host:
            staging = min(-(-2 * num_blocks // shape.num_layers), int(kv_cache.num_blocks * STAGING_SHARE))
        self.num_pool_blocks = kv_cache.num_blocks - staging   # the blocks the scheduler hands out
        if self.num_pool_blocks * bs < config.max_model_len:
            raise ValueError(f"decode_from_host stages in {staging} of the {kv_cache.num_blocks} KV blocks, "
                             f"leaving too few for max_model_len={config.max_model_len}: give the pool more")
        pages = kv_cache.pages(torch.arange(self.num_pool_blocks, kv_cache.num_blocks, device=device))
        half, heads = shape.num_layers * staging // 2, shape.num_kv_heads
        self.staging_pages = pages.transpose(1, 2).reshape(-1, heads)[:2 * half].view(2, half, heads)
        self.copy_stream = torch.cuda.Stream(device) if staging and device.type == "cuda" else None
        self.blocks_streamed = self.positions_recomputed = 0
        inputs = (config.max_num_seqs, shape.num_layers, self.input_positions, shape.hidden_size)
        self.cache = HostKVCache(kv_cache, num_blocks, inputs if self.input_positions else (0, 0, 0, 0), dtype)

    def stream(self, seqs: list[Sequence], starts: list[int], num_new: list[int], cu_seqlens: list[int],
               tables: torch.Tensor, rope_rows: Callable[[np.ndarray, np.ndarray], torch.Tensor | None]
               ) -> HostStream | None:
        """The step's traffic with the host tier, None if it has none. A sequence decoding from the
        host gets staging pages for its offloaded blocks in every layer's tables; of those blocks,
        the first ones whose positions' layer inputs were kept, as many as KVPR's split says, are
        recomputed, the others copied. Prompt rows keep their layer inputs up to input_positions,
        when every position before them has. rope_rows(positions, owners): the RoPE table's rows
        of recomputed positions (owners: the index of each one's sequence in seqs), or None."""
        if not (self.config.decode_from_host or self.input_positions):
            return None
        bs, staged = self.block_size, 0
        copied, copied_pages, recomputed_pages = [], [], []
        inputs, keep_rows, keep_at, owners = ([], []), [], ([], []), []   # (store row, position) each
        for b, seq in enumerate(seqs):
            row = seq.block_table.row
            if seq.offloaded:
                k = len(seq.offloaded)
                pages = self.staging_pages[:, staged:staged + k]   # [2, k, Hkv]: even layers', odd layers'
                staged += k
                tables[0::2, b, :, :k], tables[1::2, b, :, :k] = pages[0].T, pages[1].T
                recomputed = min(self.split(k * bs), seq.num_kept_inputs) // bs
                copied += seq.offloaded[recomputed:]
                copied_pages.append(pages[:, recomputed:])
                recomputed_pages.append(pages[:, :recomputed])
                inputs[0].extend([row] * recomputed * bs)
                inputs[1].extend(range(recomputed * bs))
                owners.extend([b] * recomputed * bs)
            elif self.input_positions and seq.method.shares_blocks \
                    and seq.num_kept_inputs == starts[b] < min(self.input_positions, seq.num_prompt_tokens):
                end = min(starts[b] + num_new[b], self.input_positions, seq.num_prompt_tokens)
                keep_rows += range(cu_seqlens[b], cu_seqlens[b] + end - starts[b])
                keep_at[0].extend([row] * (end - starts[b]))
                keep_at[1].extend(range(starts[b], end))
                seq.num_kept_inputs = end
        if not staged and not keep_rows:
            return None
        self.blocks_streamed += len(copied)
        self.positions_recomputed += len(inputs[1])
        none = self.staging_pages[:, :0]
        pages = torch.cat(recomputed_pages, dim=1) if recomputed_pages else none
        slots = (pages.long() * bs)[:, :, None] + torch.arange(bs, device=self.device)[:, None]   # [2, n, bs, Hkv]
        as_tensors = [torch.tensor(index, dtype=torch.long) for index in inputs + keep_at]
        positions, keep_rows = kernels.from_host_many(dict(positions=np.array(inputs[1], dtype=np.int64),
                                                           keep_rows=np.array(keep_rows, dtype=np.int64)),
                                                      self.device).values()
        rows = rope_rows(np.array(inputs[1], dtype=np.int64), np.array(owners, dtype=np.intp))
        return HostStream(self.cache, torch.tensor(copied, dtype=torch.long),
                          torch.cat(copied_pages, dim=1) if copied_pages else none, tuple(as_tensors[:2]),
                          positions, positions if rows is None else rows, slots.flatten(1, 2),
                          keep_rows, tuple(as_tensors[2:]), copies=self.copy_stream)
