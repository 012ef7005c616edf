"""Fused RMSNorm (+ residual add) and SiLU*mul, with the numerics of kvserve.model.layers.

References: `kvserve.kernels.triton.references.rms_norm` / `.silu_and_mul` (torch, the same formulas
as layers.RMSNorm and SwiGLU). Torch runs RMSNorm as ~8 elementwise/reduction kernels and SiLU*mul
as 2, each reading and writing the activations; at decode batch sizes they are launch- and
latency-bound, so one kernel each (one program per row) is what pays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.triton._common import cdiv, next_power_of_2, pdl_enabled

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     x_stride, residual_stride, out_stride, residual_out_stride,
                     hidden_size, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:     # see _common.pdl_enabled
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The residual stream stays in the model dtype (as in transformers): round the sum first.
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden_size
    inv_rms = 1.0 / tl.sqrt(mean_square + eps)
    # Normalise in fp32, round to the input dtype, then scale by the weight (layers.RMSNorm).
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., hidden]. Without residual: weight * (x / rms(x)) like layers.RMSNorm. With residual
    (same shape and dtype as x): (norm(x + residual), x + residual), the sum rounded to x's dtype.
    The output dtype is that of `weight * x` in torch (the model dtype when weights are cast)."""
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden_size}")
    if hidden_size > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden_size} > {MAX_HIDDEN}: one row must fit one program")
    rows_x = x.reshape(-1, hidden_size)
    if rows_x.stride(-1) != 1:
        rows_x = rows_x.contiguous()
    out = torch.empty(rows_x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = rows_residual = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must have x's shape and dtype")
        rows_residual = residual.reshape(-1, hidden_size)
        if rows_residual.stride(-1) != 1:
            rows_residual = rows_residual.contiguous()
        residual_out = torch.empty_like(rows_x)
    num_rows = rows_x.shape[0]
    if num_rows:
        block = next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_rows,)](
            rows_x, rows_residual if residual is not None else rows_x, weight, out,
            residual_out if residual is not None else out,
            rows_x.stride(0), rows_residual.stride(0) if residual is not None else 0, out.stride(0),
            residual_out.stride(0) if residual is not None else 0,
            hidden_size, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl_enabled(x.device),
            num_warps=max(1, min(16, block // 256)), launch_pdl=pdl_enabled(x.device))
    out = out.view(*x.shape[:-1], hidden_size)
    if residual is None:
        return out
    return out, residual_out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, inner_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner_size
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inner_size + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds to the input dtype before the multiply (two torch ops): keep that rounding.
    activated = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * inner] (gate first, as in SwiGLU.gate_up_proj) -> silu(gate) * up [..., inner]."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"last dimension {width} is not even")
    inner_size = width // 2
    rows = gate_up.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inner_size, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and inner_size:
        block = min(1024, next_power_of_2(inner_size))
        _silu_and_mul_kernel[(rows.shape[0], cdiv(inner_size, block))](
            rows, out, rows.stride(0), out.stride(0), inner_size, BLOCK=block,
            num_warps=max(1, min(4, block // 256)))
    return out.view(*gate_up.shape[:-1], inner_size)
