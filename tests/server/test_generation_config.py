"""The model's generation_config.json: its sampling defaults fill the fields a request leaves unset
(`--generation-config auto`, the default; `none` keeps kvserve's), and its eos_token_id list stops
generation."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import requires_default_model
from kvserve.model.loader.generation_config import eos_token_ids, sampling_defaults
from loopback_server import LoopbackServer, build_tiny_chat_model

pytestmark = [pytest.mark.slow, requires_default_model]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-genconfig"), max_position_embeddings=256)
    path = f"{folder}/generation_config.json"
    config = json.load(open(path))
    config.update(temperature=0.0, top_p=0.5, max_new_tokens=5, eos_token_id=[7, 9], do_sample=True)
    json.dump(config, open(path, "w"))
    return folder


def test_the_file_is_read(folder, tmp_path):
    assert sampling_defaults(folder) == {"temperature": 0.0, "top_p": 0.5, "max_tokens": 5}
    assert eos_token_ids(folder) == {7, 9}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(str(tmp_path)) == {} and sampling_defaults(str(tmp_path / "nowhere")) == {}


def test_the_engine_stops_at_every_eos_the_file_lists(folder):
    from kvserve.engine.engine import Engine
    engine = Engine.from_options(model=folder, kv_cache_memory=4 << 20, max_model_len=256)
    assert {7, 9} <= engine.eos_token_ids


@pytest.mark.parametrize("mode", ["auto", "none", "vllm"])
def test_unset_fields_take_the_models_defaults(folder, mode):
    server = LoopbackServer(engine_options=dict(model=folder, max_model_len=256, kv_cache_memory=4 << 20),
                            generation_config=mode)
    try:
        body = {"messages": [{"role": "user", "content": "Tell me a story"}], "seed": 1}
        replies = [httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json() for _ in range(2)]
        explicit = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 8, "temperature": 1.0},
                              timeout=60).json()
    finally:
        server.stop()
    tokens = [reply["usage"]["completion_tokens"] for reply in replies]
    if mode == "auto":      # max_new_tokens 5 and greedy from the file
        assert tokens == [5, 5]
        assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]
    else:                   # kvserve's defaults: up to the context's end
        assert all(count > 5 for count in tokens)
    assert explicit["usage"]["completion_tokens"] == 8          # a field the request sets wins


def test_the_offline_api_defaults_to_the_models_sampling(folder):
    from kvserve import LLM
    with LLM(folder, kv_cache_memory=4 << 20, max_model_len=256) as llm:
        assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().max_tokens) == (0.0, 5)
        outputs = [llm.generate(["Once upon a time"], use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert len(outputs[0]) <= 5 and outputs[0] == outputs[1]
