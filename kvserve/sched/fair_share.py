"""Fair share between tenants: the Virtual Token Counter scheduler (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024), `--scheduling-policy fair`.

Each tenant has a counter of the service it received, in weighted tokens over its weight
(--qos-config): a prompt token costs 1 and a generated token 2, VTC's h(n_p, n_q) = n_p + 2 n_q.
Admission takes the waiting request of the tenant with the lowest counter (then the earliest). A
tenant that had nothing in the engine and sends a request has its counter lifted to the lowest
counter of the tenants that do, so idle time banks no credit. A tenant sending ten times another's
load therefore gets its weighted share of the service while both wait, not ten times.

Prompt tokens are charged when the request is first admitted (less what the prefix cache served),
so one step does not admit all of one tenant's requests before its counter moves; generated tokens
as they are sampled. Recomputation after a preemption is not charged.

When the next waiting request of the fair order finds no slot or blocks, the scheduler preempts a
running request of the tenant whose counter is highest, if it stays above the waiting tenant's
with the waiting prompt charged (kvserve/sched/scheduler.py, `_preempt_for_fairness`).
"""

from __future__ import annotations

from typing import Iterable, Optional

from kvserve.sched.qos_config import QoSConfig
from kvserve.stats import TenantShareStats

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


class VirtualTokenCounters:
    def __init__(self, config: QoSConfig) -> None:
        self.config = config
        self._counters: dict[Optional[str], float] = {}
        self.served: dict[Optional[str], float] = {}      # weighted tokens, before the weight divides them

    def counter(self, tenant: Optional[str]) -> float:
        return self._counters.get(tenant, 0.0)

    def activate(self, tenant: Optional[str], active: Iterable[Optional[str]]) -> None:
        """`tenant` had nothing waiting or running and now sends a request; `active`: the tenants
        that have."""
        floor = min((self.counter(other) for other in active if other != tenant), default=None)
        if floor is not None and self.counter(tenant) < floor:
            self._counters[tenant] = floor

    def prompt_cost(self, tenant: Optional[str], prompt_tokens: int) -> float:
        """What admitting a prompt of this many tokens adds to the tenant's counter."""
        return PROMPT_TOKEN_COST * prompt_tokens / self.config.weight_of(tenant)

    def charge(self, tenant: Optional[str], prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        self.served[tenant] = self.served.get(tenant, 0.0) + cost
        self._counters[tenant] = self.counter(tenant) + cost / self.config.weight_of(tenant)

    def make_stats(self) -> dict[Optional[str], TenantShareStats]:
        """Every tenant the counters have seen: a lifted tenant has a counter before it is served."""
        return {tenant: TenantShareStats(self.config.weight_of(tenant), self.counter(tenant),
                                         self.served.get(tenant, 0.0))
                for tenant in {**self._counters, **self.served}}
