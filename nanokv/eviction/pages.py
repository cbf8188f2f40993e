"""KV-Compress's block eviction (Sec. 4.2.2 of the paper): a sequence
gives up whole pages, chosen across all its heads and layers, so the pairs each
(layer, KV head) keeps follow its scores instead of one budget for all.

Each head's slots are put in eviction order once, lowest priority first, and evicting e
pages from a head costs the largest priority among its e * bs lowest slots (the empty slots
of its partly filled last page counting as the lowest; +inf never goes): kernels.eviction_order.
The num_pages cheapest page evictions over all heads are taken, a head's e-th before its
e+1-th as their costs never decrease, every head keeping at least floor_pages pages:
kernels.choose_pages. Each head then keeps its other slots, the survivors above its new length
moving into the holes below it, a sequence's moves packed together (kernels.hole_moves).
All but the choice run on the layers a piece at a time, the choice on them all. The
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

