"""Multi-head Latent Attention (DeepSeek-V2/V3) over the paged latent cache.

Per token the layer caches only the normalised KV latent c (kv_lora_rank) and the rotated shared
RoPE key (qk_rope_head_dim); see kvserve/model/mla_cache.py for the layout. Keys and values of a
head h are linear in c: k_nope_h = W_UK_h c, v_h = W_UV_h c (the rows of kv_b_proj). So:

- Decode (one query token per sequence, the memory-bound case) runs in the absorbed form:
  q_latent_h = W_UK_h^T q_nope_h, scores = q_latent_h . c + q_rope_h . k_rope, out_latent_h =
  sum p c, and finally v-space output W_UV_h out_latent_h. The cache is read once for all heads
  and nothing is expanded (the torch reference in kvserve.kernels.mla_reference, a Triton kernel
  in kvserve.kernels.triton.mla_decode on CUDA).
- Prefill (many query tokens, compute-bound) expands c into per-head K and V with one GEMM and
  runs ordinary causal attention, which costs fewer FLOPs than the absorbed form when queries are
  many; chunks over a cached prefix gather the prefix's latents from the cache first.

The model attends through this module, not the engine's attention backend: the backend's name only
picks the kernel (its "triton" means the GPU fast path, "torch" the reference).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.interface import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels import mla_reference
from kvserve.kvstore import LayerKV, is_quantized
from kvserve.model.layers import RMSNorm, apply_rotary


def yarn_softmax_scale(hf_config, qk_head_dim: int) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN: DeepSeek scales
    attention logits for the extended context (the cos/sin tables carry the other mscale ratio)."""
    scale = qk_head_dim ** -0.5
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if params.get("rope_type", params.get("type", "default")) != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        factor = params.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return scale


@functools.lru_cache(maxsize=1)
def _triton_mla():
    try:
        from kvserve.kernels.triton import mla_decode
    except ImportError:
        return None
    return mla_decode


class LatentUpProjection(nn.Module):
    """kv_b_proj's weight [heads * (qk_nope + v), kv_lora_rank], kept as a plain parameter (not an
    nn.Linear, which CPU weight packing would replace): decode reads it per head as W_UK / W_UV."""

    def __init__(self, num_heads: int, nope_dim: int, v_dim: int, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads * (nope_dim + v_dim), rank))

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return F.linear(latent, self.weight)


class MLAAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        hidden, bias = cfg.hidden_size, bool(getattr(cfg, "attention_bias", False))
        q_out = self.num_heads * self.qk_dim
        kv_a_out = self.kv_lora_rank + self.rope_dim
        # Projections that read the hidden state share one GEMM: [q_a or q | latent | k_rope].
        # (Without a q LoRA and with attention bias, q_proj has no bias but kv_a has: kept apart.)
        self.q_width = self.q_lora_rank if self.q_lora_rank is not None else q_out
        self.fused_q = self.q_lora_rank is not None or not bias
        if self.fused_q:
            self.qkv_a_proj = nn.Linear(hidden, self.q_width + kv_a_out, bias=bias)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_a_out, bias=bias)
        if self.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = LatentUpProjection(self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scale = yarn_softmax_scale(cfg, self.qk_dim)

    # --- weights seen per head -----------------------------------------------------------------
    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, r], W_UV [H, v, r]) as views of kv_b_proj's weight."""
        per_head = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return per_head[:, :self.nope_dim], per_head[:, self.nope_dim:]

    # --- forward --------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: LayerKV,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.fused_q:
            projected = self.qkv_a_proj(hidden)
            q, latent, k_rope = projected.split((self.q_width, self.kv_lora_rank, self.rope_dim), dim=-1)
        else:
            q = self.q_proj(hidden)
            latent, k_rope = self.kv_a_proj_with_mqa(hidden).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q = q.view(num_tokens, self.num_heads, self.qk_dim)
        q_nope, q_rope = q[..., :self.nope_dim], q[..., self.nope_dim:]
        latent = self.kv_a_layernorm(latent.contiguous())
        # The checkpoint's interleaved RoPE pairs were de-interleaved at load (see deepseek.py), so
        # the half-split rotation applies.
        q_rope = apply_rotary(q_rope, cos, sin)
        k_rope = apply_rotary(k_rope.reshape(num_tokens, 1, self.rope_dim), cos, sin)
        latent = latent.view(num_tokens, 1, self.kv_lora_rank)
        latent_cache, rope_cache = kv_cache
        gpu = self._gpu_kernels(backend, hidden)
        self._store(latent, k_rope, latent_cache, rope_cache, meta, gpu)
        fast = gpu and kv_cache.full_precision

        output = hidden.new_empty(num_tokens, self.num_heads, self.v_dim)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            output[:num_decodes] = self._decode(q_nope[:num_decodes], q_rope[:num_decodes], latent_cache,
                                                rope_cache, meta, fast)
        for chunk in meta.prefills:
            span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.context_slots is None:
                ctx_latent, ctx_rope = latent[span, 0], k_rope[span, 0]
            else:
                ctx_latent, ctx_rope = mla_reference.gather_context(latent_cache, rope_cache, chunk.context_slots,
                                                                    chunk.kv_row, hidden.dtype)
            output[span] = self._prefill(q_nope[span], q_rope[span], ctx_latent, ctx_rope)
        return self.o_proj(output.view(num_tokens, self.num_heads * self.v_dim))

    def _gpu_kernels(self, backend: AttentionBackend, hidden: torch.Tensor) -> bool:
        """Whether the Triton kernels run: CUDA and the triton backend (the decode kernel also needs
        full-precision parts; quantized ones are read by the torch reference)."""
        return hidden.is_cuda and backend.name == "triton" and _triton_mla() is not None

    def _store(self, latent, k_rope, latent_cache, rope_cache, meta: AttentionMetadata, gpu: bool) -> None:
        for cache, values in ((latent_cache, latent), (rope_cache, k_rope)):
            if gpu and not is_quantized(cache):
                _triton_mla().store_rows(values, cache, meta.slot_mapping)     # skips padding slots (-1)
            elif not (gpu and _store_quantized_on_gpu(cache, values, meta)):
                mla_reference.store_part(cache, values, meta.slot_mapping, meta.kv_window_slots, meta.kv_rows)

    def _decode(self, q_nope, q_rope, latent_cache, rope_cache, meta: AttentionMetadata, fast: bool) -> torch.Tensor:
        w_uk, w_uv = self._up_weights()
        # [B, H, nope] -> [H, B, nope] @ [H, nope, r] -> [B, H, r]: W_UK folded into the query.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        if fast:
            out_latent = _triton_mla().mla_decode_attention(
                q_latent, q_rope, latent_cache, rope_cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale)
        else:
            out_latent = mla_reference.mla_decode_attention(
                q_latent.contiguous(), q_rope.contiguous(), latent_cache, rope_cache, meta.decode_block_tables,
                meta.decode_context_lens, self.scale, meta.decode_kv_rows)
        # [H, B, r] @ [H, r, v] -> [B, H, v]: W_UV after attention.
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q_nope, q_rope, ctx_latent: torch.Tensor, ctx_rope: torch.Tensor) -> torch.Tensor:
        """Expanded attention of Q queries (the last Q positions of a C-token context)."""
        num_queries, context_len = q_nope.shape[0], ctx_latent.shape[0]
        kv = self.kv_b_proj(ctx_latent).view(context_len, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, value = kv[..., :self.nope_dim], kv[..., self.nope_dim:]
        key = torch.cat((k_nope, ctx_rope[:, None, :].expand(context_len, self.num_heads, self.rope_dim)), dim=-1)
        query = torch.cat((q_nope, q_rope), dim=-1)
        if self.v_dim != self.qk_dim:
            # Flash attention wants one head size for q, k and v: pad v, drop the padding after.
            value = F.pad(value, (0, self.qk_dim - self.v_dim))
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        if num_queries == context_len:
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=self.scale)
        else:
            query_pos = torch.arange(context_len - num_queries, context_len, device=query.device)
            mask = torch.arange(context_len, device=query.device)[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=self.scale)
        return out.squeeze(0).transpose(0, 1)[..., :self.v_dim]


def _store_quantized_on_gpu(cache, x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Quantize-on-write with the KV-format Triton store (it skips CUDA-graph padding slots of -1);
    False where that kernel does not cover the part (then the torch reference stores it)."""
    if not is_quantized(cache) or cache.residual is not None:
        return False
    try:
        from kvserve.kernels.triton import kv_store_quant
    except ImportError:
        return False
    if not kv_store_quant.supported(cache):
        return False
    kv_store_quant.store_quantized(x, cache, meta.slot_mapping, meta.kv_window_slots)
    return True
