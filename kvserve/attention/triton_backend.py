"""Triton attention backend: the GPU fast path behind TorchAttentionBackend's interface.

Per layer and step: one store_kv launch for the step's new K/V, one split-KV paged decode launch
(plus its combine kernel) for all decode tokens, and one varlen paged prefill launch for all prefill
chunks. The decode path reads block tables and context lengths from the device only, so a decode
step is CUDA-graph capturable as long as the block table's width (or `max_decode_context_len`)
stays fixed across replays.

Plain prefills (no cached prefix) go through the same Triton kernel by default: their K/V are in
the cache once store_kv has run, and one launch for every chunk of a step beats a Python loop of
SDPA calls when a step holds many short prompts. `plain_prefill="sdpa"` sends them to SDPA
(flash) one chunk at a time instead, for long prompts where flash's tuned kernel may win;
benchmarks/kernels/attention_bench.py measures both.
"""

from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels import quant_reference, reference
from kvserve.kvstore import KVPart, is_quantized


class TritonAttentionBackend:
    name = "triton"
    # The model may write K/V into full-precision caches itself, fused with rotary
    # (layers.rotary_and_store_kv), and pass kv_stored=True.
    stores_kv_with_rotary = True

    def __init__(self, plain_prefill: str = "triton", max_decode_context_len: int | None = None) -> None:
        if plain_prefill not in ("triton", "sdpa"):
            raise ValueError(f"plain_prefill must be 'triton' or 'sdpa', got {plain_prefill!r}")
        # Imported here: the core engine imports without triton.
        from kvserve.kernels import triton as kernels
        self._kernels = kernels
        self.plain_prefill = plain_prefill
        self.max_decode_context_len = max_decode_context_len
        # Every layer of a step sees the same metadata: its prefill plan is built once.
        self._planned_meta: AttentionMetadata | None = None
        self._plan = None
        self._sdpa_chunks: list = []

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: KVPart, v_cache: KVPart, meta: AttentionMetadata,
                scale: float, kv_stored: bool = False) -> torch.Tensor:
        """query [T, heads, D], key/value [T, kv_heads, D] -> [T, heads, D]. kv_stored: the model
        already wrote key/value into the (full-precision) caches (stores_kv_with_rotary)."""
        if is_quantized(k_cache) or is_quantized(v_cache):
            return self._forward_quantized(query, key, value, k_cache, v_cache, meta, scale)
        kernels = self._kernels
        if not kv_stored:
            kernels.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        output = torch.empty_like(query)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            kernels.paged_decode_attention(
                query[:num_decodes], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                scale, out=output[:num_decodes], max_context_len=self.max_decode_context_len)
        if meta.prefills:
            plan, sdpa_chunks = self._prefill_plan(meta)
            if plan.num_chunks:
                kernels.paged_prefill_attention(query, k_cache, v_cache, plan, scale, out=output)
            for chunk in sdpa_chunks:
                span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
                output[span] = reference.prefill_attention(query[span], key[span], value[span], scale)
        return output

    def _forward_quantized(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata,
                           scale: float) -> torch.Tensor:
        """A layer with a quantized part (kvserve.kvstore): the store kernel quantizes on
        write, the decode kernel dequantizes K/V tiles as it reads them. Prefill chunks over a
        cached prefix go through the torch reference (gather + dequantize + SDPA); plain prefills
        attend over their own full-precision K/V, as in the full-precision path."""
        from kvserve.kernels.triton.decode_attention_quant import paged_decode_attention_quant
        self._store_part(k_cache, key, meta)
        self._store_part(v_cache, value, meta)
        output = torch.empty_like(query)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            paged_decode_attention_quant(query[:num_decodes], k_cache, v_cache, meta.decode_block_tables,
                                         meta.decode_context_lens, scale, meta.decode_kv_rows,
                                         out=output[:num_decodes], max_context_len=self.max_decode_context_len)
        for chunk in meta.prefills:
            span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.context_slots is None:
                output[span] = reference.prefill_attention(query[span], key[span], value[span], scale)
            else:
                output[span] = quant_reference.paged_prefill_attention(query[span], k_cache, v_cache,
                                                                       chunk.context_slots, scale, chunk.kv_row)
        return output

    def _store_part(self, cache, x: torch.Tensor, meta: AttentionMetadata) -> None:
        if not is_quantized(cache):
            self._kernels.store_kv(x, x, cache, cache, meta.slot_mapping)   # one part: K and V slots alike
            return
        from kvserve.kernels.triton import kv_store_quant
        if cache.residual is not None or not kv_store_quant.supported(cache):
            # Error feedback runs token after token on the host (DecodeGraphs skips it).
            cache.store(x, meta.slot_mapping, meta.kv_window_slots, meta.kv_rows)
            return
        kv_store_quant.store_quantized(x, cache, meta.slot_mapping, meta.kv_window_slots)

    def _prefill_plan(self, meta: AttentionMetadata):
        if self._planned_meta is not meta:
            if self.plain_prefill == "sdpa":
                triton_chunks = [chunk for chunk in meta.prefills if chunk.context_slots is not None]
                self._sdpa_chunks = [chunk for chunk in meta.prefills if chunk.context_slots is None]
            else:
                triton_chunks, self._sdpa_chunks = meta.prefills, []
            self._plan = self._kernels.plan_prefill(triton_chunks, meta.slot_mapping)
            self._planned_meta = meta
        return self._plan, self._sdpa_chunks
