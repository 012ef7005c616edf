"""One chat-template renderer (kvserve/engine/chat_template.py) for `LLM.chat` and the server: the same
messages give the engine the same prompt token ids through either, and the renderer's own checks.

The end-to-end test uses a tiny random Llama with the default model's real tokenizer and chat
template, plus a hook that renders the template variable `note`, so that template variables are
seen to reach the template through both doors.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from conftest import requires_default_model

NOTE_HOOK = "{% if note is defined %}[note: {{ note }}]{% endif %}"

# (messages, request options): each as LLM.chat takes them and as the chat endpoint does.
CASES = [
    ([{"role": "user", "content": "Name an animal."}], {}),
    ([{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"},
      {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"}], {}),
    ([{"role": "user", "content": "Say hi."}], {"add_generation_prompt": False}),
    ([{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    ([{"role": "user", "content": "Hello."}], {"chat_template_kwargs": {"note": "from the caller"}}),
]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    import transformers

    from loopback_server import build_tiny_chat_model
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-template"), max_position_embeddings=512)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = tokenizer.chat_template + NOTE_HOOK
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@requires_default_model
def test_llm_chat_and_the_server_render_the_same_prompt_tokens(tiny_chat_model):
    from loopback_server import LoopbackServer

    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams
    llm = LLM(tiny_chat_model, max_model_len=512, kv_cache_memory=8 << 20)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    offline = []
    for messages, options in CASES:   # before the server: its engine thread then owns the engine
        [output] = llm.chat(messages, params, use_tqdm=False, **options)
        offline.append(output.prompt_token_ids)
    assert "[note: from the caller]" in llm.get_tokenizer().decode(offline[-1])
    assert offline[0] != offline[2]        # add_generation_prompt made a difference
    reference = llm.get_tokenizer().apply_chat_template(CASES[1][0], add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]
    assert offline[1] == list(reference)   # what transformers' tokenize=True gives

    server = LoopbackServer(llm.engine)
    submitted: list[list[int]] = []
    async_engine = server.app.state.async_engine
    add_request = async_engine.add_request

    async def recording_add_request(request_id, prompt, params, **kwargs):
        submitted.append(list(prompt["prompt_token_ids"]))
        return await add_request(request_id, prompt, params, **kwargs)

    async_engine.add_request = recording_add_request
    try:
        for (messages, options), expected in zip(CASES, offline):
            body = {"messages": messages, "max_tokens": 1, "temperature": 0, **options}
            response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert submitted[-1] == expected, options
            assert response.json()["usage"]["prompt_tokens"] == len(expected)
            if not options.get("continue_final_message"):    # /v1/tokenize renders with the same code
                tokenize = {key: value for key, value in body.items() if key not in ("max_tokens", "temperature")}
                assert httpx.post(server.url + "/v1/tokenize", json=tokenize, timeout=60).json()["tokens"] == expected
        assert len(submitted) == len(CASES)
    finally:
        server.stop()


def _tokenizer(template):
    return SimpleNamespace(chat_template=template, special_tokens_map={"bos_token": "<s>"})


def test_the_renderer_refuses_what_no_template_can_render():
    from kvserve.engine.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplateError
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(NoChatTemplateError, match="no tokenizer"):
        ChatTemplate(None).encode(hi)
    with pytest.raises(NoChatTemplateError, match="no chat template") as info:
        ChatTemplate(_tokenizer(None)).encode(hi)
    assert isinstance(info.value, ValueError)       # what LLM.chat raised before, still
    template = ChatTemplate(_tokenizer("{{ messages }}"))
    with pytest.raises(ChatTemplateError, match="cannot both be true") as info:
        template.check(hi, add_generation_prompt=True, continue_final_message=True)
    assert info.value.param == "continue_final_message"
    with pytest.raises(ChatTemplateError, match="final assistant message") as info:
        template.check(hi, add_generation_prompt=False, continue_final_message=True)
    assert info.value.param == "messages"
    template.check(hi + [{"role": "assistant", "content": "he"}], add_generation_prompt=False,
                   continue_final_message=True)


def test_the_renderer_passes_tools_and_variables_to_the_template():
    from kvserve.engine.chat_template import ChatTemplate
    calls = []

    class Tokenizer:
        chat_template = "{{ messages }}"
        special_tokens_map = {"eos_token": "</s>"}

        def apply_chat_template(self, conversation, tools=None, add_generation_prompt=False,
                                continue_final_message=False, tokenize=True, padding=False, **kwargs):
            calls.append(dict(conversation=conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tokenize=tokenize, **kwargs))
            return "rendered"

        def __call__(self, text, add_special_tokens=True):
            assert text == "rendered" and add_special_tokens is False
            return {"input_ids": [7, 8]}

    template = ChatTemplate(Tokenizer())
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert template.encode([{"role": "user", "content": "hi"}], tools=tools, variables={"enable_thinking": False}) \
        == [7, 8]
    assert calls == [dict(conversation=[{"role": "user", "content": "hi"}], tools=tools, add_generation_prompt=True,
                          continue_final_message=False, tokenize=False, enable_thinking=False)]
    # Not template variables: the call's own parameters, the context's names, the special tokens.
    assert {"padding", "tokenize", "messages", "tools", "eos_token", "raise_exception"} <= template.reserved_names
    assert "enable_thinking" not in template.reserved_names
