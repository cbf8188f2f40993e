"""Where a step's new pairs go in heads that have pages of their own (an uneven method once
it has evicted, kernels/kv_store.py's layout): each token's slot in every (layer, KV head),
from the head's page table and length.

A token from_end slots before its sequence's end goes to slot lens - from_end of each head:
that index's page in the head's table, and its offset in the page. The torch reference is six
ops for a decode (a token a sequence, the last slot) and more for prompt chunks, each a launch
on a GPU at every step; the Triton kernel is one.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024   # the (token, head) pairs a program takes


def head_slots_ref(tables: torch.Tensor, lens: torch.Tensor, block_size: int, row_seq: torch.Tensor | None = None,
                   from_end: torch.Tensor | None = None) -> torch.Tensor:
    """[L, T, H] int64: the slot of token t's pair in each head, for heads with pages tables
    [L, B, H, W] holding lens [L, B, H] (this step's tokens included). row_seq [T]: each token's
    sequence, from_end [T]: its distance from the sequence's end (1: the last); None: a decode,
    token b the last of sequence b."""
    L, B, H = lens.shape
    if row_seq is None:
        index = lens - 1
        pages = tables.gather(3, (index // block_size)[..., None].long())[..., 0]
    else:
        index = lens[:, row_seq] - from_end[None, :, None]
        pages = tables[torch.arange(L, device=lens.device)[:, None, None], row_seq[None, :, None],
                       torch.arange(H, device=lens.device)[None, None, :], index // block_size]
    return pages.long() * block_size + index % block_size


@triton.jit
def _head_slots_kernel(tables, lens, row_seq, from_end, out, T, H, stride_tl, stride_tb, stride_th,
                       stride_ll, stride_lb, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, DECODE: tl.constexpr):
    """Layer program_id(0)'s slots of BLOCK (token, head) pairs."""
    layer = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = i < T * H
    token, head = i // H, i % H
    if DECODE:
        seq, back = token, 1
    else:
        seq = tl.load(row_seq + token, mask=valid, other=0)
        back = tl.load(from_end + token, mask=valid, other=1)
    index = tl.load(lens + layer * stride_ll + seq * stride_lb + head, mask=valid, other=1) - back
    page = tl.load(tables + layer * stride_tl + seq * stride_tb + head * stride_th + index // BLOCK_SIZE,
                   mask=valid, other=0)
    tl.store(out + (layer * T + token) * H + head, page.to(tl.int64) * BLOCK_SIZE + index % BLOCK_SIZE, mask=valid)


def head_slots_triton(tables: torch.Tensor, lens: torch.Tensor, block_size: int, row_seq: torch.Tensor | None = None,
                      from_end: torch.Tensor | None = None) -> torch.Tensor:
    """head_slots_ref in one launch."""
    L, B, H = lens.shape
    T = B if row_seq is None else row_seq.shape[0]
    out = torch.empty(L, T, H, dtype=torch.int64, device=lens.device)
    if tables.stride(-1) != 1 or lens.stride(-1) != 1:
        tables, lens = tables.contiguous(), lens.contiguous()
    _head_slots_kernel[(L, triton.cdiv(T * H, BLOCK))](
        tables, lens, lens if row_seq is None else row_seq, lens if from_end is None else from_end, out, T, H,
        *tables.stride()[:3], *lens.stride()[:2], BLOCK_SIZE=block_size, BLOCK=BLOCK, DECODE=row_seq is None)
    return out
