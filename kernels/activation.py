"""The gated MLP activation."""
import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu(gate) * up, with gate and up side by side."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
