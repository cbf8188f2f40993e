"""Paged attention in Triton: a flash-attention kernel for prefill and mixed
batches, and the building blocks it shares with flash-decoding
(kernels/decode_attention.py).

Both kernels read K and V straight from the paged cache (layout in kernels/kv_store.py)
through the block tables, and both follow the semantics of the torch oracle,
kernels/attention.py: sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
and query j of it sees slots 0 .. context_lens[b, h] - q_len + j of KV head h.

Ideas shared by the kernels:

* Online softmax. Keys are visited one tile of BLOCK_N slots at a time; each
  query row keeps a running max m, a running denominator l and an unnormalised
  output acc, rescaled whenever the max grows. Nothing of size context_len is
  ever materialised, and K and V are read exactly once.
* Base-2 exponentials. Scores are kept in log2 units (the softmax scale is
  multiplied by log2(e) once), so every exponential is a bare exp2, the
  instruction the hardware has. Log-sum-exps are converted back to natural
  logs only when they are written out.
* Per-slot page lookup. A key tile is BLOCK_N consecutive slots of one
  (sequence, KV head); each slot finds its page through that head's row of the
  block tables. The tile size is therefore independent of the block size (any
  multiple of 16), and a tile may straddle pages.
* GQA packing. The G = Hq / Hkv query heads that share a KV head are computed
  by one program, as rows of the same tile, so each K/V tile loaded serves all
  of them. In the prefill kernel row r of a tile is query token r // G, query
  head r % G (vLLM's unified attention does the same); rows that fall past the
  tile or the sequence are padding and are masked out, so G need not be a power
  of 2 (the bundled model has G = 3).
* Pages. A page holds the slots of one KV head, so every program, which serves
  one KV head, reads its own row of the block tables [B, Hkv, nb] and its own
  context length context_lens[b, h]; heads of a sequence may hold different
  numbers of slots (per-head eviction), and no head offset enters an address.
* Precision. Accumulation is always fp32. On a GPU, 16-bit operands go to the
  tensor cores as they are; fp32 operands use "ieee" precision (TF32 would
  be off by ~3e-4). Triton's interpreter multiplies bf16 operands wrongly, so
  there (only there) bf16 tiles are upcast to fp32 before tl.dot.
* Quantized caches (int8, fp8; kernels/kv_store.py). K and V tiles are loaded
  in 8 bits and converted in registers to q's dtype (exact: int8 and e4m3
  values are bf16/fp16 values); the scales fold into the softmax instead of
  the tiles: a key's scale multiplies its column of scores, a value's scale its
  column of probabilities before they meet V. With an unquantized cache the
  scales are constant ones, which the compiler folds away.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels.kv_store import QUANT_MAX, from_cache, kernel_view

LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))    # turns the kernels' log2-sum-exps into natural logs

# Tile sizes. Prefill: BLOCK_M query rows (tokens x heads of a group) against
# BLOCK_N key slots; a batch whose query tiles would be mostly padding (short
# chunks) uses the minimum tl.dot height of 16 instead. Decode is bound by
# reading K and V, so its query tile is just the group, padded to 16 rows for
# tl.dot. fp32 tiles are smaller: at 64 x 64 an exact ("ieee") fp32 dot needs
# more registers than a thread has and spills (kernels/compile_check.py).
PREFILL_BLOCK_M = 64
MIN_BLOCK_M = 16
BLOCK_N = 64
FP32_BLOCK_N = 32

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


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """Check the cache and the tables against q; returns the scales the kernels read (a stand-in
    when unquantized). The kernels find context_lens[b, h] at b * stride(0) + h."""
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype and k_cache.dim() == 3
    assert k_cache.dtype == q.dtype or k_cache.dtype in QUANT_MAX, (k_cache.dtype, q.dtype)
    assert (kv_scales is not None) == (k_cache.dtype in QUANT_MAX), "a quantized cache, and only one, has scales"
    assert block_tables.dim() == 3 and context_lens.shape == block_tables.shape[:2], \
        f"tables {tuple(block_tables.shape)} must be [B, Hkv, nb], context_lens {tuple(context_lens.shape)} [B, Hkv]"
    assert context_lens.stride(1) == 1 and block_tables.stride(2) == 1, "context_lens, tables: last dim contiguous"
    assert q.shape[-2] % block_tables.shape[1] == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.shape[1] % 16 == 0, "cache block size must be a multiple of 16"
    if kv_scales is None:
        return k_cache   # a stand-in the kernels never read (QUANTIZED off)
    assert kv_scales.shape == (*k_cache.shape[:2], 2) and kv_scales.stride(2) == 1, kv_scales.shape
    return kv_scales


# ----------------------------------------------------------------------------
# Building blocks shared by the kernels
# ----------------------------------------------------------------------------

@triton.jit
def _pages(table_ptr, slots, valid, BLOCK_SIZE: tl.constexpr):
    """The page (int64) of each of the given slots of one (sequence, KV head).

    table_ptr points at that sequence's and head's row of the block tables.
    Slots outside `valid` look nothing up and get page 0 (their loads are
    masked anyway), so a padding row of zeros or a short table is never read
    past its end. int64: page * stride can pass 2**31 elements in a large cache.
    """
    return tl.load(table_ptr + slots // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, pages, slots, slot_valid, dims, dim_valid, BLOCK_SIZE: tl.constexpr,
                  stride_kp, stride_ks, stride_vp, stride_vs, dtype: tl.constexpr):
    """The K and V rows [BLOCK_N, HEAD_DIM_PAD] of the given slots, which live in `pages`
    (zeros where a slot or a dimension is not valid), converted to `dtype` (q's: this
    upcasts under the interpreter and turns 8-bit values into 16-bit ones).

    The loops that call this look up the *next* tile's pages while the current
    tile is being processed (software prefetch of the table): a K/V address that
    depends on a table load of the same iteration keeps Triton's pipeliner from
    double-buffering K and V below num_stages 5; one that comes from the
    previous iteration does not (checked in kernels/compile_check.py).
    """
    offset = slots % BLOCK_SIZE
    kv_mask = slot_valid[:, None] & dim_valid[None, :]
    k = tl.load(k_ptr + (pages * stride_kp + offset * stride_ks)[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + (pages * stride_vp + offset * stride_vs)[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    return from_cache(k, dtype), from_cache(v, dtype)


@triton.jit
def _load_kv_scales(scales_ptr, pages, slots, slot_valid, BLOCK_SIZE: tl.constexpr,
                    stride_p, stride_s, QUANTIZED: tl.constexpr):
    """The K and V scales [BLOCK_N] of the given slots (kernels/kv_store.py); constant ones
    for an unquantized cache, so that multiplying by them costs nothing."""
    if QUANTIZED:
        at = scales_ptr + pages * stride_p + (slots % BLOCK_SIZE) * stride_s
        return tl.load(at, mask=slot_valid, other=0.0), tl.load(at + 1, mask=slot_valid, other=0.0)
    ones = tl.full(slots.shape, 1.0, tl.float32)
    return ones, ones


@triton.jit
def _online_softmax_step(acc, m, l, s, v, v_scale, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running softmax of each query row.

    s [M, N]: scores in log2 units, -inf where masked; v [N, D]: the tile's values,
    each row to be multiplied by its v_scale [N].
    Callers guarantee each row has a finite score by its first tile, so the
    running max is finite and exp2(-inf - m) = 0 removes masked keys.
    """
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)            # rescales what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l


# ----------------------------------------------------------------------------
# Prefill, chunked prefill and mixed batches
# ----------------------------------------------------------------------------

@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, scales_ptr, out_ptr, lse_ptr, table_ptr, cu_seqlens_q_ptr, context_lens_ptr,
        qk_scale,                                     # softmax scale * log2(e)
        stride_qt, stride_qh, stride_kp, stride_ks, stride_vp, stride_vs, stride_qsp, stride_qss,
        stride_ot, stride_oh, stride_lt, stride_table_b, stride_table_h, stride_cl,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, RETURN_LSE: tl.constexpr, QUANTIZED: tl.constexpr):
    """One program: BLOCK_Q query tokens of one sequence x the G query heads of one KV head.

    Grid (B, cdiv(max_query_len, BLOCK_Q), Hkv); programs past the end of
    their sequence's queries return at once.
    """
    seq, q_tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq * stride_cl + kv_head)
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

    # The last query of this tile sees up to slot kv_end - 1. Every query sees
    # slot 0, so each row has a finite score in the first tile.
    kv_end = prior + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    table = table_ptr + seq * stride_table_b + kv_head * stride_table_h
    slots = tl.arange(0, BLOCK_N)
    pages = _pages(table, slots, slots < kv_end, BLOCK_SIZE)
    for n in range(0, kv_end, BLOCK_N):
        slots = n + tl.arange(0, BLOCK_N)
        slot_valid = slots < kv_end
        k, v = _load_kv_tile(k_ptr, v_ptr, pages, slots, slot_valid, dims, dim_valid, BLOCK_SIZE,
                             stride_kp, stride_ks, stride_vp, stride_vs, q.dtype)
        k_scale, v_scale = _load_kv_scales(scales_ptr, pages, slots, slot_valid, BLOCK_SIZE,
                                           stride_qsp, stride_qss, QUANTIZED)
        pages = _pages(table, slots + BLOCK_N, slots + BLOCK_N < kv_end, BLOCK_SIZE)   # prefetch
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (qk_scale * k_scale)[None, :]
        visible = slots[None, :] <= (prior + token)[:, None]    # causal by slot; implies slot < kv_end
        s = tl.where(visible, s, float("-inf"))
        acc, m, l = _online_softmax_step(acc, m, l, s, v, v_scale, DOT_PRECISION)

    out = acc / l[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    if RETURN_LSE:
        tl.store(lse_ptr + q_rows * stride_lt + head, (m + tl.log2(l)) * LN2, mask=row_valid)


def kv_tile(dtype: torch.dtype, quantized: bool = False) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for a loop over key tiles: exact fp32 dots take smaller tiles
    over more warps, else they spill (kernels/compile_check.py); so do the conversions of
    8-bit tiles at head_dim 128 with 4 warps (flash-decoding on sm_90, key scores on sm_80)."""
    if dtype == torch.float32:
        return FP32_BLOCK_N, 8
    return BLOCK_N, 8 if quantized else 4


def prefill_tiles(dtype: torch.dtype, max_query_len: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the prefill kernel: 64 x 64 tiles over 8 warps
    (4 warps spill at 64 rows on sm_80); 16-row tiles when the chunks are short; small
    tiles for fp32. BLOCK_M holds at least one token's whole group."""
    tall = max_query_len * group > MIN_BLOCK_M and dtype != torch.float32
    block_m = max(PREFILL_BLOCK_M if tall else MIN_BLOCK_M, triton.next_power_of_2(group))
    block_n, num_warps = kv_tile(dtype)
    return block_m, block_n, 8 if block_m >= 64 else num_warps


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, return_lse: bool = False,
                           max_query_len: int | None = None, out: torch.Tensor | None = None,
                           kv_scales: torch.Tensor | None = None):
    """Same contract as paged_attention_ref: q [T, Hq, D] -> out [T, Hq, D] in q's
    dtype, and with return_lse also lse [T, Hq] fp32 (natural log of each
    query's softmax denominator).

    block_tables [B, Hkv, nb], context_lens [B, Hkv] (kernels/kv_store.py).
    max_query_len: the longest chunk in the batch; the caller knows it, and
    passing it avoids reading it back from the device (a sync).
    out: where to write, else a new tensor. Only the rows of the B sequences are
    written, so a caller may hand this kernel some sequences of a batch
    (cu_seqlens_q and the tables sliced, q and out whole) and the others to
    flash-decoding. kv_scales: the scales of a quantized cache (kernels/kv_store.py).
    """
    scales = _check_cache(q, k_cache, v_cache, kv_scales, block_tables, context_lens)
    T, Hq, D = q.shape
    Hkv, block_size = block_tables.shape[1], k_cache.shape[1]
    G = Hq // Hkv
    B = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if B > 0 else 0
    if T > 0 and B > 0 and max_query_len > 0:
        block_m, block_n, num_warps = prefill_tiles(q.dtype, max_query_len, G)
        block_q = block_m // G
        upcast, precision = _dot_config(q.dtype)
        grid = (B, triton.cdiv(max_query_len, block_q), Hkv)
        _paged_attention_kernel[grid](
            q, kernel_view(k_cache), kernel_view(v_cache), scales, out, lse, block_tables, cu_seqlens_q, context_lens,
            scale * LOG2E,
            q.stride(0), q.stride(1), *k_cache.stride()[:2], *v_cache.stride()[:2], *scales.stride()[:2],
            out.stride(0), out.stride(1), lse.stride(0), *block_tables.stride()[:2], context_lens.stride(0),
            HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), BLOCK_SIZE=block_size,
            G=G, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
            UPCAST=upcast, DOT_PRECISION=precision, RETURN_LSE=return_lse, QUANTIZED=kv_scales is not None,
            num_warps=num_warps)
    return (out, lse) if return_lse else out
