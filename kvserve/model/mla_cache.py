"""The KV-cache spec of MLA models: per layer a latent part and a RoPE-key part, not K and V.

A DeepSeek-V2/V3 layer caches, per token, the normalised KV latent (kv_lora_rank, 512) and the
rotated shared RoPE key (qk_rope_head_dim, 64): one "head" of 576 values instead of K and V for
every head. The spec reuses the KV-format machinery of kvserve.kvstore with the two parts
in the places of K and V, each with its own width:

- part 0 ("k" in format options and scale files) is the latent, `[blocks, block_size, 1, r]`;
- part 1 ("v") is the RoPE key, `[blocks, block_size, 1, dr]`.

So the quantized formats apply to the latent: `kv_cache_dtype=fp8_e4m3` stores an fp8 latent with
one fp16 scale per token (or per `kv_quant_group_size` channels), while the RoPE key stays in the
model dtype unless `kv_cache_dtype_v` asks otherwise: it is 11% of the bytes and carries the
position signal, which quantization hurts most (FlashMLA's fp8 cache makes the same choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.config import resolve_format_name
from kvserve.kvstore.spec import KVCacheSpec, build_kv_cache_spec


@dataclass
class MLAKVCacheSpec(KVCacheSpec):
    """`head_dim` is the latent width (kv_lora_rank); `rope_dim` the RoPE key's; one head each."""

    rope_dim: int = 0

    def part_dims(self) -> tuple[int, int]:
        return self.head_dim, self.rope_dim

    def describe(self) -> str:
        names = sorted({f"{k.name}/{v.name}" for k, v in self.layer_formats})
        extra = f", window {self.window}, sinks {self.sinks}" if self.needs_rows else ""
        return (f"MLA latent {self.head_dim} + rope {self.rope_dim} ({','.join(names)}){extra}, "
                f"{self.bytes_per_token} bytes/token")


def build_mla_kv_cache_spec(num_layers: int, kv_lora_rank: int, rope_dim: int, model_dtype: torch.dtype,
                            **options: Any) -> MLAKVCacheSpec:
    """The spec from CacheConfig's kv_* options: `kv_cache_dtype` / `kv_cache_dtype_k` choose the
    latent's format, `kv_cache_dtype_v` the RoPE key's (default: the model dtype)."""
    options = dict(options)
    # An int4 latent keeps per-token scales (and its window) under auto: per-channel latents were not
    # measured (docs/deepseek.md).
    if options.get("kv_quant_key_layout", "auto") == "auto":
        options["kv_quant_key_layout"] = "token"
    latent_name = options.pop("kv_cache_dtype_k", None) or options.get("kv_cache_dtype", "auto")
    rope_name = options.pop("kv_cache_dtype_v", None) or "auto"
    options.pop("kv_cache_dtype", None)
    # Each part is validated (group sizes, int4 packing) against its own width.
    latent = build_kv_cache_spec(num_layers, 1, kv_lora_rank, model_dtype, kv_cache_dtype=latent_name,
                                 kv_cache_dtype_v=resolve_format_name(latent_name), **options)
    rope = build_kv_cache_spec(num_layers, 1, rope_dim, model_dtype, kv_cache_dtype=rope_name, **options)
    formats = [(lat[0], rp[1]) for lat, rp in zip(latent.layer_formats, rope.layer_formats)]
    static = {name: scale for name, scale in latent.static_scales.items() if name.endswith(".k")}
    static.update({name: scale for name, scale in rope.static_scales.items() if name.endswith(".v")})
    any_quantized = any(fmt.quantized for pair in formats for fmt in pair)
    # The window/sink defaults depend on the formats (int4 gets a window); take them from the part
    # that is quantized.
    source = latent if any(pair[0].quantized for pair in formats) else rope
    return MLAKVCacheSpec(formats, 1, kv_lora_rank, model_dtype,
                          source.window if any_quantized else 0, source.sinks if any_quantized else 0,
                          source.error_feedback, static, rope_dim=rope_dim)


def mha_equivalent_bytes_per_token(hf_config, dtype_bytes: int = 2) -> dict[str, int]:
    """KV bytes per token of the layouts MLA replaces, for the same config (all layers, 16-bit):
    - `mha`: K (qk_nope + qk_rope per head) and V (v_head_dim per head) for every head, which is
      what an expanded cache (transformers' eager path before 5.x, or a naive port) stores;
    - `mla`: the latent + RoPE key.
    """
    layers, heads = hf_config.num_hidden_layers, hf_config.num_attention_heads
    qk = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    mha = layers * heads * (qk + hf_config.v_head_dim) * dtype_bytes
    mla = layers * (hf_config.kv_lora_rank + hf_config.qk_rope_head_dim) * dtype_bytes
    return {"mha": mha, "mla": mla}
