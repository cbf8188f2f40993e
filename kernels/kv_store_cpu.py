"""Writing new K/V rows into the paged cache, for the CPU backend: store_kv_ref's
writes with fewer ops. The reference first drops padding tokens with boolean
masks (each a nonzero and a copy) and splits slots into (page, offset); when
no token is padding, as in every decode step, the slots already are rows of
the pool seen flat, and four index_copy_ do it. A padded step or a quantized
cache takes the reference.
"""
import torch

from kernels.kv_store import store_kv_ref


def store_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 pos_cache: torch.Tensor, score_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, positions: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """store_kv_ref's contract: k, v [T, Hkv, D] to slots slot_mapping [T, Hkv] (-1: padding)."""
    if kv_scales is not None or bool((slot_mapping < 0).any()):
        return store_kv_ref(k, v, k_cache, v_cache, pos_cache, score_cache, slot_mapping, positions, kv_scales)
    T, Hkv, D = k.shape
    slots = slot_mapping.reshape(-1)
    k_cache.view(-1, D).index_copy_(0, slots, k.reshape(-1, D).to(k_cache.dtype))
    v_cache.view(-1, D).index_copy_(0, slots, v.reshape(-1, D).to(v_cache.dtype))
    pos_cache.view(-1).index_copy_(0, slots, positions.to(pos_cache.dtype).repeat_interleave(Hkv))
    score_cache.view(-1).index_fill_(0, slots, 0.0)
