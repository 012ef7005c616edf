"""Torch reference of Multi-head Latent Attention (MLA) over the paged latent cache.

The cache of one layer is two parts addressed by the same slots (NHD paged, one "head" each):
the normalised KV latent `[num_blocks, block_size, 1, kv_lora_rank]` and the rotated shared RoPE
key `[num_blocks, block_size, 1, qk_rope_head_dim]`. Either part may be a quantized
`QuantizedKVCache` (kvserve.kvstore); reads dequantize to the query dtype.

Decode runs in the *absorbed* form: the query's no-RoPE part has already been multiplied by W_UK
(so it lives in latent space), scores are `q_latent . latent + q_rope . k_rope`, and the output is
the probability-weighted sum of latents (W_UV is applied by the caller). Every head reads the same
latent, so the cache is read once per sequence, not once per head: MQA with a 576-wide key whose
first 512 channels are also the value. `kvserve.kernels.triton.mla_decode` must match this.
"""

from __future__ import annotations

import torch

from kvserve.kernels.quant_reference import gather_blocks_part, gather_slots_part, store_part


def store_latent(latent_cache, rope_cache, latent: torch.Tensor, k_rope: torch.Tensor,
                 slot_mapping: torch.Tensor, window_slots: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None) -> None:
    """latent [T, 1, r], k_rope [T, 1, dr] -> their slots (quantized on write where a part is)."""
    store_part(latent_cache, latent, slot_mapping, window_slots, rows)
    store_part(rope_cache, k_rope, slot_mapping, window_slots, rows)


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache, rope_cache,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         rows: torch.Tensor | None = None) -> torch.Tensor:
    """q_latent [B, H, r], q_rope [B, H, dr] -> latent-space output [B, H, r] in the query dtype.

    Softmax in fp32; probabilities enter P @ latent in the query dtype (as the kernels do). A row
    with context length 0 (CUDA-graph padding) gives zeros."""
    dtype = q_latent.dtype
    latents = gather_blocks_part(latent_cache, block_tables, rows, context_lens, dtype)[:, :, 0]   # [B, L, r]
    ropes = gather_blocks_part(rope_cache, block_tables, rows, context_lens, dtype)[:, :, 0]       # [B, L, dr]
    scores = torch.bmm(q_latent, latents.transpose(1, 2)).float() + torch.bmm(q_rope, ropes.transpose(1, 2)).float()
    length = latents.shape[1]
    lens = context_lens.to(q_latent.device)
    mask = torch.arange(length, device=q_latent.device)[None, :] < lens[:, None]
    scores = scores * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)     # all-masked (padding) rows -> 0
    return torch.bmm(probs.to(dtype), latents)


def gather_context(latent_cache, rope_cache, slots: torch.Tensor, row: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A context's latents [C, r] and RoPE keys [C, dr] at `slots` (for expanded prefill)."""
    latents = gather_slots_part(latent_cache, slots, row, dtype)[:, 0]
    ropes = gather_slots_part(rope_cache, slots, row, dtype)[:, 0]
    return latents, ropes
