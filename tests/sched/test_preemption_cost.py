"""--preemption-mode auto (kvserve/sched/preemption_cost.py): swap when moving the KV out and back
is measured cheaper than recomputing it, recompute otherwise."""

from __future__ import annotations

from kvserve.sched.preemption_cost import MIN_PREFILL_TOKENS, PreemptionCost


def test_swap_wins_on_a_fast_link_and_loses_on_a_slow_one():
    # 7B-like: 56 KiB of KV per token, prefill at 20k tokens/s.
    cost = PreemptionCost(kv_bytes_per_token=56 << 10, transfer_bytes_per_s=50e9)
    cost.observe_step(4096, 4096 / 20_000)
    assert cost.swap_seconds(1000) < cost.recompute_seconds(1000)
    assert cost.prefers_swap(1000)
    slow = PreemptionCost(kv_bytes_per_token=56 << 10, transfer_bytes_per_s=1e9)
    slow.observe_step(4096, 4096 / 20_000)
    assert not slow.prefers_swap(1000)
    assert (cost.num_swap_choices, slow.num_recompute_choices) == (1, 1)


def test_observations_move_the_choice():
    cost = PreemptionCost(kv_bytes_per_token=1 << 20, transfer_bytes_per_s=None)
    assert not cost.prefers_swap(100)            # the link not measured yet: recompute
    cost.observe_transfer(1 << 30, 0.02)         # ~54 GB/s
    assert cost.prefers_swap(100)                # prefill not timed yet: swap on a measured link
    cost.observe_step(MIN_PREFILL_TOKENS - 1, 1e-6)      # a decode step says nothing about prefill
    assert cost.prefill_tokens_per_s is None
    for _ in range(30):
        cost.observe_step(8192, 0.001)           # a very fast prefill: recompute is cheaper
    assert not cost.prefers_swap(100)


def test_the_prefill_rate_follows_the_fastest_steps_at_once_and_slower_ones_slowly():
    cost = PreemptionCost(kv_bytes_per_token=1000)
    cost.observe_step(512, 512 / 2_000)            # a first step that compiled kernels
    cost.observe_step(8192, 8192 / 20_000)         # a full prefill chunk
    assert cost.prefill_tokens_per_s == 20_000
    cost.observe_step(256, 256 / 4_000)            # decodes mixed in: eases it down, not to 4k
    assert 15_000 < cost.prefill_tokens_per_s < 20_000


def _true_seconds(shape, context: int, tokens: int, rate: float) -> float:
    """A machine whose step time is its weights' work plus its attention's, at one FLOP rate."""
    from kvserve.model.compute_shape import attention_pairs
    return (tokens * shape.flops_per_token + attention_pairs(context, tokens) * shape.flops_per_pair) / rate


def test_a_long_prefix_is_charged_its_attention():
    """Timed on 8k-token chunks from an empty context, a 32k-token recompute costs the chunks' rate
    plus the attention of its longer context: on an R1-Distill-Qwen-7B shape about half again the
    work per token. Charged tokens alone it came out a third short, and a read from disk that was
    faster than recomputing was skipped (docs/kv_tiers.md)."""
    from kvserve.model.compute_shape import compute_shape
    from transformers import Qwen2Config
    shape = compute_shape(Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                      num_attention_heads=28, num_key_value_heads=4, vocab_size=152064))
    flops = 700e12
    aware = PreemptionCost(kv_bytes_per_token=57344, shape=shape)
    plain = PreemptionCost(kv_bytes_per_token=57344)
    for cost in (aware, plain):
        cost.observe_step(8192, _true_seconds(shape, 0, 8192, flops), attention_pairs=8192 * 8193 // 2)
    truth = _true_seconds(shape, 0, 32768, flops)
    assert abs(aware.recompute_seconds(32768) - truth) < 1e-3 * truth
    assert plain.recompute_seconds(32768) < 0.8 * truth
    # Steps at any context agree on the rate, so the estimate holds whichever steps were timed.
    later = PreemptionCost(kv_bytes_per_token=57344, shape=shape)
    later.observe_step(4096, _true_seconds(shape, 20_000, 4096, flops), attention_pairs=4096 * 20_000 + 4096 * 4097 // 2)
    assert abs(later.recompute_seconds(32768) - truth) < 1e-3 * truth
    # The tail of a prefix after a cached head pays for the head's context.
    tail = _true_seconds(shape, 16384, 16384, flops)
    assert abs(aware.recompute_seconds(16384, context_tokens=16384) - tail) < 1e-3 * tail
    assert aware.recompute_seconds(16384, context_tokens=16384) > 1.3 * aware.recompute_seconds(16384)
