"""Decoding from the host tier (KVPR): what one step moves between host memory and the
device, layer by layer.

A sequence that decodes from the host keeps the K/V of its first blocks in the host tier
(models/kv_cache.py HostKVCache) and its newest ones in the pool. Its page tables name
*staging* pages for those first blocks: pages of blocks beyond the ones the block manager
hands out, one page per (block, KV head), in two halves: even layers read the first, odd
layers the second, so that one half can fill while the other is read. Before each layer's
attention, HostStream has filled its half with that layer's K/V: for the first positions
it recomputes K/V from the layer inputs the host tier kept when the prompt was read (the
layer's own projection, norms and RoPE), for the rest it copies the K/V itself: per
buffer one gather on the host, into a staging buffer every step reuses, and one transfer
(HostKVCache.stage_layer). How many positions are recomputed is KVPR's split
(nanokv/engine/offload_costs.py), chosen by the runner.

On CUDA the copies run on a stream of their own: layer i+1's are issued before layer i's
attention, once layer i-1 (the last reader of that half) is done, and layer i's attention
waits for its own; the transfer of one layer overlaps the compute of the one before. On a
CPU they run in order.

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
    pages: torch.Tensor           # [2, n, Hkv] the staging pages they go to, per half (on the device)
    inputs: tuple[torch.Tensor, torch.Tensor]   # ([P] store row, [P] position): the kept inputs recomputed
    positions: torch.Tensor       # [P] their positions (on the device)
    rope_rows: torch.Tensor       # [P] their rows of the RoPE table (kernels.long_rope_rows; else positions)
    slots: torch.Tensor           # [2, P, Hkv] int64: the staging slots their K/V go to, per half (on the device)
    keep_rows: torch.Tensor       # [K] step rows whose layer inputs are kept (on the device)
    keep_at: tuple[torch.Tensor, torch.Tensor]  # ([K] store row, [K] position) where they go
    kept: list[torch.Tensor] = field(default_factory=list)   # per layer: those rows' inputs
    copies: torch.cuda.Stream | None = None   # CUDA: the copies' own stream
    ready: dict[int, tuple] = field(default_factory=dict)   # layer -> (its copies' event, its inputs on the device)

    def before_attention(self, layer: int, x: torch.Tensor, attention, cos_sin: torch.Tensor) -> None:
        """Keep layer's inputs x of the kept rows, and have the staging pages of the layer's half
        hold its K/V. attention: the layer's (models/decoder.py Attention), for its projection."""
        if len(self.keep_rows):
            self.kept.append(x[self.keep_rows])
        if not len(self.blocks) and not len(self.positions):
            return
        if self.copies is None:
            inputs = self._copy(layer)
        else:
            if layer == 0:
                self._issue(0)
            if layer + 1 < self.host.cache.num_layers:
                self._issue(layer + 1)
            event, inputs = self.ready.pop(layer)
            torch.cuda.current_stream().wait_event(event)
            if inputs is not None:
                inputs.record_stream(torch.cuda.current_stream())
        if inputs is not None:
            cache = self.host.cache
            _, k, v = attention.project(inputs, self.rope_rows, cos_sin)
            kernels.store_kv(k, v, cache.k, cache.v, cache.positions, cache.scores, self.slots[layer % 2],
                             self.positions, kv_scales=cache.kv_scales)

    def _copy(self, layer: int) -> torch.Tensor | None:
        """Copy layer's K/V into its half; returns the recomputed positions' inputs on the device."""
        pages, inputs = self.host.stage_layer(layer % 2, layer, self.blocks, self.inputs)
        for staged, pool in zip(pages, self.host.cache.per_slot):   # [n, Hkv, bs, ...] each
            pool[self.pages[layer % 2]] = staged
        return inputs

    def _issue(self, layer: int) -> None:
        """Issue layer's copies on the copy stream, after everything the device has been given so
        far (the last layer that read its half among it)."""
        given = torch.cuda.current_stream().record_event()
        with torch.cuda.stream(self.copies):
            self.copies.wait_event(given)
            inputs = self._copy(layer)
            self.ready[layer] = (self.copies.record_event(), inputs)

    def finish(self) -> None:
        """Write the kept layer inputs to the host tier: one transfer for all layers."""
        if self.kept:
            rows, positions = self.keep_at
            self.host.layer_inputs[rows, :, positions] = torch.stack(self.kept, dim=1).cpu()
