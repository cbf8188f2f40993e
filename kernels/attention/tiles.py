"""The building blocks of the Triton attention kernels: prefill (prefill.py),
flash-decoding (decode.py) and the key scores (key_scores.py).

All follow the torch oracle (reference.py) and read K and V straight from the
paged cache (layout: kernels/kv_store.py). What they share:
* Online softmax in base 2: keys are visited a tile of BLOCK_N slots at a time,
  each query row keeps a running max, denominator and output (online_softmax_step),
  scores are in log2 units so every exponential is a bare exp2; nothing of the
  context's size is materialised and K and V are read once.
* Per-slot page lookup (slot_pages): a tile is BLOCK_N consecutive slots of one
  (sequence, KV head), each slot finds its page in that head's row of the page
  tables, so tiles are independent of the block size and heads of a sequence may
  hold different numbers of slots.
* GQA packing: the G query heads that share a KV head are rows of one program's
  tile, so each K/V tile loaded serves all of them (G need not be a power of 2).
* Precision: fp32 accumulation; 16-bit operands go to the tensor cores as they
  are, fp32 ones in "ieee" precision (dot_config). A quantized cache is loaded in
  8 bits and converted in registers; its scales multiply scores and probabilities
  (load_kv_scales), constant ones when unquantized, which the compiler folds away.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels.kv_store import QUANT_MAX, from_cache

LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))    # turns the kernels' log2-sum-exps into natural logs

# Tile sizes. Prefill: BLOCK_M query rows (tokens x heads of a group) against
# BLOCK_N key slots; a batch whose query tiles would be mostly padding (short
# chunks) uses the minimum tl.dot height of 16 instead. Decode is bound by
# reading K and V, so its query tile is just the group, padded to 16 rows for
# tl.dot. fp32 tiles are smaller: at 64 x 64 an exact ("ieee") fp32 dot needs
# more registers than a thread has and spills (kernels/compile_check.py).
MIN_BLOCK_M = 16
BLOCK_N = 64
FP32_BLOCK_N = 32
# A context is cut into splits that programs take in parallel (flash-decoding, short prefill
# chunks) of at least MIN_SPLIT slots: shorter splits cost more than the parallelism they add.
# Measured on an H200 (docs/PERF.md), decode at batch 1, context 4k: 16 splits of 256 slots
# 20.5 us, 64 splits of 64 slots 35 us.
MIN_SPLIT = 256

_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast, input_precision) for the tl.dots of a cache in `dtype`.

    Upcast bf16 tiles to fp32 only under the interpreter, whose bf16 dot is
    wrong; a GPU must keep them 16-bit to use its tensor cores at full speed.
    "ieee" keeps fp32 dots exact on a GPU; "tf32", Triton's default, leaves
    16-bit dots as they are.
    """
    upcast = _INTERPRETER and dtype == torch.bfloat16
    exact = upcast or dtype == torch.float32
    return upcast, "ieee" if exact else "tf32"


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                 page_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """Check the cache and the tables against q; returns the scales the kernels read (a stand-in
    when unquantized). The kernels find context_lens[b, h] at b * stride(0) + h."""
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype and k_cache.dim() == 3
    assert k_cache.dtype == q.dtype or k_cache.dtype in QUANT_MAX, (k_cache.dtype, q.dtype)
    assert (kv_scales is not None) == (k_cache.dtype in QUANT_MAX), "a quantized cache, and only one, has scales"
    assert page_tables.dim() == 3 and context_lens.shape == page_tables.shape[:2], \
        f"tables {tuple(page_tables.shape)} must be [B, Hkv, nb], context_lens {tuple(context_lens.shape)} [B, Hkv]"
    assert context_lens.stride(1) == 1 and page_tables.stride(2) == 1, "context_lens, tables: last dim contiguous"
    assert q.shape[-2] % page_tables.shape[1] == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.shape[1] % 16 == 0, "cache block size must be a multiple of 16"
    if kv_scales is None:
        return k_cache   # a stand-in the kernels never read (QUANTIZED off)
    assert kv_scales.shape == (*k_cache.shape[:2], 2) and kv_scales.stride(2) == 1, kv_scales.shape
    return kv_scales


@triton.jit
def slot_pages(table_ptr, slots, valid, BLOCK_SIZE: tl.constexpr):
    """The page (int64) of each of the given slots of one (sequence, KV head).

    table_ptr points at that sequence's and head's row of the page tables.
    Slots outside `valid` look nothing up and get page 0 (their loads are
    masked anyway), so a padding row of zeros or a short table is never read
    past its end. int64: page * stride can pass 2**31 elements in a large cache.
    """
    return tl.load(table_ptr + slots // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)


@triton.jit
def load_kv_tile(k_ptr, v_ptr, pages, slots, slot_valid, dims, dim_valid, BLOCK_SIZE: tl.constexpr,
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
def load_kv_scales(scales_ptr, pages, slots, slot_valid, BLOCK_SIZE: tl.constexpr,
                    stride_p, stride_s, QUANTIZED: tl.constexpr):
    """The K and V scales [BLOCK_N] of the given slots (kernels/kv_store.py); constant ones
    for an unquantized cache, so that multiplying by them costs nothing."""
    if QUANTIZED:
        at = scales_ptr + pages * stride_p + (slots % BLOCK_SIZE) * stride_s
        return tl.load(at, mask=slot_valid, other=0.0), tl.load(at + 1, mask=slot_valid, other=0.0)
    ones = tl.full(slots.shape, 1.0, tl.float32)
    return ones, ones


@triton.jit
def split_range(context_len_ptr, split, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """The slots [start, end) of one split of a (sequence, KV head)'s context, whose length
    is at context_len_ptr, the split length, and the context length.

    Each (sequence, KV head) cuts its *own* context into num_splits ranges, each a
    whole number of tiles and at least MIN_SPLIT slots (so a short context uses only
    its first few splits): the grid depends on shapes alone, for CUDA graphs,
    while the work follows the real context lengths.
    """
    context_len = tl.load(context_len_ptr)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    start = split * split_len
    return start, tl.minimum(start + split_len, context_len), split_len, context_len


@triton.jit
def online_softmax_step(acc, m, l, s, v, v_scale, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running softmax of each query row.

    s [M, N]: scores in log2 units, -inf where masked; v [N, D]: the tile's values,
    each row to be multiplied by its v_scale [N]. A row with no finite score yet (a
    split of a chunk's context that lies past its query) keeps l = 0 and acc = 0:
    exp2(-inf - m) = 0 removes masked keys.
    """
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing seen: no rescaling
    alpha = tl.exp2(m - m_ref)            # rescales what was accumulated under the old max
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l


@triton.jit
def finish_split(part_out, part_lse, counter, out, lse, row_valid, mask, split, stride_pos, num_splits):
    """Store one split's partial output and log2-sum-exp (part_out, part_lse: its rows' first
    split's), and count it done in counter: whether it is the last of the rows' num_splits
    splits to finish. Every thread's partials are written before the count says so (the
    counter's add is one thread's, releasing them to the GPU), and the last split's loads
    come after its add, so they see every split's."""
    tl.store(part_out + split * stride_pos, out, mask=mask)
    tl.store(part_lse + split, lse, mask=row_valid)
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1


@triton.jit
def merged_splits(part_out, part_lse, counter, row_valid, mask, num_splits, stride_pos, BLOCK_M: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr):
    """The rows' splits combined by the last to finish (finish_split), in split order, so the
    bits are the same whichever finishes last: split i's output weighted by exp2(lse_i - lse),
    its share of the whole denominator; and the whole log2-sum-exp (-inf: no slot in any).
    The counter goes back to 0 for the next launch."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for i in range(0, num_splits):
        m = tl.maximum(m, tl.load(part_lse + i, mask=row_valid, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)          # no slot (and padding rows)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for i in range(0, num_splits):
        weight = tl.exp2(tl.load(part_lse + i, mask=row_valid, other=float("-inf")) - m)
        total += weight
        acc += weight[:, None] * tl.load(part_out + i * stride_pos, mask=mask, other=0.0)
    tl.store(counter, 0)
    seen = total > 0.0
    total = tl.where(seen, total, 1.0)
    return acc / total[:, None], tl.where(seen, m + tl.log2(total), float("-inf"))


@triton.jit
def store_result(out_ptr, lse_ptr, out, lse, row, head, dims, row_valid, mask, stride_o, stride_oh, stride_l):
    """The rows' output, in out's dtype, at out_ptr[row, head], and their log-sum-exp, from log2
    units to natural, at lse_ptr[row, head] (row, head [BLOCK_M])."""
    tl.store(out_ptr + row[:, None] * stride_o + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + row * stride_l + head, lse * LN2, mask=row_valid)


def kv_tile(dtype: torch.dtype, quantized: bool = False) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for a loop over key tiles: exact fp32 dots take smaller tiles
    over more warps, else they spill (kernels/compile_check.py); so do the conversions of
    8-bit tiles at head_dim 128 with 4 warps (flash-decoding on sm_90, key scores on sm_80)."""
    if dtype == torch.float32:
        return FP32_BLOCK_N, 8
    return BLOCK_N, 8 if quantized else 4
