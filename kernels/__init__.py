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
from kernels.decode_attention import (MIN_SPLIT, DecodeWorkspace, decode_workspace, logits_scratch,
                                      paged_decode_attention_triton)
from kernels.key_scores import accumulate_key_scores_ref, accumulate_key_scores_triton
from kernels.kv_store import store_kv_ref, store_kv_triton
from kernels.kv_store_cpu import store_kv_cpu
from kernels.linear_cpu import PackedLinear, can_prepack, prepack_linears
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
    store_kv = store_kv_triton if TRITON else store_kv_cpu if name == "cpu" else store_kv_ref
    rms_norm = rms_norm_triton if TRITON else rms_norm_ref
    add_rms_norm = add_rms_norm_triton if TRITON else add_rms_norm_ref
    apply_rope = apply_rope_triton if TRITON else apply_rope_cpu if name == "cpu" else apply_rope_ref


set_backend(os.environ.get("NANOKV_KERNELS") or ("triton" if torch.cuda.is_available() else "cpu"))

# Decode: enough (sequence, KV head, split) programs to fill the GPU several times over.
# A program of the 16-bit decode kernel at head_dim 128 takes ~72 KB of shared memory for
# its double-buffered K/V tiles (kernels/compile_check.py): 3 are resident on an H100 SM
# (228 KB), 2 on an A100's (164 KB). With DECODE_WAVES waves of them, the last, partly
# empty wave costs at most a quarter of the time.
DECODE_WAVES = 4


def decode_programs_per_sm(capability_major: int) -> int:
    return 3 if capability_major >= 9 else 2


if torch.cuda.is_available():
    _gpu = torch.cuda.get_device_properties(0)
    DECODE_PROGRAMS = DECODE_WAVES * decode_programs_per_sm(_gpu.major) * _gpu.multi_processor_count
else:
    DECODE_PROGRAMS = DECODE_WAVES   # the interpreter: a few splits, so tests see several


def decode_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int) -> int:
    """Splits per (sequence, KV head) for flash-decoding: enough programs for DECODE_WAVES
    waves, and no more than a context of max_context_len can use (each split holds at
    least MIN_SPLIT slots). Depends on shapes only, so CUDA graphs (which pass
    max_model_len) and eager steps of one batch size compile and launch alike."""
    wanted = -(-DECODE_PROGRAMS // (batch_size * num_kv_heads))
    return max(1, min(wanted, -(-max_context_len // MIN_SPLIT)))


def decode_workspace_for(max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         max_context_len: int, device) -> DecodeWorkspace:
    """The split partials for every decode batch of up to max_num_seqs sequences."""
    most = max(b * decode_num_splits(b, num_kv_heads, max_context_len) for b in range(1, max_num_seqs + 1))
    return decode_workspace(most * num_heads, head_dim, device)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, *,
                    max_query_len: int, max_context_len: int, num_decodes: int = 0,
                    score_cache=None, score_from=None, logits=None, workspace=None, cpu_plan=None,
                    kv_scales=None, square_scores=None, score_skip=None, positions=None, pos_cache=None):
    """Attention of q [T, Hq, D] over one layer of the paged cache (semantics: kernels/attention.py).

    The cache is the pool of pages of every layer (layout: kernels/kv_store.py): k_cache,
    v_cache [P, bs, D], score_cache [P, bs], kv_scales [P, bs, 2]; the layer's
    block_tables [B, Hkv, nb] pick its pages, and context_lens [B, Hkv] says how many
    slots each (sequence, KV head) holds, this step's tokens last.

    With score_cache, also add to it, for every key, the softmax probability each query
    gave it (its square for sequence b if square_scores [B] bool says so), summed over the
    query heads of its group: the eviction scores. score_from [B] int32, if given: only
    sequence b's queries from index score_from[b] of its chunk count. score_skip [B] int32,
    if given: only the (query, key) pairs whose positions (the queries' positions [T], the
    keys' in pos_cache [P, bs]) are at least score_skip[b] apart count (KVC-full).
    max_query_len and max_context_len are host-side upper bounds, so that no kernel
    needs a device sync to size its grid. The first num_decodes sequences have one
    query each (the runner orders them first): they go to flash-decoding, the rest
    to the prefill kernel. logits and workspace: flash-decoding's scratch
    (kernels/decode_attention.py), allocated per call if None; cpu_plan: the CPU
    backend's plan of this layer (kernels/attention_cpu.py, StepPlan.layer), built per call if None.
    kv_scales: the scales of an int8 or fp8 cache (kernels/kv_store.py), None for an unquantized one.
    """
    if BACKEND == "cpu":
        return paged_attention_cpu(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                   score_cache=score_cache, score_from=score_from, plan=cpu_plan,
                                   kv_scales=kv_scales, square_scores=square_scores, score_skip=score_skip,
                                   positions=positions, pos_cache=pos_cache)
    want_lse = score_cache is not None
    if not TRITON:
        result = paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                     return_lse=want_lse, kv_scales=kv_scales)
        if want_lse:
            out, lse = result
            accumulate_key_scores_ref(q, k_cache, score_cache, block_tables, cu_seqlens_q, context_lens,
                                      lse, scale, score_from, kv_scales, square_scores, score_skip, positions,
                                      pos_cache)
            return out
        return result
    out = torch.empty_like(q)

    def part(per_seq, which: slice):   # the decodes' or the chunks' part of a per-sequence tensor, or None
        return None if per_seq is None else per_seq[which]
    if num_decodes:
        splits = decode_num_splits(num_decodes, block_tables.shape[1], max_context_len)
        decodes = slice(None, num_decodes)
        paged_decode_attention_triton(q[decodes], k_cache, v_cache, block_tables[decodes],
                                      context_lens[decodes], scale, splits, score_cache=score_cache,
                                      logits=logits, workspace=workspace, out=out[decodes],
                                      score_from=part(score_from, decodes), kv_scales=kv_scales,
                                      square_scores=part(square_scores, decodes),
                                      score_skip=part(score_skip, decodes), positions=part(positions, decodes),
                                      pos_cache=pos_cache)
    if num_decodes == len(context_lens):
        return out
    # The chunks: their rows of q, out and lse are addressed through cu_seqlens_q.
    chunks = slice(num_decodes, None)
    cu_seqlens, tables, lens = cu_seqlens_q[chunks], block_tables[chunks], context_lens[chunks]
    result = paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens, lens, scale, return_lse=want_lse,
                                    max_query_len=max_query_len, out=out, kv_scales=kv_scales)
    if want_lse:
        accumulate_key_scores_triton(q, k_cache, score_cache, tables, cu_seqlens, lens, result[1], scale,
                                     part(score_from, chunks), max_query_len=max_query_len,
                                     max_context_len=max_context_len, kv_scales=kv_scales,
                                     square_scores=part(square_scores, chunks), score_skip=part(score_skip, chunks),
                                     positions=positions, pos_cache=pos_cache)
    return out


__all__ = ["BACKEND", "add_rms_norm", "apply_rope", "compact_kv", "decode_num_splits", "decode_workspace_for",
           "logits_scratch", "paged_attention", "rms_norm",
           "rope_cos_sin_cache", "silu_and_mul", "store_kv"]
