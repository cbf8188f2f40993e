"""Linear layers for the CPU backend: each weight reordered once for oneDNN.

A decode step multiplies every weight matrix by a few rows, one per sequence.
From 4 rows on, the sgemm behind F.linear (the reference) reads the weights
at about half the memory bandwidth: the bundled model's 121 matrices take
~37-48 ms at 4-8 rows against ~25 ms to read them. oneDNN's matmul, with the
weight reordered ahead of time into its blocked layout, takes ~25-30 ms
(docs/PERF.md). Outside 4-64 rows sgemm is as fast or faster (in the engine,
one row by ~20%, a 1,000-token prefill by ~10%), so the plain weight stays
too: the CPU backend holds the weights twice. The two oneDNN ops are the ones
PyTorch's own compiler uses for CPU linears; they exist where torch was
built with oneDNN (mkldnn), for float32 and, on CPUs with the instructions,
bfloat16 and float16 weights; elsewhere the weights stay plain.
"""
import functools

import torch
from torch import nn
from torch.nn import functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS_HINT = 8      # the row count oneDNN tunes the layout for; prefill and decode alike run well with it
PACKED_ROWS = range(4, 65)   # inputs of other row counts take F.linear


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and _onednn_runs(weight.dtype)


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs here in dtype: tried once. Its bfloat16 and float16 paths
    refuse CPUs without the instructions they need (AVX-512 or AVX-NE-CONVERT, AVX512-FP16),
    which many laptops lack; torch built without oneDNN has no such ops at all."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype), ROWS_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.ones(PACKED_ROWS.start, 4, dtype=dtype), packed, None,
                                           "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


class PackedLinear(nn.Module):
    """nn.Linear's x W^T + b, with W also in oneDNN's layout (an opaque tensor, not a parameter)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features]."""
        if x.shape[0] in PACKED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepack_linears(module: nn.Module) -> None:
    """Replace, in place, every nn.Linear under module whose weight can be packed."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            if can_prepack(child.weight):
                setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            prepack_linears(child)
