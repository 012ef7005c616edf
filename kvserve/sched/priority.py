"""Priority scheduling (`--scheduling-policy priority`, vLLM's semantics: a lower value goes first).

A request's effective priority is its `priority` less one level per `aging_s` seconds since it
arrived, so a low-priority request moves up the longer it has been in the engine: it is not
overtaken, nor preempted by newcomers, forever. A request of a class with a TTFT target starts
aging only after a share of that target (`AGING_GRACE_SHARE`): one within its own target is not
starving, and aging it then only hands it the capacity of the classes above (docs/qos.md).
Ties go to the earlier arrival. The scheduler
keeps its running list in this order (the back is preempted first) and admits waiting requests in
it; a waiting request that outranks the worst running one and does not fit preempts it.
"""

from __future__ import annotations

from typing import Iterable, Protocol


# Of a class's TTFT target, the time a request of it waits before it starts to age.
AGING_GRACE_SHARE = 0.5


class Prioritized(Protocol):
    priority: int
    arrival_time: float
    aging_grace_s: float


def aging_grace_s(class_ttft_p99_s: float | None) -> float:
    return 0.0 if class_ttft_p99_s is None else AGING_GRACE_SHARE * class_ttft_p99_s


def effective_priority(request: Prioritized, now: float, aging_s: float) -> float:
    if aging_s <= 0:
        return float(request.priority)
    return request.priority - max(0.0, now - request.arrival_time - request.aging_grace_s) / aging_s


def priority_key(now: float, aging_s: float):
    """Sort key: effective priority, then arrival (earlier first)."""
    return lambda request: (effective_priority(request, now, aging_s), request.arrival_time)


def by_priority(requests: Iterable[Prioritized], now: float, aging_s: float) -> list:
    return sorted(requests, key=priority_key(now, aging_s))
