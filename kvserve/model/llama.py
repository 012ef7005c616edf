"""Llama and Qwen2 families (Llama 2/3, SmolLM2, DeepSeek-R1-Distill-Llama/Qwen): GQA + RoPE.

The model sees a flat batch of tokens ([T]) with their positions and an AttentionMetadata; it never
sees requests. Q/K/V and gate/up projections are fused into single GEMMs: fewer kernel launches,
one read of the activations.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kvserve.attention.interface import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kvstore import KVCacheStore, LayerKV
from kvserve.model.layers import (Linear, RMSNorm, RotaryEmbedding, SwiGLU, UsesKernelSwitches, rotary_and_store_kv,
                                  rotate_queries_and_keys, split_qkv)
from kvserve.model.loader.common import QuantizedWeight
from kvserve.model.quantized_linear import QuantizedPart, install_quantized_linears


class LlamaAttention(UsesKernelSwitches, nn.Module):
    def __init__(self, cfg, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKV, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if backend.stores_kv_with_rotary and self.switches.fused(qkv) and kv_cache.full_precision:
            # One kernel rotates q/k and writes K/V into the cache; the backend then only attends.
            rotary_and_store_kv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin,
                                kv_cache[0], kv_cache[1], meta.slot_mapping)
            q, k, v = split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
            if meta.observe is not None:
                meta.observe.record(q)
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_stored=True)
        else:
            q, k, v = rotate_queries_and_keys(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin,
                                              self.switches)
            if meta.observe is not None:
                meta.observe.record(q)
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, qkv_bias, o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=getattr(cfg, "mlp_bias", False))

    def forward(self, hidden, residual, cos, sin, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer output, residual stream) in and out: each residual add is fused into the next
        norm (one kernel on CUDA). Adds stay in the model dtype, as in transformers."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    # Qwen2 always has a bias on q/k/v and none on o; Llama has one flag for all four.
    has_qwen2_bias = False

    def __init__(self, hf_config) -> None:
        super().__init__()
        cfg = hf_config
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        if self.has_qwen2_bias:
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(cfg, "attention_bias", False))
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, qkv_bias, o_bias) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        first_attn = self.layers[0].self_attn
        self.rotary = RotaryEmbedding(cfg, first_attn.head_dim)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tie_word_embeddings:
            # One parameter under two names; named_parameters() lists it once, as embed_tokens.
            self.lm_head.weight = self.embed_tokens.weight

    # --- what the runner and KV cache need to know -------------------------------------------
    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_head_shape(self) -> tuple[int, int]:
        attn = self.layers[0].self_attn
        return attn.num_kv_heads, attn.head_dim

    # --- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_store: KVCacheStore, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_store):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta, backend)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor | QuantizedWeight"]]) -> None:
        """Copies HF-named tensors into the fused parameters; every parameter must be covered. A linear's
        weight given as GGUF blocks (`QuantizedWeight`) stays in them: the linear becomes a
        QuantizedLinear (kvserve/model/quantized_linear.py); a tied embedding's blocks serve lm_head so,
        while the embedding's lookup table is dequantized."""
        params = dict(self.named_parameters())
        linears = {name for name, module in self.named_modules() if isinstance(module, nn.Linear)}
        pending: dict[str, list[QuantizedPart]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            target, rows = self._map_weight_name(name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            record = target if rows is None else f"{target}[{rows.start}:{rows.stop}]"
            if isinstance(tensor, QuantizedWeight):
                module_name = target.removesuffix(".weight")
                if module_name in linears:
                    self._check_shape(name, tensor.shape, params[target], rows)
                    pending.setdefault(module_name, []).append(QuantizedPart(rows, tensor))
                    loaded.add(record)
                    continue
                if target == "embed_tokens.weight" and self.tie_word_embeddings:
                    pending["lm_head"] = [QuantizedPart(None, tensor)]
                tensor = tensor.dequantize()
            param = params[target]
            self._check_shape(name, tuple(tensor.shape), param, rows)
            with torch.no_grad():
                (param.data if rows is None else param.data[rows]).copy_(tensor)
            loaded.add(record)
        missing = self._expected_loads() - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        install_quantized_linears(self, pending)

    @staticmethod
    def _check_shape(name: str, shape: tuple[int, ...], param: torch.Tensor, rows: slice | None) -> None:
        expected = tuple((param.data if rows is None else param.data[rows]).shape)
        if tuple(shape) != expected:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(shape)}, expected {expected}")

    def _fused_slices(self) -> dict[str, tuple[str, slice]]:
        attn = self.layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        inter = self.layers[0].mlp.intermediate_size
        return {
            "q_proj": ("self_attn.qkv_proj", slice(0, q)),
            "k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
            "v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
            "gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
            "up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
        }

    def _map_weight_name(self, name: str) -> tuple[str | None, slice | None]:
        if "rotary_emb" in name:
            return None, None
        if name == "lm_head.weight":
            return (None, None) if self.tie_word_embeddings else ("lm_head.weight", None)
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[0] == "layers":
            # layers.N.(self_attn|mlp).X_proj.(weight|bias)
            prefix, proj, kind = ".".join(parts[:2]), parts[3], parts[-1]
            fused = self._fused_slices().get(proj)
            if fused is not None:
                return f"{prefix}.{fused[0]}.{kind}", fused[1]
        return name, None

    def _expected_loads(self) -> set[str]:
        expected = set()
        fused_targets = {target for target, _ in self._fused_slices().values()}
        for name, _ in self.named_parameters():
            parts = name.split(".")
            module = ".".join(parts[2:4]) if parts[0] == "layers" else ""
            if module in fused_targets:
                prefix, kind = ".".join(parts[:2]), parts[-1]
                for target, rows in self._fused_slices().values():
                    if target == module:
                        expected.add(f"{prefix}.{target}.{kind}[{rows.start}:{rows.stop}]")
            else:
                expected.add(name)
        return expected


class Qwen2ForCausalLM(LlamaForCausalLM):
    has_qwen2_bias = True


MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
