"""A real 2-layer Llama rigged to answer every chat with one fixed reply: its attention and MLP
outputs are zeroed, so each next token depends on the last one only (a chain through the
embeddings and lm_head). The tokenizer is the default model's plus `added_tokens`, which lets a
reply hold markers (<think>, <tool_call>) or repeat text as single, distinct tokens."""

from __future__ import annotations

from typing import Optional


def rigged_model(folder, reply: str, added_tokens: list[str], chat_template: Optional[str] = None) -> str:
    import torch
    import transformers

    from kvserve.engine.chat_template import ChatTemplate
    from kvserve.model.loader import resolve_model
    tokenizer = resolve_model(None).load_tokenizer()
    tokenizer.add_tokens(added_tokens)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    ids = ChatTemplate(tokenizer).encode([{"role": "user", "content": "hi"}])        # what the server renders
    chain = [ids[-1]] + tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "a first-order chain needs distinct tokens"
    hidden = 64
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:            # the residual stream stays the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for step, (token, following) in enumerate(zip(chain, chain[1:])):
            embed[token] = 0.0
            embed[token, step] = 1.0
            head[following, step] = 10.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
