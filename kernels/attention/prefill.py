"""Paged attention in Triton for prefill, chunked prefill and the prompt chunks of
mixed batches: a flash-attention kernel over the page tables (the building
blocks, and the ideas behind them, are in tiles.py).

A batch of short chunks over long contexts (block-wise prefill: 64 tokens at a time over
|kv| held pairs) has few query tiles to fill the GPU with, so each (sequence, KV head)'s
context can be cut into splits taken by programs in parallel, as flash-decoding does
(tiles.split_range). Each split writes its partial result, and the last of a query tile's
splits to finish merges them all by their log-sum-exps, in the same launch: a counter per
tile says how many are done (split_counters).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.tiles import (LOG2E, MIN_BLOCK_M, MIN_SPLIT, check_cache, dot_config, finish_split, kv_tile,
                                     load_kv_scales, load_kv_tile, merged_splits, online_softmax_step, slot_pages,
                                     split_range, store_result)
from kernels.kv_store import kernel_view

PREFILL_BLOCK_M = 128   # query rows (tokens x heads of a group) of a tile; MIN_BLOCK_M for short chunks
QUANTIZED_BLOCK_M = 64  # an 8-bit cache's tile: at 128 rows its conversions spill on sm_80


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, scales_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
        table_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        qk_scale, num_splits,                         # softmax scale * log2(e); splits of each context
        stride_qt, stride_qh, stride_kp, stride_ks, stride_vp, stride_vs, stride_qsp, stride_qss,
        stride_ot, stride_oh, stride_lt, stride_pot, stride_poh, stride_pos, stride_plt, stride_plh,
        stride_table_b, stride_table_h, stride_cl,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr, SPLIT: tl.constexpr,
        MIN_SPLIT: tl.constexpr):
    """One program: BLOCK_Q query tokens of one sequence x the G query heads of one KV head,
    against one split of that head's context (all of it when not SPLIT).

    Grid (B, cdiv(max_query_len, BLOCK_Q), Hkv * num_splits); programs past the end of
    their sequence's queries return at once. SPLIT: each program writes its partials into
    part_out [T, Hq, num_splits, D] and part_lse [T, Hq, num_splits] (log2 units, -inf for a
    row that sees no slot of its split), then counts itself done in counters[tile]; the last
    of the tile's splits merges them into out and lse and sets the counter back to 0.
    """
    seq, q_tile = tl.program_id(0), tl.program_id(1)
    kv_head, split = tl.program_id(2) // num_splits, tl.program_id(2) % num_splits
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    start, end, split_len, context_len = split_range(context_lens_ptr + seq * stride_cl + kv_head, split,
                                                     num_splits, BLOCK_N, MIN_SPLIT)
    prior = context_len - q_len                       # this head's slots cached before this chunk

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // G              # index of the query within the chunk
    head = kv_head * G + rows % G                     # query head
    row_valid = (rows // G < BLOCK_Q) & (token < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)

    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # The last query of this tile sees up to slot kv_end - 1.
    kv_end = tl.minimum(prior + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q), end)
    table = table_ptr + seq * stride_table_b + kv_head * stride_table_h
    slots = start + tl.arange(0, BLOCK_N)
    pages = slot_pages(table, slots, slots < kv_end, BLOCK_SIZE)
    for n in range(start, kv_end, BLOCK_N):
        slots = n + tl.arange(0, BLOCK_N)
        slot_valid = slots < kv_end
        k, v = load_kv_tile(k_ptr, v_ptr, pages, slots, slot_valid, dims, dim_valid, BLOCK_SIZE,
                             stride_kp, stride_ks, stride_vp, stride_vs, q.dtype)
        k_scale, v_scale = load_kv_scales(scales_ptr, pages, slots, slot_valid, BLOCK_SIZE,
                                           stride_qsp, stride_qss, QUANTIZED)
        pages = slot_pages(table, slots + BLOCK_N, slots + BLOCK_N < kv_end, BLOCK_SIZE)   # prefetch
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (qk_scale * k_scale)[None, :]
        visible = slots[None, :] <= (prior + token)[:, None]    # causal by slot; implies slot < kv_end
        s = tl.where(visible, s, float("-inf"))
        acc, m, l = online_softmax_step(acc, m, l, s, v, v_scale, DOT_PRECISION)

    empty = l == 0.0                                  # no slot of this split visible to the row
    out = acc / tl.where(empty, 1.0, l)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))   # log2 units
    mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        part_out = part_out_ptr + q_rows[:, None] * stride_pot + head[:, None] * stride_poh + dims[None, :]
        part_lse = part_lse_ptr + q_rows * stride_plt + head * stride_plh
        counter = counters_ptr + (seq * tl.num_programs(1) + q_tile) * (tl.num_programs(2) // num_splits) + kv_head
        if finish_split(part_out, part_lse, counter, out, lse, row_valid, mask, split, stride_pos, num_splits):
            out, lse = merged_splits(part_out, part_lse, counter, row_valid, mask, num_splits, stride_pos,
                                     BLOCK_M, HEAD_DIM_PAD)
            store_result(out_ptr, lse_ptr, out, lse, q_rows, head, dims, row_valid, mask,
                         stride_ot, stride_oh, stride_lt)
    else:
        store_result(out_ptr, lse_ptr, out, lse, q_rows, head, dims, row_valid, mask, stride_ot, stride_oh, stride_lt)


_split_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(num_tiles: int, device: torch.device) -> torch.Tensor:
    """int32 counters, zero, for the query tiles (x KV heads) of a split launch on device: one
    buffer a device, made larger when a launch needs more. Each launch leaves them zero (its
    last splits reset them), so launches in stream order share them."""
    counters = _split_counters.get(device)
    if counters is None or counters.numel() < num_tiles:
        counters = _split_counters[device] = torch.zeros(max(num_tiles, 1024), dtype=torch.int32, device=device)
    return counters


def prefill_tiles(dtype: torch.dtype, max_query_len: int, group: int, quantized: bool = False
                  ) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the prefill kernel: 128 x 64 tiles over 8 warps (a
    full 4k prefill on an H200: 1.8x faster than 64 x 64, docs/PERF.md), 64 rows for a
    quantized cache; 16-row tiles when the chunks are short; small tiles for fp32. BLOCK_M
    holds at least one token's whole group."""
    tall = max_query_len * group > MIN_BLOCK_M and dtype != torch.float32
    block_m = max((QUANTIZED_BLOCK_M if quantized else PREFILL_BLOCK_M) if tall else MIN_BLOCK_M,
                  triton.next_power_of_2(group))
    block_n, num_warps = kv_tile(dtype)
    return block_m, block_n, 8 if block_m >= 64 else num_warps


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, return_lse: bool = False,
                           max_query_len: int | None = None, out: torch.Tensor | None = None,
                           kv_scales: torch.Tensor | None = None, num_splits: int = 1):
    """Same contract as paged_attention_ref: q [T, Hq, D] -> out [T, Hq, D] in q's
    dtype, and with return_lse also lse [T, Hq] fp32 (natural log of each
    query's softmax denominator).

    page_tables [B, Hkv, nb], context_lens [B, Hkv] (kernels/kv_store.py).
    max_query_len: the longest chunk in the batch; the caller knows it, and
    passing it avoids reading it back from the device (a sync).
    out: where to write, else a new tensor. Only the rows of the B sequences are
    written, so a caller may hand this kernel some sequences of a batch
    (cu_seqlens_q and the tables sliced, q and out whole) and the others to
    flash-decoding. kv_scales: the scales of a quantized cache (kernels/kv_store.py).
    num_splits: the parts each (sequence, KV head)'s context is cut into, taken in parallel
    and merged (kernels.prefill_num_splits chooses); 1: each query tile walks it all.
    """
    scales = check_cache(q, k_cache, v_cache, kv_scales, page_tables, context_lens)
    T, Hq, D = q.shape
    Hkv, block_size = page_tables.shape[1], k_cache.shape[1]
    G = Hq // Hkv
    B = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if B > 0 else 0
    if T > 0 and B > 0 and max_query_len > 0:
        block_m, block_n, num_warps = prefill_tiles(q.dtype, max_query_len, G, kv_scales is not None)
        block_q = block_m // G
        upcast, precision = dot_config(q.dtype)
        grid = (B, triton.cdiv(max_query_len, block_q), Hkv)
        split = num_splits > 1
        if split:   # each split's partial output and log2-sum-exp, merged by the tile's last split
            part_out = torch.empty(T, Hq, num_splits, D, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(T, Hq, num_splits, dtype=torch.float32, device=q.device)
            counters = split_counters(grid[0] * grid[1] * Hkv, q.device)
        else:
            part_out, part_lse, counters = out.unsqueeze(2), lse.unsqueeze(2), lse   # not used
        _paged_attention_kernel[grid[:2] + (Hkv * num_splits,)](
            q, kernel_view(k_cache), kernel_view(v_cache), scales, out, lse, part_out, part_lse, counters,
            page_tables, cu_seqlens_q, context_lens, scale * LOG2E, num_splits,
            q.stride(0), q.stride(1), *k_cache.stride()[:2], *v_cache.stride()[:2], *scales.stride()[:2],
            out.stride(0), out.stride(1), lse.stride(0), *part_out.stride()[:3], *part_lse.stride()[:2],
            *page_tables.stride()[:2], context_lens.stride(0),
            HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), BLOCK_SIZE=block_size, G=G, BLOCK_Q=block_q,
            BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=upcast, DOT_PRECISION=precision,
            QUANTIZED=kv_scales is not None, SPLIT=split, MIN_SPLIT=MIN_SPLIT, num_warps=num_warps)
    return (out, lse) if return_lse else out
