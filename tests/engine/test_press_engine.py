"""Presses in the paged engine: the KV really shrinks (blocks back in the pool, the request's table
shorter), decoding after a press equals transformers attending only to the kept tokens at their
original positions, keep ratio 1.0 is a no-op, blocks the press rewrote never reach the prefix cache,
the token budget holds as the output grows, and bad press requests are refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import LLM, SamplingParams
from kvserve.engine.engine import Engine
from kvserve.kvcache.manager import blocks_for_tokens
from kvserve.sched.scheduler import RequestRejected

BLOCK = 16
_RNG = random.Random(7)
PROMPT = [1] + [_RNG.randrange(3, 250) for _ in range(299)]     # 300 tokens
MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("press-llama")
    model = build_tiny_checkpoint("llama", path)
    return str(path), model


def _engine(folder: str, **options) -> Engine:
    base = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, block_size=BLOCK,
                max_model_len=512, kv_press_min_tokens=32, async_scheduling="off")
    return Engine.from_options(**{**base, **options})


def _run(engine: Engine, prompt: list[int], params: SamplingParams, request_id: str = "r"):
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return [o for o in outputs if o.finished][-1].outputs[0].token_ids


def _greedy(**press) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **press)


def _hf_greedy_with_kept(model, prompt: list[int], kept: set[int], max_new: int) -> list[int]:
    """transformers decoding whose new tokens attend only to the prompt tokens in `kept` (and to
    the generated ones), at their original positions: what a press that keeps `kept` computes."""
    ids = torch.tensor([prompt], device=TEST_DEVICE)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        tokens = [token]
        for step in range(max_new - 1):
            length = len(prompt) + step + 1
            allowed = torch.tensor([i in kept or i >= len(prompt) for i in range(length)], device=TEST_DEVICE)
            mask = torch.where(allowed, 0.0, float("-inf"))[None, None, None, :]
            out = model(torch.tensor([[token]], device=TEST_DEVICE), past_key_values=cache, attention_mask=mask,
                        position_ids=torch.tensor([[length - 1]], device=TEST_DEVICE), use_cache=True)
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
            tokens.append(token)
    return tokens


def test_streaming_press_frees_blocks_and_decodes_like_attention_over_the_kept_tokens(checkpoint):
    folder, hf_model = checkpoint
    engine = _engine(folder)
    free_before = engine.kv_manager.num_free_blocks
    params = _greedy(kv_press="streaming_llm", kv_keep_ratio=0.25)
    engine.add_request("r", {"prompt_token_ids": PROMPT}, params)
    tokens = []
    while not tokens:                               # the prefill step: the press runs after it
        tokens = [o for o in engine.step() if o.outputs[0].token_ids]
    request = engine.scheduler.requests["r"]
    keep = round(0.25 * len(PROMPT))
    assert request.num_pruned_tokens == len(PROMPT) - keep and request.num_kv_tokens == keep
    assert len(engine.kv_manager.block_table("r")) == blocks_for_tokens(keep, BLOCK)
    assert engine.kv_manager.num_free_blocks == free_before - blocks_for_tokens(keep, BLOCK)
    while engine.has_unfinished_requests():
        tokens += engine.step()
    ours = [o for o in tokens if o.finished][-1].outputs[0].token_ids
    sinks = 4
    kept = set(range(sinks)) | set(range(len(PROMPT) - (keep - sinks), len(PROMPT)))
    assert ours == _hf_greedy_with_kept(hf_model, PROMPT, kept, MAX_NEW)
    # Not what full attention computes: the test tells a press from none.
    assert ours != _hf_greedy_with_kept(hf_model, PROMPT, set(range(len(PROMPT))), MAX_NEW)
    stats = {p.press: p for p in engine.make_stats().presses}["streaming_llm"]
    assert (stats.applied, stats.tokens_pruned) == (1, len(PROMPT) - keep)
    assert stats.blocks_freed == blocks_for_tokens(len(PROMPT), BLOCK) - blocks_for_tokens(keep, BLOCK)
    assert engine.kv_manager.num_free_blocks == free_before


def test_keep_ratio_one_is_bit_identical_to_no_press(checkpoint):
    folder, _ = checkpoint
    plain = _run(_engine(folder), PROMPT, _greedy())
    assert _run(_engine(folder), PROMPT, _greedy(kv_press="snapkv", kv_keep_ratio=1.0)) == plain


@pytest.mark.parametrize("press", ["snapkv", "tova", "h2o", "knorm", "similarity_merge", "streaming_llm"])
def test_every_press_runs_in_the_engine_and_frees_its_share(checkpoint, press):
    folder, _ = checkpoint
    engine = _engine(folder)
    free = engine.kv_manager.num_free_blocks
    tokens = _run(engine, PROMPT, _greedy(kv_press=press, kv_keep_ratio=0.5))
    assert len(tokens) == MAX_NEW
    stats = {p.press: p for p in engine.make_stats().presses}[press]
    assert stats.applied == 1 and stats.tokens_pruned == len(PROMPT) - round(0.5 * len(PROMPT))
    assert engine.kv_manager.num_free_blocks == free


def test_the_token_budget_holds_as_the_output_grows(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder, kv_press_slack=8)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, kv_press="tova", kv_keep_tokens=64)
    engine.add_request("r", {"prompt_token_ids": PROMPT}, params)
    request = engine.scheduler.requests["r"]
    longest = 0
    while engine.has_unfinished_requests():
        engine.step()
        if not request.is_finished and request.output_token_ids:
            longest = max(longest, request.num_kv_tokens)
            assert request.num_kv_tokens <= 64 + 8 + 1
            assert len(engine.kv_manager.block_table("r")) <= blocks_for_tokens(64 + 8 + 1, BLOCK)
    assert longest > 64                      # it grew past the budget and was pruned back
    stats = {p.press: p for p in engine.make_stats().presses}["tova"]
    assert stats.tokens_pruned > len(PROMPT) - 64


def test_pruned_blocks_are_not_published_but_a_shared_prefix_is_kept(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder)
    system = PROMPT[:128]                              # 8 whole blocks
    _run(engine, system + [5, 6, 7], _greedy(), "warm")            # publishes the system prompt's blocks
    cached_before = engine.kv_manager.prefix_cache.num_cached_blocks
    _run(engine, system + PROMPT[128:], _greedy(kv_press="knorm", kv_keep_ratio=0.25), "pressed")
    request_hits = engine.make_stats().kv_cache
    assert request_hits is not None
    # The pressed request found the 8 system blocks and kept them whole; it published nothing it rewrote.
    assert engine.kv_manager.prefix_cache.num_cached_blocks == cached_before
    again = _run(engine, system + PROMPT[128:], _greedy(), "again")
    cold = _run(_engine(folder), system + PROMPT[128:], _greedy())
    assert again == cold                                 # no pruned block was found by the full-KV request


def test_bad_press_requests_are_refused_by_field(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder)
    with pytest.raises(RequestRejected, match="kv_press"):
        engine.add_request("a", {"prompt_token_ids": PROMPT}, _greedy(kv_press="nonesuch", kv_keep_ratio=0.5))
    with pytest.raises(RequestRejected, match="kv_keep_ratio"):
        engine.add_request("b", {"prompt_token_ids": PROMPT}, _greedy(kv_press="snapkv"))
    with pytest.raises(RequestRejected, match="kv_keep"):
        engine.add_request("c", {"prompt_token_ids": PROMPT}, _greedy(kv_keep_ratio=0.5))
    with pytest.raises(ValueError, match="kv_keep_ratio"):
        SamplingParams(kv_keep_ratio=1.5)
    with pytest.raises(ValueError, match="kv_keep_tokens"):
        SamplingParams(kv_keep_tokens=0)
    with pytest.raises(ValueError, match="--kv-press"):
        _engine(folder, kv_press="nonesuch", kv_keep_ratio=0.5)


def test_a_window_format_is_refused_with_the_reason(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder, kv_cache_dtype="int4", kv_quant_key_layout="token")   # int4 keys per token: a window
    with pytest.raises(RequestRejected, match="kv_press.*window"):
        engine.add_request("a", {"prompt_token_ids": PROMPT}, _greedy(kv_press="snapkv", kv_keep_ratio=0.5))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8", "int4"])      # int4: keys per channel, no window
def test_quantized_formats_are_pruned_too(checkpoint, kv_cache_dtype):
    folder, _ = checkpoint
    engine = _engine(folder, kv_cache_dtype=kv_cache_dtype)
    free = engine.kv_manager.num_free_blocks
    tokens = _run(engine, PROMPT, _greedy(kv_press="snapkv", kv_keep_ratio=0.5))
    assert len(tokens) == MAX_NEW and engine.kv_manager.num_free_blocks == free


def test_server_defaults_apply_and_a_request_can_turn_them_off(checkpoint):
    folder, _ = checkpoint
    with LLM(folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, block_size=BLOCK,
             max_model_len=512, kv_press="streaming_llm", kv_keep_ratio=0.25, kv_press_min_tokens=32) as llm:
        llm.generate([{"prompt_token_ids": PROMPT}], _greedy(), use_tqdm=False)
        llm.generate([{"prompt_token_ids": PROMPT}], _greedy(kv_press="none"), use_tqdm=False)
        stats = {p.press: p for p in llm.engine.make_stats().presses}["streaming_llm"]
        assert stats.applied == 1


def test_random_press_abort_preempt_leaks_no_block(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder, kv_cache_memory=480 << 10, max_num_seqs=6)     # 40 blocks: it must preempt
    free = engine.kv_manager.num_free_blocks
    rng = random.Random(3)
    presses = ["snapkv", "knorm", "streaming_llm", "similarity_merge", None]
    live = []
    for index in range(24):
        press = rng.choice(presses)
        prompt = [1] + [rng.randrange(3, 250) for _ in range(rng.randrange(40, 300))]
        extra = dict(kv_press=press, kv_keep_ratio=rng.choice([0.25, 0.5])) if press else {}
        if press and rng.random() < 0.3:
            extra = dict(kv_press=press, kv_keep_tokens=rng.randrange(40, 120))
        engine.add_request(str(index), {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=rng.randrange(40, 160), temperature=0.0, ignore_eos=True, **extra))
        live.append(str(index))
        for _ in range(rng.randrange(0, 3)):
            engine.step()
        if rng.random() < 0.2:
            engine.abort(live.pop(rng.randrange(len(live))))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions_total > 0          # the small cache made it preempt
    assert engine.kv_manager.num_tracked_requests == 0
    assert engine.kv_manager.num_free_blocks == free


def test_a_pressed_request_preempted_by_recompute_gives_the_same_tokens(checkpoint):
    """It is pressed at its prompt's end again and its outputs recomputed over the pressed KV."""
    folder, _ = checkpoint
    params = SamplingParams(max_tokens=175, temperature=0.0, ignore_eos=True, kv_press="snapkv", kv_keep_ratio=0.25)
    alone = _run(_engine(folder), PROMPT, params, "a")
    engine = _engine(folder, kv_cache_memory=30 * 12288, max_model_len=480, preemption_mode="recompute",
                     enable_prefix_caching=False)
    # b runs first, a joins behind it and is pressed; as both grow, a (the back) is preempted.
    engine.add_request("b", {"prompt_token_ids": PROMPT[:100]},
                       SamplingParams(max_tokens=370, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.add_request("a", {"prompt_token_ids": PROMPT}, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    assert engine.scheduler.num_preemptions_total > 0
    assert done["a"] == alone


def test_a_press_with_nothing_observed_leaves_the_request_whole(checkpoint, monkeypatch):
    folder, _ = checkpoint
    engine = _engine(folder)
    monkeypatch.setattr(engine.runner, "_split_observation", lambda *args: {})
    free = engine.kv_manager.num_free_blocks
    assert len(_run(engine, PROMPT, _greedy(kv_press="snapkv", kv_keep_ratio=0.25))) == MAX_NEW
    stats = {p.press: p for p in engine.make_stats().presses}["snapkv"]
    assert (stats.applied, stats.skipped, stats.tokens_pruned) == (0, 1, 0)
    assert engine.kv_manager.num_free_blocks == free
