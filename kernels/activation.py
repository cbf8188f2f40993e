"""The gated MLP activation."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu(gate) * up, with gate and up side by side."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# A program takes this many values at least: a block of one row's columns, or several short rows.
ROW_ELEMENTS = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, n_rows, inter, stride_row, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, j) computes columns j*BLOCK.. of rows i*ROWS.., entirely in fp32."""
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < n_rows) & (cols < inter)
    gate = tl.load(gate_up_ptr + rows * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + rows * stride_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * inter + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_and_mul_ref in one launch; math in fp32 with one rounding at the end, so in fp16/bf16
    it can differ from the reference (which rounds silu(gate) first) by an ulp."""
    if gate_up.shape[-1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up needs an even, contiguous last dim, got shape {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(inter), ROW_ELEMENTS)
    per_program = ROW_ELEMENTS // block
    _silu_and_mul_kernel[(triton.cdiv(rows.shape[0], per_program), triton.cdiv(inter, block))](
        rows, out, rows.shape[0], inter, rows.stride(0), ROWS=per_program, BLOCK=block)
    return out
