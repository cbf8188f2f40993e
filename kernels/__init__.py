"""The hot ops of the model, each a plain function on tensors.

This issue provides the torch reference implementations; they run on any
device and are the oracle the Triton kernels are tested against.
"""
from kernels.activation import silu_and_mul
from kernels.attention import paged_attention
from kernels.kv_store import store_kv
from kernels.norm import add_rms_norm, rms_norm
from kernels.rope import apply_rope, rope_cos_sin_cache

__all__ = ["add_rms_norm", "apply_rope", "paged_attention", "rms_norm", "rope_cos_sin_cache",
           "silu_and_mul", "store_kv"]
