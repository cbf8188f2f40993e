"""Key scores for average-attention eviction (Batch-Max, Sec. 3.2).

Every kept KV pair accumulates `sum_weights`: the sum of the softmax
probabilities it received from every query processed so far, in GQA from
every query head of its group. The eviction rule later divides it by the
number of queries that could see the pair, so the sum must count each query
exactly once.

Decode steps get their probabilities from the decode attention kernel. After
a prefill chunk the attention kernel has only kept each query's log-sum-exp
(`lse`), so the probabilities are recomputed here as
    p[i, s] = exp(scale * q_i . k_s - lse_i),
which is exactly the softmax the attention used, without its running max or
a second pass over V.

With square_scores [B] bool, a sequence whose flag is set adds p**2 instead of p
(KV-Compress's squared-attention metric, Sec. 4.3), still summed over the
queries and the query heads of the group. With score_skip [B] int32, query
position positions[t] adds nothing to a key whose position (pos_cache [P, bs])
is fewer than score_skip[b] before it (KVC-full's excluded local queries, eq. 19):
the pairs that count are those with q_pos - key_pos >= score_skip[b].

Batch and cache layout are those of kernels/attention/reference.py and kernels/kv_store.py:
sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1], its KV head h
holds context_lens[b, h] slots in the pages page_tables[b, h] (its new tokens
last), and query j sees slots 0 .. context_lens[b, h] - q_len + j of head h.
score_from [B] int32, if given, makes only the queries j >= score_from[b] of
sequence b count (windowed rankings: SnapKV's observation window, TOVA's last
query); per-sequence tensors, so one batch mixes rules and a CUDA graph
replays for any window.
"""

import torch
import triton
import triton.language as tl

from kernels.attention.tiles import check_cache, dot_config, kv_tile, load_kv_scales, slot_pages
from kernels.kv_store import dequantize, from_cache, kernel_view


def accumulate_key_scores_ref(q: torch.Tensor, k_cache: torch.Tensor, score_cache: torch.Tensor,
                              page_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              context_lens: torch.Tensor, lse: torch.Tensor, scale: float,
                              score_from: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
                              square_scores: torch.Tensor | None = None, score_skip: torch.Tensor | None = None,
                              positions: torch.Tensor | None = None, pos_cache: torch.Tensor | None = None) -> None:
    """Add to score_cache [P, bs] (fp32, in place) the attention probabilities (squared
    where square_scores[b]) that the queries q [T, Hq, D] gave each key of their context,
    summed over the queries and over the G = Hq / Hkv query heads of each KV head
    (with score_skip: only the pairs at least score_skip[b] positions apart).

    lse [T, Hq] is each query's log softmax denominator, as returned by
    paged_attention_ref(..., return_lse=True). The oracle of
    accumulate_key_scores_triton: one sequence at a time, all its heads padded to the
    longest, in fp32. kv_scales: a quantized cache's (kernels/kv_store.py).
    """
    Hq, D = q.shape[1:]
    Hkv, block_size = page_tables.shape[1], k_cache.shape[1]
    G = Hq // Hkv
    for b in range(len(context_lens)):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n, lens = end - start, context_lens[b]                          # lens [Hkv]
        slots = torch.arange(int(lens.max()), device=q.device)
        held = slots < lens[:, None]                                    # [Hkv, L]
        pages = page_tables[b][:, slots // block_size].long()          # [Hkv, L]
        offsets = (slots % block_size).expand_as(pages)
        k_scale = None if kv_scales is None else kv_scales[pages, offsets, 0]
        k = dequantize(k_cache[pages, offsets], k_scale).float()         # [Hkv, L, D]
        q_b = q[start:end].float().view(n, Hkv, G, D)
        lse_b = lse[start:end].view(n, Hkv, G).permute(1, 2, 0)          # [Hkv, G, n]
        logits = torch.einsum("nhgd,hld->hgnl", q_b, k) * scale
        query_slot = lens[:, None] - n + torch.arange(n, device=q.device)   # [Hkv, n]
        visible = slots <= query_slot[..., None]                        # [Hkv, n, L]; implies held
        if score_from is not None:
            visible &= (torch.arange(n, device=q.device) >= int(score_from[b]))[:, None]
        if score_skip is not None:
            apart = positions[start:end, None] - pos_cache[pages, offsets][:, None]   # [Hkv, n, L]
            visible &= apart >= int(score_skip[b])
        # Masked, not multiplied: exp of an unseen key's logit may overflow to inf.
        probs = torch.exp(logits - lse_b[..., None]).masked_fill(~visible[:, None], 0.0)
        if square_scores is not None and bool(square_scores[b]):
            probs = probs ** 2
        score_cache[pages[held], offsets[held]] += probs.sum(dim=(1, 2))[held]


@triton.jit
def _accumulate_key_scores_kernel(
        q_ptr, k_cache_ptr, scales_ptr, score_cache_ptr, page_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        lse_ptr, score_from_ptr, square_ptr, skip_ptr, q_pos_ptr, pos_cache_ptr, scale,
        stride_q_t, stride_q_h, stride_k_page, stride_k_slot, stride_qs_page, stride_qs_slot, stride_score_page,
        stride_pos_page,
        stride_table_seq, stride_table_head, stride_cl, stride_lse_t, stride_lse_h,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_IN_FP32: tl.constexpr,
        QUANTIZED: tl.constexpr, SQUARE: tl.constexpr, SKIP: tl.constexpr):
    """One program: BLOCK_N key slots of one KV head of one sequence, scored by
    all the sequence's queries, BLOCK_Q tokens x G heads (= up to BLOCK_M rows) at a time.

    The tile's sums stay in registers until the end and are then added to
    score_cache with a plain load-add-store: no other program owns these slots.
    """
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq * stride_cl + kv_head)
    first_slot = tile * BLOCK_N
    if first_slot >= context_len:   # the grid is sized for the longest context
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    prefix_len = context_len - q_len   # this head's slots before this step's tokens, seen by every query

    # The tile's keys, each slot looked up in its head's page table on its own, so
    # BLOCK_N need not match the block size.
    slots = first_slot + tl.arange(0, BLOCK_N)
    slot_mask = slots < context_len
    table = page_tables_ptr + seq * stride_table_seq + kv_head * stride_table_head
    pages = slot_pages(table, slots, slot_mask, BLOCK_SIZE)
    offsets = slots % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < HEAD_DIM
    k = tl.load(k_cache_ptr + (pages * stride_k_page + offsets * stride_k_slot)[:, None] + dims[None, :],
                mask=slot_mask[:, None] & dim_mask[None, :], other=0.0)
    k = from_cache(k, tl.float32 if DOT_IN_FP32 else q_ptr.dtype.element_ty)   # q's dtype: 8 bits if quantized
    # A quantized key's scale multiplies its logits (kernels/attention/tiles.py); ones otherwise.
    k_scale = load_kv_scales(scales_ptr, pages, slots, slot_mask, BLOCK_SIZE,
                              stride_qs_page, stride_qs_slot, QUANTIZED)[0]
    if SKIP:   # KVC-full: only pairs at least `skip` positions apart count
        key_pos = tl.load(pos_cache_ptr + pages * stride_pos_page + offsets, mask=slot_mask, other=0)
        skip = tl.load(skip_ptr + seq)

    # Row m of a query tile is token m // G, query head kv_head * G + m % G
    # (vLLM's GQA packing); rows past BLOCK_Q * G are padding when G does not divide BLOCK_M.
    rows = tl.arange(0, BLOCK_M)
    q_heads = kv_head * G + rows % G
    scores = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Query j sees slot s iff s <= prefix_len + j: queries before j = first_slot - prefix_len
    # see none of this tile, and those before score_from count for nothing, so the loop starts there.
    first_counted = tl.maximum(tl.load(score_from_ptr + seq), 0)
    # q's chunk in 64 bits: the step's rows of the fused qkv pass 2**31 elements at ~350k
    # tokens (Llama-8B), rows within one sequence's chunk never; lse's [T, Hq] rows are short.
    q_chunk = q_ptr + q_start.to(tl.int64) * stride_q_t
    for first_query in range(tl.maximum(first_slot - prefix_len, first_counted), q_len, BLOCK_Q):
        queries = first_query + rows // G
        row_mask = (rows < BLOCK_Q * G) & (queries < q_len)
        q = tl.load(q_chunk + queries[:, None] * stride_q_t + q_heads[:, None] * stride_q_h
                    + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)
        lse = tl.load(lse_ptr + (q_start + queries) * stride_lse_t + q_heads * stride_lse_h, mask=row_mask, other=0.0)
        # "ieee" keeps fp32 dots out of TF32; fp16/bf16 dots are exact products either way.
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * (scale * k_scale)[None, :]
        visible = (slots[None, :] <= prefix_len + queries[:, None]) & row_mask[:, None] & slot_mask[None, :]
        if SKIP:
            q_pos = tl.load(q_pos_ptr + q_start + queries, mask=row_mask, other=0)
            visible &= q_pos[:, None] - key_pos[None, :] >= skip
        # tl.where, not a multiply: exp of a masked-out logit may overflow to inf.
        probs = tl.where(visible, tl.exp(logits - lse[:, None]), 0.0)
        if SQUARE:
            probs = tl.where(tl.load(square_ptr + seq) != 0, probs * probs, probs)
        scores += tl.sum(probs, axis=0)

    score_ptrs = score_cache_ptr + pages * stride_score_page + offsets
    tl.store(score_ptrs, tl.load(score_ptrs, mask=slot_mask) + scores, mask=slot_mask)


def accumulate_key_scores_triton(q: torch.Tensor, k_cache: torch.Tensor, score_cache: torch.Tensor,
                                 page_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 context_lens: torch.Tensor, lse: torch.Tensor, scale: float,
                                 score_from: torch.Tensor | None = None,
                                 max_query_len: int | None = None, max_context_len: int | None = None,
                                 kv_scales: torch.Tensor | None = None,
                                 square_scores: torch.Tensor | None = None, score_skip: torch.Tensor | None = None,
                                 positions: torch.Tensor | None = None, pos_cache: torch.Tensor | None = None) -> None:
    """accumulate_key_scores_ref as one Triton kernel that never materialises the
    [queries x keys] probabilities: each program recomputes them tile by tile.

    max_query_len / max_context_len (Python ints, upper bounds are fine) size
    the launch; the caller usually knows them, which saves a device sync each.
    """
    Hq, D = q.shape[1:]
    Hkv, block_size = page_tables.shape[1], k_cache.shape[1]
    G = Hq // Hkv
    scales = check_cache(q, k_cache, k_cache, kv_scales, page_tables, context_lens)
    assert score_cache.shape == k_cache.shape[:2] and score_cache.stride(1) == 1, score_cache.shape
    assert score_cache.dtype == torch.float32 and lse.dtype == torch.float32
    B = len(context_lens)
    if score_from is None:
        score_from = torch.zeros(B, dtype=torch.int32, device=q.device)
    assert score_from.dtype == torch.int32 and score_from.shape == (B,), score_from.shape
    assert square_scores is None or (square_scores.dtype == torch.bool and square_scores.shape == (B,))
    skip = score_skip is not None
    assert not skip or (score_skip.dtype == torch.int32 and score_skip.shape == (B,)
                        and pos_cache.shape == score_cache.shape and positions.shape == q.shape[:1])
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    # Up to 64 query rows per dot (>= 16, the smallest tile tl.dot compiles on a
    # GPU); fewer when the chunks are short, so decode rows do not pad to 64.
    # Exact fp32 dots need small tiles not to spill (kernels/compile_check.py).
    fp32 = q.dtype == torch.float32
    block_m = max(16, triton.next_power_of_2(G), min(16 if fp32 else 64, triton.next_power_of_2(max_query_len * G)))
    block_n, num_warps = kv_tile(q.dtype, quantized=kv_scales is not None)
    if fp32:
        block_n //= 2   # the K tile stays in registers for the whole loop
    grid = (B, triton.cdiv(max_context_len, block_n), Hkv)
    _accumulate_key_scores_kernel[grid](
        q, kernel_view(k_cache), scales, score_cache, page_tables, cu_seqlens_q, context_lens, lse,
        score_from, score_from if square_scores is None else square_scores,
        *((score_skip, positions, pos_cache) if skip else (score_from,) * 3), scale,
        q.stride(0), q.stride(1), *k_cache.stride()[:2], *scales.stride()[:2], score_cache.stride(0),
        pos_cache.stride(0) if skip else 0,
        *page_tables.stride()[:2], context_lens.stride(0), lse.stride(0), lse.stride(1),
        G=G, HEAD_DIM=D, HEAD_DIM_PADDED=triton.next_power_of_2(D), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_m // G, BLOCK_N=block_n,
        DOT_IN_FP32=dot_config(q.dtype)[0],   # the interpreter's bf16 tl.dot is wrong
        QUANTIZED=kv_scales is not None, SQUARE=square_scores is not None, SKIP=skip,
        num_warps=num_warps,
    )
