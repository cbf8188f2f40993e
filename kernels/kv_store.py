"""Writing new K/V rows into the paged cache.

Cache layout, per layer (one source of truth, see nanokv/kv_cache.py):
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    pos_cache:        [num_blocks, num_kv_heads, block_size] int32
    score_cache:      [num_blocks, num_kv_heads, block_size] float32
A slot is `block * block_size + offset`. Each KV head has its own position
and score per slot: after eviction, slot j of head 0 and slot j of head 1 may
hold different tokens.
"""
import torch


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             pos_cache: torch.Tensor, score_cache: torch.Tensor,
             slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] to their slots [T] (slot -1 = padding, skipped),
    record each token's position for every head and reset its score to 0."""
    keep = slot_mapping >= 0
    if not keep.all():
        slot_mapping, k, v, positions = slot_mapping[keep], k[keep], v[keep], positions[keep]
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)
    pos_cache[blocks, :, offsets] = positions.to(pos_cache.dtype).unsqueeze(1)
    score_cache[blocks, :, offsets] = 0.0
