"""Flash-decoding over the paged cache: one query per sequence, the context
cut into splits processed in parallel and merged by their log-sum-exps.

The building blocks (per-slot block lookup, GQA packing, base-2 online
softmax, per-head block tables) are those of kernels/attention_triton.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_triton import (BLOCK_N, LOG2E, LN2, MIN_BLOCK_M, _block_table_strides, _check_cache,
                                      _dot_config, _kv_offsets, _load_kv_tile, _online_softmax_step)

# ----------------------------------------------------------------------------
@dataclass
class DecodeWorkspace:
    """Scratch of paged_decode_attention_triton, allocated once and reused.

    For CUDA graphs allocate it before capture, for the largest batch and the
    widest block table the graphs will see (decode_workspace() does), and pass
    the same one to every layer and every replay: a call with a smaller batch
    uses its first rows. Nothing in it needs initialising: every element read
    is written earlier in the same call.

        partial_out  [B, Hq, num_splits, D]  fp32  each split's normalised output
        partial_lse  [B, Hq, num_splits]     fp32  each split's log2-sum-exp (-inf: empty)
        logits       [B, Hq, max_slots]      fp32  raw scores in log2 units, for key
                                                   scores only (else a 0-size tensor);
                                                   max_slots >= max_blocks * block_size
    """
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    logits: torch.Tensor


def decode_workspace(batch_size: int, num_heads: int, head_dim: int, num_splits: int,
                     max_slots: int, with_scores: bool, device: torch.device | str) -> DecodeWorkspace:
    """The scratch for decode batches of up to batch_size sequences whose block
    tables address up to max_slots slots (max_blocks * block_size), in bytes
    4 * B * Hq * (num_splits * (D + 1) + (max_slots if with_scores else 0))."""
    def scratch(*shape):
        return torch.empty(shape, dtype=torch.float32, device=device)
    return DecodeWorkspace(partial_out=scratch(batch_size, num_heads, num_splits, head_dim),
                           partial_lse=scratch(batch_size, num_heads, num_splits),
                           logits=scratch(batch_size, num_heads, max_slots if with_scores else 0))


@triton.jit
def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr, logits_ptr,
        qk_scale, split_len,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_table_b, stride_table_h, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
        stride_lgb, stride_lgh,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SAVE_LOGITS: tl.constexpr):
    """One program: the G query heads of one KV head of one sequence, against the
    slots [split * split_len, (split + 1) * split_len) of its context.

    Grid (B, Hkv, num_splits), fixed by shapes alone. The loop bound is read
    from context_lens, so a split that starts past the context runs no
    iteration and writes the neutral partial (output 0, lse -inf).
    """
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    rows = tl.arange(0, BLOCK_M)                      # query heads of the group, padded to BLOCK_M
    row_valid = rows < G
    head = kv_head * G + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = table_ptr + seq * stride_table_b + kv_head * stride_table_h
    logits_rows = logits_ptr + seq.to(tl.int64) * stride_lgb + head[:, None] * stride_lgh
    for n in range(start, end, BLOCK_N):              # slot n is visible: rows get a finite score
        slots = n + tl.arange(0, BLOCK_N)
        slot_valid = slots < end
        k, v = _load_kv_tile(k_ptr, v_ptr, table, slots, slot_valid, kv_head, dims, dim_valid, BLOCK_SIZE,
                             stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(slot_valid[None, :], s, float("-inf"))
        if SAVE_LOGITS:   # kept for the merge kernel, which knows the final lse
            tl.store(logits_rows + slots[None, :], s, mask=row_valid[:, None] & slot_valid[None, :])
        acc, m, l = _online_softmax_step(acc, m, l, s, v, DOT_PRECISION)

    empty = l == 0.0                                  # no slot in this split
    l = tl.where(empty, 1.0, l)
    out = acc / l[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log2(l))
    part = seq.to(tl.int64) * stride_pob + head * stride_poh + split * stride_pos
    tl.store(part_out_ptr + part[:, None] + dims[None, :], out,
             mask=row_valid[:, None] & dim_valid[None, :])
    tl.store(part_lse_ptr + seq * stride_plb + head * stride_plh + split, lse, mask=row_valid)


@triton.jit
def _decode_merge_kernel(
        part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, logits_ptr, score_ptr, table_ptr, context_lens_ptr,
        num_splits, split_len,
        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh, stride_lb,
        stride_lgb, stride_lgh, stride_sb, stride_sh, stride_table_b, stride_table_h,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr, G_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        RETURN_LSE: tl.constexpr, SCORES: tl.constexpr):
    """Combine the splits of one (sequence, KV head), and emit its key scores.

    Grid (B, Hkv, num_splits). Every program computes the final log-sum-exp of
    the G query heads from the num_splits partial ones (a few numbers). The
    program of split 0 merges the outputs: split i's output is weighted by
    exp2(lse_i - lse), its share of the whole denominator. With SCORES, every
    program turns the saved logits of its own split's slots into probabilities,
    exp2(logit - lse), sums them over the group and adds them into the score
    cache, so the key scores are as parallel as the attention itself.
    """
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, G_PAD)
    row_valid = rows < G
    head = kv_head * G + rows
    splits = tl.arange(0, SPLITS_PAD)
    part_lse = tl.load(part_lse_ptr + seq * stride_plb + head[:, None] * stride_plh + splits[None, :],
                       mask=row_valid[:, None] & (splits < num_splits)[None, :], other=float("-inf"))
    m = tl.max(part_lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)          # context_len 0 (and padding rows): all empty
    total = tl.sum(tl.exp2(part_lse - m[:, None]), 1)
    has_keys = total > 0.0
    total = tl.where(has_keys, total, 1.0)
    lse = tl.where(has_keys, m + tl.log2(total), float("-inf"))

    if split == 0:
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
        part = seq.to(tl.int64) * stride_pob + head[:, None] * stride_poh + dims[None, :]
        acc = tl.zeros([G_PAD, HEAD_DIM_PAD], tl.float32)
        for i in range(0, num_splits):
            weight = tl.exp2(tl.load(part_lse_ptr + seq * stride_plb + head * stride_plh + i,
                                     mask=row_valid, other=float("-inf")) - m)
            acc += weight[:, None] * tl.load(part_out_ptr + part + i * stride_pos, mask=mask, other=0.0)
        tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + dims[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        if RETURN_LSE:
            tl.store(lse_ptr + seq * stride_lb + head, lse * LN2, mask=row_valid)

    if SCORES:
        context_len = tl.load(context_lens_ptr + seq)
        start = split * split_len
        end = tl.minimum(start + split_len, context_len)
        table = table_ptr + seq * stride_table_b + kv_head * stride_table_h
        logits_rows = logits_ptr + seq.to(tl.int64) * stride_lgb + head[:, None] * stride_lgh
        for n in range(start, end, BLOCK_N):
            slots = n + tl.arange(0, BLOCK_N)
            slot_valid = slots < end
            logits = tl.load(logits_rows + slots[None, :], mask=row_valid[:, None] & slot_valid[None, :],
                             other=float("-inf"))
            score = tl.sum(tl.exp2(logits - tl.where(has_keys, lse, 0.0)[:, None]), 0)  # padding rows: 0
            offs = _kv_offsets(table, slots, slot_valid, BLOCK_SIZE, stride_sb, 1) + kv_head * stride_sh
            # Atomic: two sequences may share a block (e.g. a common prefix).
            tl.atomic_add(score_ptr + offs, score, mask=slot_valid)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  num_splits: int, return_lse: bool = False,
                                  score_cache: torch.Tensor | None = None,
                                  workspace: DecodeWorkspace | None = None):
    """One query per sequence: q [B, Hq, D] -> out [B, Hq, D] (and lse [B, Hq]),
    as paged_attention_ref with cu_seqlens_q = arange(B + 1).

    Flash-decoding: each sequence's context is cut into num_splits contiguous
    ranges of split_len slots, split_len = cdiv(max_blocks * block_size,
    num_splits) rounded up to a tile, so many programs share one long context;
    a merge kernel then combines the ranges. Every launch parameter follows
    from shapes (the block table's width, not the context lengths), so a CUDA
    graph captured once replays correctly for any context lengths that fit
    the table. Rows with context_len 0 (graph padding) give output 0, lse -inf.

    score_cache [num_blocks, Hkv, block_size] fp32, if given, gets added (in
    place) for every visible slot the softmax probabilities of that key,
    summed over the G query heads of its KV head.

    workspace: scratch from decode_workspace(). If None it is allocated per
    call, which is fine eagerly; under CUDA graphs pass one allocated before
    capture, shared by all layers and all captured batch sizes.
    """
    _check_cache(q, k_cache, v_cache)
    B, Hq, D = q.shape
    Hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    max_slots = block_tables.shape[-1] * block_size
    split_len = triton.cdiv(triton.cdiv(max_slots, num_splits), BLOCK_N) * BLOCK_N
    scores = score_cache is not None
    if workspace is None:
        workspace = decode_workspace(B, Hq, D, num_splits, max_slots, scores, q.device)
    part_out, part_lse, logits = workspace.partial_out, workspace.partial_lse, workspace.logits
    assert part_out.shape[0] >= B and part_out.shape[1:] == (Hq, num_splits, D), "workspace does not fit"
    if scores:
        assert logits.shape[0] >= B and logits.shape[1] == Hq and logits.shape[2] >= max_slots, \
            "workspace has no room for the logits of max_blocks * block_size slots"
        assert score_cache.shape == k_cache.shape[:3] and score_cache.dtype == torch.float32
        assert score_cache.stride(-1) == 1
    else:
        logits = score_cache = part_lse   # stand-ins the kernels never touch with scores off
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    if B == 0:
        return (out, lse) if return_lse else out

    upcast, precision = _dot_config(q.dtype)
    table_strides = _block_table_strides(block_tables, Hkv)
    common = dict(HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), BLOCK_SIZE=block_size,
                  G=G, BLOCK_N=BLOCK_N)
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse, logits,
        scale * LOG2E, split_len,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *table_strides,
        *part_out.stride()[:3], *part_lse.stride()[:2], *logits.stride()[:2],
        BLOCK_M=max(MIN_BLOCK_M, triton.next_power_of_2(G)),
        UPCAST=upcast, DOT_PRECISION=precision, SAVE_LOGITS=scores, **common)
    _decode_merge_kernel[(B, Hkv, num_splits)](
        part_out, part_lse, out, lse, logits, score_cache, block_tables, context_lens,
        num_splits, split_len,
        *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), lse.stride(0),
        *logits.stride()[:2], *score_cache.stride()[:2], *table_strides,
        G_PAD=triton.next_power_of_2(G), SPLITS_PAD=triton.next_power_of_2(num_splits),
        RETURN_LSE=return_lse, SCORES=scores, **common)
    return (out, lse) if return_lse else out
