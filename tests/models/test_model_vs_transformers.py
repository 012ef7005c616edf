"""Our forward pass and greedy decoding against transformers' on the same tiny random weights."""

from __future__ import annotations

import pytest
import torch

from conftest import INVARIANCE_CASES, TEST_DEVICE, assert_batch_invariant, prompt_logprob_errors
from kvserve import LLM, SamplingParams

PROMPTS = [
    [1, 17, 42, 99, 3, 250, 7],
    [1, 5],
    [1] + list(range(30, 90)),          # longer than several blocks
    [1, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211],
]
MAX_NEW = 24


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=TEST_DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         min_new_tokens=max_new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _options(**overrides):
    options = dict(dtype="float32", device=TEST_DEVICE, kv_cache_memory=8 << 20, block_size=16)
    options.update(overrides)
    return options


@pytest.fixture(scope="module")
def engine_llm(tiny_checkpoint):
    folder, hf_model = tiny_checkpoint
    return LLM(folder, **_options()), hf_model


def _assert_logits_match(llm, hf_model, prompt: list[int]) -> None:
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([prompt], device=TEST_DEVICE)).logits[0].float()
    runner = llm.engine.runner
    from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
    n = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=TEST_DEVICE))
    meta.prefills.append(PrefillChunk(0, n, n, None))
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt, device=TEST_DEVICE), torch.arange(n, device=TEST_DEVICE),
                              runner.kv_store, meta, runner.backend)
        ours = runner.model.compute_logits(hidden)
    # fp32 on both sides; differences are GEMM summation order only.
    torch.testing.assert_close(ours, hf_logits, atol=2e-4, rtol=1e-4)


def test_logits_match_transformers(engine_llm):
    llm, hf_model = engine_llm
    _assert_logits_match(llm, hf_model, PROMPTS[2])


def test_logits_match_transformers_over_several_forward_chunks(engine_llm):
    """A 450-token step: the native CPU forward runs each layer over 192-token chunks, each attending to
    the K/V the earlier chunks of the same layer stored."""
    llm, hf_model = engine_llm
    generator = torch.Generator().manual_seed(11)
    _assert_logits_match(llm, hf_model, [1] + torch.randint(3, 256, (449,), generator=generator).tolist())


def test_prompt_logprobs_match_transformers(engine_llm):
    llm, hf_model = engine_llm
    prompt = PROMPTS[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt], device=TEST_DEVICE)).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        assert out.prompt_logprobs[pos][prompt[pos]] == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)


def test_greedy_matches_transformers(engine_llm):
    llm, hf_model = engine_llm
    expected = [_hf_greedy(hf_model, p, MAX_NEW) for p in PROMPTS]
    # min_tokens masks eos exactly as transformers' min_new_tokens does.
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


@pytest.mark.parametrize("case", list(INVARIANCE_CASES))
def test_batch_invariance(tiny_checkpoint, engine_llm, case):
    folder, _ = tiny_checkpoint
    reference_llm, _ = engine_llm
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    alone = [reference_llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
             for p in PROMPTS]
    overrides = INVARIANCE_CASES[case]
    assert_batch_invariant(folder, reference_llm, alone, PROMPTS, MAX_NEW, _options(**overrides), overrides)


def test_bf16_logits_close_to_fp32_transformers(tiny_checkpoint):
    """Half precision changes rounding, not the function: bf16 logits stay near the fp32 reference."""
    folder, hf_model = tiny_checkpoint
    errors = prompt_logprob_errors(LLM(folder, **_options(dtype="bfloat16")), hf_model, PROMPTS[2])
    # On CUDA the fused norm/rotary/SiLU kernels round differently by an ulp; on an H200 the llama case
    # measured max 0.19 at one position of 40 (all others <= 0.09): bound the typical error tightly and
    # the worst loosely.
    assert errors.median().item() < 0.05 and errors.max().item() < 0.3, errors
