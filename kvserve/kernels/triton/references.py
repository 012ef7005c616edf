"""Torch references for the Triton kernels that kvserve.kernels.reference does not cover.

Pure torch (no triton import): fused RMSNorm(+residual) and SiLU*mul with the numerics of
kvserve.model.layers, and thin adapters from the Triton kernels' inputs (context lengths, a step's
prefill chunks) to the attention references in kvserve.kernels.reference.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from kvserve.kernels import reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layers.RMSNorm.forward, with the decoder layer's residual add (in the model dtype) in front."""
    if residual is not None:
        x = x + residual
    input_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(input_dtype)
    return out if residual is None else (out, x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The activation of layers.SwiGLU: silu(gate) * up, gate first."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def decode_context_mask(context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B] lengths -> [B, width] bool mask of the positions that hold context."""
    positions = torch.arange(width, device=context_lens.device)
    return positions[None, :] < context_lens[:, None].to(positions.dtype)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """reference.paged_decode_attention from context lengths; a row of length 0 (graph padding)
    gives zeros, as the kernel does (the reference's softmax over nothing would give NaN)."""
    block_size = k_cache.shape[1]
    mask = decode_context_mask(context_lens, block_tables.shape[1] * block_size)
    out = reference.paged_decode_attention(query, k_cache, v_cache, block_tables, mask, scale)
    return torch.where((context_lens > 0)[:, None, None].to(out.device), out, torch.zeros_like(out))


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            chunks: Sequence, slot_mapping: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Every chunk of a step (PrefillChunk-like objects) through reference.paged_prefill_attention;
    a chunk without context_slots attends over its own slot_mapping span in the cache."""
    out = torch.empty_like(query) if out is None else out
    for chunk in chunks:
        span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        slots = chunk.context_slots if chunk.context_slots is not None else slot_mapping[span]
        out[span] = reference.paged_prefill_attention(query[span], k_cache, v_cache, slots, scale)
    return out
