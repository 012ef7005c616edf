"""The tiering press mode (kv_press_mode "tier", engine/kv_tiering.py): blocks the press would drop
go to the host tier, the GPU keeps the budget's worth, decode steps bring blocks back. Decoding
equals transformers attending, at each step, to exactly the blocks the request's table held; a
recalled block holds the bytes it had when it was demoted; nothing leaks under random
tier/abort/preempt; a tier request without a host tier is refused by field."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import LLM, SamplingParams
from kvserve.engine.engine import Engine
from kvserve.kvstore import HOST_STORE

BLOCK = 16
_RNG = random.Random(11)
PROMPT = [1] + [_RNG.randrange(3, 250) for _ in range(319)]     # 320 tokens: 20 blocks
MAX_NEW = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tier-llama")
    model = build_tiny_checkpoint("llama", path)
    return str(path), model


def _engine(folder: str, **options) -> Engine:
    base = dict(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, block_size=BLOCK,
                max_model_len=512, kv_press_min_tokens=32, kv_host_memory=4 << 20, async_scheduling="off",
                kv_press_window=16)
    return Engine.from_options(**{**base, **options})


def _tiered(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, kv_press="snapkv",
                          kv_keep_ratio=0.25, kv_press_mode="tier", **extra)


def _visible(engine: Engine, request_id: str, length: int) -> set[int]:
    """Positions the request's next step attends to: the tokens of the blocks in its table."""
    state = engine.scheduler.requests[request_id].press.tier
    resident = set(state.table_logicals)
    return {i for i in range(length) if i // BLOCK in resident or i // BLOCK >= state.next_logical}


def _run_recording(engine: Engine, prompt: list[int], params: SamplingParams, request_id: str = "r"):
    """(tokens, the visible positions of each decode step after the first token)."""
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    outputs, visible = [], []
    while engine.has_unfinished_requests():
        request = engine.scheduler.requests.get(request_id)
        if request is not None and request.press is not None and request.press.tier is not None:
            visible.append(_visible(engine, request_id, request.num_tokens))
        outputs += engine.step()
    return [o for o in outputs if o.finished][-1].outputs[0].token_ids, visible


def _hf_greedy_with_masks(model, prompt: list[int], visible: list[set[int]], max_new: int) -> list[int]:
    """transformers decoding whose step s (after the first token) attends to `visible[s - 1]`."""
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=TEST_DEVICE), use_cache=True)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        tokens = [token]
        for step in range(max_new - 1):
            length = len(prompt) + step + 1
            allowed = torch.tensor([i in visible[step] for i in range(length)], device=TEST_DEVICE)
            mask = torch.where(allowed, 0.0, float("-inf"))[None, None, None, :]
            out = model(torch.tensor([[token]], device=TEST_DEVICE), past_key_values=cache, attention_mask=mask,
                        position_ids=torch.tensor([[length - 1]], device=TEST_DEVICE), use_cache=True)
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
            tokens.append(token)
    return tokens


def test_tiering_keeps_the_budget_on_the_gpu_and_decodes_over_exactly_its_table(checkpoint):
    folder, hf_model = checkpoint
    engine = _engine(folder, kv_tier_interval=1, kv_tier_recall_blocks=2)
    free_before = engine.kv_manager.num_free_blocks
    tokens, visible = _run_recording(engine, PROMPT, _tiered())
    assert len(visible) == MAX_NEW - 1
    # 25% of the 20 prompt blocks stays on the GPU: 5 blocks of 16, the sink and the window among them.
    assert len(visible[0]) == 5 * BLOCK + 1 and {0, len(PROMPT) - 1} <= visible[0]
    stats = {p.press: p for p in engine.make_stats().presses}["snapkv"]
    assert stats.applied == 1 and stats.tokens_recalled > 0 and stats.tokens_demoted > 15 * BLOCK
    assert len({frozenset(v & set(range(len(PROMPT)))) for v in visible}) > 1     # the resident set moved
    assert tokens == _hf_greedy_with_masks(hf_model, PROMPT, visible, MAX_NEW)
    # Not what full attention computes: the test tells tiering from none.
    full = [set(range(len(PROMPT) + step + 1)) for step in range(MAX_NEW - 1)]
    assert tokens != _hf_greedy_with_masks(hf_model, PROMPT, full, MAX_NEW)
    engine.step()                   # recalls that landed after the last step are reported (and freed) at the next
    assert engine.kv_manager.num_free_blocks == free_before
    assert engine.kv_manager.host_tier.num_used_blocks == 0     # held blocks are not cached ones


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_ranking_steps_replay_graphs_that_record_the_queries_eager_steps_record(checkpoint):
    """With the host tier the decode graphs record every layer's queries, so a ranking step replays
    its graph; the blocks it ranks and the tokens are those of an eager engine."""
    folder, _ = checkpoint
    graphed, eager = _engine(folder, kv_tier_interval=2), _engine(folder, kv_tier_interval=2, enforce_eager=True)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.queries is not None
    replays = 0
    original = graphed.runner._graph_observation

    def counting(*args, **kwargs):                  # called after a replay that recorded queries
        nonlocal replays
        replays += 1
        return original(*args, **kwargs)

    graphed.runner._graph_observation = counting
    assert _run_recording(graphed, PROMPT, _tiered()) == _run_recording(eager, PROMPT, _tiered())
    assert replays >= MAX_NEW // 2 - 2          # (nearly) every ranking step after the prompt's end


def test_a_recalled_block_holds_what_it_held_when_demoted(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder, kv_tier_interval=1, kv_tier_recall_blocks=4)
    engine.add_request("r", {"prompt_token_ids": PROMPT}, _tiered())
    checked, copied = 0, set()
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.scheduler.requests.get("r")
        if request is None or request.is_finished or request.press.tier is None:
            continue
        state = request.press.tier
        store, host = engine.runner.kv_store, engine.runner.transfers.stores[HOST_STORE]
        table = engine.kv_manager.block_table("r")
        # Every resident block with a host copy (all full ones: recalled or never demoted) holds the
        # bytes of its copy, which was taken from the GPU when the block filled (copies queued by the
        # step just run go with the next one: those are checked from then on).
        pairs = [(table[p], state.host_of[b]) for p, b in enumerate(state.table_logicals) if b in copied]
        copied = set(state.host_of)
        if pairs:
            gpu = store.read_blocks([g for g, _ in pairs])
            assert torch.equal(gpu, host.read_blocks([h for _, h in pairs]))
            checked += len(pairs)
    assert checked > 0 and {p.press: p for p in engine.make_stats().presses}["snapkv"].tokens_recalled > 0


def test_tiering_needs_the_host_tier_and_says_which_field(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder, kv_host_memory=0)
    with pytest.raises(ValueError, match="^kv_press_mode 'tier'.*--kv-host-memory"):
        engine.add_request("r", {"prompt_token_ids": PROMPT}, _tiered())
    with pytest.raises(ValueError, match="kv_press_mode"):
        SamplingParams(kv_press_mode="sideways")
    with pytest.raises(ValueError, match="--kv-press-mode"):
        _engine(folder, kv_host_memory=0, kv_press_mode="tier")


def test_keep_ratio_one_in_tier_mode_is_bit_identical_to_no_press(checkpoint):
    folder, _ = checkpoint
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine = _engine(folder)
    engine.add_request("a", {"prompt_token_ids": PROMPT}, plain)
    engine.add_request("b", {"prompt_token_ids": PROMPT}, SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, kv_press="snapkv", kv_keep_ratio=1.0,
        kv_press_mode="tier"))
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    assert done["a"] == done["b"]


def test_the_token_budget_holds_as_the_output_grows(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder, kv_tier_interval=2)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True, kv_press="knorm", kv_keep_tokens=96,
                            kv_press_mode="tier")
    engine.add_request("r", {"prompt_token_ids": PROMPT}, params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.scheduler.requests.get("r")
        if request is not None and request.press.tier is not None:
            most = max(most, len(engine.kv_manager.block_table("r")))
    # 96 tokens of warm and hot blocks, plus the sink, the window's two and the one being filled.
    assert most <= 96 // BLOCK + 3


def test_random_tier_abort_preempt_leaks_no_block(checkpoint):
    folder, _ = checkpoint
    engine = _engine(folder, kv_cache_memory=480 << 10, max_num_seqs=6, kv_tier_interval=1)   # it must preempt
    free = engine.kv_manager.num_free_blocks
    host_free = engine.kv_manager.host_tier.num_blocks
    rng = random.Random(5)
    live = []
    for index in range(20):
        prompt = [1] + [rng.randrange(3, 250) for _ in range(rng.randrange(40, 300))]
        extra = dict(kv_press=rng.choice(["snapkv", "knorm", "streaming_llm"]), kv_press_mode="tier",
                     kv_keep_ratio=rng.choice([0.25, 0.5]))
        engine.add_request(str(index), {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=rng.randrange(40, 160), temperature=0.0, ignore_eos=True, **extra))
        live.append(str(index))
        for _ in range(rng.randrange(0, 4)):
            engine.step()
        if rng.random() < 0.25:
            engine.abort(live.pop(rng.randrange(len(live))))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()                                   # the last step's released host blocks come free after it
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.kv_manager.num_tracked_requests == 0
    assert engine.kv_manager.num_free_blocks == free
    tier = engine.kv_manager.host_tier
    assert tier.num_free_blocks + tier.num_used_blocks == host_free


def test_the_server_default_mode_applies(checkpoint):
    folder, _ = checkpoint
    with LLM(folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, block_size=BLOCK,
             max_model_len=512, kv_press="snapkv", kv_keep_ratio=0.25, kv_press_min_tokens=32,
             kv_host_memory=4 << 20, kv_press_mode="tier") as llm:
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        stats = {p.press: p for p in llm.engine.make_stats().presses}["snapkv"]
        assert stats.applied == 1 and stats.tokens_demoted > 0 and stats.tokens_pruned == 0


def test_decode_reads_the_resident_kv_only(checkpoint):
    """The engine's count of KV bytes decode attention read: every step's whole context without a
    press; the resident blocks' tokens in tier mode."""
    folder, _ = checkpoint
    plain_engine, tier_engine = _engine(folder), _engine(folder, kv_tier_interval=2)
    plain_engine.add_request("p", {"prompt_token_ids": PROMPT},
                             SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    _run_recording(tier_engine, PROMPT, _tiered())
    while plain_engine.has_unfinished_requests():
        plain_engine.step()
    per_token = plain_engine.kv_bytes_per_token
    plain = plain_engine.make_stats().decode_kv_bytes_total
    assert plain == per_token * sum(len(PROMPT) + step for step in range(1, MAX_NEW))
    assert tier_engine.make_stats().decode_kv_bytes_total < 0.4 * plain
