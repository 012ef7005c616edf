"""Which quantized decode kernel can serve a pair of cache parts, and its launch shape: the host-side
facts both kernel modules need (decode_attention_quant.py dispatches and runs the fast and generic
kernels; decode_attention_quant_pipelined.py hands a window's positions to the fast kernel), kept
here so neither imports the other."""

from __future__ import annotations

from dataclasses import replace

import torch
import triton.language as tl

from kvserve.kernels.triton._common import interpreting
from kvserve.kernels.triton.decode_attention import DecodeConfig, default_decode_config
from kvserve.kernels.triton.kv_store_quant import CHANNEL_FORMAT, FORMAT_CODES

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def default_quant_decode_config(head_dim: int, dtype: torch.dtype, int4: bool = False) -> DecodeConfig:
    """The fast kernel's launch shape for 16-bit queries (decode_attention's otherwise).

    Measured on an H200 at 32k context, batch 32, Qwen-7B attention
    (benchmarks/kernels/kv_quant_variants.py, benchmarks/results/kernels/h200_kv_quant_variants.json;
    figures: docs/kv_quantization.md#measurements): the loop is latency-bound, not bound by its
    instruction count, so what pays is bytes per iteration and programs per SM. Tiles of 128
    positions under 4 warps (twice the bytes of 64); block ids one iteration ahead, so the payload
    loads wait on one round trip, not two; and for 8-bit parts a cap of 128 registers (4 programs per
    SM instead of 3). int4 parts (`int4`: either part is int4) spill under that cap and ran slower
    with it; they get 168, which keeps 3 programs per SM when a full-precision window's loop needs
    more (212 registers uncapped: 2 per SM)."""
    config = default_decode_config(head_dim, dtype)
    if interpreting() or dtype == torch.float32:
        return config
    return replace(config, tile=128, num_warps=4, num_stages=2, ids_ahead=True,
                   max_registers=168 if int4 else 128)


def fast_config(head_dim: int, dtype: torch.dtype, k_cache, v_cache) -> DecodeConfig:
    int4 = any(not isinstance(c, torch.Tensor) and c.fmt.name == "int4" for c in (k_cache, v_cache))
    return default_quant_decode_config(head_dim, dtype, int4)


def fast_segments(cache, head_dim: int, keys: bool = True):
    """(FORMAT, NSEG, SEG, GROUP, SCALED, STATIC) of a part for the fast kernel, None if it does not
    fit it (segments of >= 16 power-of-2 columns, at most 4 per head). Per-channel int4 keys: the
    two halves of the head (one byte chunk), no per-token scales; keys only (`keys`: the part's side)."""
    if isinstance(cache, torch.Tensor):
        return 0, 1, head_dim, head_dim, False, False
    fmt = cache.fmt
    if fmt.per_channel:
        seg = head_dim // 2
        if seg < 16 or seg & (seg - 1) or not keys:
            return None
        return CHANNEL_FORMAT, 2, seg, head_dim, False, False
    width = head_dim // 2 if fmt.name == "int4" else head_dim
    group = fmt.group(head_dim)
    seg = width if fmt.static_scales else min(group, width)
    if seg < 16 or seg & (seg - 1) or head_dim % seg or head_dim // seg > 4:
        return None
    return FORMAT_CODES[fmt.name], head_dim // seg, seg, group, not fmt.static_scales, fmt.static_scales


def fast_kernel_supported(query: torch.Tensor, k_cache, v_cache, config: DecodeConfig | None = None) -> bool:
    """Whether the fast kernel (segments, scales after the dots) serves these caches."""
    head_dim = query.shape[2]
    config = config or fast_config(head_dim, query.dtype, k_cache, v_cache)
    if head_dim < 16 or head_dim & (head_dim - 1) or not config.use_dot or config.tile < 16:
        return False
    if query.dtype not in TL_DTYPES:
        return False
    if fast_segments(k_cache, head_dim) is None or fast_segments(v_cache, head_dim, keys=False) is None:
        return False
    quantized = [c for c in (k_cache, v_cache) if not isinstance(c, torch.Tensor)]
    rings = [c for c in quantized if c.window is not None]
    if rings:
        # The exact loop reads each part from its ring, or from a plain cache: every quantized part
        # needs a ring, all with the same shape.
        if len(rings) != len(quantized):
            return False
        if len({(c.num_sinks, c.window_size, c.window.stride()[:2], c.window.dtype) for c in rings}) != 1:
            return False
    return True
