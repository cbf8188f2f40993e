"""The hot ops of the model, each a plain function on tensors.

Every op has a torch reference (`*_ref`), which runs on any device and is the
oracle its Triton kernel is tested against. One switch picks the backend for
the whole process: NANOKV_KERNELS=torch|triton, by default Triton when CUDA
is available and the references otherwise.
"""
import os

import torch

from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref
from kernels.kv_store import store_kv_ref
from kernels.norm import add_rms_norm_ref, rms_norm_ref
from kernels.rope import apply_rope_ref, rope_cos_sin_cache

BACKEND = os.environ.get("NANOKV_KERNELS") or ("triton" if torch.cuda.is_available() else "torch")
if BACKEND not in ("torch", "triton"):
    raise ValueError(f"NANOKV_KERNELS={BACKEND!r}; use 'torch' or 'triton'")

silu_and_mul = silu_and_mul_ref
paged_attention = paged_attention_ref
store_kv = store_kv_ref
rms_norm, add_rms_norm = rms_norm_ref, add_rms_norm_ref
apply_rope = apply_rope_ref

__all__ = ["BACKEND", "add_rms_norm", "apply_rope", "paged_attention", "rms_norm", "rope_cos_sin_cache",
           "silu_and_mul", "store_kv"]
