"""Evicting by filling holes: once each head knows which of its pairs leave, which of its
survivors move into the slots they leave (kernels/eviction_order.py picks a uniform method's
pairs, nanokv/eviction/pages.py KV-Compress's pages).

A head holding n pairs that drops k of them keeps its first n - k slots: the pairs it keeps
there stay where they are, and the survivors in its last k slots move into the slots of the
evicted pairs below them (the holes), the j-th survivor into the j-th hole. An eviction thus
writes at most k pairs per head, whatever it holds, and slot order stops being position order:
whatever needs the order of positions reads the positions stored per slot. A sequence's moves
are packed together, head after head, so that what it moves is bounded by what it evicts, not
by what its heads hold (KV-Compress's heads each drop their own number).

The torch reference is some twenty ops, each a launch on a GPU whatever the batch. The Triton
kernels do it in two launches, a program per (sequence, head) each: the first marks the head's
leaving slots and counts what it drops and moves, the second packs its moves after those of the
heads before it (which it reads from the first's counts).
"""
import torch
import triton
import triton.language as tl

from kernels.repaging import exclusive_count

BLOCK = 1024   # the slots (or heads) a program takes at a time


def hole_moves_ref(order: torch.Tensor, lens: torch.Tensor, num_leaving: torch.Tensor, num_slots: int,
                   max_moves: int, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For S sequences whose head (s, l, h) has num_slots slots and holds lens[s, l, h] pairs
    (int32) in its first ones, and drops the pairs among the first num_leaving[s, l, h] slots of
    order [S, L, H, m] (int64: its slots, those that leave first; distinct): the moves that fill
    its holes and the new lens [S, L, H].

    The moves src, dst [S, max_moves] (int64): slot src's pair goes to slot dst, a slot of head
    (l, h) numbered (l * H + h) * num_slots + its slot (as in its tables [S, L, H, num_slots / bs]
    flattened to [S, L * H * num_slots / bs]); the rest of a row moves head (0, 0)'s last held slot
    onto itself (no move writes there: a head with a hole holds pairs past its new length).
    max_moves must be at least each sequence's moves. counts [2] (int64) += the pairs dropped and
    those moved."""
    S, L, H, m = order.shape
    n, column = num_slots, torch.arange(m, device=order.device)
    gone = (column < num_leaving[..., None]) & (order < lens[..., None])   # held, and leaving
    new_lens = lens - gone.sum(dim=-1, dtype=lens.dtype)
    holes = (gone & (order < new_lens[..., None])).flatten(1)
    # The survivors above the new length: at most m of them, among the last m slots held.
    leaving = torch.zeros(S, L, H, n, dtype=torch.bool, device=order.device).scatter_(-1, order, gone)
    tail = lens[..., None] - m + column
    above = tail >= new_lens[..., None]
    movers = (above & ~leaving.gather(-1, tail.clamp_(min=0))).flatten(1)   # in place: less to allocate
    # A sequence's j-th hole, in order, gets its j-th mover (each head has as many of both); the
    # rest of the row is head (0, 0)'s idle move, and column 0 takes what is neither, dropped.
    head_first = torch.arange(0, L * H * n, n, device=order.device).view(1, L, H, 1)   # each head's slot 0
    idle = (lens[:, 0, 0].long() - 1).clamp(min=0)[:, None].expand(S, max_moves + 1)
    src, dst = (idle.scatter(-1, taken.cumsum(-1).mul_(taken), slots.flatten(1))[:, 1:]
                for taken, slots in ((movers, tail.add_(head_first)), (holes, order + head_first)))
    counts += torch.stack([(lens - new_lens).sum(), holes.sum()])
    return src, dst, new_lens


@triton.jit
def _slots(marks, lens, row, i, n, BLOCK: tl.constexpr):
    """Slots i .. i + BLOCK of head row: the slots, which are in range, and which are held and leave."""
    slot = i + tl.arange(0, BLOCK)
    in_range = slot < n
    leaving = (tl.load(marks + row * n + slot, mask=in_range, other=0) != 0) & (slot < tl.load(lens + row))
    return slot, in_range, leaving


@triton.jit
def _hole_count_kernel(order, lens, num_leaving, marks, new_lens, num_moves, counts, LH, n, m,
                       BLOCK: tl.constexpr):
    """Head (s, head)'s leaving slots marked (marks [S, LH, n]: scratch), its new length and its
    number of moves (new_lens, num_moves [S, LH]), and counts += them."""
    row = tl.program_id(0).to(tl.int64) * LH + tl.program_id(1)
    at = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        tl.store(marks + row * n + i + at, tl.full([BLOCK], 0, tl.int8), mask=i + at < n)
    tl.debug_barrier()   # every mark cleared before any is set: the program's threads share them
    first = tl.minimum(tl.load(num_leaving + row), m)
    for i in range(0, m, BLOCK):
        slot = tl.load(order + row * m + i + at, mask=i + at < first, other=0)
        tl.store(marks + row * n + slot, tl.full([BLOCK], 1, tl.int8), mask=i + at < first)
    tl.debug_barrier()
    dropped = 0
    for i in range(0, n, BLOCK):
        dropped += tl.sum(_slots(marks, lens, row, i, n, BLOCK)[2].to(tl.int32), axis=0)
    new_len = tl.load(lens + row) - dropped
    moves = 0   # the holes: the leaving slots below the new length
    for i in range(0, n, BLOCK):
        slot, _, leaving = _slots(marks, lens, row, i, n, BLOCK)
        moves += tl.sum((leaving & (slot < new_len)).to(tl.int32), axis=0)
    tl.store(new_lens + row, new_len)
    tl.store(num_moves + row, moves)
    tl.atomic_add(counts, dropped.to(tl.int64))
    tl.atomic_add(counts + 1, moves.to(tl.int64))


@triton.jit
def _hole_pack_kernel(order, num_leaving, marks, lens, new_lens, num_moves, src, dst, LH, n, m, max_moves,
                      BLOCK: tl.constexpr):
    """Head (s, head)'s moves, after those of the sequence's heads before it: its holes in order,
    its movers in slot order; the last head's program fills the rest of the row with the idle move."""
    s, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row = s * LH + head
    at = tl.arange(0, BLOCK)
    offset = 0
    for h in range(0, LH, BLOCK):
        offset += tl.sum(tl.load(num_moves + s * LH + h + at, mask=h + at < head, other=0), axis=0)
    src, dst = src + s * max_moves + offset, dst + s * max_moves + offset
    new_len, length = tl.load(new_lens + row), tl.load(lens + row)
    first = tl.minimum(tl.load(num_leaving + row), m)
    holes = 0   # in order
    for i in range(0, m, BLOCK):
        slot = tl.load(order + row * m + i + at, mask=i + at < first, other=n)
        hole = (i + at < first) & (slot < new_len)   # below the new length: held
        place = exclusive_count(hole, holes)   # stores stay in the row, even past a bound too small
        tl.store(dst + place, head * n + slot, mask=hole & (offset + place < max_moves))
        holes += tl.sum(hole.to(tl.int32), axis=0)
    movers = 0   # in slot order
    for i in range(0, n, BLOCK):
        slot, in_range, leaving = _slots(marks, lens, row, i, n, BLOCK)
        mover = in_range & ~leaving & (slot >= new_len) & (slot < length)
        place = exclusive_count(mover, movers)
        tl.store(src + place, head * n + slot, mask=mover & (offset + place < max_moves))
        movers += tl.sum(mover.to(tl.int32), axis=0)
    if head == LH - 1:
        idle = tl.maximum(tl.load(lens + s * LH) - 1, 0).to(tl.int64)
        for j in range(0, max_moves, BLOCK):
            rest = (offset + holes + j + at < max_moves)
            tl.store(src + holes + j + at, tl.full([BLOCK], 0, tl.int64) + idle, mask=rest)
            tl.store(dst + holes + j + at, tl.full([BLOCK], 0, tl.int64) + idle, mask=rest)


def hole_moves_triton(order: torch.Tensor, lens: torch.Tensor, num_leaving: torch.Tensor, num_slots: int,
                      max_moves: int, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hole_moves_ref in two launches."""
    S, L, H, m = order.shape
    order, lens, num_leaving = order.contiguous(), lens.contiguous(), num_leaving.contiguous()
    marks = torch.empty(S, L, H, num_slots, dtype=torch.int8, device=order.device)
    new_lens, num_moves = torch.empty_like(lens), torch.empty(S, L, H, dtype=torch.int32, device=order.device)
    src, dst = (torch.empty(S, max_moves, dtype=torch.int64, device=order.device) for _ in range(2))
    _hole_count_kernel[(S, L * H)](order, lens, num_leaving, marks, new_lens, num_moves, counts, L * H, num_slots, m,
                                   BLOCK=BLOCK)
    _hole_pack_kernel[(S, L * H)](order, num_leaving, marks, lens, new_lens, num_moves, src, dst, L * H, num_slots,
                                  m, max_moves, BLOCK=BLOCK)
    return src, dst, new_lens
