"""The requests of a KV map (kvserve/stats.py KVMapRequest): who is in the engine and what KV each
holds, from the scheduler's queues and the KV manager's tables. Read on the engine thread."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvserve.stats import KVMapRequest

if TYPE_CHECKING:
    from kvserve.sched.request import Request
    from kvserve.sched.scheduler import Scheduler

# Requests listed when the reader does not say: every running request of a usual batch, and a
# look at the queue. The snapshot counts the rest.
DEFAULT_MAX_REQUESTS = 256


def make_request_map(scheduler: "Scheduler", max_requests: int = DEFAULT_MAX_REQUESTS
                     ) -> tuple[tuple[KVMapRequest, ...], int]:
    """(the first `max_requests` requests: running, loading, waiting in queue order, prefetching;
    how many requests there are in all). Those that hold KV come first, so that the map's blocks
    name their holders whenever the list is cut."""
    manager = scheduler.kv_manager
    queues = (("running", scheduler.running), ("loading", scheduler.loading.values()),
              ("waiting", scheduler.waiting), ("prefetching", scheduler.prefetching.values()))
    total = sum(len(queue) for _, queue in queues)

    def entry(state: str, request: "Request") -> KVMapRequest:
        if state == "waiting" and manager.is_swapped(request.request_id):
            state = "swapped"
        return KVMapRequest(request.request_id, state, request.tenant, request.qos_class, request.priority,
                            request.num_prompt_tokens, len(request.output_token_ids), request.num_kv_tokens,
                            request.num_cached_tokens or 0, len(manager.block_table(request.request_id)),
                            manager.host_blocks_of(request.request_id), request.arrival_time)

    listed = itertools.islice(((state, request) for state, queue in queues for request in queue), max(0, max_requests))
    return tuple(entry(state, request) for state, request in listed), total
