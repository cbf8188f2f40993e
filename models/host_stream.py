"""Decoding from the host tier (KVPR): what one step moves between host memory and the
device, layer by layer.

A sequence that decodes from the host keeps the K/V of its first blocks in the host tier
(models/kv_cache.py HostKVCache) and its newest ones in the pool. Its page tables name
*staging* pages for those first blocks: pages of blocks beyond the ones the block manager
hands out, one page per (block, KV head), which every layer reuses in turn. Before each
layer's attention, HostStream fills them with that layer's K/V: for the first positions
it recomputes K/V from the layer inputs the host tier kept when the prompt was read (the
layer's own projection, norms and RoPE), for the rest it copies the K/V itself, one
gather on the host and one transfer per buffer. How many positions are recomputed is
KVPR's split (nanokv/engine/offload_costs.py), chosen by the runner.

The same object keeps the step's layer inputs of prompt positions that may be recomputed
later: each layer's rows are gathered on the device and written to the host tier once,
after the forward pass (finish).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from models.kv_cache import HostKVCache


@dataclass
class HostStream:
    host: HostKVCache
    blocks: torch.Tensor          # [n] host blocks whose K/V every layer copies in
    pages: torch.Tensor           # [n, Hkv] the staging pages they go to (on the device)
    inputs: tuple[torch.Tensor, torch.Tensor]   # ([P] store row, [P] position): the kept inputs recomputed
    positions: torch.Tensor       # [P] their positions (on the device)
    slots: torch.Tensor           # [P, Hkv] int64: the staging slots their K/V go to (on the device)
    keep_rows: torch.Tensor       # [K] step rows whose layer inputs are kept (on the device)
    keep_at: tuple[torch.Tensor, torch.Tensor]  # ([K] store row, [K] position) where they go
    kept: list[torch.Tensor] = field(default_factory=list)   # per layer: those rows' inputs

    def before_attention(self, layer: int, x: torch.Tensor, attention, cos_sin: torch.Tensor) -> None:
        """Keep layer's inputs x of the kept rows, and fill the staging pages with the layer's
        K/V. attention: the layer's (models/decoder.py Attention), for its projection."""
        if len(self.keep_rows):
            self.kept.append(x[self.keep_rows])
        cache = self.host.cache
        if len(self.blocks):
            for host, pool in zip(self.host.per_slot, cache.per_slot):
                pool[self.pages] = self.host.to_device(host[self.blocks, layer])   # [n, Hkv, bs, ...]
        if len(self.positions):
            rows, positions = self.inputs
            inputs = self.host.to_device(self.host.layer_inputs[rows, layer, positions])
            _, k, v = attention.project(inputs, self.positions, cos_sin)
            kernels.store_kv(k, v, cache.k, cache.v, cache.positions, cache.scores, self.slots, self.positions,
                             kv_scales=cache.kv_scales)

    def finish(self) -> None:
        """Write the kept layer inputs to the host tier: one transfer for all layers."""
        if self.kept:
            rows, positions = self.keep_at
            self.host.layer_inputs[rows, :, positions] = torch.stack(self.kept, dim=1).cpu()
