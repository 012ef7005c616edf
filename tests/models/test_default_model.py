"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers loading the same GGUF."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import requires_default_model
from kvserve import LLM, SamplingParams
from kvserve.model.loader import default_model_path

pytestmark = requires_default_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "List three uses of a paperclip.",
    "Explain what a KV cache is in one sentence.",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def llm():
    # quantization="none": transformers dequantizes the GGUF at load, so kvserve does too here
    # (the blocks kept quantized are tested in test_gguf_kept_quantized.py).
    return LLM(None, dtype="float32", device="cpu", kv_cache_memory=256 << 20, quantization="none")


@pytest.fixture(scope="module")
def hf_model():
    import transformers
    folder, name = os.path.split(default_model_path())
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(llm):
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_outputs(hf_model, chat_prompts):
    return [_hf_greedy(hf_model, p) for p in chat_prompts]


def test_greedy_equals_transformers_on_real_model(llm, chat_prompts, hf_outputs):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outputs]
    assert ours == hf_outputs
    # The texts are the decoded tokens, without the end-of-turn special token.
    tokenizer = llm.get_tokenizer()
    for output, tokens in zip(outputs, hf_outputs):
        assert output.outputs[0].text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_chat_api_and_string_prompts(llm, hf_outputs):
    chat = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
                    use_tqdm=False)
    assert chat[0].outputs[0].token_ids == hf_outputs[0]
    assert chat[0].outputs[0].finish_reason == "stop"          # ended on <|im_end|>
    text_out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0),
                            use_tqdm=False)[0]
    assert text_out.prompt == "The capital of France is"
    assert text_out.prompt_token_ids == llm.get_tokenizer()("The capital of France is")["input_ids"]
    assert len(text_out.outputs[0].token_ids) == 4


def test_real_model_invariant_to_chunking_and_preemption(llm, chat_prompts, hf_outputs):
    per_token = llm.engine.kv_bytes_per_token
    longest = max(len(p) for p in chat_prompts) + MAX_NEW
    squeezed = LLM(None, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=24,
                   kv_cache_memory=per_token * (longest + 40), quantization="none")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    outputs = squeezed.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_outputs
    engine = squeezed.engine
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_stop_strings_and_seeded_sampling(llm, chat_prompts):
    greedy = llm.generate({"prompt_token_ids": chat_prompts[0]}, SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
                          use_tqdm=False)[0].outputs[0].text
    assert "Paris" in greedy
    stopped = llm.generate({"prompt_token_ids": chat_prompts[0]},
                           SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop=["Paris"]), use_tqdm=False)[0]
    completion = stopped.outputs[0]
    assert completion.text == greedy[: greedy.index("Paris")]
    assert completion.finish_reason == "stop" and completion.stop_reason == "Paris"

    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, n=3)
    first = llm.generate({"prompt_token_ids": chat_prompts[1]}, params, use_tqdm=False)[0]
    # Same seed, different batch company: same samples.
    batch = llm.generate([{"prompt_token_ids": chat_prompts[2]}, {"prompt_token_ids": chat_prompts[1]}],
                         [SamplingParams(max_tokens=8, temperature=0.8), params], use_tqdm=False)[1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in batch.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1      # the n samples differ


def test_logprobs_are_consistent(llm, chat_prompts):
    out = llm.generate({"prompt_token_ids": chat_prompts[0]},
                       SamplingParams(max_tokens=8, temperature=0.0, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) <= 4
        assert entry[token] == pytest.approx(max(entry.values()))   # greedy picks the top logprob
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(out.logprobs, out.token_ids)))
