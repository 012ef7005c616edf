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
