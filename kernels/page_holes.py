"""KV-Compress's holes: once each head knows how many pages it gives up, which of its
survivors move into the slots its evicted pairs leave (nanokv/eviction/pages.py says how
the pages are chosen; nanokv/eviction/holes.py is the same filling for methods whose heads
drop alike).

A head that gives up e pages drops the held pairs among the first e * bs of its slots in
eviction order; it keeps its first new-length slots, where the pairs it keeps stay, and the
survivors above its new length move into the holes below it, the j-th survivor into the j-th
hole. A sequence's moves are packed together, head after head, so that what it moves is
bounded by what it evicts, not by what its heads hold.

The torch reference is some thirty ops, each a launch on a GPU whatever the batch. The Triton
kernels do it in two launches, a program per (sequence, head) each: the first ranks the head's
slots and counts what it drops and moves, the second packs its moves after those of the heads
before it (which it reads from the first's counts).
"""
import torch
import triton
import triton.language as tl

from kernels.repaging import exclusive_count

BLOCK = 1024   # the slots (or heads) a program takes at a time


def page_hole_moves_ref(order: torch.Tensor, lens: torch.Tensor, evicted: torch.Tensor, block_size: int,
                        max_moves: int, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For S sequences whose head (s, l, h) holds lens[s, l, h] pairs (int32) in its first slots,
    its n slots in eviction order order [S, L, H, n] (int64, a permutation of them), and gives up
    its evicted[s, l, h] cheapest pages: the moves that fill its holes and the new lens [S, L, H].

    The moves src, dst [S, max_moves] (int64): slot src's pair goes to slot dst, a slot of head
    (l, h) numbered (l * H + h) * n + its slot (as in its tables [S, L, H, n / bs] flattened to
    [S, L * H * n / bs]); the rest of a row moves head (0, 0)'s last held slot onto itself (no
    move writes there: a head with a hole holds pairs past its new length). max_moves must be at
    least each sequence's moves. counts [2] (int64) += the pairs dropped and those moved."""
    S, L, H, n = order.shape
    slot = torch.arange(n, device=order.device)
    rank = torch.empty_like(order).scatter_(-1, order, slot.expand_as(order))
    held = slot < lens[..., None]
    leaving = (rank < (evicted * block_size)[..., None]) & held
    new_lens = lens - leaving.sum(dim=-1, dtype=lens.dtype)
    below = slot < new_lens[..., None]
    last = n + slot   # where a slot that is no hole (no mover) sorts: after them all
    holes = torch.where(leaving & below, slot, last).sort(dim=-1).values
    movers = torch.where(held & ~(leaving | below), slot, last).sort(dim=-1).values
    valid = (holes < n).flatten(1)
    at = torch.where(valid, valid.cumsum(-1), 0)   # valid: columns 1, 2, ...; the rest: column 0, dropped
    first = torch.arange(0, L * H * n, n, device=order.device).view(1, L, H, 1)   # each head's slot 0
    idle = (lens[:, 0, 0].long() - 1).clamp(min=0)[:, None].expand(S, max_moves + 1)
    src, dst = (idle.scatter(-1, at, (moves + first).flatten(1))[:, 1:] for moves in (movers, holes))
    counts += torch.stack([(lens - new_lens).sum(), valid.sum()])
    return src, dst, new_lens


@triton.jit
def _slots(rank, lens, evicted, row, i, n, BS: tl.constexpr, BLOCK: tl.constexpr):
    """Slots i .. i + BLOCK of head row: the slots, which are in range, and which are held and leave."""
    slot = i + tl.arange(0, BLOCK)
    in_range = slot < n
    length = tl.load(lens + row)
    leaving = (tl.load(rank + row * n + slot, mask=in_range, other=n) < tl.load(evicted + row) * BS) & (slot < length)
    return slot, in_range, leaving


@triton.jit
def _hole_count_kernel(order, lens, evicted, rank, new_lens, num_moves, counts, LH, n,
                  BS: tl.constexpr, BLOCK: tl.constexpr):
    """Head (s, head)'s rank of each slot in its eviction order (rank [S, LH, n]: scratch), its
    new length and its number of moves (new_lens, num_moves [S, LH]), and counts += them."""
    row = tl.program_id(0).to(tl.int64) * LH + tl.program_id(1)
    at = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        slot = tl.load(order + row * n + i + at, mask=i + at < n, other=0)
        tl.store(rank + row * n + slot, i + at, mask=i + at < n)
    tl.debug_barrier()   # every rank stored: the program's threads read each other's
    num_leaving = 0
    for i in range(0, n, BLOCK):
        num_leaving += tl.sum(_slots(rank, lens, evicted, row, i, n, BS, BLOCK)[2].to(tl.int32), axis=0)
    new_len = tl.load(lens + row) - num_leaving
    moves = 0   # the holes: the leaving slots below the new length
    for i in range(0, n, BLOCK):
        slot, _, leaving = _slots(rank, lens, evicted, row, i, n, BS, BLOCK)
        moves += tl.sum((leaving & (slot < new_len)).to(tl.int32), axis=0)
    tl.store(new_lens + row, new_len)
    tl.store(num_moves + row, moves)
    tl.atomic_add(counts, num_leaving.to(tl.int64))
    tl.atomic_add(counts + 1, moves.to(tl.int64))


@triton.jit
def _hole_pack_kernel(rank, lens, evicted, new_lens, num_moves, src, dst, LH, n, max_moves,
                 BS: tl.constexpr, BLOCK: tl.constexpr):
    """Head (s, head)'s moves, after those of the sequence's heads before it; the last head's
    program fills the rest of the row with the idle move."""
    s, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row = s * LH + head
    at = tl.arange(0, BLOCK)
    offset = 0
    for h in range(0, LH, BLOCK):
        offset += tl.sum(tl.load(num_moves + s * LH + h + at, mask=h + at < head, other=0), axis=0)
    src, dst = src + s * max_moves + offset, dst + s * max_moves + offset
    new_len, length = tl.load(new_lens + row), tl.load(lens + row)
    holes, movers = 0, 0
    for i in range(0, n, BLOCK):
        slot, in_range, leaving = _slots(rank, lens, evicted, row, i, n, BS, BLOCK)
        hole = leaving & (slot < new_len)
        mover = in_range & ~leaving & (slot >= new_len) & (slot < length)
        tl.store(dst + exclusive_count(hole, holes), head * n + slot, mask=hole)
        tl.store(src + exclusive_count(mover, movers), head * n + slot, mask=mover)
        holes += tl.sum(hole.to(tl.int32), axis=0)
        movers += tl.sum(mover.to(tl.int32), axis=0)
    if head == LH - 1:
        idle = tl.maximum(tl.load(lens + s * LH) - 1, 0).to(tl.int64)
        for j in range(0, max_moves, BLOCK):
            rest = (offset + holes + j + at < max_moves)
            tl.store(src + holes + j + at, tl.full([BLOCK], 0, tl.int64) + idle, mask=rest)
            tl.store(dst + holes + j + at, tl.full([BLOCK], 0, tl.int64) + idle, mask=rest)


def page_hole_moves_triton(order: torch.Tensor, lens: torch.Tensor, evicted: torch.Tensor, block_size: int,
                           max_moves: int, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """page_hole_moves_ref in two launches."""
    S, L, H, n = order.shape
    order, lens, evicted = order.contiguous(), lens.contiguous(), evicted.contiguous()
    rank = torch.empty(order.shape, dtype=torch.int32, device=order.device)
    new_lens, num_moves = torch.empty_like(lens), torch.empty(S, L, H, dtype=torch.int32, device=order.device)
    src, dst = (torch.empty(S, max_moves, dtype=torch.int64, device=order.device) for _ in range(2))
    _hole_count_kernel[(S, L * H)](order, lens, evicted, rank, new_lens, num_moves, counts, L * H, n,
                              BS=block_size, BLOCK=BLOCK)
    _hole_pack_kernel[(S, L * H)](rank, lens, evicted, new_lens, num_moves, src, dst, L * H, n, max_moves,
                             BS=block_size, BLOCK=BLOCK)
    return src, dst, new_lens
