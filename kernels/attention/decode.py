"""Flash-decoding over the paged cache: one query per sequence, each KV head's
context cut into splits processed in parallel and merged by their log-sum-exps.

The building blocks (per-slot page lookup, GQA packing, base-2 online
softmax, pages of one KV head, quantized caches) are those of
kernels/attention/tiles.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.tiles import (LN2, LOG2E, MIN_BLOCK_M, MIN_SPLIT, check_cache, dot_config, kv_tile,
                                     load_kv_scales, load_kv_tile, online_softmax_step, slot_pages, split_range)
from kernels.kv_store import kernel_view



@dataclass
class DecodeWorkspace:
    """The partial results of the splits, allocated once and reused.

    Allocate it for the most (sequence x split) pairs any call will use
    (decode_workspace() does) and pass the same one to every layer and, under
    CUDA graphs, to every captured batch size: each call views the first
    B * num_splits rows. Nothing in it needs initialising: every element read
    is written earlier in the same call.

        partial_out  [B * num_splits * Hq * D]  fp32  each split's normalised output
        partial_lse  [B * num_splits * Hq]      fp32  each split's log2-sum-exp (-inf: empty)
    """
    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    def views(self, batch_size: int, num_heads: int, num_splits: int, head_dim: int):
        """[B, Hq, num_splits, D] and [B, Hq, num_splits] views of the first rows."""
        n = batch_size * num_heads * num_splits
        if self.partial_lse.numel() < n or self.partial_out.numel() < n * head_dim:
            raise ValueError(f"decode workspace holds {self.partial_lse.numel()} partials, "
                             f"this call needs {batch_size} x {num_heads} x {num_splits} = {n}")
        return (self.partial_out[:n * head_dim].view(batch_size, num_heads, num_splits, head_dim),
                self.partial_lse[:n].view(batch_size, num_heads, num_splits))


def decode_workspace(max_partials: int, head_dim: int, device: torch.device | str) -> DecodeWorkspace:
    """Scratch for decode calls with B * Hq * num_splits <= max_partials
    (4 * max_partials * (D + 1) bytes)."""
    return DecodeWorkspace(partial_out=torch.empty(max_partials * head_dim, dtype=torch.float32, device=device),
                           partial_lse=torch.empty(max_partials, dtype=torch.float32, device=device))


def logits_scratch(num_pages: int, group: int, block_size: int, device: torch.device | str) -> torch.Tensor:
    """Where a scored decode keeps each key's raw logits until the merge knows the final
    log-sum-exp: [P, G, block_size] fp32, laid out like the cache (a slot of a page of KV
    head h keeps the logits of its G query heads h*G .. h*G+G-1), so its size follows the
    pool, not the longest context. One serves every layer."""
    return torch.empty(num_pages, group, block_size, dtype=torch.float32, device=device)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, scales_ptr, table_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr, logits_ptr,
        qk_scale, num_splits,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_vp, stride_vs, stride_qsp, stride_qss,
        stride_table_b, stride_table_h, stride_cl, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
        stride_lgp, stride_lgg,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SAVE_LOGITS: tl.constexpr, QUANTIZED: tl.constexpr):
    """One program: the G query heads of one KV head of one sequence, against
    one split of its context (split_range).

    Grid (B, Hkv, num_splits), fixed by shapes alone. A split that starts past
    the context runs no iteration and writes the neutral partial (output 0,
    lse -inf).
    """
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, split_len, context_len = split_range(context_lens_ptr + seq * stride_cl + kv_head, split,
                                                      num_splits, BLOCK_N, MIN_SPLIT)

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
    slots = start + tl.arange(0, BLOCK_N)
    pages = slot_pages(table, slots, slots < end, BLOCK_SIZE)
    for n in range(start, end, BLOCK_N):              # slot n is visible: rows get a finite score
        slots = n + tl.arange(0, BLOCK_N)
        slot_valid = slots < end
        k, v = load_kv_tile(k_ptr, v_ptr, pages, slots, slot_valid, dims, dim_valid, BLOCK_SIZE,
                             stride_kp, stride_ks, stride_vp, stride_vs, q.dtype)
        k_scale, v_scale = load_kv_scales(scales_ptr, pages, slots, slot_valid, BLOCK_SIZE,
                                           stride_qsp, stride_qss, QUANTIZED)
        if SAVE_LOGITS:   # where the merge kernel, which knows the final lse, finds them: like the cache
            logits_slots = pages * stride_lgp + slots % BLOCK_SIZE
        pages = slot_pages(table, slots + BLOCK_N, slots + BLOCK_N < end, BLOCK_SIZE)   # prefetch
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (qk_scale * k_scale)[None, :]
        s = tl.where(slot_valid[None, :], s, float("-inf"))
        if SAVE_LOGITS:
            tl.store(logits_ptr + logits_slots[None, :] + rows[:, None] * stride_lgg, s,
                     mask=row_valid[:, None] & slot_valid[None, :])
        acc, m, l = online_softmax_step(acc, m, l, s, v, v_scale, DOT_PRECISION)

    empty = l == 0.0                                  # no slot in this split
    l = tl.where(empty, 1.0, l)
    out = acc / l[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log2(l))
    part = seq.to(tl.int64) * stride_pob + head * stride_poh + split * stride_pos
    tl.store(part_out_ptr + part[:, None] + dims[None, :], out,
             mask=row_valid[:, None] & dim_valid[None, :])
    tl.store(part_lse_ptr + seq * stride_plb + head * stride_plh + split, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
        part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, logits_ptr, score_ptr, table_ptr, context_lens_ptr,
        score_from_ptr, square_ptr, skip_ptr, q_pos_ptr, pos_cache_ptr, num_splits,
        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh, stride_lb,
        stride_lgp, stride_lgg, stride_sp, stride_table_b, stride_table_h, stride_cl, stride_pcp,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
        SCORES: tl.constexpr, SQUARE: tl.constexpr, SKIP: tl.constexpr):
    """Combine the splits of one (sequence, KV head), and emit its key scores.

    Grid (B, Hkv, num_splits). Every program computes the final log-sum-exp of
    the G query heads from the partial ones of the splits that hold slots (a
    few numbers). The program of split 0 merges the outputs: split i's output
    is weighted by exp2(lse_i - lse), its share of the whole denominator. With
    SCORES, every program turns the saved logits of its own split's slots into
    probabilities, exp2(logit - lse), squares them if SQUARE and square_scores[seq],
    sums them over the group and adds them into the score cache, so the key scores
    are as parallel as the attention. A sequence's one query counts only if
    score_from[seq] <= 0 (windowed rankings), and with SKIP only for the keys at
    least score_skip[seq] positions before it (KVC-full).
    """
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, split_len, context_len = split_range(context_lens_ptr + seq * stride_cl + kv_head, split,
                                                      num_splits, BLOCK_N, MIN_SPLIT)
    if SCORES:
        counts = tl.load(score_from_ptr + seq) <= 0
        end = tl.where(counts, end, start)   # a query before its window scores no slot
        idle = (split > 0) & (start >= end)   # no slots to score (split 0 writes the output)
    else:
        idle = split > 0
    if idle:
        return
    rows = tl.arange(0, G_PAD)
    row_valid = rows < G
    head = kv_head * G + rows
    lse_row = part_lse_ptr + seq * stride_plb + head * stride_plh
    used_splits = tl.cdiv(context_len, split_len)     # the rest are empty
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    for i in range(0, used_splits):
        m = tl.maximum(m, tl.load(lse_row + i, mask=row_valid, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)          # context_len 0 (and padding rows): all empty
    total = tl.zeros([G_PAD], tl.float32)
    for i in range(0, used_splits):
        total += tl.exp2(tl.load(lse_row + i, mask=row_valid, other=float("-inf")) - m)
    has_keys = total > 0.0
    total = tl.where(has_keys, total, 1.0)
    lse = tl.where(has_keys, m + tl.log2(total), float("-inf"))

    if split == 0:
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
        part = seq.to(tl.int64) * stride_pob + head[:, None] * stride_poh + dims[None, :]
        acc = tl.zeros([G_PAD, HEAD_DIM_PAD], tl.float32)
        for i in range(0, used_splits):
            weight = tl.exp2(tl.load(lse_row + i, mask=row_valid, other=float("-inf")) - m)
            acc += weight[:, None] * tl.load(part_out_ptr + part + i * stride_pos, mask=mask, other=0.0)
        tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + dims[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + seq * stride_lb + head, lse * LN2, mask=row_valid)

    if SCORES:
        table = table_ptr + seq * stride_table_b + kv_head * stride_table_h
        for n in range(start, end, BLOCK_N):
            slots = n + tl.arange(0, BLOCK_N)
            slot_valid = slots < end
            pages = slot_pages(table, slots, slot_valid, BLOCK_SIZE)
            logits = tl.load(logits_ptr + (pages * stride_lgp + slots % BLOCK_SIZE)[None, :]
                             + rows[:, None] * stride_lgg,
                             mask=row_valid[:, None] & slot_valid[None, :], other=float("-inf"))
            probs = tl.exp2(logits - tl.where(has_keys, lse, 0.0)[:, None])   # padding rows: 0
            if SQUARE:
                probs = tl.where(tl.load(square_ptr + seq) != 0, probs * probs, probs)
            if SKIP:
                key_pos = tl.load(pos_cache_ptr + pages * stride_pcp + slots % BLOCK_SIZE, mask=slot_valid, other=0)
                probs = tl.where((tl.load(q_pos_ptr + seq) - key_pos >= tl.load(skip_ptr + seq))[None, :], probs, 0.0)
            # No two programs of a call write one slot; relaxed (not ordered) atomics keep
            # concurrent calls on a shared page correct at no ordering cost.
            tl.atomic_add(score_ptr + pages * stride_sp + slots % BLOCK_SIZE, tl.sum(probs, 0), mask=slot_valid,
                          sem="relaxed")


def decode_tile(dtype: torch.dtype, quantized: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of flash-decoding: tiles.kv_tile's, except that a 16-bit query over
    an 8-bit cache runs on 2 warps. Measured on an H200 (docs/PERF.md), int8, batch 64, context
    4k: 218 us on 2 warps, 295 on 4, 341 on 8 (the bf16 cache: 275)."""
    if quantized and dtype != torch.float32:
        return kv_tile(dtype)[0], 2
    return kv_tile(dtype, quantized)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  page_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  num_splits: int, return_lse: bool = False,
                                  score_cache: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                                  workspace: DecodeWorkspace | None = None, out: torch.Tensor | None = None,
                                  score_from: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
                                  square_scores: torch.Tensor | None = None, score_skip: torch.Tensor | None = None,
                                  positions: torch.Tensor | None = None, pos_cache: torch.Tensor | None = None):
    """One query per sequence: q [B, Hq, D] -> out [B, Hq, D] (and lse [B, Hq]),
    as paged_attention_ref with cu_seqlens_q = arange(B + 1).

    Flash-decoding: each sequence's context is cut into up to num_splits
    ranges (split_range), processed in parallel and combined by a merge
    kernel. Every launch parameter follows from shapes, never from context
    lengths, so a CUDA graph captured once replays correctly for any context
    lengths that fit the table. A KV head with context length 0 (graph padding)
    gives its query heads output 0, lse -inf.

    page_tables [B, Hkv, nb], context_lens [B, Hkv] (kernels/kv_store.py).
    score_cache [P, block_size] fp32, if given, gets added (in place) for every
    visible slot the softmax probabilities of that key (squared for a sequence
    whose square_scores [B] bool is set), summed over the G query heads of its
    KV head; logits (logits_scratch()) holds the raw scores meanwhile.
    score_from [B] int32: a sequence's query adds to the scores only where
    score_from <= 0 (None: everywhere). score_skip [B] int32: only to the keys
    whose position (pos_cache [P, block_size]) is at least score_skip before the
    query's (positions [B]); None: to all.

    workspace (decode_workspace()) and logits are allocated per call if None,
    which is fine eagerly; under CUDA graphs pass ones allocated before capture,
    shared by all layers and all captured batch sizes. out: where to write
    (a [B, Hq, D] view), else a new tensor. kv_scales: a quantized cache's (kernels/kv_store.py).
    """
    scales = check_cache(q, k_cache, v_cache, kv_scales, page_tables, context_lens)
    B, Hq, D = q.shape
    num_pages, block_size = k_cache.shape[:2]
    Hkv = page_tables.shape[1]
    G = Hq // Hkv
    scores = score_cache is not None
    if workspace is None:
        workspace = decode_workspace(B * Hq * num_splits, D, q.device)
    part_out, part_lse = workspace.views(B, Hq, num_splits, D)
    if scores:
        if logits is None:
            logits = logits_scratch(num_pages, G, block_size, q.device)
        assert logits.shape == (num_pages, G, block_size) and logits.dtype == torch.float32, logits.shape
        assert score_cache.shape == k_cache.shape[:2] and score_cache.dtype == torch.float32
        assert score_cache.stride(-1) == 1 and logits.stride(-1) == 1
        if score_from is None:
            score_from = torch.zeros(B, dtype=torch.int32, device=q.device)
        assert score_from.dtype == torch.int32 and score_from.shape[0] >= B, score_from.shape
        assert square_scores is None or (square_scores.dtype == torch.bool and square_scores.shape[0] >= B)
        assert score_skip is None or (score_skip.dtype == torch.int32 and score_skip.shape[0] >= B
                                      and positions.shape[0] >= B and pos_cache.shape == score_cache.shape)
    else:
        logits = score_cache = score_from = part_lse   # stand-ins the kernels never touch with scores off
    square = square_scores is not None and scores
    skip = score_skip is not None and scores
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    if B == 0:
        return (out, lse) if return_lse else out

    upcast, precision = dot_config(q.dtype)
    table_strides = (*page_tables.stride()[:2], context_lens.stride(0))
    block_n, num_warps = decode_tile(q.dtype, quantized=kv_scales is not None)
    common = dict(HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), BLOCK_SIZE=block_size,
                  G=G, BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT)
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, kernel_view(k_cache), kernel_view(v_cache), scales, page_tables, context_lens,
        part_out, part_lse, logits, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), *k_cache.stride()[:2], *v_cache.stride()[:2], *scales.stride()[:2],
        *table_strides,
        *part_out.stride()[:3], *part_lse.stride()[:2], *logits.stride()[:2],
        BLOCK_M=max(MIN_BLOCK_M, triton.next_power_of_2(G)),
        UPCAST=upcast, DOT_PRECISION=precision, SAVE_LOGITS=scores, QUANTIZED=kv_scales is not None,
        num_warps=num_warps, **common)
    _decode_merge_kernel[(B, Hkv, num_splits)](
        part_out, part_lse, out, lse, logits, score_cache, page_tables, context_lens, score_from,
        square_scores if square else score_from, *((score_skip, positions, pos_cache) if skip else (score_from,) * 3),
        num_splits, *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1), lse.stride(0),
        *logits.stride()[:2], score_cache.stride(0), *table_strides, pos_cache.stride(0) if skip else 0,
        G_PAD=triton.next_power_of_2(G), SCORES=scores, SQUARE=square, SKIP=skip,
        num_warps=num_warps, **common)
    return (out, lse) if return_lse else out
