"""Flash-decoding over the paged cache: one query per sequence, each KV head's
context cut into splits processed in parallel and merged by their log-sum-exps,
by the last split to finish, in the same launch (as a split prefill merges). A
method that reads key scores takes a second launch for them: a key's probability
needs the final log-sum-exp, known only once every split is done.

The building blocks (per-slot page lookup, GQA packing, base-2 online
softmax, pages of one KV head, quantized caches) are those of
kernels/attention/tiles.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.tiles import (LN2, LOG2E, MIN_BLOCK_M, MIN_SPLIT, check_cache, dot_config, finish_split,
                                     kv_tile, load_kv_scales, load_kv_tile, merged_splits, online_softmax_step,
                                     slot_pages, split_range, store_result)
from kernels.kv_store import kernel_view


@dataclass
class DecodeWorkspace:
    """The partial results of the splits, and their counters, allocated once and reused.

    Allocate it for the most (sequence x split) pairs any call will use
    (decode_workspace() does) and pass the same one to every layer and, under
    CUDA graphs, to every captured batch size: each call views the first
    B * num_splits rows. The partials need no initialising (every element read
    is written earlier in the same call); the counters start at zero, and every
    call leaves them so.

        partial_out  [B * num_splits * Hq * D]  fp32   each split's normalised output
        partial_lse  [B * num_splits * Hq]      fp32   each split's log2-sum-exp (-inf: empty)
        counters     [B * num_splits * Hq]      int32  a (sequence, KV head)'s splits done
    """
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    counters: torch.Tensor

    def views(self, batch_size: int, num_heads: int, num_splits: int, head_dim: int):
        """[B, Hq, num_splits, D] and [B, Hq, num_splits] views of the first rows, and the counters."""
        n = batch_size * num_heads * num_splits
        if self.partial_lse.numel() < n or self.partial_out.numel() < n * head_dim:
            raise ValueError(f"decode workspace holds {self.partial_lse.numel()} partials, "
                             f"this call needs {batch_size} x {num_heads} x {num_splits} = {n}")
        return (self.partial_out[:n * head_dim].view(batch_size, num_heads, num_splits, head_dim),
                self.partial_lse[:n].view(batch_size, num_heads, num_splits), self.counters)


def decode_workspace(max_partials: int, head_dim: int, device: torch.device | str) -> DecodeWorkspace:
    """Scratch for decode calls with B * Hq * num_splits <= max_partials
    (4 * max_partials * (D + 2) bytes)."""
    return DecodeWorkspace(partial_out=torch.empty(max_partials * head_dim, dtype=torch.float32, device=device),
                           partial_lse=torch.empty(max_partials, dtype=torch.float32, device=device),
                           counters=torch.zeros(max_partials, dtype=torch.int32, device=device))


def logits_scratch(num_pages: int, group: int, block_size: int, device: torch.device | str) -> torch.Tensor:
    """Where a scored decode keeps each key's raw logits until the scores kernel knows the final
    log-sum-exp: [P, G, block_size] fp32, laid out like the cache (a slot of a page of KV
    head h keeps the logits of its G query heads h*G .. h*G+G-1), so its size follows the
    pool, not the longest context. One serves every layer."""
    return torch.empty(num_pages, group, block_size, dtype=torch.float32, device=device)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(
        q_ptr, k_ptr, v_ptr, scales_ptr, table_ptr, context_lens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        counters_ptr, logits_ptr, qk_scale, num_splits,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_vp, stride_vs, stride_qsp, stride_qss,
        stride_table_b, stride_table_h, stride_cl, stride_ob, stride_oh, stride_lb,
        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_lgp, stride_lgg,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SAVE_LOGITS: tl.constexpr, QUANTIZED: tl.constexpr):
    """One program: the G query heads of one KV head of one sequence, against
    one split of its context (split_range).

    Grid (B, Hkv, num_splits), fixed by shapes alone. A split that starts past
    the context runs no iteration: its partial is neutral (output 0, lse -inf).
    With one split the program writes out and lse; with more, each writes its
    partials and the last of a (sequence, KV head)'s splits to finish merges them
    (tiles.finish_split, counters [B, Hkv]).
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
        if SAVE_LOGITS:   # where the scores kernel, which knows the final lse, finds them: like the cache
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
    mask = row_valid[:, None] & dim_valid[None, :]
    seqs = tl.zeros([BLOCK_M], tl.int64) + seq        # the rows' sequence, for their stores
    if num_splits > 1:
        part_out = part_out_ptr + seq.to(tl.int64) * stride_pob + head[:, None] * stride_poh + dims[None, :]
        part_lse = part_lse_ptr + seq * stride_plb + head * stride_plh
        counter = counters_ptr + seq * tl.num_programs(1) + kv_head
        if finish_split(part_out, part_lse, counter, out, lse, row_valid, mask, split, stride_pos, num_splits):
            out, lse = merged_splits(part_out, part_lse, counter, row_valid, mask, num_splits, stride_pos,
                                     BLOCK_M, HEAD_DIM_PAD)
            store_result(out_ptr, lse_ptr, out, lse, seqs, head, dims, row_valid, mask, stride_ob, stride_oh,
                         stride_lb)
    else:
        store_result(out_ptr, lse_ptr, out, lse, seqs, head, dims, row_valid, mask, stride_ob, stride_oh, stride_lb)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_scores_kernel(
        lse_ptr, logits_ptr, score_ptr, table_ptr, context_lens_ptr, score_from_ptr, square_ptr, skip_ptr, q_pos_ptr,
        pos_cache_ptr, num_splits, stride_lb, stride_lgp, stride_lgg, stride_sp, stride_table_b, stride_table_h,
        stride_cl, stride_pcp,
        BLOCK_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        MIN_SPLIT: tl.constexpr, SQUARE: tl.constexpr, SKIP: tl.constexpr):
    """The key scores of one split of a (sequence, KV head)'s context, once the decode has
    written the query heads' final log-sum-exps: each slot's saved logits turned into
    probabilities, exp2(logit - lse), squared if SQUARE and square_scores[seq], summed over
    the group and added into the score cache, so the scores are as parallel as the attention.
    A sequence's one query counts only if score_from[seq] <= 0 (windowed rankings), and with
    SKIP only for the keys at least score_skip[seq] positions before it (KVC-full).

    Grid (B, Hkv, num_splits), the decode's.
    """
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, split_len, context_len = split_range(context_lens_ptr + seq * stride_cl + kv_head, split,
                                                      num_splits, BLOCK_N, MIN_SPLIT)
    end = tl.where(tl.load(score_from_ptr + seq) <= 0, end, start)   # a query before its window scores no slot
    if start >= end:
        return
    rows = tl.arange(0, G_PAD)
    row_valid = rows < G
    lse = tl.load(lse_ptr + seq * stride_lb + kv_head * G + rows, mask=row_valid, other=0.0) / LN2
    table = table_ptr + seq * stride_table_b + kv_head * stride_table_h
    for n in range(start, end, BLOCK_N):
        slots = n + tl.arange(0, BLOCK_N)
        slot_valid = slots < end
        pages = slot_pages(table, slots, slot_valid, BLOCK_SIZE)
        logits = tl.load(logits_ptr + (pages * stride_lgp + slots % BLOCK_SIZE)[None, :] + rows[:, None] * stride_lgg,
                         mask=row_valid[:, None] & slot_valid[None, :], other=float("-inf"))
        probs = tl.exp2(logits - lse[:, None])   # padding rows: 0
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
    ranges (split_range), processed in parallel and merged by the last of
    them to finish, in the same launch. Every launch parameter follows from
    shapes, never from context lengths, so a CUDA graph captured once replays
    correctly for any context lengths that fit the table. A KV head with
    context length 0 (graph padding) gives its query heads output 0, lse -inf.

    page_tables [B, Hkv, nb], context_lens [B, Hkv] (kernels/kv_store.py).
    score_cache [P, block_size] fp32, if given, gets added (in place) for every
    visible slot the softmax probabilities of that key (squared for a sequence
    whose square_scores [B] bool is set), summed over the G query heads of its
    KV head, by a second launch once the final lse are known; logits
    (logits_scratch()) holds the raw scores meanwhile.
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
    part_out, part_lse, counters = workspace.views(B, Hq, num_splits, D)
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
        logits = part_lse   # a stand-in the kernel never touches with scores off
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    if B == 0:
        return (out, lse) if return_lse else out

    upcast, precision = dot_config(q.dtype)
    table_strides = (*page_tables.stride()[:2], context_lens.stride(0))
    block_n, num_warps = decode_tile(q.dtype, quantized=kv_scales is not None)
    _decode_kernel[(B, Hkv, num_splits)](
        q, kernel_view(k_cache), kernel_view(v_cache), scales, page_tables, context_lens, out, lse,
        part_out, part_lse, counters, logits, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), *k_cache.stride()[:2], *v_cache.stride()[:2], *scales.stride()[:2],
        *table_strides, out.stride(0), out.stride(1), lse.stride(0),
        *part_out.stride()[:3], *part_lse.stride()[:2], *logits.stride()[:2],
        HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), BLOCK_SIZE=block_size, G=G,
        BLOCK_M=max(MIN_BLOCK_M, triton.next_power_of_2(G)), BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT,
        UPCAST=upcast, DOT_PRECISION=precision, SAVE_LOGITS=scores, QUANTIZED=kv_scales is not None,
        num_warps=num_warps)
    if scores:
        square, skip = square_scores is not None, score_skip is not None
        _decode_scores_kernel[(B, Hkv, num_splits)](
            lse, logits, score_cache, page_tables, context_lens, score_from, square_scores if square else score_from,
            *((score_skip, positions, pos_cache) if skip else (score_from,) * 3), num_splits, lse.stride(0), *logits.stride()[:2], score_cache.stride(0), *table_strides,
            pos_cache.stride(0) if skip else 0,
            BLOCK_SIZE=block_size, G=G, G_PAD=triton.next_power_of_2(G), BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT,
            SQUARE=square, SKIP=skip, num_warps=num_warps)
    return (out, lse) if return_lse else out
