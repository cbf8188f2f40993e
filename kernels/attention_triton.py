"""Paged attention in Triton: a flash-attention kernel for prefill and mixed
batches, and a flash-decoding kernel pair for decode steps.

Both read K and V straight from the paged cache (layout in kernels/kv_store.py)
through the block tables, and both follow the semantics of the torch oracle,
kernels/attention.py: sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
and query j of it sees slots 0 .. context_len - q_len + j.

Ideas shared by the kernels:

* Online softmax. Keys are visited one tile of BLOCK_N slots at a time; each
  query row keeps a running max m, a running denominator l and an unnormalised
  output acc, rescaled whenever the max grows. Nothing of size context_len is
  ever materialised, and K and V are read exactly once.
* Base-2 exponentials. Scores are kept in log2 units (the softmax scale is
  multiplied by log2(e) once), so every exponential is a bare exp2, the
  instruction the hardware has. Log-sum-exps are converted back to natural
  logs only when they are written out.
* Per-slot block lookup. A key tile is BLOCK_N consecutive slots of one
  sequence; each slot finds its cache block through the block table. The tile
  size is therefore independent of the cache block size (any multiple of 16),
  and a tile may straddle blocks.
* GQA packing. The G = Hq / Hkv query heads that share a KV head are computed
  by one program, as rows of the same tile, so each K/V tile loaded serves all
  of them. In the prefill kernel row r of a tile is query token r // G, query
  head r % G (vLLM's unified attention does the same); rows that fall past the
  tile or the sequence are padding and are masked out, so G need not be a power
  of 2 (the bundled model has G = 3).
* Per-head block tables. The kernels take a block-table stride per KV head:
  0 for a table [B, max_blocks] shared by all heads, the real stride for
  tables [B, Hkv, max_blocks] (after per-head eviction a slot of head 0 and the
  same slot of head 1 can live in different blocks).
* Precision. Accumulation is always fp32. On a GPU, 16-bit operands go to the
  tensor cores as they are; fp32 operands use "ieee" precision (TF32 would
  be off by ~3e-4). Triton's interpreter multiplies bf16 operands wrongly, so
  there (only there) bf16 tiles are upcast to fp32 before tl.dot.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))    # turns the kernels' log2-sum-exps into natural logs

# Tile sizes. Prefill: BLOCK_M query rows (tokens x heads of a group) against
# BLOCK_N key slots; a batch whose query tiles would be mostly padding (only
# decodes, or short chunks) uses the minimum tl.dot height of 16 instead.
# Decode is bound by reading K and V, so its query tile is just the group,
# padded to 16 rows for tl.dot.
PREFILL_BLOCK_M = 64
MIN_BLOCK_M = 16
BLOCK_N = 64

_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def _dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast, input_precision) for the tl.dots of a cache in `dtype`.

    Upcast bf16 tiles to fp32 only under the interpreter, whose bf16 dot is
    wrong; a GPU must keep them 16-bit to use its tensor cores at full speed.
    "ieee" keeps fp32 dots exact on a GPU; "tf32", Triton's default, leaves
    16-bit dots as they are.
    """
    upcast = _INTERPRETER and dtype == torch.bfloat16
    exact = upcast or dtype == torch.float32
    return upcast, "ieee" if exact else "tf32"


def _block_table_strides(block_tables: torch.Tensor, num_kv_heads: int) -> tuple[int, int]:
    """(stride per sequence, stride per KV head) of a [B, nb] or [B, Hkv, nb] table."""
    if block_tables.dim() == 2:
        return block_tables.stride(0), 0
    assert block_tables.dim() == 3 and block_tables.shape[1] == num_kv_heads, block_tables.shape
    return block_tables.stride(0), block_tables.stride(1)


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype == q.dtype
    assert q.shape[-2] % k_cache.shape[1] == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.shape[2] % 16 == 0, "cache block size must be a multiple of 16"


# ----------------------------------------------------------------------------
# Building blocks shared by the kernels
# ----------------------------------------------------------------------------

@triton.jit
def _kv_offsets(table_ptr, slots, valid, BLOCK_SIZE: tl.constexpr, stride_block, stride_slot):
    """Element offsets in a cache of the given slots of one sequence and KV head.

    table_ptr points at that sequence's (and head's) row of the block table.
    Slots outside `valid` look nothing up and get offset 0 (their loads are
    masked anyway), so a padding row of zeros or a short table is never read
    past its end. Offsets are int64: a large cache exceeds 2**31 elements.
    """
    block = tl.load(table_ptr + slots // BLOCK_SIZE, mask=valid, other=0)
    return block.to(tl.int64) * stride_block + (slots % BLOCK_SIZE) * stride_slot


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, table, slots, slot_valid, kv_head, dims, dim_valid, BLOCK_SIZE: tl.constexpr,
                  stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, UPCAST: tl.constexpr):
    """The K and V rows [BLOCK_N, HEAD_DIM_PAD] of the given slots of one KV head
    (zeros where a slot or a dimension is not valid)."""
    k_offs = _kv_offsets(table, slots, slot_valid, BLOCK_SIZE, stride_kb, stride_ks) + kv_head * stride_kh
    v_offs = _kv_offsets(table, slots, slot_valid, BLOCK_SIZE, stride_vb, stride_vs) + kv_head * stride_vh
    kv_mask = slot_valid[:, None] & dim_valid[None, :]
    k = tl.load(k_ptr + k_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + v_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(acc, m, l, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running softmax of each query row.

    s [M, N]: scores in log2 units, -inf where masked; v [N, D]: the tile's values.
    Callers guarantee each row has a finite score by its first tile, so the
    running max is finite and exp2(-inf - m) = 0 removes masked keys.
    """
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)            # rescales what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l


# ----------------------------------------------------------------------------
# Prefill, chunked prefill and mixed batches
# ----------------------------------------------------------------------------

@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, table_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        qk_scale,                                     # softmax scale * log2(e)
        stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_ot, stride_oh, stride_lt, stride_table_b, stride_table_h,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, RETURN_LSE: tl.constexpr):
    """One program: BLOCK_Q query tokens of one sequence x the G query heads of one KV head.

    Grid (B, cdiv(max_query_len, BLOCK_Q), Hkv); programs past the end of
    their sequence's queries return at once.
    """
    seq, q_tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prior = context_len - q_len                       # slots cached before this chunk

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

    # The last query of this tile sees up to slot kv_end - 1. Every query sees
    # slot 0, so each row has a finite score in the first tile.
    kv_end = prior + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    table = table_ptr + seq * stride_table_b + kv_head * stride_table_h
    for n in range(0, kv_end, BLOCK_N):
        slots = n + tl.arange(0, BLOCK_N)
        slot_valid = slots < kv_end
        k, v = _load_kv_tile(k_ptr, v_ptr, table, slots, slot_valid, kv_head, dims, dim_valid, BLOCK_SIZE,
                             stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = slots[None, :] <= (prior + token)[:, None]    # causal by slot; implies slot < kv_end
        s = tl.where(visible, s, float("-inf"))
        acc, m, l = _online_softmax_step(acc, m, l, s, v, DOT_PRECISION)

    out = acc / l[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    if RETURN_LSE:
        tl.store(lse_ptr + q_rows * stride_lt + head, (m + tl.log2(l)) * LN2, mask=row_valid)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, return_lse: bool = False,
                           max_query_len: int | None = None):
    """Same contract as paged_attention_ref: q [T, Hq, D] -> out [T, Hq, D] in q's
    dtype, and with return_lse also lse [T, Hq] fp32 (natural log of each
    query's softmax denominator).

    block_tables: [B, max_blocks] shared by all KV heads, or [B, Hkv, max_blocks].
    max_query_len: the longest chunk in the batch; the caller knows it, and
    passing it avoids reading it back from the device (a sync).
    """
    _check_cache(q, k_cache, v_cache)
    T, Hq, D = q.shape
    Hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    B = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if B > 0 else 0
    if T > 0 and max_query_len > 0:
        block_m = PREFILL_BLOCK_M if max_query_len * G > MIN_BLOCK_M else MIN_BLOCK_M
        block_m = max(block_m, triton.next_power_of_2(G))
        block_q = block_m // G
        upcast, precision = _dot_config(q.dtype)
        grid = (B, triton.cdiv(max_query_len, block_q), Hkv)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, lse, block_tables, cu_seqlens_q, context_lens, scale * LOG2E,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            out.stride(0), out.stride(1), lse.stride(0), *_block_table_strides(block_tables, Hkv),
            HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), BLOCK_SIZE=block_size,
            G=G, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            UPCAST=upcast, DOT_PRECISION=precision, RETURN_LSE=return_lse)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------
# Decode: flash-decoding with a static grid, plus key-score emission
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
