"""Rotary position embeddings: a cos/sin table indexed by absolute position.

Any RoPE scaling (linear, Llama-3, LongRoPE) is folded into the table, so applying it
is the same for every model. Layout follows HF ("rotate half"): dimension i
pairs with dimension i + D/2. Qwen3's RMSNorm of each q and k head, which comes right
before the rotation, is made in the same pass (QKNorms): one launch for the three.
"""
import math
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.norm import rms_norm_ref


class QKNorms(NamedTuple):
    """The RMSNorms of q's and k's heads that come before RoPE (Qwen3): their weights [D], in the
    heads' dtype, and epsilon."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The D/2 rotation frequencies, with the model's scaling applied."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin_cache(head_dim: int, max_len: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[rows, D] float32 on the CPU: cos of the D/2 angles, then their sin; row p for position p.
    LongRoPE adds rows for the long factors' angles of positions before the original length
    (long_rope_rows)."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        return _long_rope_table(head_dim, max_len, theta, scaling)
    return _table(torch.arange(max_len, dtype=torch.float64, device="cpu"), rope_inv_freq(head_dim, theta, scaling))


def _table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    angles = torch.outer(positions, inv_freq)
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * scale).float()


def _long_rope_table(head_dim: int, max_len: int, theta: float, scaling: dict) -> torch.Tensor:
    """LongRoPE (Phi-3): each frequency divided by its short or long factor, every cos and sin
    scaled by the attention factor (by default HF's, from the length factor). Rows: positions
    before the original length with the short factors, the later ones with the long, then the
    earlier ones again with the long."""
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    scale = scaling.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
    inv_freq = rope_inv_freq(head_dim, theta, None)
    short, long = (inv_freq / torch.tensor(scaling[name], dtype=torch.float64, device="cpu")
                   for name in ("short_factor", "long_factor"))
    positions, split = torch.arange(max_len, dtype=torch.float64, device="cpu"), min(original, max_len)
    return torch.cat([_table(positions[:split], short, scale), _table(positions[split:], long, scale),
                      _table(positions[:split], long, scale)])


def long_rope_rows(positions: np.ndarray, prompt_lens: np.ndarray, original: int, max_len: int) -> np.ndarray | None:
    """LongRoPE: the row of rope_cos_sin_cache(..., max_len, ...) of each token at positions, of a
    sequence with a prompt of prompt_lens tokens; None where every row is the token's position.
    The factors are picked as HF picks them, by how far the forward pass that reads a token
    reaches: the long ones for every token of a prompt longer than the original length, and
    for any token from that length on (so one request's tokens equal HF's generate)."""
    early_long = (prompt_lens > original) & (positions < original)
    return np.where(early_long, positions + max_len, positions) if early_long.any() else None


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   norms: QKNorms | None = None):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by their tokens' positions [T]; with norms,
    each head RMS-normalised first (Qwen3's q/k norm: kernels.norm.rms_norm_ref, in the heads' dtype)."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    for x, weight in zip((q, k), (None, None) if norms is None else norms[:2]):
        normed = x if weight is None else rms_norm_ref(x, weight, norms.eps)
        x1, x2 = normed.float().chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(rotated)


# A program rotates the heads of enough tokens for this many values of q: one token of a large
# model, several of a small one.
TOKEN_ELEMENTS = 1024


@triton.jit
def _rotate_heads(ptr, tokens, stride_t, n_heads, stride_h, half, cos, sin, w_ptr, eps,
                  NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate in place the heads [n_heads, 2 * half] of the tokens [TOKENS] (-1: none); cos, sin
    are [TOKENS, 1, BLOCK_HALF] fp32. NORM: each head RMS-normalised by the weight at w_ptr
    first, rounded as rms_norm_ref rounds (the normalised value, then its product with the weight)."""
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    cols = tl.arange(0, BLOCK_HALF)[None, None, :]
    mask = (tokens >= 0)[:, None, None] & (heads < n_heads) & (cols < half)
    first = ptr + tokens[:, None, None] * stride_t + heads * stride_h + cols
    dtype = ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = 1 / tl.sqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * half) + eps)[:, :, None]
        w1 = tl.load(w_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, eps, T, n_q_heads, n_kv_heads, half,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, NORM: tl.constexpr, TOKENS: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """TOKENS tokens a program: each one's cos/sin row is read once and used for all its q and k heads."""
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    t = tl.where(t < T, t, -1)
    pos = tl.load(pos_ptr + t, mask=t >= 0, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cs_row = cos_sin_ptr + pos[:, None] * stride_cs + cols
    mask = (t >= 0)[:, None] & (cols < half)
    cos = tl.load(cs_row, mask=mask, other=0.0)[:, None, :]
    sin = tl.load(cs_row + half, mask=mask, other=0.0)[:, None, :]
    _rotate_heads(q_ptr, t, stride_qt, n_q_heads, stride_qh, half, cos, sin, qw_ptr, eps, NORM, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, t, stride_kt, n_kv_heads, stride_kh, half, cos, sin, kw_ptr, eps, NORM, BLOCK_HKV,
                  BLOCK_HALF)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      norms: QKNorms | None = None):
    """apply_rope_ref in one launch, in place on q [T, Hq, D] and k [T, Hkv, D], which may be strided
    views (slices of the fused qkv output) as long as each head's D values are contiguous.
    positions must lie in [0, len(cos_sin)): they are not bounds-checked (that would sync the GPU)."""
    T, n_q_heads, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or positions.shape != (T,):
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("apply_rope needs each head's D values contiguous in q and k")
    if cos_sin.dtype != torch.float32 or cos_sin.shape[1] != D or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin must be float32 [max_len, {D}] with contiguous rows")
    if not (q.device == k.device == positions.device == cos_sin.device):
        raise ValueError("q, k, positions and cos_sin must be on one device")
    if norms is not None and any(w.shape != (D,) or w.dtype != x.dtype for w, x in zip(norms[:2], (q, k))):
        raise ValueError(f"the q/k norms' weights must be [{D}] in the heads' dtype {q.dtype}, got "
                         f"{[(tuple(w.shape), w.dtype) for w in norms[:2]]}")
    block_hq, block_hkv, block_half = (triton.next_power_of_2(n) for n in (n_q_heads, k.shape[1], D // 2))
    per_program = max(1, TOKEN_ELEMENTS // (2 * block_half * block_hq))   # powers of 2, all
    q_weight, k_weight, eps = (q, k, 0.0) if norms is None else norms   # not read without norms
    _rope_kernel[(triton.cdiv(T, per_program),)](
        q, k, positions, cos_sin, q_weight, k_weight, eps, T, n_q_heads, k.shape[1], D // 2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0), NORM=norms is not None,
        TOKENS=per_program, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half)
