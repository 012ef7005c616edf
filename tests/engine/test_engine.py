"""Engine-level behaviour on a tiny model: admission, aborts, block accounting, options."""

from __future__ import annotations

import pytest

from conftest import TEST_DEVICE
from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.sched.scheduler import RequestRejected


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    return Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=2 << 20,
                               block_size=16, max_model_len=256)


def _drain(engine: Engine, limit: int = 10_000) -> list:
    finished = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return finished
        finished += [o for o in engine.step() if o.finished]
    raise AssertionError("engine did not finish its requests")


def test_unknown_option_is_rejected():
    with pytest.raises(TypeError, match="unknown engine option 'block_sise'"):
        EngineConfig.from_options(block_sise=8)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_options(block_size=0)


def test_device_dependent_defaults_are_resolved_by_the_config_on_a_copy():
    config = EngineConfig.from_options(block_size=8)
    assert config.resolved_for("cuda").scheduler_config.max_num_batched_tokens == 8192
    assert config.resolved_for("cpu").scheduler_config.max_num_batched_tokens == 2048
    assert config.scheduler_config.max_num_batched_tokens is None          # the caller's config as given
    assert config.resolved_for("cpu").cache_config.block_size == 8
    given = EngineConfig.from_options(max_num_batched_tokens=300)
    assert given.resolved_for("cuda").scheduler_config.max_num_batched_tokens == 300


def test_make_stats_reports_what_the_owners_hold(engine):
    engine.add_request("s1", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("s2", [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    before = engine.make_stats()
    assert (before.scheduler.num_waiting, before.scheduler.num_running) == (2, 0)
    assert before.scheduler.latency is None                     # no latency targets on this engine
    engine.step()
    during = engine.make_stats()
    assert (during.scheduler.num_waiting, during.scheduler.num_running) == (0, 2)
    assert during.kv_cache.num_free_blocks == engine.kv_manager.num_blocks - 2
    assert during.kv_cache.capacity_tokens == engine.kv_manager.capacity_tokens
    assert during.prompt_tokens_total == before.prompt_tokens_total
    _drain(engine)
    after = engine.make_stats()
    assert after.kv_cache.num_free_blocks == after.kv_cache.num_blocks
    assert after.requests_finished_total["length"] >= 2
    before.requests_finished_total["length"] = -1                # a copy: the engine's totals are its own
    assert engine.stats.requests_finished_total["length"] >= 2


def test_kv_bytes_per_token_and_capacity(engine):
    hf = engine.model.config
    head_dim = hf.hidden_size // hf.num_attention_heads
    assert engine.kv_bytes_per_token == 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4
    assert engine.kv_manager.capacity_tokens == engine.kv_manager.num_blocks * 16
    assert engine.kv_manager.num_blocks == (2 << 20) // (engine.kv_bytes_per_token * 16)


def test_too_long_requests_are_rejected_at_admission(engine):
    with pytest.raises(RequestRejected, match="max_model_len"):
        engine.add_request(None, [1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request(None, [], SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="token ids"):
        engine.add_request(None, [1, 10_000], SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests()


def test_prompt_over_the_step_budget_without_chunking_is_rejected(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    unchunked = Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=2 << 20,
                                    block_size=16, enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(RequestRejected, match=r"chunked prefill is off .* max_num_batched_tokens \(32\)"):
        unchunked.add_request(None, [1] * 33, SamplingParams(max_tokens=4))
    assert not unchunked.has_unfinished_requests()
    unchunked.add_request("fits", [1] * 32, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in _drain(unchunked)] == [4]


def test_unchunked_preempted_requests_recompute_past_the_budget_with_the_same_tokens(tiny_checkpoint):
    """A preempted request recomputes its prompt and its outputs: without chunking that exceeds the
    step budget the prompt alone respected, and it must still run (alone), not wait forever."""
    from kvserve import LLM
    folder, _ = tiny_checkpoint
    prompts = [[1] + [(7 * i + 3 * j) % 250 + 2 for j in range(5)] for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = LLM(folder, dtype="float32", device=TEST_DEVICE, kv_cache_memory=2 << 20, block_size=4,
                enable_chunked_prefill=False, max_num_batched_tokens=16)
    alone = [roomy.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    # Without the prefix cache, which would often hold the blocks a victim needs back.
    tight = LLM(folder, dtype="float32", device=TEST_DEVICE, block_size=4, enable_chunked_prefill=False,
                max_num_batched_tokens=16, kv_cache_memory=roomy.engine.kv_bytes_per_token * 4 * 12,  # 12 blocks
                enable_prefix_caching=False)
    recomputed: list[int] = []
    preempt = tight.engine.scheduler._preempt

    def record(request):
        recomputed.append(request.num_tokens)
        preempt(request)
    tight.engine.scheduler._preempt = record
    batched = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert max(recomputed) > 16          # the case this is about: a recompute over the budget
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert tight.engine.kv_manager.num_free_blocks == tight.engine.kv_manager.num_blocks


def test_a_step_that_can_schedule_nothing_raises_instead_of_spinning(engine, monkeypatch):
    from kvserve.sched.scheduler import SchedulerStalled
    engine.add_request("stuck", [1, 2, 3], SamplingParams(max_tokens=4))
    monkeypatch.setattr(engine.scheduler, "_admit_waiting", lambda out, budget, held_below=None: None)   # admits nothing
    with pytest.raises(SchedulerStalled, match="no waiting request can be scheduled"):
        engine.step()
    monkeypatch.undo()
    engine.abort("stuck")
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_request_over_kv_capacity_is_rejected(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    small = Engine.from_options(model=folder, dtype="float32", device=TEST_DEVICE, block_size=16,
                                kv_cache_memory=4 * 16 * 3 * 2 * 2 * 16 * 4)   # 4 blocks = 64 tokens
    assert small.max_model_len == 64       # clipped to what the cache holds
    with pytest.raises(RequestRejected):
        small.add_request(None, [1] * 60, SamplingParams(max_tokens=10))


def test_abort_frees_blocks_at_once(engine):
    rid = engine.add_request("to-abort", [1] * 40, SamplingParams(max_tokens=100, ignore_eos=True))
    other = engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv_manager.num_free_blocks < engine.kv_manager.num_blocks
    assert engine.abort(rid)
    assert not engine.abort(rid)
    finished = _drain(engine)
    assert [o.request_id for o in finished] == [other]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert engine.kv_manager.num_tracked_requests == 0


def test_duplicate_request_id(engine):
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    _drain(engine)


def test_max_tokens_default_fills_context_and_stops_at_max_model_len(engine):
    engine.add_request("long", [1] * 200, SamplingParams(max_tokens=None, ignore_eos=True))
    [out] = _drain(engine)
    assert len(out.outputs[0].token_ids) == 56 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_and_n(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("ref", [1, 5, 9], greedy)
    [ref] = _drain(engine)
    tokens = ref.outputs[0].token_ids
    stop_at = tokens[5]
    engine.add_request("stopped", [1, 5, 9], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                            stop_token_ids=[stop_at]))
    [out] = _drain(engine)
    assert out.outputs[0].token_ids == tokens[: tokens.index(stop_at) + 1]
    assert out.outputs[0].stop_reason == stop_at and out.outputs[0].finish_reason == "stop"

    engine.add_request("many", [1, 5, 9], SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3))
    [many] = _drain(engine)
    assert [c.index for c in many.outputs] == [0, 1, 2, 3]
    assert all(1 <= len(c.token_ids) <= 6 for c in many.outputs)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_graph_batch_ladder_covers_every_batch_size():
    from kvserve.worker.cuda_graphs import graph_batch_sizes
    sizes = graph_batch_sizes(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100
    for batch in range(1, 101):
        padded = next(s for s in sizes if s >= batch)
        assert padded - batch < 16


def test_token_slices_match_the_concatenated_sequence():
    from kvserve.sched.request import Request
    request = Request("r", [1, 2, 3, 4], SamplingParams(), max_tokens=8)
    request.output_token_ids.extend([7, 8, 9])
    whole = request.all_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert request.token_ids_between(start, end) == whole[start:end]
    assert request.last_token_id == 9
