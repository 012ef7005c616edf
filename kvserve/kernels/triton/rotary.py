"""Rotary embedding of queries and keys in one kernel, in place on the fused QKV projection output.

Reference: `kvserve.model.layers.apply_rotary` (transformers' half-split rotate_half form). torch runs
it as five elementwise kernels per tensor (mul, neg, cat, mul, add) for q and again for k; at decode
batch sizes each is a few microseconds of launch and latency, ten per layer. This kernel rotates all
query and key heads of a token in one program and writes them back where the GEMM put them.

Rounding follows torch's op order: each product is rounded to the activation dtype before the sum,
so bf16/fp16 results match the reference bit for bit (fp32 up to fused multiply-add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton._common import next_power_of_2


@triton.jit
def _rotary_kernel(qk_ptr, cos_ptr, sin_ptr, token_stride, head_stride, cos_stride, num_heads,
                   HALF: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_BLOCK)
    cols = tl.arange(0, HALF_BLOCK)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    base = qk_ptr + token * token_stride + heads[:, None] * head_stride + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    cos_row = cos_ptr + token * cos_stride + cols
    sin_row = sin_ptr + token * cos_stride + cols
    cos1 = tl.load(cos_row, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    # rotate_half(x) = cat(-x2, x1): first half x1*cos1 - x2*sin1, second half x2*cos2 + x1*sin2.
    out1 = (a * cos1).to(dtype).to(tl.float32) + (-b * sin1).to(dtype).to(tl.float32)
    out2 = (b * cos2).to(dtype).to(tl.float32) + (a * sin2).to(dtype).to(tl.float32)
    tl.store(base, out1.to(dtype), mask=mask)
    tl.store(base + HALF, out2.to(dtype), mask=mask)


def rotary_inplace(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk [T, heads, D] (any token/head strides, D contiguous); cos/sin [T, D] in qk's dtype.

    Rotates every head of every token in place and returns qk. Pass the query and key heads as one
    view when they are adjacent in memory (the fused QKV output): one launch for both.
    """
    num_tokens, num_heads, head_dim = qk.shape
    if head_dim % 2 or qk.stride(-1) != 1:
        raise ValueError("rotary needs an even head_dim laid out contiguously")
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [{num_tokens}, {head_dim}] and contiguous in the last dim")
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin must share a row stride")
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](qk, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0), num_heads,
                                      HALF=half, HEADS_BLOCK=next_power_of_2(num_heads),
                                      HALF_BLOCK=next_power_of_2(half), num_warps=4)
    return qk
