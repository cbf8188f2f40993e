"""The quantized KV cache (kernels/kv_store.py): int8 and fp8 rows with per-slot
scales, written by store_kv and dequantized by every attention kernel as it loads.

Each kernel on a quantized cache must match the reference on the dequantized cache as
tightly as on an unquantized one (the same numbers, dequantized in another order), and
the reference on the original, unquantized cache within the format's error (LOOSE).
"""
import pytest
import torch

from batches import TOL, make_cache, mixed_chunks, mixed_squares, param_id, scattered_tables, varlen_batch
from helpers import KERNEL_DEVICE
from kernels.attention.cpu import paged_attention_cpu
from kernels.attention.decode import paged_decode_attention_triton
from kernels.attention.key_scores import accumulate_key_scores_ref, accumulate_key_scores_triton
from kernels.attention.prefill import paged_attention_triton
from kernels.attention.reference import paged_attention_ref
from kernels.kv_store import QUANT_MAX, dequantize, quantize, store_kv_ref, store_kv_triton

FORMATS = list(QUANT_MAX)   # int8, and fp8 e4m3 where torch has it
# The reference on a quantized cache against the unquantized one (unit-variance K, V and q,
# head_dim 64, the batch below): atol = rtol allowed on outputs, lse and key scores. The worst
# absolute errors over 40 seeds were int8 0.026 (output), 0.025 (lse), 0.025 (scores) and fp8
# 0.16, 0.083, 0.12: the bounds are about twice those of the worst seed.
LOOSE = {torch.int8: 0.05, getattr(torch, "float8_e4m3fn", None): 0.3}


def test_fp8_is_there():
    """This torch has float8: the fp8 cache is tested here, not skipped."""
    assert len(FORMATS) == 2


@pytest.mark.parametrize("fmt", FORMATS, ids=param_id)
def test_round_trip_within_the_format_bound(fmt):
    """int8: at most half a step (scale / 2) from the original; fp8 e4m3: half an ulp of 3
    mantissa bits (2**-4 relative), or of the subnormal step 2**-9 * scale. Zero rows stay 0."""
    with torch.device(KERNEL_DEVICE):
        x = torch.randn(64, 4, 96) * torch.logspace(-3, 2, 96)
    x[3, 1] = 0.0
    values, scales = quantize(x, fmt)
    assert values.dtype == fmt and scales.shape == (64, 4)
    error = (dequantize(values, scales) - x).abs()
    slack = 1e-6 * x.abs().amax(-1, keepdim=True)   # fp32 rounding of x / scale and back
    if fmt == torch.int8:
        bound = scales[..., None] / 2
    else:
        bound = torch.maximum(x.abs() * 2**-4, scales[..., None] * 2**-10)
    assert (error <= bound + slack).all()
    assert torch.equal(dequantize(values, scales)[3, 1], torch.zeros_like(x[3, 1]))
    assert torch.allclose(dequantize(values, scales).abs().amax(-1), x.abs().amax(-1), rtol=1e-6)


def test_int8_rounds_as_the_kernel_divides():
    """A row where 127 * (1 / amax), torch's scalar / tensor, is an ulp below 127 / amax, and
    x * that lands on the other side of a rounding boundary: 2 by a true division, not 1."""
    with torch.device(KERNEL_DEVICE):
        x = torch.zeros(1, 1, 16)
        x[0, 0, 0], x[0, 0, 1] = 2.5812828540802, 0.03048759140074253
        values, _ = quantize(x, torch.int8)
        assert values[0, 0, 1] == 2
        written = []
        for store in (store_kv_ref, store_kv_triton):
            cache = [torch.zeros(1, 16, 16, dtype=torch.int8), torch.zeros(1, 16, 16, dtype=torch.int8),
                     torch.zeros(1, 16, dtype=torch.int32), torch.zeros(1, 16)]
            store(x, x, *cache, torch.tensor([[3]]), torch.tensor([0]), kv_scales=torch.zeros(1, 16, 2))
            written.append(cache[0][0, 3])
    assert torch.equal(*written)


@pytest.mark.parametrize("fmt", FORMATS, ids=param_id)
def test_store_kv_quantizes_as_it_writes(fmt):
    """The Triton store writes exactly what the reference writes: values, scales, positions."""
    T, H, D, num_pages, bs = 6, 3, 80, 4, 16
    with torch.device(KERNEL_DEVICE):
        k, v = torch.randn(T, H, D) * 3, torch.randn(T, H, D) * torch.logspace(-4, 0, D)
        k[1, 2] = 0.0
        slots = torch.randperm(num_pages * bs)[:T * H].view(T, H)
        slots[2] = -1   # a padding token
        positions = torch.arange(T) + 100
        written = []
        for store in (store_kv_ref, store_kv_triton):
            cache = [torch.zeros(num_pages, bs, D, dtype=fmt), torch.zeros(num_pages, bs, D, dtype=fmt),
                     torch.zeros(num_pages, bs, dtype=torch.int32), torch.ones(num_pages, bs)]
            scales = torch.zeros(num_pages, bs, 2)
            store(k, v, *cache, slots, positions, kv_scales=scales)
            written.append([t.float() for t in (*cache, scales)])   # as values: -0 == 0
    for ref, tri in zip(*written):
        assert torch.equal(ref, tri)
    k_cache, _, _, _, scales = written[0]
    page, offset = slots[1] // bs, slots[1] % bs   # token 1's slot in each head
    assert torch.equal(dequantize(k_cache[page, offset], scales[page, offset, 0]), dequantize(*quantize(k[1], fmt)))


def quantized_cache(num_pages, block_size, head_dim, fmt, device):
    """(K, V) unquantized fp32, (K, V) quantized to fmt, their scales, (K, V) dequantized."""
    k, v = make_cache(num_pages, block_size, head_dim, torch.float32, device)
    (kq, ks), (vq, vs) = quantize(k, fmt), quantize(v, fmt)
    return (k, v), (kq, vq), torch.stack([ks, vs], dim=-1), (dequantize(kq, ks), dequantize(vq, vs))


def quantized_batch(fmt, dtype, device):
    """A mixed batch (ragged heads) over a quantized cache, and the reference on it:
    (q, cache, scales, dequantized, original, args, reference)."""
    block_size, Hkv, G, D = 16, 2, 3, 64
    chunks = mixed_chunks(block_size)
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, Hkv, G, D, dtype, device)
    width = -(-int(context_lens.max()) // block_size) + 2
    num_pages = len(chunks) * Hkv * width
    original, cache, scales, dequantized = quantized_cache(num_pages, block_size, D, fmt, device)
    dequantized = [t.to(dtype) if dtype == torch.float32 else t for t in dequantized]
    tables = scattered_tables(context_lens, block_size, num_pages, width)
    square = mixed_squares(len(chunks), device)
    args = (tables, cu_seqlens_q, context_lens, D ** -0.5)

    def reference(k_cache, v_cache, kv_scales=None, batch=(q, *args, square)):
        q_, tables_, cu_seqlens_q_, context_lens_, scale, square_ = batch
        out, lse = paged_attention_ref(q_, k_cache, v_cache, tables_, cu_seqlens_q_, context_lens_, scale,
                                       return_lse=True, kv_scales=kv_scales)
        scores = torch.zeros(num_pages, block_size, device=device)
        accumulate_key_scores_ref(q_, k_cache, scores, tables_, cu_seqlens_q_, context_lens_, lse, scale,
                                  kv_scales=kv_scales, square_scores=square_)
        return out.float(), lse, scores

    return q, cache, scales, dequantized, original, args, square, reference


def close(actual, expected, tol):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.float(), e.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt,dtype", [(torch.int8, torch.float32), (FORMATS[-1], torch.float32),
                                       (torch.int8, torch.bfloat16)], ids=param_id)
def test_every_kernel_dequantizes(fmt, dtype):
    """Prefill (Triton), decode (Triton), key scores (Triton, plain and squared) and the
    reference, on one quantized cache: each as close to the reference on the dequantized
    cache as on an unquantized cache, and within LOOSE of the reference on the original values."""
    q, cache, scales, dequantized, original, args, square, reference = quantized_batch(fmt, dtype, KERNEL_DEVICE)
    tight, loose = TOL[dtype][0], LOOSE[fmt]
    expected = reference(*dequantized)
    close(reference(*cache, scales), expected, 1e-6)   # the reference dequantizes as it gathers
    close(reference(*original), expected, loose)

    out, lse = paged_attention_triton(q, *cache, *args, return_lse=True, kv_scales=scales)
    scores = torch.zeros(cache[0].shape[:2], device=KERNEL_DEVICE)
    accumulate_key_scores_triton(q, cache[0], scores, *args[:3], lse, args[3], kv_scales=scales,
                                 square_scores=square)
    close((out, lse, scores), expected, tight)

    # Flash-decoding gets the rows of one query each (mixed_chunks puts them 4th to 8th).
    tables, cu_seqlens_q, context_lens, scale = args
    rows = slice(3, len(context_lens) - 1)
    decodes = (q[cu_seqlens_q[rows].long()], tables[rows], torch.arange(5 + 1, dtype=torch.int32, device=KERNEL_DEVICE),
               context_lens[rows], scale, square[rows])
    expected = reference(*dequantized, batch=decodes)
    close(reference(*original, batch=decodes), expected, loose)
    scores = torch.zeros(cache[0].shape[:2], device=KERNEL_DEVICE)
    out, lse = paged_decode_attention_triton(decodes[0], *cache, decodes[1], decodes[3], scale, 3, return_lse=True,
                                             score_cache=scores, kv_scales=scales, square_scores=decodes[5])
    close((out, lse, scores), expected, tight)


@pytest.mark.parametrize("fmt", FORMATS, ids=param_id)
def test_cpu_backend_dequantizes(fmt):
    """The CPU backend on a quantized cache, as close to the reference as on an unquantized one."""
    q, cache, scales, dequantized, _, args, square, reference = quantized_batch(fmt, torch.float32, "cpu")
    scores = torch.zeros(cache[0].shape[:2], device=q.device)
    out = paged_attention_cpu(q, *cache, *args, score_cache=scores, kv_scales=scales, square_scores=square)
    close((out, scores), reference(*dequantized)[::2], TOL[torch.float32][0])


def test_memory_accounting_counts_the_scales():
    """bytes_per_block is what a pool allocates per block, scales included; for the bundled model
    (block 16, the CPU backend: no decode scratch) an int8 pool holds 380,160 / 207,360 = 1.83x the
    tokens of bf16, 3.61x of fp32."""
    from models.kv_cache import KVCache
    from models.shapes import shape_config

    model = shape_config("smollm2-135m")
    cpu = torch.device("cpu")
    per_block = {dtype: KVCache.bytes_per_block(model, 16, dtype, cpu)
                 for dtype in (torch.float32, torch.bfloat16, *FORMATS)}
    assert per_block == {torch.float32: 748_800, torch.bfloat16: 380_160, torch.int8: 207_360, FORMATS[-1]: 207_360}
    for dtype in per_block:
        cache = KVCache(model, 2, 16, dtype, cpu)
        allocated = [cache.k, cache.v, cache.positions, cache.scores, cache.logits, cache.kv_scales]
        assert sum(t.numel() * t.element_size() for t in allocated if t is not None) == 2 * per_block[dtype]
