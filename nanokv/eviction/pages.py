"""KV-Compress's block eviction (Sec. 4.2.2 of the paper): a sequence
gives up whole pages, chosen across all its heads and layers, so the pairs each
(layer, KV head) keeps follow its scores instead of one budget for all.

Each head's slots are put in eviction order once, lowest priority first, and evicting e
pages from a head costs the largest priority among its e * bs lowest slots (the empty slots
of its partly filled last page counting as the lowest; +inf never goes): kernels.eviction_order.
The num_pages cheapest page evictions over all heads are taken, a head's e-th before its
e+1-th as their costs never decrease, every head keeping at least floor_pages pages:
choose_pages. Each head then keeps its other slots, the survivors above its new length
moving into the holes below it, a sequence's moves packed together (kernels.hole_moves).
All but choose_pages run on the layers a piece at a time, choose_pages on them all. The
pages a head keeps in the blocks its sequence gives back then move into the blocks it keeps
(kernels.repage).

Pure tensor functions of sequences' pages: one sequence's, or several evicted together along
leading dimensions; the eviction surgery (nanokv/engine/evict.py) reads the pairs from the
cache and moves them.
"""
from __future__ import annotations

import torch


def held_pages(lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pages that hold lens pairs."""
    return (lens + (block_size - 1)) // block_size


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
