"""Which of a head's pairs leave first: the lowest priority, ties to the lower position.

KV-Compress (eviction_order) puts each head's slots in that order, its empty slots (at or
past its length) first and the slots of pages it does not hold never (+inf), nor its protected
pairs (+inf: a sequence's sinks and most recent positions, Protected), and prices its
pages: evicting its first e pages costs the priority of its (e * bs)-th slot in that order,
a page below its floor +inf (kernels/page_choice.py chooses the pages from the costs). A
uniform method (lowest) takes the k first of every head's slots, all held.

The torch references are sixteen ops (two stable sorts) and, for a uniform method, a partial
selection of seventeen, and five more for the protected pairs, each a launch on a GPU. The
Triton kernel takes a program a head, in one launch: it sorts the head's slots by position to
rank them, then by (priority, rank, slot) packed in one 64-bit key, priority's bits flipped so
that integer order is float order.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# The most slots a head's program sorts in its registers (no spills on sm_80); past them, the reference.
MAX_SLOTS = 4096


class Protected(NamedTuple):
    """The pairs a method never evicts, whatever their priority: the positions before `sinks`
    and the `recent` most recent, those after current - recent, current [S] (int64) being the
    position each of the S sequences (the heads' first dimension) has reached."""
    sinks: int
    recent: int
    current: torch.Tensor

    def priority(self, priority: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """priority [S, ..., n] with the protected pairs' (by positions [S, ..., n]) +inf."""
        current = self.current.view(-1, *[1] * (priority.dim() - 1))
        return priority.masked_fill((positions < self.sinks) | (positions > current - self.recent), float("inf"))


def eviction_order_ref(priority: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor, pages: torch.Tensor,
                       block_size: int, floor_pages: int, protected: Protected | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """For heads [..., n] holding lens [...] pairs (the slots below) in pages [...] pages, with
    priority and positions [..., n] per slot: each head's slots in eviction order [..., n] (int64)
    and what evicting its e-th page costs [..., n / block_size] (+inf below its floor_pages).
    protected: pairs whose priority is +inf (None: none)."""
    if protected is not None:
        priority = protected.priority(priority, positions)
    slot = torch.arange(priority.shape[-1], device=priority.device)
    empty = slot >= lens[..., None]
    beyond = slot >= (pages * block_size)[..., None]   # in pages it does not hold
    priority = priority.masked_fill(empty, float("-inf")).masked_fill(beyond, float("inf"))
    by_position = positions.masked_fill(empty, -1).argsort(dim=-1, stable=True)
    order = by_position.gather(-1, priority.gather(-1, by_position).argsort(dim=-1, stable=True))
    costs = priority.gather(-1, order[..., block_size - 1::block_size])
    count = torch.arange(1, costs.shape[-1] + 1, device=priority.device)
    return order, costs.masked_fill(count > (pages - floor_pages)[..., None], float("inf"))


def lowest_ref(priority: torch.Tensor, positions: torch.Tensor, k: int, protected: Protected | None = None
               ) -> torch.Tensor:
    """[..., k]: the slots of each head's k lowest priorities of [..., n] (protected pairs' +inf),
    ties going to the lower position, in ascending slot order. A partial selection (the k-th
    value, then the ties), no full sort."""
    if protected is not None:
        priority = protected.priority(priority, positions)
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


@triton.jit
def float_order(bits):
    """Float bits (int32) made to sort as their floats do, and back: a negative's magnitude flipped."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def float_key(x):
    """fp32 x as an int32 that sorts as x does, -0.0 tied with 0.0 as the float compare has it."""
    return float_order(tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True))


@triton.jit
def _eviction_order_kernel(priority, positions, lens, pages, order, costs, current, n, floor_pages, heads_per_seq,
                           sinks, recent, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, SLOT_BITS: tl.constexpr,
                           PROTECT: tl.constexpr):
    """Head `row`'s order [n] and costs [n / BLOCK_SIZE]; its row of order holds each slot's
    position rank in between (the sort's inverse, through memory)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, BLOCK).to(tl.int64)
    valid = slot < n
    empty = slot >= tl.load(lens + row)
    held = tl.load(pages + row)
    last = 0x7FFFFFFFFFFFFFFF   # a key past every slot's: the block's padding
    position = tl.load(positions + row * n + slot, mask=valid, other=0).to(tl.int64)
    if PROTECT:   # before the empty slots' -1
        protected = (position < sinks) | (position > tl.load(current + row // heads_per_seq) - recent)
    position = tl.where(empty, -1, position)
    by_position = tl.sort(tl.where(valid, ((position + 1) << SLOT_BITS) | slot, last))
    tl.store(order + row * n + (by_position & (BLOCK - 1)), slot, mask=valid)
    tl.debug_barrier()   # the ranks stored, by every thread, before any is read
    rank = tl.load(order + row * n + slot, mask=valid, other=0)
    tl.debug_barrier()   # read before the order overwrites them
    p = tl.load(priority + row * n + slot, mask=valid, other=0.0)
    if PROTECT:
        p = tl.where(protected, float("inf"), p)
    p = tl.where(slot >= held * BLOCK_SIZE, float("inf"), tl.where(empty, float("-inf"), p))
    key = (float_key(p).to(tl.int64) << 32) | (rank << SLOT_BITS) | slot
    ordered = tl.sort(tl.where(valid, key, last))
    tl.store(order + row * n + slot, ordered & (BLOCK - 1), mask=valid)
    cost = float_order((ordered >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
    page = slot // BLOCK_SIZE
    cost = tl.where(page + 1 > held - floor_pages, float("inf"), cost)
    tl.store(costs + row * (n // BLOCK_SIZE) + page, cost, mask=valid & (slot % BLOCK_SIZE == BLOCK_SIZE - 1))


def eviction_order_triton(priority: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor, pages: torch.Tensor,
                          block_size: int, floor_pages: int, protected: Protected | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """eviction_order_ref in one launch, for fp32 priorities of heads of at most MAX_SLOTS slots."""
    n = priority.shape[-1]
    if priority.dtype != torch.float32 or n > MAX_SLOTS:
        return eviction_order_ref(priority, positions, lens, pages, block_size, floor_pages, protected)
    heads = priority.shape[:-1]
    order = torch.empty(*heads, n, dtype=torch.int64, device=priority.device)
    costs = torch.empty(*heads, n // block_size, dtype=torch.float32, device=priority.device)
    sinks, recent, current = (0, 0, lens) if protected is None else protected   # lens: a stand-in, not read
    block = triton.next_power_of_2(n)
    _eviction_order_kernel[(heads.numel(),)](priority.contiguous(), positions.contiguous(), lens.contiguous(),
                                             pages.contiguous(), order, costs, current.contiguous(), n, floor_pages,
                                             heads[1:].numel(), sinks, recent, BLOCK_SIZE=block_size,
                                             BLOCK=block, SLOT_BITS=block.bit_length() - 1,
                                             PROTECT=protected is not None, num_warps=max(4, min(16, block // 256)))
    return order, costs


def lowest_triton(priority: torch.Tensor, positions: torch.Tensor, k: int, protected: Protected | None = None
                  ) -> torch.Tensor:
    """lowest_ref as the first k of the eviction order (every slot held, in one page), sorted."""
    n = priority.shape[-1]
    if k == 0 or priority.dtype != torch.float32 or n > MAX_SLOTS:
        return lowest_ref(priority, positions, k, protected)
    held = torch.full(priority.shape[:-1], n, dtype=torch.int32, device=priority.device)
    order, _ = eviction_order_triton(priority, positions, held, torch.ones_like(held), n, 0, protected)
    return order[..., :k].sort(dim=-1).values
