"""Attention backends behind one interface: store the step's new K/V, then attend over the cache.

`TorchAttentionBackend` is the reference (CPU and GPU): paged gathers + SDPA. On CUDA, SDPA picks
flash/memory-efficient kernels for prefill. Faster paged kernels plug in here by implementing the
same `forward`.
"""

from __future__ import annotations

import torch

from kvserve.attention.interface import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import quant_reference, reference
from kvserve.kernels.triton import references
from kvserve.kvstore import KVPart, is_quantized


class TorchAttentionBackend:
    name = "torch"
    stores_kv_with_rotary = False

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: KVPart, v_cache: KVPart, meta: AttentionMetadata,
                scale: float, kv_stored: bool = False) -> torch.Tensor:
        """query [T, heads, D], key/value [T, kv_heads, D] -> [T, heads, D]."""
        if is_quantized(k_cache) or is_quantized(v_cache):
            return forward_quantized(query, key, value, k_cache, v_cache, meta, scale)
        if not kv_stored:
            reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        output = torch.empty_like(query)
        num_decodes = meta.num_decode_tokens
        if num_decodes and _native_cpu_decode(query, k_cache):
            # Reads the blocks in place instead of gathering them (kvserve.kernels.cpu).
            output[:num_decodes] = cpu_kernels.paged_decode_attention(
                query[:num_decodes], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        elif num_decodes:
            # Only this path reads a mask; derived here from the lengths every backend gets.
            mask = meta.decode_context_mask
            if mask is None:
                mask = references.decode_context_mask(meta.decode_context_lens,
                                                      meta.decode_block_tables.shape[1] * k_cache.shape[1])
            output[:num_decodes] = reference.paged_decode_attention(
                query[:num_decodes], k_cache, v_cache, meta.decode_block_tables, mask, scale)
        for chunk in meta.prefills:
            span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.context_slots is None:
                output[span] = reference.prefill_attention(query[span], key[span], value[span], scale)
            else:
                output[span] = reference.paged_prefill_attention(
                    query[span], k_cache, v_cache, chunk.context_slots, scale)
        return output


def _native_cpu_decode(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and query.dtype == torch.float32 and k_cache.dtype == torch.float32
            and cpu_kernels.available())


def forward_quantized(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache, v_cache,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference over a layer whose K and/or V part is quantized (kvserve.kvstore).

    Plain prefills attend over the chunk's own full-precision K/V, as the full-precision path does:
    quantization error enters through what later steps read back from the cache."""
    quant_reference.store_part(k_cache, key, meta.slot_mapping, meta.kv_window_slots, meta.kv_rows)
    quant_reference.store_part(v_cache, value, meta.slot_mapping, meta.kv_window_slots, meta.kv_rows)
    output = torch.empty_like(query)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        output[:num_decodes] = quant_reference.paged_decode_attention(
            query[:num_decodes], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
            meta.decode_kv_rows)
    for chunk in meta.prefills:
        span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.context_slots is None:
            output[span] = reference.prefill_attention(query[span], key[span], value[span], scale)
        else:
            output[span] = quant_reference.paged_prefill_attention(
                query[span], k_cache, v_cache, chunk.context_slots, scale, chunk.kv_row)
    return output


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_attention_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """auto: the Triton backend on CUDA when triton imports, else the torch reference. (The CPU's
    native whole-model forward is not an attention backend: kvserve/worker/forward_path.py.)"""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
    if name == "torch" or (name == "auto" and (device.type != "cuda" or not triton_available())):
        return TorchAttentionBackend()
    if device.type != "cuda":
        raise ValueError("the triton attention backend needs a CUDA device")
    from kvserve.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend()
