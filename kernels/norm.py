"""RMSNorm, plain and fused with the residual add that precedes it."""
import torch
import triton
import triton.language as tl

# A program normalises rows of this many values at least: one row of a model's hidden size, or
# several of a q/k norm's heads, so that no program (nor the interpreter's per-program cost) is
# spent on a hundred values.
ROW_ELEMENTS = 1024


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * weight / sqrt(mean(x^2) + eps), computed in float32 (as HF does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual += x, then normalise it: returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_rows, n_inner, N, stride_xa, stride_xb, stride_ra,
                     stride_rb, eps, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows a program; rows are addressed by two strides (see _rows)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    a, b = (rows // n_inner)[:, None], (rows % n_inner)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows[:, None] < n_rows) & (cols < N)
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + a * stride_ra + b * stride_rb + cols
        x = x + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum as the reference does, and normalise the value actually stored.
        new_res = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptrs, new_res, mask=mask)
        x = new_res.to(tl.float32)
    inv_rms = 1 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    # Like the reference: normalised value rounded to the input dtype, then scaled by the weight.
    normed = (x * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * N + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as [A, B, N] rows, a view where possible: the kernel takes A's and B's strides, so
    per-head rows [T, H, D] sliced from a fused projection output need no copy."""
    if x.stride(-1) != 1:
        raise ValueError(f"rms_norm needs a contiguous last dim, got strides {tuple(x.stride())}")
    return x.reshape(-1, *x.shape[-2:]) if x.dim() >= 3 else x.reshape(-1, 1, x.shape[-1])


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    if weight.shape != (N,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{N}] tensor, got {tuple(weight.shape)}")
    rows = _rows(x)
    res_rows = rows if residual is None else residual.view(rows.shape)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block = triton.next_power_of_2(N)
    per_program = max(1, ROW_ELEMENTS // block)
    n_rows = rows.shape[0] * rows.shape[1]
    _rms_norm_kernel[(triton.cdiv(n_rows, per_program),)](
        rows, res_rows, weight, out, n_rows, rows.shape[1], N, rows.stride(0), rows.stride(1),
        res_rows.stride(0), res_rows.stride(1), eps, HAS_RESIDUAL=residual is not None, ROWS=per_program,
        BLOCK=block, num_warps=min(max(per_program * block // 256, 1), 8))
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_ref in one launch, for x [..., N] whose last dim is contiguous (leading dims may be
    strided, e.g. q [T, H, D] viewed out of the fused qkv output). Returns a new contiguous tensor."""
    return _launch(x, None, weight, eps)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """add_rms_norm_ref in one launch. In place: x + residual is written INTO `residual`, which is
    returned as the new residual (saves an allocation and a pass over memory); callers must not
    need the old residual afterwards. residual must be contiguous, of x's shape and dtype."""
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous with x's shape and dtype: x {tuple(x.shape)} {x.dtype}, "
                         f"residual {tuple(residual.shape)} {residual.dtype} contiguous={residual.is_contiguous()}")
    return _launch(x, residual, weight, eps), residual
