"""--reasoning-parser over HTTP: a chat reply's think goes to `reasoning_content`, the answer to
`content`, in a whole response and in stream deltas, with `usage.completion_tokens_details.
reasoning_tokens`. The model is a real 2-layer Llama rigged to answer every chat with one fixed
reply (its attention and MLP outputs zeroed, so each next token depends on the last one only: a
chain through the embeddings and lm_head), with the default model's tokenizer plus R1's `<think>`
and `</think>` tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer

pytestmark = [pytest.mark.slow, requires_default_model]

THINK, ANSWER = "Let me see", "The answer is four"


def _rigged_model(folder) -> str:
    import torch
    import transformers

    from kvserve.model.loader import resolve_model
    tokenizer = resolve_model(None).load_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    from kvserve.engine.chat_template import ChatTemplate
    ids = ChatTemplate(tokenizer).encode([{"role": "user", "content": "hi"}])        # what the server renders
    chain = [ids[-1]] + tokenizer.encode(f"<think>{THINK}</think>{ANSWER}", add_special_tokens=False)
    chain.append(tokenizer.eos_token_id)
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


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def server(request, tmp_path_factory):
    folder = _rigged_model(tmp_path_factory.mktemp("rigged-think"))
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=512, kv_cache_memory=8 << 20),
                            reasoning_parser=request.param)
    yield server.url
    server.stop()


def _chat(url: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_the_think_goes_to_reasoning_content(server):
    reply = _chat(server).json()
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THINK, ANSWER)
    # <think>, Let, me, see, </think>
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


def test_a_think_cut_at_max_tokens_is_all_reasoning(server):
    message = _chat(server, max_tokens=3).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me" and message["content"] == ""


def test_streamed_deltas_carry_each_part(server):
    reasoning, content, usage = "", "", None
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk["choices"]:
                reasoning += choice["delta"].get("reasoning_content", "")
                content += choice["delta"].get("content", "")
            usage = chunk.get("usage") or usage
    assert (reasoning, content) == (THINK, ANSWER)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 5
