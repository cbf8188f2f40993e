"""KV-Compress's pages repaged after an eviction: each head's pages in the blocks its sequence
gives back move into unused pages of the blocks it keeps, and the rest of those are shared out
among its heads (nanokv/eviction/pages.py says how the pages to give up are chosen).

The torch reference is some fifty ops, each a launch on a GPU whatever the batch: what a
kvcompress eviction step's host pays for. The Triton kernel does it in one launch, a program a
sequence, in three phases over the sequence's pages, a barrier between each: mark the pages its
heads use and the pages of the blocks it keeps (in a fresh zeroed array over the pool's pages,
which each sequence touches only at its own pages); lay out its unused pages; then its moves,
tables and widths. A barrier makes what every thread of a program stored visible to all
of them: the phases need nothing of other programs.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024   # the elements a program takes at a time (its pages, columns or moves)


def repage_ref(tables: torch.Tensor, kept: torch.Tensor, staying: torch.Tensor, max_moves: int, num_pages: int,
               share_cap: torch.Tensor, width: int, moved: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    [S, 2, max_moves] (page moves[s, 0, j]'s content goes to moves[s, 1, j]) and each sequence's
    widest head's pages [S]; moved (an int64 scalar) += the pages that move. max_moves bounds a
    sequence's leaving pages; the moves past a sequence's own copy head (s, 0, 0)'s first page
    onto itself (a page in use: moves write only unused ones).
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
    page_moves = torch.stack([idle.scatter(-1, at, pages)[:, :moves] for pages in (used, moved_to.long())], dim=1)
    moved += num_leaving.sum()
    tables = torch.where(leaving, moved_to, used).view(S, L, H, W).where(in_use, tables).to(tables.dtype)
    share = torch.minimum((unused.sum(-1) - num_leaving) // (L * H), share_cap)[:, None, None, None]
    column = torch.arange(width, device=device)
    old = tables.gather(-1, column.clamp(max=W - 1).expand(S, L, H, width))
    extra = column - kept[..., None]                                 # index of the spare page a column takes
    head = torch.arange(L * H, device=device).view(1, L, H, 1)
    spare = (num_leaving[:, None, None, None] + extra.clamp(min=0) * L * H + head).clamp(max=staying.shape[-1] - 1)
    new = unused_first.gather(-1, spare.flatten(1)).view(S, L, H, width)
    widths = kept.flatten(1).amax(1) + share[:, 0, 0, 0]
    return torch.where(extra < 0, old, torch.where(extra < share, new, 0)), page_moves, widths


@triton.jit
def exclusive_count(flags, carry):
    """Each flag's place among the flags set so far: carry + those set before it."""
    return carry + tl.cumsum(flags.to(tl.int32), axis=0) - flags.to(tl.int32)


@triton.jit
def _columns(tables, kept, column, N, W):
    """The pages at the given columns [BLOCK] of a sequence's heads (column: head * W + its column),
    and which of them are in use (a column below its head's kept pages)."""
    in_use = (column < N) & (column % W < tl.load(kept + column // W, mask=column < N, other=0))
    return tl.load(tables + column, mask=in_use, other=0), in_use


@triton.jit
def _repage_kernel(tables, kept, staying, share_cap, marks, unused_first, out, moves, widths, moved,
                   LH, W, P, num_pages, num_moves, width, BLOCK: tl.constexpr):
    """Sequence s's repage_ref; unused_first [S, P]: scratch, where only the unused pages are laid
    out (the reference's rest is never read); marks [2, num_pages]: zeros (the pages of blocks
    kept, the pages used)."""
    s = tl.program_id(0).to(tl.int64)
    at = tl.arange(0, BLOCK)
    tables, kept, staying = tables + s * LH * W, kept + s * LH, staying + s * P
    unused_first, out = unused_first + s * P, out + s * LH * width
    src = moves + s * 2 * num_moves
    dst = src + num_moves
    N = LH * W
    for i in range(0, N, BLOCK):   # phase 1: mark
        page, in_use = _columns(tables, kept, i + at, N, W)
        tl.store(marks + num_pages + page.to(tl.int64), tl.full([BLOCK], 1, tl.int8), mask=in_use)
    for p in range(0, P, BLOCK):
        page = tl.load(staying + p + at, mask=p + at < P, other=-1).to(tl.int64)
        tl.store(marks + page, tl.full([BLOCK], 1, tl.int8), mask=page >= 0)
    tl.debug_barrier()
    num_unused = 0   # phase 2: the unused pages of the blocks kept, laid out in order
    for p in range(0, P, BLOCK):
        page = tl.load(staying + p + at, mask=p + at < P, other=-1)
        unused = (page >= 0) & (tl.load(marks + num_pages + page.to(tl.int64), mask=page >= 0, other=1) == 0)
        tl.store(unused_first + exclusive_count(unused, num_unused), page, mask=unused)
        num_unused += tl.sum(unused.to(tl.int32), axis=0)
    tl.debug_barrier()
    num_leaving = 0   # phase 3: moves and tables
    for i in range(0, N, BLOCK):   # the columns in use: a leaving page moves to the next unused one
        column = i + at
        page, in_use = _columns(tables, kept, column, N, W)
        leaving = in_use & (tl.load(marks + page.to(tl.int64), mask=in_use, other=1) == 0)
        rank = exclusive_count(leaving, num_leaving)
        moved_to = tl.load(unused_first + rank, mask=leaving, other=0)
        tl.store(src + rank, page.to(tl.int64), mask=leaving & (rank < num_moves))
        tl.store(dst + rank, moved_to.to(tl.int64), mask=leaving & (rank < num_moves))
        tl.store(out + (column // W) * width + column % W, tl.where(leaving, moved_to, page),
                 mask=in_use & (column % W < width))
        num_leaving += tl.sum(leaving.to(tl.int32), axis=0)
    tl.atomic_add(moved, num_leaving.to(tl.int64))
    share = tl.minimum((num_unused - num_leaving) // LH, tl.load(share_cap + s))
    first = tl.load(tables)   # the rest of the moves: head (s, 0, 0)'s first page onto itself
    idle = tl.where(tl.load(kept) > 0, first.to(tl.int64), num_pages)
    for j in range(0, num_moves, BLOCK):
        move = j + at
        tl.store(src + move, tl.full([BLOCK], 0, tl.int64) + idle, mask=(move < num_moves) & (move >= num_leaving))
        tl.store(dst + move, tl.full([BLOCK], 0, tl.int64) + idle, mask=(move < num_moves) & (move >= num_leaving))
    for i in range(0, LH * width, BLOCK):   # the columns past each head's: its share of the unused pages
        column = i + at
        head = column // width
        extra = column % width - tl.load(kept + head, mask=column < LH * width, other=0)
        spare = num_leaving + extra * LH + head   # below num_unused where extra < share
        page = tl.load(unused_first + spare, mask=(column < LH * width) & (extra >= 0) & (extra < share), other=0)
        tl.store(out + column, page, mask=(column < LH * width) & (extra >= 0))
    widest = 0
    for h in range(0, LH, BLOCK):
        widest = tl.maximum(widest, tl.max(tl.load(kept + h + at, mask=h + at < LH, other=0), axis=0).to(tl.int32))
    tl.store(widths + s, widest + share)


def repage_triton(tables: torch.Tensor, kept: torch.Tensor, staying: torch.Tensor, max_moves: int,
                  num_pages: int, share_cap: torch.Tensor, width: int, moved: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """repage_ref in one launch (and one zeroed array of marks)."""
    S, L, H, W = tables.shape
    P, device = staying.shape[-1], tables.device
    moves = max(max_moves, 1)
    out = torch.empty(S, L, H, width, dtype=tables.dtype, device=device)
    page_moves = torch.empty(S, 2, moves, dtype=torch.int64, device=device)
    widths = torch.empty(S, dtype=torch.int64, device=device)
    unused_first = torch.empty(S, P, dtype=staying.dtype, device=device)
    marks = torch.zeros(2 * num_pages, dtype=torch.int8, device=device)
    _repage_kernel[(S,)](tables.contiguous(), kept.contiguous(), staying.contiguous(), share_cap, marks,
                         unused_first, out, page_moves, widths, moved, L * H, W, P, num_pages, moves, width,
                         BLOCK=BLOCK,
                         num_warps=8)   # at 4 warps its blocks of 1024 spill on sm_80 (kernels/compile_check.py)
    return out, page_moves, widths
