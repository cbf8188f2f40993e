"""Moving pairs between the slots of a head after eviction (KV-Compress's MoveCache).

After a sequence evicts, each (layer, KV head) keeps its own subset of slots; moving
survivors into the slots below the head's new length leaves its last pages empty, and
those are freed (all of a block's pages when all heads keep the same number). A move
writes a slot of every per-slot buffer of the cache (KVCache.per_slot: K, V, positions,
scores and a quantized cache's scales): the torch reference indexes each buffer twice,
the Triton kernel moves them all in one launch, which is what an eviction step's host
pays for on a GPU. Moving whole pages (move_pages) is the same kernel.
"""
import torch
import triton
import triton.language as tl

MOVES_PER_PROGRAM = 32


def move_slots_ref(buffers: tuple[torch.Tensor, ...], tables: torch.Tensor, src: torch.Tensor,
                   dst: torch.Tensor) -> None:
    """For heads whose pages are tables [..., nb] (page ids): slot dst[..., j] of each head gets
    the contents of its slot src[..., j], in every per-slot buffer [num_pages, bs, ...]. src and
    dst [..., m] slot indices (broadcast over tables' leading dimensions), every move made (no
    mask: no host sync). No slot is read by one move and written by another with other
    contents (a slot moved onto itself is written with what it holds): the moves may be made
    in any order."""
    bs = buffers[0].shape[1]
    tables = tables.long()
    src, dst = (moves.long().expand(*tables.shape[:-1], moves.shape[-1]) for moves in (src, dst))
    src = (tables.gather(-1, src // bs), src % bs)
    dst = (tables.gather(-1, dst // bs), dst % bs)
    for buffer in buffers:
        buffer[dst] = buffer[src]


@triton.jit
def _copy_rows(buffer, src, dst, mask, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows src of buffer [slots, WORDS] into rows dst, where mask."""
    word = tl.arange(0, BLOCK_W)
    both = mask[:, None] & (word[None, :] < WORDS)
    rows = tl.load(buffer + src[:, None] * WORDS + word[None, :], mask=both)
    tl.store(buffer + dst[:, None] * WORDS + word[None, :], rows, mask=both)


@triton.jit
def _move_slots_kernel(k, v, positions, scores, scales, tables, src, dst, num_moves,
                       tables_stride, src_stride, dst_stride,
                       BS: tl.constexpr, KV_WORDS: tl.constexpr, KV_BLOCK: tl.constexpr, HAS_SCALES: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    """One row of moves (a head's, or a sequence's) a block of BLOCK_M at a time: each move's
    slots found through the row's table, then the slot's row of every buffer moved (as words)."""
    row = tl.program_id(0).to(tl.int64)
    move = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = move < num_moves
    table = tables + row * tables_stride
    s = tl.load(src + row * src_stride + move, mask=mask, other=0)
    d = tl.load(dst + row * dst_stride + move, mask=mask, other=0)
    s = tl.load(table + s // BS, mask=mask, other=0).to(tl.int64) * BS + s % BS
    d = tl.load(table + d // BS, mask=mask, other=0).to(tl.int64) * BS + d % BS
    _copy_rows(k, s, d, mask, KV_WORDS, KV_BLOCK)
    _copy_rows(v, s, d, mask, KV_WORDS, KV_BLOCK)
    _copy_rows(positions, s, d, mask, 1, 2)
    _copy_rows(scores, s, d, mask, 1, 2)
    if HAS_SCALES:
        _copy_rows(scales, s, d, mask, 2, 2)


def _words(buffer: torch.Tensor) -> torch.Tensor:
    """A per-slot buffer [num_pages, bs, ...] as each slot's row of 32-bit words (of bytes if
    its row is not a whole number of words): [num_pages * bs, words]."""
    rows = buffer.view(buffer.shape[0] * buffer.shape[1], -1)
    return rows.view(torch.int32) if rows.shape[1] * rows.element_size() % 4 == 0 else rows.view(torch.uint8)


def move_slots_triton(buffers: tuple[torch.Tensor, ...], tables: torch.Tensor, src: torch.Tensor,
                      dst: torch.Tensor) -> None:
    """move_slots_ref in one launch; buffers (K, V, positions, scores[, scales]) as KVCache.per_slot
    orders them."""
    k, v, positions, scores, *scales = (_words(buffer) for buffer in buffers)
    lead = tables.shape[:-1]
    tables = tables.reshape(-1, tables.shape[-1])
    src, dst = (moves.expand(*lead, moves.shape[-1]).reshape(-1, moves.shape[-1]) for moves in (src, dst))
    assert src.stride(-1) == dst.stride(-1) == 1 and tables.stride(-1) == 1
    num_moves = src.shape[-1]
    _move_slots_kernel[(tables.shape[0], triton.cdiv(num_moves, MOVES_PER_PROGRAM))](
        k, v, positions, scores, scales[0] if scales else k, tables, src, dst, num_moves,
        tables.stride(0), src.stride(0), dst.stride(0), BS=buffers[0].shape[1], KV_WORDS=k.shape[1],
        KV_BLOCK=max(2, triton.next_power_of_2(k.shape[1])), HAS_SCALES=bool(scales), BLOCK_M=MOVES_PER_PROGRAM)
