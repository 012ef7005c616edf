"""Skinny GEMM for decode at small batch: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 16.

At batch 1 a decode step is a chain of matrix-vector products whose only cost is streaming the
weights: the step's time is bytes / bandwidth. cuBLAS's GEMV-shaped kernels fall well short of the
H200's copy bandwidth on the R1-Distill-Qwen-7B chain; this kernel exists to do better where it
measures better (`benchmarks/kernels/gemv_bench.py`; measured: docs/gpu_performance.md#decode-throughput-by-batch-size).

Shape of the kernel: each program owns BLOCK_N output features and walks K in BLOCK_K steps; the
weight tile [BLOCK_N, BLOCK_K] is loaded once (software-pipelined over `num_stages` tiles) and
multiplied on the tensor cores against x padded to 16 rows, so the same kernel serves M = 1..16 at
the same weight traffic. Optional SPLIT_K programs share one output tile along K; the last of them to
finish sums their fp32 partial tiles and writes the output: for K >> N (the MLP's
down projection) there are otherwise too few programs to keep every SM streaming. With SILU_MUL a
program streams a tile of gate rows and the matching up rows and writes silu(gate) * up: SwiGLU's
activation without its own kernel or the [M, 2 x intermediate] round trip.

Reference: `torch.nn.functional.linear` (fp32 accumulation in both; summation order differs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.triton._common import cdiv, pdl_enabled

MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K, x_stride, w_stride, out_stride,
                 K_PER_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr):
    """N output features (SILU_MUL: N gate rows, then N up rows of the weight, out = silu(gate) * up)."""
    if PDL:     # see _common.pdl_enabled: wait for the previous kernel, let the next one be scheduled
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows_m = tl.arange(0, BLOCK_M)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows_m < M
    mask_n = cols_n < N
    # Out-of-range weight rows read row 0 instead of masking: the loads stay unpredicated and
    # vectorized, and those columns are never stored.
    safe_n = tl.where(mask_n, cols_n, 0).to(tl.int64)
    w_rows = w_ptr + safe_n[:, None] * w_stride
    up_rows = w_rows + N * w_stride
    x_rows = x_ptr + rows_m[:, None] * x_stride
    k_begin = pid_k * K_PER_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_begin + k_step + offs_k
        if EVEN_K:
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None], other=0.0)
            w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
            if SILU_MUL:
                w_up = tl.load(up_rows + ks[None, :], eviction_policy="evict_first")
        else:
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0, eviction_policy="evict_first")
            if SILU_MUL:
                w_up = tl.load(up_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0,
                               eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc)
        if SILU_MUL:
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    out_ptrs = out_ptr + rows_m[:, None] * out_stride + cols_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + cols_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if SILU_MUL:
                acc_up += tl.load(bias_ptr + N + cols_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        # As the unfused path rounds: gate and up to the model dtype (the GEMM's output), silu(gate)
        # to the dtype (F.silu), then the product.
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptrs, (activated * up).to(out_ptr.dtype.element_ty), mask=out_mask)
    elif SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Each split leaves its fp32 partial tile; the last to arrive (a per-tile counter, released
        # and acquired by the atomic) sums them in split order, writes the output and resets the
        # counter for the next call. No zero-fill or conversion kernel around it.
        tile = rows_m[:, None] * N + cols_n[None, :]
        tl.store(partial_ptr + pid_k * BLOCK_M * N + tile, acc, mask=out_mask)
        # Every thread's partial stores come before the (one-thread) release: a CTA barrier first.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(partial_ptr + split * BLOCK_M * N + tile, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")      # from L2: other SMs wrote them
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(counter_ptr + pid_n, 0)


def default_config(n: int, k: int) -> GemvConfig:
    """Launch shape by weight shape, from `benchmarks/kernels/gemv_bench.py --sweep` on an H200 over
    the R1-Distill-Qwen-7B layers (benchmarks/results/kernels/h200_gemv_sweep.json). A sweep's
    per-layer winners for o_proj (split 2) and down (split 3) made the whole decode step slower in
    the engine, so these are the shapes the step measured best with (measured:
    docs/gpu_performance.md#decode-throughput-by-batch-size)."""
    if k >= 4 * n and cdiv(n, 64) < 2 * 132:
        # K >> N (the MLP's down projection): too few output tiles to keep every SM streaming, so two
        # programs share each tile along K.
        return GemvConfig(block_n=64, block_k=256, split_k=2, num_stages=5)
    if n * k >= 64 << 20:                   # the big streams: gate_up, lm_head
        return GemvConfig(block_n=64 if n >= 65536 else 32, block_k=128, num_stages=5 if n >= 65536 else 3)
    return GemvConfig(block_n=64 if n >= 4096 else 32, block_k=256, num_stages=5)


_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per output tile, shared by every split-K call on the device
    (calls on one stream run one after another, and each leaves its counters at zero)."""
    key = (device, tiles)
    if key not in _counters:
        _counters[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return _counters[key]


def _shapes_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and x.device == weight.device
            and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2 and weight.stride(1) == 1
            and x.shape[1] == weight.shape[1] and x.shape[1] % 8 == 0)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes and dtypes this kernel takes on CUDA (the caller falls back to F.linear otherwise)."""
    return x.is_cuda and _shapes_ok(x, weight)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight[N, K]^T + bias, in x's dtype. silu_mul: weight holds gate rows then
    up rows (SwiGLU's fused gate_up), and the result is silu(gate) * up, [M, N / 2]."""
    if not _shapes_ok(x, weight):
        raise ValueError(f"gemv takes 1-{MAX_ROWS} bf16/fp16 rows matching a row-major weight; got x "
                         f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n} output features")
    if silu_mul and n % 2:
        raise ValueError(f"silu_mul needs an even number of weight rows (gate, then up); got {n}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out_features = n // 2 if silu_mul else n
    config = config or default_config(n, k)
    split = 1 if silu_mul else config.split_k      # silu is not additive over K splits
    out = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    tiles = cdiv(out_features, config.block_n)
    if split > 1:
        partials = torch.empty(split, MAX_ROWS, out_features, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, tiles)
    else:
        partials = counters = out
    # Each split's K range, whole K steps; the last split's may run past K (masked). A compile-time
    # constant: a model has a handful of weight shapes, and the loop's trip count is then fixed.
    k_per_split = cdiv(cdiv(k, split), config.block_k) * config.block_k
    grid = (tiles, split)
    pdl = pdl_enabled(x.device)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, out, partials, counters, m, out_features, k, x.stride(0), weight.stride(0),
        out.stride(0), K_PER_SPLIT=k_per_split, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=split,
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % (config.block_k * split) == 0,
        PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    return out
