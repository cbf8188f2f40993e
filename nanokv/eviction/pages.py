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
All but choose_pages run on the layers a piece at a time, choose_pages on them all. The pages a
head keeps in the blocks its sequence gives back then move into the blocks it keeps (kernels.repage).

Pure tensor functions of sequences' pages: one sequence's, or several evicted together along
leading dimensions; the eviction surgery (nanokv/engine/evict.py) reads the pairs from the
cache and moves them.
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
