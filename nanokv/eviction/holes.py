"""Evicting by filling holes: which slots of a head go, and which survivors move.

A head that holds n pairs and drops k of them keeps its first n - k slots: the pairs it
keeps there stay where they are, and the survivors in its last k slots move into the
slots of the evicted pairs below them (the holes). An eviction thus writes at most k
pairs per head, whatever it holds, and slot order stops being position order: whatever
needs the order of positions reads the positions stored per slot.

Pure tensor functions over [..., n] (any leading dimensions: sequences, layers, heads),
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


def hole_moves(evicted: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, valid), each [..., k]: for heads of n slots each evicting the ascending slots
    evicted [..., k], the survivor in slot src[j] moves to the hole dst[j] wherever valid[j]:
    the survivors among the last k slots, into the evicted slots below n - k, in order.
    Elsewhere src[j] = dst[j], an evicted slot no valid move reads or writes: the moves can
    all be made, with no mask (no data-dependent shape: no host sync)."""
    k = evicted.shape[-1]
    kept = n - k
    tail = torch.arange(kept, n, device=evicted.device)
    leaving = torch.zeros(*evicted.shape[:-1], n, dtype=torch.bool, device=evicted.device)
    leaving.scatter_(-1, evicted, True)
    survivors = torch.where(leaving[..., kept:], n + tail, tail).sort(dim=-1).values   # the tail's survivors first
    valid = torch.arange(k, device=evicted.device) < (evicted < kept).sum(-1, keepdim=True)
    return torch.where(valid, survivors, evicted), evicted, valid   # not valid: a slot onto itself
