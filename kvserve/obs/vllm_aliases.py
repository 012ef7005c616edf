"""vLLM-compatible names for the kvserve metrics that mean the same thing (--vllm-metric-aliases).

A dashboard or alert written for vLLM queries `vllm:` names with a `model_name` label. With the
flag, /metrics repeats each series of `VLLM_ALIASES` under its vLLM name: the same samples, labels,
type and buckets (the renaming happens at render time, on the families the registry collects, so
there is one count of everything and the alias can never drift from its kvserve series).

Only series that mean the same are aliased: same unit, same events counted, same label meaning.
vLLM labels its series `model_name` and `engine` (the data-parallel rank); ours carry `model_name`
(the first --served-model-name, as vLLM's) and no `engine`, so dashboards that filter on
`model_name` work and ones that group by `engine` see one engine. Left out on purpose:
- `vllm:time_per_output_token_seconds` (v0, deprecated in v1) and `vllm:inter_token_latency_seconds`
  observe every gap between two tokens; ours observes one mean per request, which is vLLM's
  `vllm:request_time_per_output_token_seconds`. Their quantiles differ, so no alias.
- `vllm:iteration_tokens_total`, `vllm:request_{prefill,decode,inference}_time_seconds`,
  `vllm:cache_config_info`: we have no series that counts the same thing.
- `kvserve:prefix_cache_hit_rate` (since start): vLLM v1 has only the counters (aliased below).
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

# kvserve exposed name -> vLLM exposed names (counters with their `_total`, as /metrics shows them).
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    # Requests in the running batch: vLLM's RUNNING requests.
    "kvserve:num_requests_running": ("vllm:num_requests_running",),
    # Queued, preempted or loading KV from a tier: vLLM's WAITING queue holds the same three.
    "kvserve:num_requests_waiting": ("vllm:num_requests_waiting",),
    # Fraction 0-1 of GPU KV blocks held by requests (cached evictable blocks count as free, as in
    # vLLM); gpu_cache_usage_perc is the pre-0.9 name older dashboards still query.
    "kvserve:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    # Prompt tokens of admitted requests, n samples counting n times (vLLM fans a request out into n).
    "kvserve:prompt_tokens_total": ("vllm:prompt_tokens_total",),
    "kvserve:generation_tokens_total": ("vllm:generation_tokens_total",),
    # Each preemption of a running request (recompute or swap), as vLLM counts them.
    "kvserve:num_preemptions_total": ("vllm:num_preemptions_total",),
    # Requests that left the engine by finished_reason: stop, length, abort as vLLM's; ours adds the
    # values rejected (shed by the latency targets) and error.
    "kvserve:request_success_total": ("vllm:request_success_total",),
    # Prompt tokens looked up in / served from the GPU prefix cache (tokens, not blocks, as vLLM's).
    "kvserve:prefix_cache_queries_total": ("vllm:prefix_cache_queries_total",),
    "kvserve:prefix_cache_hits_total": ("vllm:prefix_cache_hits_total",),
    # Arrival at the server to the first generated token.
    "kvserve:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # Per request, (last token - first token) / (tokens - 1): vLLM's per-request TPOT histogram.
    "kvserve:time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "kvserve:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    # Arrival to first scheduling: vLLM's WAITING phase.
    "kvserve:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    # Per finished request (with n > 1 ours observes the request once, its samples' tokens summed;
    # vLLM observes each of the n samples).
    "kvserve:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "kvserve:request_generation_tokens": ("vllm:request_generation_tokens",),
}


def _exposed_name(family: Metric) -> str:
    """A family's name as /metrics shows it: prometheus_client keeps counters' `_total` off it."""
    return family.name + "_total" if family.type == "counter" else family.name


def _renamed(family: Metric, exposed: str) -> Metric:
    base = exposed[:-len("_total")] if family.type == "counter" else exposed
    alias = Metric(base, family.documentation + " (vLLM name of " + _exposed_name(family) + ")", family.type,
                   family.unit)
    # Sample names are the family name plus a suffix (_total, _bucket, _sum, _count, _created).
    alias.samples = [sample._replace(name=base + sample.name[len(family.name):]) for sample in family.samples]
    return alias


class VLLMAliasedRegistry:
    """A registry view whose collect() yields every family of `registry`, then the vLLM-named copy
    of each aliased one (what generate_latest renders)."""

    def __init__(self, registry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        aliases = []
        for family in self._registry.collect():
            yield family
            for exposed in VLLM_ALIASES.get(_exposed_name(family), ()):
                aliases.append(_renamed(family, exposed))
        yield from aliases
