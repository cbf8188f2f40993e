"""Rotary position embeddings: a cos/sin table indexed by absolute position.

Any RoPE scaling (linear, Llama-3) is folded into the table, so applying it
is the same for every model. Layout follows HF ("rotate half"): dimension i
pairs with dimension i + D/2.
"""
import math

import torch


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
    """[max_len, D] float32 on the CPU: cos of the D/2 angles, then their sin."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64, device="cpu"), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by their tokens' positions [T]."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(rotated)
