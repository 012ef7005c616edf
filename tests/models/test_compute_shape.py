"""kvserve/model/compute_shape.py: FLOPs per token and per attention pair from a model's config,
checked against the weights of transformers' own models built from those configs."""

from __future__ import annotations

import pytest

from kvserve.model.compute_shape import attention_pairs, compute_shape


def _weights_per_token(model, top_k: int = 0, experts: int = 0) -> int:
    """Multiply-adds per token of the decoder layers' linear weights (routed experts: top_k of them)."""
    total = 0
    for name, param in model.model.layers.named_parameters():
        if param.dim() < 2:
            continue                        # norms and biases
        per_expert = ".experts." in name or name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if per_expert and param.dim() == 3:  # stacked experts [E, out, in]
            total += param[0].numel() * top_k
        elif per_expert:
            total += param.numel() * top_k // experts
        else:
            total += param.numel()
    return total


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_models_match_their_weights(arch):
    import transformers
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    config = config_class(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=300, head_dim=16)
    model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[arch](config)
    shape = compute_shape(config)
    assert shape.flops_per_token == 2 * _weights_per_token(model)
    assert shape.flops_per_pair == 3 * 4 * 4 * 16           # layers x (QK + PV: 2 x 2 x heads x head_dim)


def test_deepseek_mla_and_moe_match_their_weights():
    import transformers
    config = transformers.DeepseekV2Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=300)
    model = transformers.DeepseekV2ForCausalLM(config)
    shape = compute_shape(config)
    assert shape.flops_per_token == 2 * _weights_per_token(model, top_k=2, experts=8)
    assert shape.flops_per_pair == 3 * 2 * 4 * (16 + 8 + 16)


def test_the_crossover_of_a_7b_shape_and_pair_counts():
    from transformers import Qwen2Config
    shape = compute_shape(Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                      num_attention_heads=28, num_key_value_heads=4, vocab_size=152064))
    assert 13.0e9 < shape.flops_per_token < 13.2e9
    assert 32_000 < shape.crossover_tokens < 33_000
    assert attention_pairs(0, 4) == 10 and attention_pairs(10, 4) == 50
    # Chunked or not, a prefix's pairs add up the same.
    assert attention_pairs(0, 8192) + attention_pairs(8192, 8192) == attention_pairs(0, 16384)
