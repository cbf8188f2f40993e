"""KV-Compress's page choice: which pages each of a sequence's heads gives up, the cheapest of
all its heads' (kernels/eviction_order.py prices them, nanokv/eviction/pages.py says why).

The torch reference sorts each sequence's costs whole, some ten ops, each a launch on a GPU. The
Triton kernel takes a program a sequence, in one launch: it finds the k-th cheapest cost by a
binary search over the costs' bits (float order as integer order), then gives each head its pages
below that cost and, of the pages that cost as much, the first ones in (layer, head, page) order
up to k: what a stable sort takes.
"""
import torch
import triton
import triton.language as tl

from kernels.eviction_order import float_key

ELEMENTS = 2048   # the costs a program counts at a time: as many heads as hold that many pages


def choose_pages_ref(costs: torch.Tensor, pages: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[S, L, H] pages each head gives up (int64): the cheapest of each sequence's costs
    [S, L, H, m] (its e-th page's, never less than its e-1-th's) until its heads, holding pages
    [S, L, H], hold target [S] pages in all; ties go to the lower (layer, head, page). Every page
    chosen has a finite cost: the settings keep a head's floor within what an eviction leaves it
    on average (settings._check_uneven)."""
    S, L, H, m = costs.shape
    flat = costs.flatten(1)
    order = flat.argsort(dim=-1, stable=True)
    rank = torch.arange(flat.shape[-1], device=costs.device)
    chosen = rank < (pages.flatten(1).sum(1) - target).clamp(min=0)[:, None]
    evicted = torch.zeros_like(order).scatter_add_(-1, order // m, chosen.long())
    return evicted[:, :L * H].view(S, L, H)


@triton.jit
def _key(costs_ptr, heads, column, valid, m):
    """The costs at heads x column as int32 in float order (-0.0 as 0.0); past the costs, the largest."""
    cost = tl.load(costs_ptr + heads[:, None] * m + column[None, :], mask=valid, other=0.0)
    return tl.where(valid, float_key(cost), 0x7FFFFFFF)


@triton.jit
def _choose_pages_kernel(costs, pages, target, evicted, LH, m, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """Sequence s's heads' pages given up, evicted [LH] (int64), of costs [LH, m] and pages [LH]."""
    s = tl.program_id(0).to(tl.int64)
    costs, pages, evicted = costs + s * LH * m, pages + s * LH, evicted + s * LH
    rows, column = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_M)
    held = tl.full([], 0, tl.int64)
    for h in range(0, LH, BLOCK_H):
        held += tl.sum(tl.load(pages + h + rows, mask=h + rows < LH, other=0).to(tl.int64), axis=0)
    k = tl.maximum(held - tl.load(target + s), 0)
    # The smallest key with at least k keys at or below it: the k-th cheapest (k 0: the least key).
    lo, hi = tl.full([], -2**31, tl.int64), tl.full([], 2**31 - 1, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        count = tl.full([], 0, tl.int64)
        for h in range(0, LH, BLOCK_H):
            heads = h + rows
            valid = (heads < LH)[:, None] & (column < m)[None, :]
            count += tl.sum(tl.sum(((_key(costs, heads, column, valid, m) <= mid) & valid).to(tl.int64), 1), 0)
        hi = tl.where(count >= k, mid, hi)
        lo = tl.where(count >= k, lo, mid + 1)
    below = tl.full([], 0, tl.int64)   # first pass: the keys below the k-th, so how many of its ties are taken
    for h in range(0, LH, BLOCK_H):
        heads = h + rows
        valid = (heads < LH)[:, None] & (column < m)[None, :]
        below += tl.sum(tl.sum(((_key(costs, heads, column, valid, m) < lo) & valid).to(tl.int64), 1), 0)
    ties_left = k - below
    for h in range(0, LH, BLOCK_H):   # then each head's: its keys below, and its ties in turn
        heads = h + rows
        valid = (heads < LH)[:, None] & (column < m)[None, :]
        key = _key(costs, heads, column, valid, m)
        ties = tl.sum(((key == lo) & valid).to(tl.int64), 1)
        before = tl.cumsum(ties, 0) - ties
        taken = tl.minimum(tl.maximum(ties_left - before, 0), ties)
        tl.store(evicted + heads, tl.sum(((key < lo) & valid).to(tl.int64), 1) + taken, mask=heads < LH)
        ties_left -= tl.sum(taken, 0)


def choose_pages_triton(costs: torch.Tensor, pages: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """choose_pages_ref in one launch, for fp32 costs of heads of at most ELEMENTS pages."""
    S, L, H, m = costs.shape
    if costs.dtype != torch.float32 or m > ELEMENTS:
        return choose_pages_ref(costs, pages, target)
    evicted = torch.empty(S, L, H, dtype=torch.int64, device=costs.device)
    block_m = triton.next_power_of_2(m)
    _choose_pages_kernel[(S,)](costs.contiguous(), pages.contiguous(), target.contiguous(), evicted, L * H, m,
                               BLOCK_H=max(1, ELEMENTS // block_m), BLOCK_M=block_m, num_warps=8)
    return evicted
