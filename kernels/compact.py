"""Compaction after eviction (KV-Compress's MoveCache): survivors move to the front.

After a sequence evicts, each (layer, KV head) keeps its own subset of slots;
all heads keep the same number m, so moving every head's survivors into
slots 0..m-1 leaves whole trailing blocks empty, and those go back to the
pool. Runs every p tokens, not every step, so a vectorised torch version
serves on every device.
"""
import torch


def compact_kv(buffers: tuple[torch.Tensor, ...], block_table: torch.Tensor, keep: torch.Tensor) -> None:
    """For one sequence with blocks `block_table` [nb] (int64): slot j of layer l, head h
    becomes its old slot keep[l, h, j], in every per-slot buffer of the cache (KVCache.per_slot:
    K, V, positions, scores and a quantized cache's scales, each [L, num_blocks, H, bs, ...]).

    keep: [L, H, m], each row ascending (so the moved slots keep their order).
    """
    L, H, m = keep.shape
    bs = buffers[0].shape[3]
    layer = torch.arange(L, device=keep.device)[:, None, None]
    head = torch.arange(H, device=keep.device)[None, :, None]
    src = (layer, block_table[keep // bs], head, keep % bs)
    new = torch.arange(m, device=keep.device)
    dst = (layer, block_table[new // bs], head, new % bs)
    for buffer in buffers:
        buffer[dst] = buffer[src]   # the gather copies first, so overlapping moves are safe
