"""The elementwise Triton kernels against their torch references.

On the CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so the shapes
are small but keep the awkward cases: sizes that are not powers of 2, one token, GQA, strided
views of a fused qkv output, unsorted positions, padding slots. Inputs are fresh random numbers
each run (the seed is printed, so a failure can be replayed); freshly allocated outputs start as
NaN, so an element a kernel forgets to write fails the comparison.
"""
import os

import pytest
import torch

import kernels
from helpers import KERNEL_DEVICE
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.compact import move_slots_ref, move_slots_triton
from kernels.kv_store import store_kv_ref, store_kv_triton
from kernels.kv_store_cpu import store_kv_cpu
from kernels.norm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from kernels.eviction_order import MAX_SLOTS, Protected, eviction_order_ref, eviction_order_triton
from kernels.page_choice import choose_pages_ref, choose_pages_triton
from kernels.head_slots import BLOCK as SLOTS_BLOCK, head_slots_ref, head_slots_triton
from kernels.hole_filling import BLOCK as HOLES_BLOCK, hole_moves_ref, hole_moves_triton
from kernels.repaging import BLOCK as REPAGE_BLOCK, repage_ref, repage_triton
from kernels.rope import QKNorms, apply_rope_ref, apply_rope_triton, rope_cos_sin_cache
from kernels.rope_cpu import apply_rope_cpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rtol, atol): a one-ulp disagreement in rounding must pass, anything more must not.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}

RMS_SHAPES = [(1, 576), (37, 100), (37, 9, 64)]       # the last one per head, as Qwen3's q/k norm
# (T, Hq, Hkv, D); the last, 32 tokens a program
ROPE_CASES = [(1, 9, 3, 64), (37, 9, 3, 64), (37, 8, 8, 128), (37, 4, 2, 16)]
SILU_SHAPES = [(1, 2 * 1536), (37, 2 * 100), (2, 3, 2 * 64)]
KV_CASES = [(37, 16, 3, 64), (1, 32, 8, 128), (37, 256, 3, 64)]  # (T, block_size, Hkv, D)


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"torch seed {seed}")
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """torch.empty fills floats with NaN and integers with a sentinel, for the kernels' outputs."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)
    monkeypatch.setattr(torch, "empty", empty)


def assert_close(actual, expected):
    rtol, atol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def split_heads(qkv, Hq, Hkv, D):
    """q, k, v as the model gets them: strided [T, H, D] views into one projection output."""
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.unflatten(-1, (Hq, D)), k.unflatten(-1, (Hkv, D)), v.unflatten(-1, (Hkv, D))


def fused_qkv(T, Hq, Hkv, D, dtype, device):
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=dtype, device=device)
    return qkv, *split_heads(qkv, Hq, Hkv, D)


def check_rms_norm(shape, dtype, device):
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    if len(shape) == 3:  # per-head rows of a fused output: leading strides are not contiguous
        x = fused_qkv(shape[0], shape[1], 1, shape[2], dtype, device)[1]
    else:
        x = torch.randn(shape, dtype=dtype, device=device)
    x_before = x.clone()
    assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    assert torch.equal(x, x_before)


def check_add_rms_norm(shape, dtype, device):
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    _, expected_res = add_rms_norm_ref(x, residual.clone(), weight, 1e-5)
    out, new_res = add_rms_norm_triton(x, residual, weight, 1e-5)
    assert new_res.data_ptr() == residual.data_ptr()  # documented: written in place
    assert_close(new_res, expected_res)
    # The norm of the sum actually stored: in 16 bits a sum may round one ulp the other way
    # (the interpreter's fp32 -> bf16 rounding differs from torch's), and the norm amplifies it.
    assert_close(out, rms_norm_ref(new_res, weight, 1e-5))


def check_rope(T, Hq, Hkv, D, dtype, device, apply_rope=apply_rope_triton, norm=False):
    """apply_rope against the reference; with norm, each head RMS-normalised first (Qwen3's q/k
    norms), which in the reference is exactly rms_norm_ref's output rotated."""
    cos_sin = rope_cos_sin_cache(D, 4096, 1e5, None).to(device)
    positions = torch.randint(0, 4096, (T,), device=device)  # unsorted, with repeats possible
    qkv, q, k, _ = fused_qkv(T, Hq, Hkv, D, dtype, device)
    norms = QKNorms(*(1 + torch.randn(2, D, dtype=dtype, device=device) / 4), 1e-6) if norm else None
    expected = qkv.clone()
    q_ref, k_ref, _ = split_heads(expected, Hq, Hkv, D)
    if norm:   # the reference fused is the norms' reference, then the rotation's
        q_normed, k_normed = rms_norm_ref(q_ref, norms.q_weight, 1e-6), rms_norm_ref(k_ref, norms.k_weight, 1e-6)
        apply_rope_ref(q_normed, k_normed, positions, cos_sin)
        apply_rope_ref(q_ref, k_ref, positions, cos_sin, norms)
        assert torch.equal(q_ref, q_normed) and torch.equal(k_ref, k_normed)
    else:
        apply_rope_ref(q_ref, k_ref, positions, cos_sin)
    apply_rope(q, k, positions, cos_sin, norms)
    if norm and dtype == torch.bfloat16 and device == KERNEL_DEVICE:
        # Three roundings to bf16 in a row (the normalised value, its product with the weight, the
        # rotation), where the interpreter's rounding differs from torch's by an ulp: each head
        # within 4 ulps of its largest value, the rest of the buffer untouched.
        heads, want = (torch.cat(split_heads(x, Hq, Hkv, D)[:2], dim=1).float() for x in (qkv, expected))
        assert ((heads - want).abs() <= 2 ** -5 * want.abs().amax(-1, keepdim=True)).all()
        assert torch.equal(qkv[:, (Hq + Hkv) * D:], expected[:, (Hq + Hkv) * D:])
        return
    assert_close(qkv, expected)  # the whole buffer: v and everything else untouched


def check_silu_and_mul(shape, dtype, device):
    gate_up = torch.randn(shape, dtype=dtype, device=device) * 4
    assert_close(silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up))


def check_store_kv(T, block_size, Hkv, D, dtype, device, store=store_kv_triton, padding=True):
    """store_kv_ref against a write through the flat slot index, and store (Triton or the CPU
    backend's) against store_kv_ref; with padding, a quarter of the tokens are padding."""
    interior = (T * Hkv) // block_size + 2
    num_pages = interior + 2
    _, _, k, v = fused_qkv(T, 2, Hkv, D, dtype, device)
    # Distinct slots of random pages, never the first or the last page: a padding token (-1)
    # written by mistake at page -1 or at offset -1 of page 0 would land there.
    free = torch.arange(block_size, (num_pages - 1) * block_size, device=device)
    slot_mapping = free[torch.randperm(len(free), device=device)[:T * Hkv]].view(T, Hkv)
    if padding:
        slot_mapping[torch.randperm(T, device=device)[:T // 4]] = -1  # padding tokens: their whole row
    positions = torch.randint(0, 4000, (T,), device=device)
    caches = [torch.full((num_pages, block_size, D), float("nan"), dtype=dtype, device=device),
              torch.full((num_pages, block_size, D), float("nan"), dtype=dtype, device=device),
              torch.full((num_pages, block_size), -7, dtype=torch.int32, device=device),
              torch.full((num_pages, block_size), float("nan"), dtype=torch.float32, device=device)]
    flat = [c.clone() for c in caches]
    written = slot_mapping >= 0
    for cache, value in zip(flat, (k, v, positions[:, None].expand(T, Hkv), torch.zeros(T, Hkv, device=device))):
        rows = value[written].view(int(written.sum()), -1)
        cache.view(num_pages * block_size, -1)[slot_mapping[written]] = rows.to(cache.dtype)
    expected = [c.clone() for c in caches]
    store_kv_ref(k, v, *expected, slot_mapping, positions)
    store(k, v, *caches, slot_mapping, positions)
    for actual, ref, want in zip(caches, expected, flat):
        torch.testing.assert_close(ref, want, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(actual, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rms_norm(shape, dtype):
    check_rms_norm(shape, dtype, KERNEL_DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES[:2])
def test_add_rms_norm(shape, dtype):
    check_add_rms_norm(shape, dtype, KERNEL_DEVICE)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope(case, dtype, norm):
    check_rope(*case, dtype, KERNEL_DEVICE, norm=norm)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_cpu_backend(case, dtype, norm):
    """The CPU backend's in-place rotation (float32; other dtypes are the reference itself)."""
    check_rope(*case, dtype, "cpu", apply_rope=apply_rope_cpu, norm=norm)


@pytest.mark.parametrize("draw", range(3))
def test_the_repage_kernel_is_the_reference_over_more_pages_than_a_program_takes_at_once(draw):
    """KV-Compress's repage (kernels/repaging.py) for sequences of 4 layers x 8 heads x up to 40 pages
    (more columns, and more pages kept, than a program takes at once): each keeps about half the
    pages its heads use, the rest leave; the same tables, moves and widths as the reference, with
    a bound on the moves loose or tight."""
    S, L, H, W = 2, 4, 8, 40
    with torch.device(KERNEL_DEVICE):
        pools = torch.randperm(4 * S * L * H * W).view(S, -1).int()   # each sequence's pages
        tables = pools[:, :L * H * W].reshape(S, L, H, W)
        kept = torch.randint(0, W + 1, (S, L, H))
        kept[:, 0, 0] = kept[:, 0, 0].clamp(min=1)
        in_use = torch.arange(W) < kept[..., None]
        staying = torch.full((S, 2 * L * H * W), -1, dtype=torch.int32)
        for s in range(S):
            used = tables[s][in_use[s]]
            free = pools[s, L * H * W:][:len(used) + 50]   # room for every page that leaves, and spare ones
            pages = torch.cat([used[torch.rand(len(used)) < 0.5], free])
            staying[s, :len(pages)] = pages[torch.randperm(len(pages))]
        share_cap = torch.tensor([3, 1])
    leaving = max(int((in_use[s] & ~torch.isin(tables[s], staying[s])).sum()) for s in range(S))
    assert tables[0].numel() > REPAGE_BLOCK and staying.shape[-1] > REPAGE_BLOCK and leaving > 0
    for max_moves in (L * H * W, leaving):
        args = tables, kept, staying, max_moves, 4 * S * L * H * W, share_cap, W + 2
        with torch.device(KERNEL_DEVICE):
            moved = torch.zeros(2, dtype=torch.int64)
        got, expected = repage_triton(*args, moved[0]), repage_ref(*args, moved[1])
        assert all(torch.equal(a, b) for a, b in zip(got, expected)) and moved[0] == moved[1] > 0


@pytest.mark.parametrize("draw", range(3))
def test_the_hole_filling_kernels_are_the_reference_over_more_slots_than_a_program_takes_at_once(draw):
    """The hole-filling moves (kernels/hole_filling.py) for sequences of 4 layers x 8 heads of 1,296
    slots (more than a program takes at once), each head holding some of them and dropping the
    held ones among the first of its slots in a random order (KV-Compress's whole pages; a uniform
    method's given slots, all held): the same moves, new lengths and counts as the reference,
    with a bound on the moves loose or tight."""
    S, L, H, bs, W = 2, 4, 8, 16, 81
    n = W * bs
    torch.manual_seed(draw)
    with torch.device(KERNEL_DEVICE):
        lens = torch.randint(0, n + 1, (S, L, H)).int()
        pages = (torch.rand(S, L, H) * (lens + bs - 1) // bs).int()   # at most the pages it holds
        order = torch.rand(S, L, H, n).argsort(-1)
        full, some = torch.full((S, L, H), n, dtype=torch.int32), torch.full((S, L, H), 100, dtype=torch.int32)
        counts = [torch.zeros(2, dtype=torch.int64) for _ in range(3)]
    cases = [(order, lens, pages * bs), (order[..., :100], full, some)]   # pages of a head; given slots
    for args in cases:
        hole_moves_ref(*args, n, L * H * n, counts[0].zero_())
        assert n > HOLES_BLOCK and counts[0][1] > 0
        for max_moves in (L * H * n, int(counts[0][1])):
            expected = hole_moves_ref(*args, n, max_moves, counts[1])
            got = hole_moves_triton(*args, n, max_moves, counts[2])
            assert all(torch.equal(a, b) for a, b in zip(got, expected)) and torch.equal(counts[2], counts[1])


def test_the_head_slots_kernel_is_the_reference():
    """Where a step's pairs go in heads with pages of their own (kernels/head_slots.py), through
    tables and lengths that are views of [B, L, ...] (the head tables' layout), for a decode of 300
    sequences (more (token, head) pairs than a program takes) and for prompt chunks."""
    L, B, H, W, bs = 2, 300, 4, 5, 16
    with torch.device(KERNEL_DEVICE):
        tables = torch.randperm(2 * B * L * H * W)[:B * L * H * W].view(B, L, H, W).int().transpose(0, 1)
        lens = torch.randint(3, W * bs + 1, (B, L, H)).int().transpose(0, 1)
        row_seq, from_end = torch.tensor([0, 0, 0, 7, 299, 299]), torch.tensor([3, 2, 1, 1, 2, 1])
    assert B * H > SLOTS_BLOCK
    for extra in ((), (row_seq, from_end)):
        assert torch.equal(head_slots_triton(tables, lens, bs, *extra), head_slots_ref(tables, lens, bs, *extra))


@pytest.mark.parametrize("slots", [1296, MAX_SLOTS] if KERNEL_DEVICE == "cuda" else [80])
def test_the_eviction_order_kernel_is_the_reference(slots):
    """KV-Compress's eviction order (kernels/eviction_order.py) for heads of a number of slots that
    is no power of two (the sort's block padded), and on a GPU of MAX_SLOTS (the interpreter's sort
    takes seconds a head): heads empty, partly and wholly held, in fewer pages than their slots
    take; priorities with ties (small integers, -0.0 and 0.0) and +inf; distinct positions a head;
    no pair protected, and each sequence's sinks and most recent protected (Protected, current
    per sequence). The same order and costs as the reference, bit for bit."""
    S, L, H, bs = (2, 2, 4, 16) if KERNEL_DEVICE == "cuda" else (1, 2, 2, 16)
    with torch.device(KERNEL_DEVICE):
        lens = torch.randint(0, slots + 1, (S, L, H)).int()
        lens[0, 0, :2] = torch.tensor([0, slots])
        pages = torch.minimum(-(-lens // bs) + torch.randint(0, 3, (S, L, H)), torch.tensor(slots // bs)).int()
        priority = torch.randint(-4, 5, (S, L, H, slots)).float() / 2
        priority[priority == 0] = torch.tensor([0.0, -0.0]).repeat(slots)[:int((priority == 0).sum())]
        priority[torch.rand(S, L, H, slots) < 0.05] = float("inf")
        positions = torch.rand(S, L, H, 4 * slots).argsort(-1)[..., :slots].int()
        current = torch.tensor([3 * slots, 2 * slots])[:S]
    for floor, protected in ((1, None), (3, None), (1, Protected(4, slots // 2, current))):
        expected = eviction_order_ref(priority, positions, lens, pages, bs, floor, protected)
        got = eviction_order_triton(priority, positions, lens, pages, bs, floor, protected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch.equal(expected[0], eviction_order_ref(priority, positions, lens, pages, bs, 1)[0])


def test_the_page_choice_kernel_is_the_reference():
    """KV-Compress's page choice (kernels/page_choice.py): each sequence's heads' costs, never
    decreasing along a head, with many ties (-0.0 and 0.0 among them) and +inf pages at the end;
    more heads than a program counts at a time (28 layers x 8 heads of 37 pages); sequences giving
    up no page, half their pages of finite cost (the last taken among the zeros) and every one.
    The same pages per head as the reference."""
    torch.manual_seed(0)
    S = 3
    for L, H, m in ((2, 3, 5), (28, 8, 37), (4, 2, 300)):
        with torch.device(KERNEL_DEVICE):
            costs = (torch.randint(-2, 5, (S, L, H, m)).float() / 2).sort(-1).values
            costs[costs == 0] = torch.tensor([0.0, -0.0]).repeat(costs.numel())[:int((costs == 0).sum())]
            costs[..., m - m // 4:] = float("inf")
            pages = torch.randint(0, m + 1, (S, L, H)).int()
            finite = (costs != float("inf")).flatten(1).sum(1)
            given_up = torch.stack([torch.tensor(-5), finite[1] // 2, finite[2]])   # -5: fewer held than the target
        target = pages.flatten(1).sum(1) - given_up
        expected = choose_pages_ref(costs, pages, target)
        assert torch.equal(choose_pages_triton(costs, pages, target), expected), (L, H, m)
        assert torch.equal(expected.flatten(1).sum(1), given_up.clamp(min=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_and_mul(shape, dtype):
    check_silu_and_mul(shape, dtype, KERNEL_DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", KV_CASES)
def test_store_kv(case, dtype):
    check_store_kv(*case, dtype, KERNEL_DEVICE)


@pytest.mark.parametrize("padding", [True, False], ids=["padded", "decode"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", KV_CASES)
def test_store_kv_cpu_backend(case, dtype, padding):
    """The CPU backend's flat writes (no padding) and its fallback to the reference (padding)."""
    check_store_kv(*case, dtype, "cpu", store=store_kv_cpu, padding=padding)


def per_slot_buffers(kv_dtype: torch.dtype, head_dim: int, num_pages: int = 40, bs: int = 4) -> list[torch.Tensor]:
    """K, V, positions, scores and (a quantized cache) scales, as KVCache.per_slot, of random contents."""
    shape = (num_pages, bs, head_dim)
    with torch.device(KERNEL_DEVICE):
        kv = [torch.randint(-128, 128, shape, dtype=torch.int8).view(kv_dtype) if kv_dtype.itemsize == 1
              else torch.randn(shape).to(kv_dtype) for _ in range(2)]
        scales = [torch.rand(num_pages, bs, 2)] if kv_dtype.itemsize == 1 else []
        return [*kv, torch.randint(0, 10**6, (num_pages, bs), dtype=torch.int32), torch.randn(num_pages, bs), *scales]


def as_bytes(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [b.view(torch.uint8) for b in buffers]


MOVE_CASES = [(torch.bfloat16, 64), (torch.float32, 16), (torch.int8, 6), (torch.float8_e4m3fn, 16)]


@pytest.mark.parametrize("kv_dtype, head_dim", MOVE_CASES)
def test_moving_slots_moves_every_buffer_as_the_reference(kv_dtype, head_dim):
    """One launch for K, V, positions, scores and a quantized cache's scales (rows of bytes where
    a row is no whole number of words): survivors into holes, each sequence's heads end to end,
    the rest of its moves a slot onto itself (kernels/hole_filling.py)."""
    with torch.device(KERNEL_DEVICE):
        buffers = per_slot_buffers(kv_dtype, head_dim)
        tables = torch.randperm(40)[:2 * 3 * 3].view(2, 9).int()   # 2 sequences, 3 heads of 3 pages each
        evicted = torch.rand(2, 1, 3, 12).argsort(dim=-1)[..., :5]
        held, leaving = (torch.full((2, 1, 3), n, dtype=torch.int32) for n in (12, 5))
        counts = torch.zeros(2, dtype=torch.int64)
        src, dst, _ = hole_moves_ref(evicted, held, leaving, 12, 15, counts)
        assert 0 < counts[1] < 2 * 15   # some moves, and the rest of the rows slots onto themselves
        original, expected = [b.clone() for b in buffers], [b.clone() for b in buffers]
        move_slots_ref(expected, tables, src, dst)
        move_slots_triton(buffers, tables, src, dst)
        assert all(torch.equal(a, b) for a, b in zip(as_bytes(buffers), as_bytes(expected)))
        assert not any(torch.equal(a, b) for a, b in zip(as_bytes(buffers), as_bytes(original)))


@pytest.mark.parametrize("kv_dtype, head_dim", MOVE_CASES[::3])
def test_moving_pages_moves_their_every_slot(kv_dtype, head_dim):
    """kernels.move_pages on each backend: page moves[s, 0, i]'s slots into page moves[s, 1, i],
    in every buffer, a page moved onto itself left as it is."""
    with torch.device(KERNEL_DEVICE):
        buffers = per_slot_buffers(kv_dtype, head_dim)
        moves = torch.randperm(40)[:12].view(2, 2, 3)
        moves[1, 1, 2] = moves[1, 0, 2]   # onto itself
        src, dst = moves[:, 0], moves[:, 1]
        expected = [b.clone() for b in buffers]
        for buffer in expected:
            buffer[dst] = buffer[src]
        before = kernels.forced_backend()
        for backend in ("torch", "triton"):
            moved = [b.clone() for b in buffers]
            try:
                kernels.set_backend(backend)
                kernels.move_pages(moved, moves)
            finally:
                kernels.set_backend(before)
            assert all(torch.equal(a, b) for a, b in zip(as_bytes(moved), as_bytes(expected))), backend
        assert not any(torch.equal(a, b) for a, b in zip(as_bytes(buffers), as_bytes(expected)))


def test_bad_inputs_are_refused():
    with torch.device(KERNEL_DEVICE):
        x = torch.randn(4, 64)
        with pytest.raises(ValueError, match="contiguous last dim"):
            rms_norm_triton(x.t(), torch.ones(4), 1e-6)
        with pytest.raises(ValueError, match="residual"):
            add_rms_norm_triton(x, torch.randn(4, 64).t().contiguous().t(), torch.ones(64), 1e-6)
        with pytest.raises(ValueError, match="even"):
            silu_and_mul_triton(torch.randn(2, 7))


@pytest.mark.gpu
def test_all_on_gpu_in_bf16():
    for shape in RMS_SHAPES:
        check_rms_norm(shape, torch.bfloat16, KERNEL_DEVICE)
    for shape in RMS_SHAPES[:2]:
        check_add_rms_norm(shape, torch.bfloat16, KERNEL_DEVICE)
    for case in ROPE_CASES:
        check_rope(*case, torch.bfloat16, KERNEL_DEVICE)
    for shape in SILU_SHAPES:
        check_silu_and_mul(shape, torch.bfloat16, KERNEL_DEVICE)
    for case in KV_CASES:
        check_store_kv(*case, torch.bfloat16, KERNEL_DEVICE)
