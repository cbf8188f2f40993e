"""KV-Compress's block eviction (Sec. 4.2.2 of the paper): a sequence
gives up whole pages, chosen across all its heads and layers, so the pairs each
(layer, KV head) keeps follow its scores instead of one budget for all.

Each head's slots are put in eviction order once (eviction_order). Evicting e pages from a
head costs the largest priority among its e * bs lowest slots (the empty slots of its partly
filled last page counting as the lowest; +inf never goes): page_costs. The num_pages cheapest
page evictions over all heads are taken, a head's e-th before its e+1-th as their costs never
decrease, every head keeping at least floor_pages pages: choose_pages. Each head then keeps its
other slots, the survivors above its new length moving into the holes below it: kept_slots; a
sequence's moves are packed together, as many as its blocks hold beyond its kept pairs: packed_moves.
All but choose_pages run on the layers a piece at a time, choose_pages on them all.

Pure tensor functions of sequences' pages: one sequence's, or (but repage) several
evicted together along leading dimensions; the eviction surgery (nanokv/engine/evict.py)
reads the pairs from the cache and moves them.
"""
from __future__ import annotations

import torch


def held_pages(lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pages that hold lens pairs."""
    return (lens + (block_size - 1)) // block_size


def eviction_order(priority: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's slots in eviction order (empty slots first, other heads' never; ties by
    position) and their priorities in that order."""
    slot = torch.arange(priority.shape[-1], device=priority.device)
    empty = slot >= lens[..., None]
    beyond = slot >= (held_pages(lens, block_size) * block_size)[..., None]   # in pages it does not hold
    priority = priority.masked_fill(empty, float("-inf")).masked_fill(beyond, float("inf"))
    by_position = positions.masked_fill(empty, -1).argsort(dim=-1, stable=True)
    order = by_position.gather(-1, priority.gather(-1, by_position).argsort(dim=-1, stable=True))
    return order, priority.gather(-1, order)


def page_costs(ordered: torch.Tensor, lens: torch.Tensor, block_size: int, floor_pages: int) -> torch.Tensor:
    """[..., L, H, n / bs]: what evicting each head's e-th page costs (+inf below its floor),
    from its priorities in eviction order."""
    costs = ordered[..., block_size - 1::block_size]
    count = torch.arange(1, costs.shape[-1] + 1, device=ordered.device)
    return costs.masked_fill(count > (held_pages(lens, block_size) - floor_pages)[..., None], float("inf"))


def choose_pages(costs: torch.Tensor, num_pages: torch.Tensor | int) -> torch.Tensor:
    """[..., L, H] pages each head gives up: the num_pages [...] cheapest of each sequence's
    costs [..., L, H, m] (the leading dimensions: sequences evicted together). Every page
    chosen has a finite cost: the settings keep a head's floor within what an eviction
    leaves it on average (settings._check_uneven)."""
    *lead, L, H, m = costs.shape
    flat = costs.flatten(-3)
    order = flat.argsort(dim=-1, stable=True)
    rank = torch.arange(flat.shape[-1], device=costs.device)
    chosen = rank < torch.as_tensor(num_pages, device=costs.device)[..., None]
    evicted = torch.zeros_like(order).scatter_add_(-1, order // m, chosen.long())
    return evicted[..., :L * H].view(*lead, L, H)


def kept_slots(order: torch.Tensor, lens: torch.Tensor, evicted: torch.Tensor,
               block_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """When head (l, h) gives up its evicted[..., l, h] cheapest pages (order: its slots in
    eviction order): the moves that fill the holes its evicted pairs leave below its new length
    with its survivors above it ((src, dst, valid), each [..., L, H, n]: nanokv/eviction/holes.py,
    here with a count per head; where not valid, a slot onto itself) and the new lens [..., L, H]."""
    n = order.shape[-1]
    slot = torch.arange(n, device=order.device)
    rank = torch.empty_like(order).scatter_(-1, order, slot.expand_as(order))
    held = slot < lens[..., None]
    leaving = (rank < (evicted * block_size)[..., None]) & held
    new_lens = lens - leaving.sum(dim=-1)
    below = slot < new_lens[..., None]
    last = n + slot   # where a slot that is no hole (no mover) sorts: after them all
    holes = torch.where(leaving & below, slot, last).sort(dim=-1).values
    movers = torch.where(held & ~(leaving | below), slot, last).sort(dim=-1).values
    valid = holes < n
    # The rest move the head's last held slot onto itself: no valid move writes there (a head
    # with a hole holds pairs past its new length), so every move can be made, with no mask.
    idle = (lens - 1).clamp(min=0)[..., None].expand_as(holes)
    return (torch.where(valid, movers, idle), torch.where(valid, holes, idle), valid), new_lens


def packed_moves(src: torch.Tensor, dst: torch.Tensor, valid: torch.Tensor,
                 max_moves: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kept_slots' moves of sequences' heads [S, L, H, n], the valid ones of each sequence packed
    first into [S, max_moves], each a slot of its heads laid end to end (head (l, h)'s slot i at
    (l * H + h) * n + i, as in its tables [S, L, H, n / bs] flattened to [S, L * H * n / bs]), so
    that what a sequence moves is bounded by what it evicts, not by what its heads hold. The rest
    of a row repeats head (0, 0)'s last move, a slot onto itself (a head never has as many valid
    moves as slots). max_moves must be at least each sequence's valid moves."""
    S, L, H, n = src.shape
    first = torch.arange(0, L * H * n, n, device=src.device).view(1, L, H, 1)   # each head's slot 0
    src, dst, valid = (src + first).flatten(1), (dst + first).flatten(1), valid.flatten(1)
    at = torch.where(valid, valid.cumsum(-1), 0)   # valid: columns 1, 2, ...; the rest: column 0, dropped
    return tuple(moves[:, n - 1:n].expand(S, max_moves + 1).scatter(-1, at, moves)[:, 1:] for moves in (src, dst))


def repage(tables: torch.Tensor, kept: torch.Tensor, staying: torch.Tensor, max_moves: int, num_pages: int,
           share_cap: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For S sequences evicted together, whose pages are all distinct: head (s, l, h) now uses
    only the first kept[s, l, h] pages of its table [S, L, H, W] (head (s, 0, 0) at least one:
    every head keeps floor_pages). Its pages in blocks sequence s gives back move to unused pages
    among staying[s] (the pages of the blocks it keeps, -1 where a sequence keeps fewer than
    another), the r-th of a sequence's leaving pages in (l, h, column) order to its r-th unused
    one; then every head gets an equal share of its sequence's unused ones after those, in order,
    at most share_cap[s], for the tokens it reads until the next eviction. Every shape is known
    without reading the device's values (width bounds every head's kept pages and share); the
    pages a sequence uses and keeps are told apart by marks over all num_pages pages (torch.isin
    would wait for the device).

    Returns the new tables [S, L, H, width] (columns past a head's pages: page 0), the moves
    [S, max_moves] (page src's content goes to dst) and each sequence's widest head's pages
    [S]. max_moves bounds a sequence's leaving pages; the moves past a sequence's own copy head
    (s, 0, 0)'s first page onto itself (a page in use: moves write only unused ones).
    """
    S, L, H, W = tables.shape
    device = tables.device

    def marks(pages: torch.Tensor) -> torch.Tensor:   # [num_pages + 1]: True at pages and at num_pages (none)
        marked = torch.zeros(num_pages + 1, dtype=torch.bool, device=device).index_fill_(0, pages.flatten(), True)
        marked[num_pages:].fill_(True)   # fill_ takes the scalar as an argument; an assignment copies it from the host
        return marked
    in_use = torch.arange(W, device=device) < kept[..., None]
    used = torch.where(in_use, tables, num_pages).flatten(1).long()   # [S, N]
    stay = torch.where(staying >= 0, staying, num_pages).long()      # pages are distinct: any sequence's stay will do
    leaving = ~marks(stay)[used]      # used pages outside the blocks kept (a column not in use: num_pages)
    unused = ~marks(used)[stay]       # [S, P]: pages of the blocks kept that no head uses (padding: num_pages)
    num_leaving = leaving.sum(-1)                                    # [S]
    rank = leaving.cumsum(-1) - 1                                    # among a sequence's leaving pages
    unused_first = staying.gather(-1, (~unused).int().argsort(dim=-1, stable=True))
    moved_to = unused_first.gather(-1, rank.clamp(min=0))
    moves = max(max_moves, 1)
    at = torch.where(leaving, rank, moves)                           # the rest to a column dropped below
    idle = used[:, :1].expand(S, moves + 1)
    src, dst = (idle.scatter(-1, at, pages)[:, :moves] for pages in (used, moved_to.long()))
    tables = torch.where(leaving, moved_to, used).view(S, L, H, W).where(in_use, tables).to(tables.dtype)
    share = torch.minimum((unused.sum(-1) - num_leaving) // (L * H), share_cap)[:, None, None, None]
    column = torch.arange(width, device=device)
    old = tables.gather(-1, column.clamp(max=W - 1).expand(S, L, H, width))
    extra = column - kept[..., None]                                 # index of the spare page a column takes
    head = torch.arange(L * H, device=device).view(1, L, H, 1)
    spare = (num_leaving[:, None, None, None] + extra.clamp(min=0) * L * H + head).clamp(max=staying.shape[-1] - 1)
    new = unused_first.gather(-1, spare.flatten(1)).view(S, L, H, width)
    widths = kept.flatten(1).amax(1) + share[:, 0, 0, 0]
    return torch.where(extra < 0, old, torch.where(extra < share, new, 0)), src, dst, widths
