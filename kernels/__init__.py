"""The hot ops of the model, each a plain function on tensors.

Every op has a torch reference (`*_ref`), which runs on any device and is the
oracle its Triton kernel is tested against. One switch picks the backend for
the whole process: NANOKV_KERNELS=torch|triton|cpu, by default Triton when
CUDA is available and "cpu" otherwise. "cpu" is the references where they
are already fast, and kernels/*_cpu.py where a CPU wants another formulation
(tested against the same references); "torch" is the references alone.
"""
import os

import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.attention import paged_attention_ref
from kernels.attention_cpu import paged_attention_cpu
from kernels.attention_triton import paged_attention_triton
from kernels.compact import compact_kv
from kernels.decode_attention import paged_decode_attention_triton
from kernels.key_scores import accumulate_key_scores_ref, accumulate_key_scores_triton
from kernels.kv_store import store_kv_ref, store_kv_triton
from kernels.norm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from kernels.rope import apply_rope_ref, apply_rope_triton, rope_cos_sin_cache
from kernels.rope_cpu import apply_rope_cpu


def set_backend(name: str) -> None:
    """Bind the public ops to the Triton kernels ("triton"), the CPU path ("cpu") or the references ("torch")."""
    global BACKEND, TRITON, silu_and_mul, store_kv, rms_norm, add_rms_norm, apply_rope
    if name not in ("torch", "triton", "cpu"):
        raise ValueError(f"unknown kernel backend {name!r}; use 'torch', 'triton' or 'cpu'")
    BACKEND, TRITON = name, name == "triton"
    silu_and_mul = silu_and_mul_triton if TRITON else silu_and_mul_ref
    store_kv = store_kv_triton if TRITON else store_kv_ref
    rms_norm = rms_norm_triton if TRITON else rms_norm_ref
    add_rms_norm = add_rms_norm_triton if TRITON else add_rms_norm_ref
    apply_rope = apply_rope_triton if TRITON else apply_rope_cpu if name == "cpu" else apply_rope_ref


set_backend(os.environ.get("NANOKV_KERNELS") or ("triton" if torch.cuda.is_available() else "cpu"))

# Decode: split each context so that the GPU has at least this many programs to run.
DECODE_MIN_PROGRAMS = 2 * (torch.cuda.get_device_properties(0).multi_processor_count
                           if torch.cuda.is_available() else 1)
DECODE_MIN_SPLIT = 256   # slots: shorter splits cost more in merging than they gain


def decode_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int) -> int:
    """Splits per (sequence, KV head) for flash-decoding: enough programs to fill the GPU,
    none shorter than DECODE_MIN_SPLIT slots. Depends on shapes only (CUDA graphs)."""
    wanted = -(-DECODE_MIN_PROGRAMS // (batch_size * num_kv_heads))
    return max(1, min(wanted, -(-max_context_len // DECODE_MIN_SPLIT)))


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, *,
                    max_query_len: int, max_context_len: int, score_cache=None):
    """Attention of q [T, Hq, D] over the paged cache (semantics: kernels/attention.py).

    With score_cache, also add to it, for every key, the softmax probability each query
    gave it, summed over the query heads of its group: the eviction scores.
    max_query_len and max_context_len are host-side upper bounds, so that no kernel
    needs a device sync to size its grid; max_query_len == 1 selects flash-decoding.
    """
    if BACKEND == "cpu":
        return paged_attention_cpu(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                   score_cache=score_cache)
    want_lse = score_cache is not None
    if not TRITON:
        result = paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                     return_lse=want_lse)
        if want_lse:
            out, lse = result
            accumulate_key_scores_ref(q, k_cache, score_cache, block_tables, cu_seqlens_q, context_lens,
                                      lse, scale)
            return out
        return result
    if max_query_len == 1:
        splits = decode_num_splits(q.shape[0], k_cache.shape[1], max_context_len)
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, splits,
                                             score_cache=score_cache)
    result = paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                    return_lse=want_lse, max_query_len=max_query_len)
    if want_lse:
        out, lse = result
        accumulate_key_scores_triton(q, k_cache, score_cache, block_tables, cu_seqlens_q, context_lens, lse,
                                     scale, max_query_len=max_query_len, max_context_len=max_context_len)
        return out
    return result


__all__ = ["BACKEND", "add_rms_norm", "apply_rope", "compact_kv", "decode_num_splits", "paged_attention", "rms_norm",
           "rope_cos_sin_cache", "silu_and_mul", "store_kv"]
