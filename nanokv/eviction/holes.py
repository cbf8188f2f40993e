"""Evicting by filling holes: which slots of a head go when every head drops as many.

A head that holds n pairs and drops k of them keeps its first n - k slots, the survivors
in its last k moving into the slots of the evicted pairs below them (kernels.hole_moves):
an eviction writes at most k pairs per head, and slot order is not position order.

A pure tensor function over [..., n] (any leading dimensions: sequences, layers, heads),
of priorities already computed (KVMethod.keep_priority); nanokv/engine/evict.py reads the
pairs and moves them.
"""
from __future__ import annotations

import torch


def lowest(priority: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """[..., k]: the slots of each head's k lowest priorities, ties going to the lower position,
    in ascending slot order. A partial selection (the k-th value, then the ties), no full sort."""
    n = priority.shape[-1]
    slot = torch.arange(n, device=priority.device)
    if k == 0:
        return slot[:0].expand(*priority.shape[:-1], 0)
    threshold = priority.kthvalue(k, dim=-1, keepdim=True).values
    below = priority < threshold
    ties = priority == threshold
    wanted = k - below.sum(-1, keepdim=True)   # ties to take, by position: 1..k
    tie_positions = positions.long().masked_fill(~ties, torch.iinfo(torch.int64).max)
    last = tie_positions.topk(k, dim=-1, largest=False).values.gather(-1, wanted - 1)
    evicted = below | (ties & (tie_positions <= last))
    return torch.where(evicted, slot, n + slot).topk(k, dim=-1, largest=False).values   # sorted: ascending
