"""Teacher-forced decoding through the engine's loop (kvserve/eval/forced_decoding.py) and the
continuation perplexity it gives the press and tier formats (kv_fidelity.press_perplexity).

What must hold for a press row to be comparable with the reference row:
- the forced tokens are the request's outputs (in the synchronous and the overlapped engine), and
  each one's logprob is transformers' dense forward's at that position;
- with no press, the procedure (prompt prefilled by the scheduler, continuation forced by decode
  steps) gives decode_perplexity's number over the same tokens, to float rounding;
- keep ratio 1.0, dropping or tiering, gives exactly the no-press number;
- a press really acts on what is scored: streaming_llm's NLL is transformers' with the later
  tokens attending only to the kept prompt tokens, and not full attention's.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve.engine.engine import Engine
from kvserve.eval.forced_decoding import forced_logprobs
from kvserve.eval.kv_fidelity import decode_nll, perplexity_from_nll, press_perplexity
from kvserve.sampling_params import SamplingParams
from kvserve.sched.scheduler import RequestRejected

SEGMENT_LEN, PROMPT_LEN = 160, 120
_RNG = random.Random(11)
SEGMENTS = [[_RNG.randrange(3, 250) for _ in range(SEGMENT_LEN)] for _ in range(3)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("forced-llama")
    model = build_tiny_checkpoint("llama", path)
    return str(path), model


def _engine(folder: str, **options) -> Engine:
    # The torch forward on the CPU, as eval-kv runs every format (kv_fidelity.one_forward_path).
    base = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, block_size=16,
                max_model_len=512, kv_press_min_tokens=32, kv_press_window=32, async_scheduling="off",
                attention_backend="torch" if TEST_DEVICE == "cpu" else "auto")
    return Engine.from_options(**{**base, **options})


def _hf_logprobs(model, segment: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' logprob of each continuation token (from PROMPT_LEN on) in one dense forward
    over the segment; `mask` [T, T] bool (query, key) replaces the causal one."""
    ids = torch.tensor([segment[:-1]], device=TEST_DEVICE)
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.where(mask, 0.0, float("-inf"))[None, None].to(TEST_DEVICE)
    with torch.no_grad():
        logits = model(ids, **kwargs).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)[PROMPT_LEN - 1:]
    return logprobs.gather(1, torch.tensor(segment[PROMPT_LEN:], device=TEST_DEVICE)[:, None])[:, 0].cpu()


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_forced_tokens_are_the_outputs_and_score_as_transformers(checkpoint, async_scheduling):
    """The continuations are random tokens, not what the model would pick: if forcing were ignored
    the outputs would be the greedy ones, and every later logprob would be over another context."""
    folder, hf_model = checkpoint
    engine = _engine(folder, async_scheduling=async_scheduling)
    prompts = [s[:PROMPT_LEN] for s in SEGMENTS]
    continuations = [s[PROMPT_LEN:] for s in SEGMENTS]
    greedy = SamplingParams(max_tokens=len(continuations[0]), temperature=0.0, ignore_eos=True)
    engine.add_request("g", {"prompt_token_ids": prompts[0]}, greedy)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    greedy_tokens = [o for o in outputs if o.finished][-1].outputs[0].token_ids
    assert greedy_tokens != continuations[0]        # the test can tell forced from sampled tokens

    run = forced_logprobs(engine, prompts, continuations)     # raises unless the outputs are the forced ids
    assert run.steps >= len(continuations[0])
    for segment, ours in zip(SEGMENTS, run.logprobs):
        torch.testing.assert_close(torch.tensor(ours), _hf_logprobs(hf_model, segment), atol=2e-4, rtol=0)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_forcing_is_checked_when_the_request_is_added(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder)
    prompt = SEGMENTS[0][:8]
    with pytest.raises(RequestRejected, match="max_tokens must be as many"):
        engine.add_request("a", prompt, SamplingParams(max_tokens=3), forced_token_ids=[5, 6])
    with pytest.raises(RequestRejected, match="n = 1"):
        engine.add_request("b", prompt, SamplingParams(max_tokens=2, n=2), forced_token_ids=[5, 6])
    with pytest.raises(RequestRejected, match=r"must lie in \[0, 256\)"):
        engine.add_request("c", prompt, SamplingParams(max_tokens=2), forced_token_ids=[5, 256])
    assert not engine.has_unfinished_requests()


def test_no_press_equals_decode_perplexity_over_the_same_tokens(checkpoint):
    """The reference row's two numbers: decode_perplexity's (the runner alone, one token per step
    from position 0) restricted to the continuation, and the engine-loop procedure's (prefill in
    a chunk, then forced decode steps). Only float rounding separates them."""
    folder, _ = checkpoint
    engine = _engine(folder)
    nll = decode_nll(engine, SEGMENTS)                # first: it needs a fresh engine
    decoded = perplexity_from_nll(nll[:, PROMPT_LEN - 1:], 0.0)
    forced = press_perplexity(engine, SEGMENTS, PROMPT_LEN)
    assert forced.tokens_scored == decoded.tokens_scored == len(SEGMENTS) * (SEGMENT_LEN - PROMPT_LEN)
    assert forced.perplexity == pytest.approx(decoded.perplexity, rel=1e-5)
    assert forced.nll_per_segment == pytest.approx(decoded.nll_per_segment, rel=1e-5)


@pytest.mark.parametrize("mode", ["drop", "tier"])
def test_keep_ratio_one_is_exactly_no_press(checkpoint, mode):
    folder, _ = checkpoint
    plain = press_perplexity(_engine(folder), SEGMENTS, PROMPT_LEN)
    tier = dict(kv_press_mode="tier", kv_host_memory=8 << 20, kv_tier_interval=1) if mode == "tier" else {}
    engine = _engine(folder, kv_press="snapkv", kv_keep_ratio=1.0, **tier)
    kept = press_perplexity(engine, SEGMENTS, PROMPT_LEN)
    assert kept.nll_per_segment == plain.nll_per_segment and kept.perplexity == plain.perplexity
    (stats,) = engine.make_stats().presses            # the press was asked, and kept everything
    assert stats.skipped == len(SEGMENTS) and stats.tokens_pruned == stats.tokens_demoted == 0


def test_a_press_acts_on_the_tokens_scored(checkpoint):
    """streaming_llm at 0.25 keeps the 4 sinks and the prompt's last tokens: every continuation token
    after the first is scored as transformers scores it attending only to those and to the earlier
    continuation tokens (the first one comes from the prefill, over the whole prompt)."""
    folder, hf_model = checkpoint
    engine = _engine(folder, kv_press="streaming_llm", kv_keep_ratio=0.25)
    pressed = forced_logprobs(engine, [s[:PROMPT_LEN] for s in SEGMENTS], [s[PROMPT_LEN:] for s in SEGMENTS])
    (stats,) = engine.make_stats().presses
    keep = round(0.25 * PROMPT_LEN)
    assert stats.applied == len(SEGMENTS) and stats.tokens_pruned == len(SEGMENTS) * (PROMPT_LEN - keep)
    length = SEGMENT_LEN - 1
    mask = torch.ones(length, length).tril().bool()
    dropped = torch.ones(PROMPT_LEN, dtype=torch.bool)
    dropped[:4] = False
    dropped[PROMPT_LEN - (keep - 4):] = False
    mask[PROMPT_LEN:, :PROMPT_LEN] &= ~dropped       # decode rows (queries from the prompt's end on)
    for segment, ours in zip(SEGMENTS, pressed.logprobs):
        ours = torch.tensor(ours)
        torch.testing.assert_close(ours, _hf_logprobs(hf_model, segment, mask), atol=2e-4, rtol=0)
        full = _hf_logprobs(hf_model, segment)
        assert ours[0].item() == pytest.approx(full[0].item(), abs=2e-4)      # the prefill's: before the press
        assert (ours[1:] - full[1:]).abs().max() > 1e-2                       # not full attention's


def test_the_sampler_takes_a_forced_token_and_reports_its_logprob():
    """Forced rows beside free ones: the free rows pick as before, the forced ones their token, and
    the logprob reported is the forced token's under the raw logits."""
    from kvserve.worker.sampler import Sampler, SamplingRow
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0, logprobs=0)
    rows = [SamplingRow(params, [1], [], None, forced) for forced in (7, None, 42)]
    result = Sampler()(logits, rows, eos_token_ids=set())
    expected = torch.log_softmax(logits, -1)
    assert result.token_ids == [7, int(logits[1].argmax()), 42]
    for row, token in enumerate(result.token_ids):
        assert result.logprobs[row] == {token: pytest.approx(expected[row, token].item(), abs=1e-6)}
