"""Moving pairs between the slots of a head after eviction (KV-Compress's MoveCache).

After a sequence evicts, each (layer, KV head) keeps its own subset of slots; moving
survivors into the slots below the head's new length leaves its last pages empty, and
those are freed (all of a block's pages when all heads keep the same number). Runs every
p tokens, not every step, so a vectorised torch version serves on every device.
"""
import torch


def move_slots(buffers: tuple[torch.Tensor, ...], tables: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """For heads whose pages are tables [..., nb] (page ids): slot dst[..., j] of each head gets
    the contents of its slot src[..., j], in every per-slot buffer of the cache (KVCache.per_slot:
    K, V, positions, scores and a quantized cache's scales, each [num_pages, bs, ...]). src and
    dst [..., m] slot indices, every move made (no mask: no host sync); a slot both read and
    written by one call is read first, and a slot written twice must get the same contents."""
    bs = buffers[0].shape[1]
    tables, src, dst = tables.long(), src.long(), dst.long()
    src = (tables.gather(-1, src // bs), src % bs)
    dst = (tables.gather(-1, dst // bs), dst % bs)
    for buffer in buffers:
        buffer[dst] = buffer[src]   # the gather copies first, so overlapping moves are safe
