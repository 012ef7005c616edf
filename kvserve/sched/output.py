"""What the scheduler hands on for one step: the requests to compute and how many tokens of each,
the KV block copies to run before the forward, and the requests it preempted or shed. Read by the engine and the worker; the scheduler owns the
requests themselves."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kvstore import BlockCopy
from kvserve.sched.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int     # tokens computed this step, starting at request.num_computed_tokens

    @property
    def samples_token(self) -> bool:
        """After this step the request's every token is computed, so the step yields its next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)   # the step's batch, running ones first
    block_copies: list[BlockCopy] = field(default_factory=list)       # run in order, before the forward
    preempted: list[Request] = field(default_factory=list)   # blocks freed this step; they recompute later
    rejected: list[Request] = field(default_factory=list)     # shed in the queue (missed TTFT deadline)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.block_copies
