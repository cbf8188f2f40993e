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
import triton
import triton.language as tl


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


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_cache_ptr, score_cache_ptr, slot_ptr, positions_ptr,
                     n_heads, head_dim, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
                     stride_pb, stride_ph, stride_ps, stride_sb, stride_sh, stride_ss,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: all its heads' K and V rows, positions and scores. A padding token
    (slot -1) masks every store, so it writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block, offset = slot // block_size, slot % block_size
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < tl.where(slot >= 0, n_heads, 0)  # a padding token has no heads to write
    mask = head_ok[:, None] & (dims < head_dim)[None, :]
    h, d = heads[:, None], dims[None, :]
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + h * stride_kch + offset * stride_kcs + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + h * stride_vch + offset * stride_vcs + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    position = tl.load(positions_ptr + t)
    # Scalars broadcast to every head.
    tl.store(pos_cache_ptr + block * stride_pb + heads * stride_ph + offset * stride_ps,
             position.to(pos_cache_ptr.dtype.element_ty), mask=head_ok)
    tl.store(score_cache_ptr + block * stride_sb + heads * stride_sh + offset * stride_ss, 0.0, mask=head_ok)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    pos_cache: torch.Tensor, score_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
    """store_kv_ref in one launch. k, v may be strided views (slices of the fused qkv output) as long
    as each head's D values are contiguous. Slots are not bounds-checked (that would sync the GPU)."""
    T, n_heads, head_dim = k.shape
    block_size = k_cache.shape[2]
    if v.shape != k.shape or k_cache.shape[1:] != (n_heads, block_size, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if pos_cache.shape != k_cache.shape[:3] or score_cache.shape != k_cache.shape[:3]:
        raise ValueError(f"pos_cache {tuple(pos_cache.shape)} and score_cache {tuple(score_cache.shape)} "
                         f"must be {tuple(k_cache.shape[:3])}")
    if slot_mapping.shape != (T,) or positions.shape != (T,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} and positions {tuple(positions.shape)} "
                         f"must be [{T}]")
    if (k.stride(2), v.stride(2), k_cache.stride(3), v_cache.stride(3)) != (1, 1, 1, 1):
        raise ValueError("store_kv needs each head's D values contiguous in k, v and the caches")
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, pos_cache, score_cache, slot_mapping, positions,
        n_heads, head_dim, block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *pos_cache.stride(), *score_cache.stride(),
        BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(head_dim))
