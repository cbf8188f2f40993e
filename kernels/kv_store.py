"""Writing new K/V rows into the paged cache.

Cache layout (the one source of truth; models/kv_cache.py allocates it). One pool
of P pages shared by every layer; a page holds block_size slots of ONE (layer,
KV head) of one sequence (KV-Compress, Sec. 4.2.1), so each head of each layer
has its own page table and its own context length, and a head's pages are
freed on their own:
    k_cache, v_cache: [P, block_size, head_dim]
    kv_scales:        [P, block_size, 2] float32, a quantized cache only
    pos_cache:        [P, block_size] int32, the position of the token in the slot
    score_cache:      [P, block_size] float32, the slot's eviction score
    page_tables:      [B, Hkv, max_pages] int32 page ids of one layer (unused entries 0)
    context_lens:     [B, Hkv] int32 slots held per (sequence, KV head)
A slot is `page * block_size + offset`. A kernel is called per layer with the
whole pool; the layer's page tables select its pages. Heads of one sequence
may hold different numbers of slots (after per-head eviction), and slot j of
head 0 and slot j of head 1 may hold different tokens.

A quantized cache (k_cache and v_cache int8 or fp8 e4m3) stores each slot's
row of D values as value / scale, symmetric, with one fp32 scale per slot for
K (kv_scales[..., 0]) and one for V ([..., 1]): amax / QUANT_MAX, so the row's
largest magnitude maps to the format's largest. Kernels dequantize as they
load (value * scale); an unquantized cache has no scales. An fp8 cache
reaches the Triton kernels as its bytes (kernel_view), which they encode and
decode with integer ops: sm_80 has no fp8 type, and the interpreter truncates
conversions to fp8.
"""
import torch
import triton
import triton.language as tl

# The quantized cache formats and the largest magnitude each represents.
QUANT_MAX = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):   # torch builds without float8 have no fp8 cache
    QUANT_MAX[torch.float8_e4m3fn] = 448.0
# A program stores enough tokens for this many values of K: one token of a large model, several of a small one.
TOKEN_ELEMENTS = 1024


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] -> (values [..., D] in dtype, scales [...] fp32); an all-zero row gets scale 0.
    int8 rounds half up (floor(y + 0.5)), as the Triton kernel does; fp8 to nearest even."""
    qmax = QUANT_MAX[dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # Both divisions tensor by tensor, correctly rounded as the kernel's: torch divides by a
    # scalar as a product with its reciprocal (on a GPU), an ulp off a quarter of the time.
    qmax_rows = torch.full_like(amax, qmax)
    inv_scale = qmax_rows / torch.where(amax > 0, amax, 1.0)   # a zero row stays 0
    y = (x * inv_scale[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)
    return y.to(dtype), amax / qmax_rows


def dequantize(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """values [..., D] times scales [...] in fp32; values as they are when scales is None (unquantized)."""
    return values if scales is None else values.float() * scales[..., None]


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the Triton kernels take it: an fp8 one as its bytes (uint8), any other as it is."""
    return cache.view(torch.uint8) if cache.dtype == getattr(torch, "float8_e4m3fn", None) else cache


@triton.jit
def from_cache(x, dtype: tl.constexpr):
    """Values loaded from a cache (kernel_view) -> dtype. uint8 holds fp8 e4m3 bits: shifted into
    an fp16's (exponent bias 15, not 7) they are the value times 2**-8, subnormals included."""
    if x.dtype == tl.uint8:
        half = ((x & 0x7F).to(tl.uint16) << 7) | ((x & 0x80).to(tl.uint16) << 8)
        x = half.to(tl.float16, bitcast=True) * 256.0
    return x.to(dtype)


@triton.jit
def _to_cache(x, dtype: tl.constexpr):
    """fp32 values already in the cache's format (_quantized) -> what the cache stores; for uint8,
    the e4m3 bits (the inverse of from_cache: exact, as x is an e4m3 value)."""
    if dtype == tl.uint8:
        half = (x * 0.00390625).to(tl.float16).to(tl.uint16, bitcast=True)
        return (((half >> 8) & 0x80) | ((half >> 7) & 0x7F)).to(tl.uint8)
    return x.to(dtype)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             pos_cache: torch.Tensor, score_cache: torch.Tensor,
             slot_mapping: torch.Tensor, positions: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """Write k, v [T, Hkv, D] to their slots: token t's pair of KV head h goes to slot
    slot_mapping[t, h] ([T, Hkv] int64; -1 = padding, skipped), quantized with its scales in
    kv_scales if the cache is int8 or fp8; record the token's position (positions [T]) in
    each slot and reset its score to 0."""
    keep = slot_mapping >= 0
    slots, k, v = slot_mapping[keep], k[keep], v[keep]                 # [N], [N, D], [N, D]
    positions = positions[:, None].expand(slot_mapping.shape)[keep]
    block_size = k_cache.shape[1]
    pages, offsets = slots // block_size, slots % block_size
    if k_cache.dtype in QUANT_MAX:
        (k, k_scale), (v, v_scale) = quantize(k, k_cache.dtype), quantize(v, v_cache.dtype)
        kv_scales[pages, offsets] = torch.stack([k_scale, v_scale], dim=-1)
    k_cache[pages, offsets] = k.to(k_cache.dtype)
    v_cache[pages, offsets] = v.to(v_cache.dtype)
    pos_cache[pages, offsets] = positions.to(pos_cache.dtype)
    score_cache[pages, offsets] = 0.0


@triton.jit
def _round_to_e4m3(y):
    """fp32 y (|y| <= 448) rounded to the nearest fp8 e4m3 value, ties to even (subnormals, below
    2**-6: half up), still in fp32. Done here, not by the conversion to fp8, because Triton's
    interpreter truncates that conversion, and _to_cache then encodes exact values."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000   # keep 3 of the 23 mantissa bits
    subnormal = tl.floor(y * 512.0 + 0.5) / 512.0              # e4m3 subnormals are multiples of 2**-9
    return tl.where(tl.abs(y) < 0.015625, subnormal, bits.to(tl.float32, bitcast=True))


@triton.jit
def _quantized(x, QMAX: tl.constexpr, INT8: tl.constexpr):
    """Rows of x [T, H, D] -> (x / scale clamped and rounded to the format, in fp32; scale [T, H])."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 2)
    # Divisions rounded as torch's (a GPU's plain fp32 "/" is approximate, an ulp off at times,
    # which moves y across a rounding boundary now and then).
    qmax = tl.full(amax.shape, QMAX, tl.float32)
    y = x * tl.div_rn(qmax, tl.where(amax > 0, amax, 1.0))[:, :, None]   # a zero row stays 0
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    y = tl.floor(y + 0.5) if INT8 else _round_to_e4m3(y)
    return y, tl.div_rn(amax, qmax)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_cache_ptr, score_cache_ptr, scales_ptr,
                     slot_ptr, positions_ptr, T, n_heads, head_dim, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot_t,
                     stride_kcp, stride_kcs, stride_vcp, stride_vcs, stride_pp, stride_sp, stride_qp, stride_qs,
                     TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr,
                     INT8: tl.constexpr):
    """TOKENS tokens a program: all their heads' K and V rows, positions and scores, each head
    into its own slot; with QMAX > 0 (a quantized cache) the rows quantized and their scales.
    A padding slot (-1) masks its head's stores, so a padding token writes nothing."""
    t = (tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS))[:, None]   # [TOKENS, 1]
    heads = tl.arange(0, BLOCK_H)[None, :]
    slots = tl.load(slot_ptr + t * stride_slot_t + heads, mask=(t < T) & (heads < n_heads), other=-1).to(tl.int64)
    head_ok = slots >= 0                                                              # [TOKENS, BLOCK_H]
    pages, offsets = slots // block_size, slots % block_size
    t3, h, d = t[:, :, None], heads[:, :, None], tl.arange(0, BLOCK_D)[None, None, :]
    mask = head_ok[:, :, None] & (d < head_dim)
    k = tl.load(k_ptr + t3 * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t3 * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if QMAX > 0:
        k, k_scale = _quantized(k, QMAX, INT8)
        v, v_scale = _quantized(v, QMAX, INT8)
        scale_at = scales_ptr + pages * stride_qp + offsets * stride_qs
        tl.store(scale_at, k_scale, mask=head_ok)
        tl.store(scale_at + 1, v_scale, mask=head_ok)
    rows = (pages * stride_kcp + offsets * stride_kcs)[:, :, None]
    tl.store(k_cache_ptr + rows + d, _to_cache(k, k_cache_ptr.dtype.element_ty), mask=mask)
    rows = (pages * stride_vcp + offsets * stride_vcs)[:, :, None]
    tl.store(v_cache_ptr + rows + d, _to_cache(v, v_cache_ptr.dtype.element_ty), mask=mask)
    position = tl.load(positions_ptr + t, mask=t < T)   # [TOKENS, 1], broadcast to each head's slot
    tl.store(pos_cache_ptr + pages * stride_pp + offsets, position.to(pos_cache_ptr.dtype.element_ty), mask=head_ok)
    tl.store(score_cache_ptr + pages * stride_sp + offsets, 0.0, mask=head_ok)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    pos_cache: torch.Tensor, score_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, positions: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """store_kv_ref in one launch. k, v may be strided views (slices of the fused qkv output) as long
    as each head's D values are contiguous. Slots are not bounds-checked (that would sync the GPU)."""
    T, n_heads, head_dim = k.shape
    num_pages, block_size = k_cache.shape[:2]
    if v.shape != k.shape or k_cache.shape[2:] != (head_dim,) or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if pos_cache.shape != k_cache.shape[:2] or score_cache.shape != k_cache.shape[:2]:
        raise ValueError(f"pos_cache {tuple(pos_cache.shape)} and score_cache {tuple(score_cache.shape)} "
                         f"must be {tuple(k_cache.shape[:2])}")
    if slot_mapping.shape != (T, n_heads) or positions.shape != (T,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{T}, {n_heads}] and positions "
                         f"{tuple(positions.shape)} [{T}]")
    if (k.stride(2), v.stride(2), k_cache.stride(2), v_cache.stride(2), slot_mapping.stride(1),
            pos_cache.stride(1), score_cache.stride(1)) != (1,) * 7:
        raise ValueError("store_kv needs the last dimension of k, v, the caches and slot_mapping contiguous")
    qmax = QUANT_MAX.get(k_cache.dtype, 0.0)
    if qmax and (kv_scales is None or kv_scales.shape != (num_pages, block_size, 2) or kv_scales.stride(2) != 1):
        raise ValueError(f"a {k_cache.dtype} cache needs kv_scales {(num_pages, block_size, 2)} "
                         f"(the last dimension contiguous), got {kv_scales if kv_scales is None else kv_scales.shape}")
    scales = kv_scales if qmax else k_cache   # a stand-in the kernel never touches unquantized
    block_h, block_d = triton.next_power_of_2(n_heads), triton.next_power_of_2(head_dim)
    per_program = max(1, TOKEN_ELEMENTS // (block_h * block_d))
    _store_kv_kernel[(triton.cdiv(T, per_program),)](
        k, v, kernel_view(k_cache), kernel_view(v_cache), pos_cache, score_cache, scales, slot_mapping, positions,
        T, n_heads, head_dim, block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), slot_mapping.stride(0),
        *k_cache.stride()[:2], *v_cache.stride()[:2], pos_cache.stride(0), score_cache.stride(0),
        *scales.stride()[:2],
        TOKENS=per_program, BLOCK_H=block_h, BLOCK_D=block_d, QMAX=qmax, INT8=k_cache.dtype == torch.int8)
