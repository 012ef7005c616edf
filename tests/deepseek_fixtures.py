"""Tiny random DeepSeek-V2 / V3 checkpoints built from transformers' own config classes."""

from __future__ import annotations

import torch

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def tiny_deepseek_config(arch: str):
    import transformers
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1, first_k_dense_replace=1,
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.15, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, rope_parameters=dict(YARN))
    if arch == "deepseek_v2":
        # V2-Lite's shape in miniature: no q LoRA, softmax routing limited to 2 of 4 groups.
        return transformers.DeepseekV2Config(**common, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                                             topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             routed_scaling_factor=1.5, norm_topk_prob=False)
    if arch == "deepseek_v3":
        # V3/R1 in miniature: q LoRA, sigmoid routing with correction bias, groups, normalised weights.
        return transformers.DeepseekV3Config(**common, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3,
                                             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                             rope_interleave=True)
    raise ValueError(arch)


def build_tiny_deepseek(arch: str, folder, device: str = "cpu", config=None) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    config = config or tiny_deepseek_config(arch)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                # transformers initialises the router from initializer_range and the V3 bias to zero;
                # a random bias makes the test see whether it steers the choice.
                gate.weight.normal_(0, 0.5)
                if hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0, 0.3)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model.to(device)
