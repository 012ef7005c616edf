"""What a forward computes per token, from the model's config: the weight FLOPs every token pays, and
the attention FLOPs each (query, key) pair adds.

A prompt's prefill time is not proportional to its length: each new token attends to every token
before it, so a 32k-token prefill does about half again the work per token of an 8k one on an
R1-Distill-Qwen-7B shape. The cost models that weigh a recompute against a load (the cold tiers'
read-or-compute choice, --preemption-mode auto) charge both parts (kvserve/sched/preemption_cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ComputeShape:
    flops_per_token: float         # the decoder layers' weights, 2 FLOPs per multiply-add
    flops_per_pair: float          # QK^T and PV over all layers for one (query, key) pair

    @property
    def crossover_tokens(self) -> float:
        """The context length at which a token's attention costs as much as its weights."""
        return self.flops_per_token / self.flops_per_pair if self.flops_per_pair else float("inf")


def attention_pairs(context_tokens: int, new_tokens: int) -> int:
    """(query, key) pairs of `new_tokens` causal queries after `context_tokens` cached ones."""
    return new_tokens * context_tokens + new_tokens * (new_tokens + 1) // 2


def compute_shape(config: Any) -> ComputeShape:
    """From a transformers config of the architectures kvserve runs (Llama, Qwen2, DeepSeek V2/V3
    with MLA and MoE). The LM head is left out: a prefill computes logits for one token per sequence."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    layers = config.num_hidden_layers
    inter = config.intermediate_size
    if getattr(config, "kv_lora_rank", None):                     # MLA
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        v = config.v_head_dim
        q_lora = getattr(config, "q_lora_rank", None)
        q = hidden * q_lora + q_lora * heads * qk if q_lora else hidden * heads * qk
        kv = hidden * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank * heads * (
            config.qk_nope_head_dim + v)
        attention = q + kv + heads * v * hidden
        pair = 2 * heads * (qk + v)
    else:
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        pair = 4 * heads * head_dim
    dense_mlp = 3 * hidden * inter
    experts = getattr(config, "n_routed_experts", None)
    if experts:
        first_dense = getattr(config, "first_k_dense_replace", 0) or 0
        moe_inter = config.moe_intermediate_size
        moe_mlp = (3 * hidden * moe_inter * (config.num_experts_per_tok + (getattr(config, "n_shared_experts", 0) or 0))
                   + hidden * experts)
        mlp = first_dense * dense_mlp + (layers - first_dense) * moe_mlp
    else:
        mlp = layers * dense_mlp
    return ComputeShape(flops_per_token=2.0 * (layers * attention + mlp), flops_per_pair=float(layers * pair))
