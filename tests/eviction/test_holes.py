"""Evicting by filling holes: the k lowest by a partial selection or the Triton sort, ties by
position (kernels/eviction_order.py), and moves that write at most k slots and keep every
survivor (kernels/hole_filling.py)."""
import pytest
import torch

from helpers import KERNEL_DEVICE
from kernels.eviction_order import Protected, lowest_ref as lowest, lowest_triton
from kernels.hole_filling import hole_moves_ref


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


def test_lowest_on_the_triton_path_is_the_partial_selection():
    """kernels.lowest on the Triton path (the eviction order's first k, every slot held): the
    reference's slots, ties and +inf among them, with and without protected pairs (none evicted);
    heads of 7 and 40 slots in the
    interpreter (its sort takes seconds at hundreds), of 300 and 1,296 on a GPU."""
    g = torch.Generator().manual_seed(2)
    for n, k in ((300, 64), (1296, 1000)) if KERNEL_DEVICE == "cuda" else ((7, 3), (40, 39)):
        positions = torch.stack([torch.randperm(2 * n, generator=g)[:n] for _ in range(4)]).view(2, 2, n).int()
        ties = torch.randint(0, 4, (2, 2, n), generator=g).float()
        current = torch.tensor([2 * n, 2 * n + 1])   # positions < 2n: at most 4 protected a head
        for priority in (ties, torch.rand(2, 2, n, generator=g), ties.masked_fill(ties == 3, float("inf"))):
            got = lowest_triton(priority.to(KERNEL_DEVICE), positions.to(KERNEL_DEVICE), k).cpu()
            assert torch.equal(got, lowest(priority, positions, k)), (n, k)
        protected = Protected(2, 3, current)   # the first 2 positions and those after current - 3
        if k <= n - 4:
            got = lowest_triton(ties.to(KERNEL_DEVICE), positions.to(KERNEL_DEVICE), k,
                                protected._replace(current=current.to(KERNEL_DEVICE))).cpu()
            assert torch.equal(got, lowest(ties, positions, k, protected)), (n, k)
            evicted = positions.gather(-1, got)
            assert ((evicted >= 2) & (evicted <= current.view(2, 1, 1) - 3)).all()


def test_hole_moves_write_at_most_k_slots_and_keep_every_survivor():
    """kernels' hole-filling moves (kernels/hole_filling.py) for heads that each drop k given slots
    of the n they hold, five heads of a sequence end to end, the moves made at once."""
    g = torch.Generator().manual_seed(1)
    for n, k in ((8, 1), (16, 4), (64, 16), (100, 80), (64, 64)):
        evicted = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(5)])
        held, leaving = (torch.full((1, 1, 5), m, dtype=torch.int32) for m in (n, k))
        counts = torch.zeros(2, dtype=torch.int64)
        src, dst, new_lens = hole_moves_ref(evicted.view(1, 1, 5, k), held, leaving, n, 5 * k, counts)
        heads = list(range(5 * n))   # each slot holds its own pair
        read = [heads[a] for a in src[0].tolist()]
        for b, value in zip(dst[0].tolist(), read):
            heads[b] = value
        assert new_lens.flatten().tolist() == [n - k] * 5 and counts[0] == 5 * k
        for h, gone in enumerate(evicted.tolist()):
            survivors = sorted(v - h * n for v in heads[h * n:h * n + n - k])
            assert survivors == sorted(set(range(n)) - set(gone))   # the first n - k hold the survivors
            writes = sum(a != b and h * n <= b < (h + 1) * n for a, b in zip(src[0].tolist(), dst[0].tolist()))
            assert writes == sum(i < n - k for i in gone) <= k         # one write per hole
        assert counts[1] == sum(i < n - k for gone in evicted.tolist() for i in gone)
