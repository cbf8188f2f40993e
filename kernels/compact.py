"""Compaction after eviction (KV-Compress's MoveCache): survivors move to the front.

After a sequence evicts, each (layer, KV head) keeps its own subset of slots;
moving every head's survivors into its first slots leaves its last pages
empty, and those are freed (all of a block's pages when all heads keep the
same number). Runs every p tokens, not every step, so a vectorised torch
version serves on every device.
"""
import torch


def compact_kv(buffers: tuple[torch.Tensor, ...], tables: torch.Tensor, keep: torch.Tensor,
               counts: torch.Tensor | None = None) -> None:
    """For one sequence whose head (l, h) has the pages tables[l, h] ([L, H, nb] ids): slot j
    of each head becomes its old slot keep[l, h, j], for j < counts[l, h] (every j when
    counts is None), in every per-slot buffer of the cache (KVCache.per_slot: K, V,
    positions, scores and a quantized cache's scales, each [num_pages, bs, ...]).

    keep: [L, H, m], each head's first counts ascending (so the moved slots keep their order).
    """
    bs = buffers[0].shape[1]
    tables, keep = tables.long(), keep.long()
    new = torch.arange(keep.shape[-1], device=keep.device).expand_as(keep)
    src = (tables.gather(-1, keep // bs), keep % bs)
    dst = (tables.gather(-1, new // bs), new % bs)
    if counts is not None:
        moved = new < counts[..., None]
        src, dst = tuple(i[moved] for i in src), tuple(i[moved] for i in dst)
    for buffer in buffers:
        buffer[dst] = buffer[src]   # the gather copies first, so overlapping moves are safe
