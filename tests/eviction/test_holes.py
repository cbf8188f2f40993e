"""Evicting by filling holes (nanokv/eviction/holes.py): the k lowest by a partial selection,
ties by position, and moves that write at most k slots and keep every survivor."""
import pytest
import torch

from nanokv.eviction.holes import hole_moves, lowest


def by_sorting(priority: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The oracle: a stable sort of the pairs in position order, the first k, ascending slots."""
    order = positions.argsort(dim=-1)
    ranked = order.gather(-1, priority.gather(-1, order).argsort(dim=-1, stable=True))
    return ranked[..., :k].sort(dim=-1).values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lowest_is_the_sorted_choice_with_ties_by_position(dtype):
    g = torch.Generator().manual_seed(0)
    for n, k in ((1, 1), (7, 3), (64, 16), (300, 64), (300, 299)):
        positions = torch.stack([torch.randperm(2 * n, generator=g)[:n] for _ in range(12)]).view(3, 4, n).int()
        ties = torch.randint(0, 4, (3, 4, n), generator=g).to(dtype)          # many equal priorities
        spread = torch.rand(3, 4, n, generator=g, dtype=dtype)
        for priority in (ties, spread, ties.masked_fill(ties == 3, float("inf"))):
            if k > int((priority != float("inf")).sum(-1).min()):
                continue
            assert torch.equal(lowest(priority, positions, k), by_sorting(priority, positions, k)), (n, k)
    assert lowest(spread, positions, 0).shape == (3, 4, 0)


def test_hole_moves_write_at_most_k_slots_and_keep_every_survivor():
    g = torch.Generator().manual_seed(1)
    for n, k in ((8, 1), (16, 4), (64, 16), (100, 80), (64, 64)):
        evicted = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(5)])
        src, dst, valid = hole_moves(evicted, n)
        for gone, s, d, v in zip(evicted.tolist(), src.tolist(), dst.tolist(), valid.tolist()):
            head = list(range(n))   # each slot holds its own pair
            moves = [(a, b) for a, b, ok in zip(s, d, v) if ok]
            for a, b in moves:
                head[b] = head[a]
            assert sorted(head[:n - k]) == sorted(set(range(n)) - set(gone))   # the first n - k hold the survivors
            assert len(moves) == sum(i < n - k for i in gone) <= k              # one write per hole
