"""The real default model (SmolLM2-135M-Instruct): greedy outputs of a multi-turn chat with prefix
hits equal the outputs of an engine without prefix caching (which tests/models/test_default_model.py
checks against transformers), token for token."""

from __future__ import annotations

from conftest import requires_default_model
from kvserve import LLM, SamplingParams

pytestmark = requires_default_model

SYSTEM = ("You are a concise assistant for a hardware store. Answer in one or two sentences and "
          "mention the aisle number when you know it.")
QUESTIONS = [["Where are the screws?", "And the matching wall plugs?"],
             ["Do you sell paint rollers?", "Which size for a ceiling?"]]


def _chat_turns(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Runs the conversations turn by turn (each turn's prompt holds the earlier answers);
    returns each turn's output tokens and the prefix-cache hit tokens of each request."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs, hits = [], []
    histories = [[{"role": "system", "content": SYSTEM}] for _ in QUESTIONS]
    for turn in range(2):
        for history, questions in zip(histories, QUESTIONS):
            history.append({"role": "user", "content": questions[turn]})
            before = llm.engine.prefix.stats.hit_tokens
            out = llm.chat(history, params, use_tqdm=False)[0].outputs[0]
            hits.append(llm.engine.prefix.stats.hit_tokens - before)
            outputs.append(out.token_ids)
            history.append({"role": "assistant", "content": out.text})
    return outputs, hits


def test_multi_turn_chat_with_hits_equals_cold_run():
    warm = LLM(None, dtype="float32", device="cpu", kv_cache_memory=128 << 20, eviction_policy="adaptive")
    warm_outputs, hits = _chat_turns(warm)
    cold = LLM(None, dtype="float32", device="cpu", kv_cache_memory=128 << 20, enable_prefix_caching=False)
    cold_outputs, cold_hits = _chat_turns(cold)
    assert warm_outputs == cold_outputs
    assert cold_hits == [0, 0, 0, 0]
    # First conversation's first turn is cold; the second conversation reuses the system prompt,
    # and second turns reuse their whole first turn (prompt and answer).
    assert hits[0] == 0 and hits[1] >= 16
    assert hits[2] > hits[1] and hits[3] > hits[1]
    engine = warm.engine
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
