"""vLLM-style serve options over HTTP: --chat-template replaces the tokenizer's template, and
--served-model-name takes several names (the first is the one responses carry)."""

from __future__ import annotations

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]


def test_a_chat_template_file_and_model_aliases(tmp_path):
    folder = build_tiny_chat_model(tmp_path / "model", max_position_embeddings=256)
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=256, kv_cache_memory=4 << 20),
                            chat_template=str(template), served_model_name=["tiny", "alias"])
    try:
        messages = [{"role": "user", "content": "Hello there"}]
        tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
        text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()["prompt"]
        assert text == "user: Hello there\nassistant:"
        listed = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]
        assert listed == ["tiny", "alias"]
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"model": "alias", "messages": messages, "max_tokens": 2}).json()
        assert reply["model"] == "tiny" and reply["usage"]["completion_tokens"] == 2
        unknown = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                             json={"model": "other", "messages": messages, "max_tokens": 2})
        assert unknown.status_code == 404
    finally:
        server.stop()
