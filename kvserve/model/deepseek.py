"""DeepSeek-V2 / V3 family (DeepSeek-V2(-Lite), V2.5, V3, R1): MLA attention + DeepSeek MoE.

Layer i is [RMSNorm, MLA (kvserve/model/mla.py), RMSNorm, MLP], where the MLP is a dense SwiGLU for
the first `first_k_dense_replace` layers and DeepseekMoE (kvserve/model/moe.py) after. The KV
cache holds one latent + RoPE key per token and layer (kvserve/model/mla_cache.py); the model
tells the runner so through `build_kv_cache_spec`.

Weight loading maps checkpoint names onto the fused layout:
- q_a_proj (or q_proj) and kv_a_proj_with_mqa rows -> one `qkv_a_proj` GEMM;
- per-expert `experts.{e}.{gate,up,down}_proj` (checkpoints) or transformers' stacked
  `experts.gate_up_proj` / `experts.down_proj` -> `w13` [E, 2I, H] / `w2` [E, H, I];
- `mlp.gate.weight` -> the fp32 router weight;
- RoPE rows of q and of the shared key are de-interleaved: DeepSeek checkpoints rotate adjacent
  pairs (x0, x1), (x2, x3), ...; permuting those rows to (x0, x2, ..., x1, x3, ...) in both q and k
  leaves every q.k product unchanged and lets the standard half-split rotary (and its CUDA kernel)
  apply. Only V3 configs with `rope_interleave: false` are already half-split.
- multi-token-prediction layers (V3's layer index >= num_hidden_layers) are skipped.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from kvserve.attention.interface import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kvstore import KVCacheStore
from kvserve.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from kvserve.model.mla import MLAAttention
from kvserve.model.mla_cache import MLAKVCacheSpec, build_mla_kv_cache_spec
from kvserve.model.moe import DeepseekMoE, collect_expert_load, reset_expert_load
from kvserve.stats import ExpertLoadStats


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_index: int, v3: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # As transformers: every layer from first_k_dense_replace on is MoE (the checkpoints'
        # moe_layer_freq is 1).
        if cfg.n_routed_experts and layer_index >= (cfg.first_k_dense_replace or 0):
            self.mlp: nn.Module = DeepseekMoE(cfg, v3)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, hidden, residual, cos, sin, kv_cache, meta, backend, token_weight):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if isinstance(self.mlp, DeepseekMoE):
            return self.mlp(hidden, token_weight), residual
        return self.mlp(hidden), residual


class DeepseekV2ForCausalLM(nn.Module):
    is_v3 = False

    def __init__(self, hf_config) -> None:
        super().__init__()
        cfg = hf_config
        quant = getattr(cfg, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
            raise ValueError(f"quantized DeepSeek checkpoints ({method}) are not supported; use a bf16 checkpoint")
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, self.is_v3) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, cfg.qk_rope_head_dim)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # V2 always rotates interleaved pairs (complex multiply); V3 says so in its config.
        self.rope_interleaved = bool(getattr(cfg, "rope_interleave", True)) if self.is_v3 else True

    # --- what the runner and KV cache need to know -------------------------------------------
    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_head_shape(self) -> tuple[int, int]:
        """One latent "head" per token: kv_lora_rank + qk_rope_head_dim values (no V cache)."""
        return 1, self.config.kv_lora_rank + self.config.qk_rope_head_dim

    def build_kv_cache_spec(self, model_dtype: torch.dtype, options: dict[str, Any]) -> MLAKVCacheSpec:
        """The latent-cache spec from CacheConfig's kv_* options (see mla_cache.py)."""
        return build_mla_kv_cache_spec(self.num_kv_layers, self.config.kv_lora_rank, self.config.qk_rope_head_dim,
                                       model_dtype, **options)

    def set_moe_implementation(self, name: str) -> None:
        for module in self.modules():
            if isinstance(module, DeepseekMoE):
                module.implementation = name

    def expert_load(self) -> Optional[ExpertLoadStats]:
        return collect_expert_load(self)

    def reset_expert_load(self) -> None:
        reset_expert_load(self)

    # --- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_store: KVCacheStore,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        # Padding rows of a CUDA-graph batch have slot -1: they must not count as expert load.
        token_weight = (meta.slot_mapping >= 0).to(torch.int64)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_store):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta, backend, token_weight)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the fused parameters; every element must be written once."""
        params = dict(self.named_parameters())
        written = {name: 0 for name in params}
        for name, tensor in weights:
            for target, index, value in self._map_weight(name, tensor):
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                param = params[target]
                with torch.no_grad():
                    dest = param.data if index is None else param.data[index]
                    if dest.shape != value.shape:
                        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, "
                                         f"expected {tuple(dest.shape)}")
                    dest.copy_(value)
                written[target] += dest.numel()
        bad = [name for name, count in written.items() if count != params[name].numel()]
        if bad:
            raise ValueError(f"checkpoint leaves {len(bad)} parameters unwritten or written twice, "
                             f"e.g. {sorted(bad)[:3]}")

    def _map_weight(self, name: str, tensor: torch.Tensor):
        """(target parameter, index or None, value) for one checkpoint tensor; [] to skip it."""
        cfg = self.config
        if "rotary_emb" in name:
            return []
        if name == "lm_head.weight":
            return [] if self.tie_word_embeddings else [("lm_head.weight", None, tensor)]
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[0] != "layers":
            return [(name, None, tensor)]
        layer = int(parts[1])
        if layer >= cfg.num_hidden_layers:          # V3 multi-token-prediction layers
            return []
        prefix, rest = f"layers.{layer}", ".".join(parts[2:])
        attn = self.layers[layer].self_attn
        if rest.startswith("self_attn."):
            return self._map_attention(prefix, attn, rest.removeprefix("self_attn."), tensor)
        if rest.startswith("mlp."):
            return self._map_mlp(prefix, layer, rest.removeprefix("mlp."), tensor)
        return [(f"{prefix}.{rest}", None, tensor)]

    def _deinterleave_rows(self, tensor: torch.Tensor, rope_start: int, period: int) -> torch.Tensor:
        """Permutes the RoPE rows [rope_start, rope_start + rope_dim) of every `period` rows."""
        if not self.rope_interleaved:
            return tensor
        rope_dim = self.config.qk_rope_head_dim
        perm = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
        blocks = tensor.reshape(-1, period, *tensor.shape[1:]).clone()
        blocks[:, rope_start:rope_start + rope_dim] = blocks[:, rope_start + perm]
        return blocks.reshape(tensor.shape)

    def _map_attention(self, prefix: str, attn: MLAAttention, rest: str, tensor: torch.Tensor):
        module, kind = rest.rsplit(".", 1)
        kv_a_rows = attn.kv_lora_rank + attn.rope_dim
        if module == "kv_a_proj_with_mqa":
            tensor = self._deinterleave_rows(tensor, attn.kv_lora_rank, kv_a_rows)
            if attn.fused_q:
                return [(f"{prefix}.self_attn.qkv_a_proj.{kind}", slice(attn.q_width, attn.q_width + kv_a_rows),
                         tensor)]
        elif module in ("q_proj", "q_b_proj"):
            tensor = self._deinterleave_rows(tensor, attn.nope_dim, attn.qk_dim)
            if module == "q_proj" and attn.fused_q:
                return [(f"{prefix}.self_attn.qkv_a_proj.{kind}", slice(0, attn.q_width), tensor)]
        elif module == "q_a_proj":
            return [(f"{prefix}.self_attn.qkv_a_proj.{kind}", slice(0, attn.q_width), tensor)]
        return [(f"{prefix}.self_attn.{module}.{kind}", None, tensor)]

    def _map_mlp(self, prefix: str, layer: int, rest: str, tensor: torch.Tensor):
        mlp = self.layers[layer].mlp
        if not isinstance(mlp, DeepseekMoE):        # dense layer: gate/up fused like Llama's
            return self._map_swiglu(f"{prefix}.mlp", rest, tensor, mlp)
        inter = mlp.intermediate_size
        if rest == "gate.weight":
            return [(f"{prefix}.mlp.gate_weight", None, tensor.float())]
        if rest == "gate.e_score_correction_bias":
            return [(f"{prefix}.mlp.e_score_correction_bias", None, tensor.float())]
        if rest.startswith("shared_experts."):
            return self._map_swiglu(f"{prefix}.mlp.shared_experts", rest.removeprefix("shared_experts."), tensor,
                                    mlp.shared_experts)
        parts = rest.split(".")
        if rest == "experts.gate_up_proj":          # transformers' stacked layout [E, 2I, H]
            return [(f"{prefix}.mlp.w13", None, tensor)]
        if rest == "experts.down_proj":             # [E, H, I]
            return [(f"{prefix}.mlp.w2", None, tensor)]
        if parts[0] == "experts" and len(parts) == 4:   # experts.{e}.{gate,up,down}_proj.weight
            expert, proj = int(parts[1]), parts[2]
            if proj == "gate_proj":
                return [(f"{prefix}.mlp.w13", (expert, slice(0, inter)), tensor)]
            if proj == "up_proj":
                return [(f"{prefix}.mlp.w13", (expert, slice(inter, 2 * inter)), tensor)]
            if proj == "down_proj":
                return [(f"{prefix}.mlp.w2", expert, tensor)]
        return [(f"{prefix}.mlp.{rest}", None, tensor)]

    @staticmethod
    def _map_swiglu(prefix: str, rest: str, tensor: torch.Tensor, mlp: SwiGLU):
        proj, kind = rest.rsplit(".", 1)
        inter = mlp.intermediate_size
        if proj == "gate_proj":
            return [(f"{prefix}.gate_up_proj.{kind}", slice(0, inter), tensor)]
        if proj == "up_proj":
            return [(f"{prefix}.gate_up_proj.{kind}", slice(inter, 2 * inter), tensor)]
        return [(f"{prefix}.{rest}", None, tensor)]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    is_v3 = True


MODEL_CLASSES = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
