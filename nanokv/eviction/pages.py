"""KV-Compress's block eviction (Sec. 4.2.2 of the paper): a sequence
gives up whole pages, chosen across all its heads and layers, so the pairs each
(layer, KV head) keeps follow its scores instead of one budget for all.

Pure tensor functions of one sequence's pages; the eviction surgery
(nanokv/engine/evict.py) reads the pairs from the cache and moves them.
"""
from __future__ import annotations

import torch


def plan_page_eviction(priority: torch.Tensor, lens: torch.Tensor, num_pages: int, block_size: int,
                       floor_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which pairs stay when num_pages pages go, over all heads at once.

    priority [L, H, n] per slot (the lowest go first; +inf never), of heads holding their
    first lens [L, H] slots, n a multiple of block_size and at least every head's pages.
    Evicting e pages from a head costs the largest priority among its e * bs lowest slots,
    the empty slots of its partly filled last page counting as the lowest. The num_pages
    cheapest page evictions over all heads are taken (a head's e-th before its e+1-th, as
    their costs never decrease); every head keeps at least floor_pages pages.

    Returns keep [L, H, n] (each head's surviving slots first, ascending, then the others),
    the new lens [L, H] and the pages each head gave up [L, H]. The three steps below can run
    on the layers a piece at a time (page_costs and kept_slots), choose_pages on them all.
    """
    evicted = choose_pages(page_costs(priority, lens, block_size, floor_pages), num_pages)
    keep, kept_lens = kept_slots(priority, lens, evicted, block_size)
    return keep, kept_lens, evicted


def _ordered(priority: torch.Tensor, lens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's slots in eviction order (empty slots first, other heads' never) and their priorities."""
    slot = torch.arange(priority.shape[-1], device=priority.device)
    held_pages = -(-lens // block_size)
    priority = (priority.masked_fill(slot >= lens[..., None], float("-inf"))          # empty: first
                .masked_fill(slot >= (held_pages * block_size)[..., None], float("inf")))   # not its page
    order = priority.argsort(dim=-1, stable=True)   # ties by slot, i.e. by position
    return order, priority.gather(-1, order)


def page_costs(priority: torch.Tensor, lens: torch.Tensor, block_size: int, floor_pages: int) -> torch.Tensor:
    """[L, H, n / bs]: what evicting each head's e-th page costs (+inf below its floor)."""
    costs = _ordered(priority, lens, block_size)[1][..., block_size - 1::block_size]
    count = torch.arange(1, costs.shape[-1] + 1, device=priority.device)
    held_pages = -(-lens // block_size)
    return costs.masked_fill(count > (held_pages - floor_pages)[..., None], float("inf"))


def choose_pages(costs: torch.Tensor, num_pages: int) -> torch.Tensor:
    """[L, H] pages each head gives up: the num_pages cheapest of costs [L, H, m]."""
    L, H, m = costs.shape
    chosen = costs.flatten().argsort(stable=True)[:num_pages]
    if num_pages and costs.flatten()[chosen[-1]] == float("inf"):
        raise RuntimeError(f"cannot evict {num_pages} pages: the rest are protected or below the floor")
    return torch.bincount(chosen // m, minlength=L * H).view(L, H)


def kept_slots(priority: torch.Tensor, lens: torch.Tensor, evicted: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [L, H, n] (each head's surviving slots first, ascending) and the new lens [L, H]
    when head (l, h) gives up its evicted[l, h] cheapest pages."""
    n = priority.shape[-1]
    slot = torch.arange(n, device=priority.device)
    order = _ordered(priority, lens, block_size)[0]
    rank = torch.empty_like(order).scatter_(-1, order, slot.expand_as(order))
    kept = (rank >= (evicted * block_size)[..., None]) & (slot < lens[..., None])
    return torch.where(kept, slot, n + slot).argsort(dim=-1), kept.sum(dim=-1)


def repage(tables: torch.Tensor, kept: torch.Tensor, staying: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head (l, h) now uses only the first kept[l, h] pages of its table [L, H, W]. Its
    pages in blocks the sequence gives back move to unused pages among `staying` (the pages
    of the blocks it keeps); then every head gets an equal share of the still unused ones,
    in order, for the tokens it reads until the next eviction.

    Returns the new tables [L, H, W'] and the moves: page src[i]'s content goes to dst[i].
    """
    L, H, W = tables.shape
    in_use = torch.arange(W, device=tables.device) < kept[..., None]
    used = tables[in_use]                                   # (l, h, column) order
    leaving = ~torch.isin(used, staying)
    unused = staying[~torch.isin(staying, used)]
    src, dst = used[leaving], unused[:int(leaving.sum())]
    used[leaving] = dst
    tables = tables.clone()
    tables[in_use] = used
    spare = unused[len(dst):]
    share = len(spare) // (L * H)
    width = int(kept.max()) + share
    column = torch.arange(width, device=tables.device)
    old = tables.gather(-1, column.clamp(max=W - 1).expand(L, H, width))
    extra = column - kept[..., None]                     # index of the spare page a column takes
    head = torch.arange(L * H, device=tables.device).view(L, H, 1)
    new = spare[(extra.clamp(0, max(share - 1, 0)) * L * H + head)] if share else torch.zeros_like(old)
    return torch.where(extra < 0, old, torch.where(extra < share, new, 0)).to(tables.dtype), src, dst
