"""Continuous batching: which requests run this step, and how many of their tokens.

There are no prefill and decode phases, only requests whose `num_computed_tokens` lags their
`num_tokens`; each step closes part of that gap under a token budget, so prompt chunks and decodes
share a batch (chunked prefill). Running requests go first, oldest first. When the KV pool runs
dry, the newest running request is preempted: its blocks are freed and it is recomputed later
from its prompt plus what it had generated (recompute preemption), so outputs do not change.

Prefix caching: a waiting request's table starts with the cached blocks of its longest cached
prefix, and `num_computed_tokens` starts at their length (the last token is always computed).
Admission counts those blocks as already there. With `cache_aware_scheduling`, waiting requests
with longer cached prefixes go first (they cost less to admit and their blocks may be evicted
if they wait); a request overtaken `cache_aware_max_bypass` times goes strictly first, so nobody
starves. Preempted requests always go first.

KV from a tier (a host-tier hit, a swapped-out request resuming): admission allocates the request's
blocks and the worker copies its KV in on a stream of its own; the request waits in `loading`,
outside the running batch, until the worker reports the copy landed (`complete_transfers`), then
runs its remaining tokens as a normal chunk. A failed copy sends it back to the queue to recompute.

Latency targets (`slo_ttft`, `slo_tpot`, `slo_shed`; kvserve/sched/slo.py): a step's tokens are
capped so that it ends in time, the number of running requests is limited so the step time stays
under the TPOT target, and with shedding a request that cannot get its first token in time is
rejected at arrival (predicted by simulating the steps ahead) or in the queue.

Priority (`scheduling_policy` priority; kvserve/sched/priority.py): running and waiting requests
are ordered by effective priority (lower first, aged by time in the engine), then arrival, so
preemption under KV pressure takes the worst first; and a waiting request that outranks the worst
running one but cannot be admitted (no slot or no blocks) preempts it before the step is built.

Fair share (`scheduling_policy` fair; kvserve/sched/fair_share.py): waiting requests are admitted
by their tenant's virtual token counter, lowest first (VTC). A new prompt of a tenant behind in
service and under its share of the batch runs in a step of its own, ahead of the batch's decodes
(`fair_prefill_first`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter, deque
from typing import Iterable, Optional

from kvserve.config import SchedulerConfig
from kvserve.sched import phases
from kvserve.sched.output import ScheduledRequest, SchedulerOutput
from kvserve.sched.preemption_cost import PreemptionCost
from kvserve.sched.fair_share import VirtualTokenCounters
from kvserve.sched.kv_reservations import ClassReservations
from kvserve.sched.priority import priority_key
from kvserve.sched.qos_classes import ClassLatency
from kvserve.sched.qos_config import SHED, QoSClass, load_qos_config
from kvserve.sched.request import PENDING_TOKEN, Request, RequestStatus
from kvserve.sched.slo import (TTFT_MARGIN, EngineLoad, PendingWork, RequestOverloaded, SLOController, SLOTargets,
                               first_token_delay_s)
from kvserve.kvcache.manager import KVCacheManager, PrefixHit, blocks_for_tokens
from kvserve.stats import ClassLatencyStats, SchedulerStats

# Waiting requests the cache-aware order looks at per step (each costs a prefix lookup).
CACHE_AWARE_WINDOW = 64


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the KV cache): rejected at admission."""


class RequestForbidden(RequestRejected):
    """A request that asks for what its tenant may not use (a request class): HTTP 403."""


class SchedulerStalled(RuntimeError):
    """A step found waiting requests but nothing running and admitted none: an engine bug, raised so
    that a caller stepping until done gets an error instead of a hang."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int,
                 preemption_cost: Optional[PreemptionCost] = None) -> None:
        if config.preemption_mode == "auto" and preemption_cost is None:
            raise ValueError("preemption_mode auto needs the measured costs (PreemptionCost)")
        self.config = config
        self.preemption_cost = preemption_cost
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}       # admitted, KV being copied in from a tier
        # Not yet waiting: their prefix is being read from a tier below the host (disk, remote)
        # into the host tier, so that their lookup finds it there (engine/cold_tiers.py).
        self.prefetching: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        # Admit new work only while this many blocks stay free, so a fresh admission does not
        # immediately force a running request out.
        self._admission_watermark_blocks = max(1, kv_manager.num_blocks // 100)
        # Fair share between tenants (kvserve/sched/fair_share.py); the config is checked here, at start.
        self.qos = qos = load_qos_config(config.qos_config)
        kv_manager.tenant_kv_quotas = qos.kv_quotas(kv_manager.num_blocks)
        self.fair: Optional[VirtualTokenCounters] = (VirtualTokenCounters(qos) if config.scheduling_policy == "fair"
                                                     else None)
        # Request classes (kvserve/sched/qos_classes.py) run at their priority: they need its order.
        self.classes: Optional[ClassLatency] = None
        if qos.classes:
            if config.scheduling_policy != "priority":
                raise ValueError(f"--qos-config {config.qos_config} defines request classes, which run at their "
                                 f"priority: they need --scheduling-policy priority (not {config.scheduling_policy})")
            self.classes = ClassLatency(qos.classes)
        self.reservations: Optional[ClassReservations] = (
            ClassReservations.from_config(qos, kv_manager.num_blocks, config.qos_config) if self.classes else None)
        targets = SLOTargets(config.slo_ttft, config.slo_tpot, config.slo_shed)
        # The latency controller also when only classes have targets: their shedding simulates the
        # steps ahead with its step-cost model.
        self.slo: Optional[SLOController] = (SLOController(targets, config.max_num_seqs)
                                             if targets.enabled or self.classes is not None else None)

    # --- run-time changes (the admin config API; engine/runtime_config.py) -----------------------
    def set_latency_targets(self, ttft_s: Optional[float], tpot_s: Optional[float]) -> bool:
        """New --slo-ttft / --slo-tpot. The controller keeps its step-time average, running limit and
        step-cost model; without one yet, one is made (True: its step-cost model needs calibrating).
        Without targets or classes left it goes, and scheduling is plain continuous batching again.
        The targets are changed in place: the server's arrival gate holds the same controller."""
        self.config.slo_ttft, self.config.slo_tpot = ttft_s, tpot_s
        if self.slo is None:
            if ttft_s is None and tpot_s is None:
                return False
            self.slo = SLOController(SLOTargets(ttft_s, tpot_s, self.config.slo_shed), self.config.max_num_seqs)
            return True
        self.slo.targets.ttft_s, self.slo.targets.tpot_s = ttft_s, tpot_s
        if not self.slo.targets.enabled and self.classes is None:
            self.slo = None
        return False

    def set_class(self, name: str, cls: QoSClass) -> None:
        """A request class's new definition (its targets changed at run time). The class latency
        windows and the per-step TPOT limit read the same dict, so both judge by it from now on."""
        if name not in self.qos.classes:
            raise ValueError(f"qos_classes.{name}: no such request class")
        self.qos.classes[name] = cls

    # --- admission ----------------------------------------------------------------------------
    def check_admissible(self, num_prompt_tokens: int, max_tokens: int, tenant: Optional[str] = None) -> None:
        if num_prompt_tokens < 1:
            raise RequestRejected("the prompt is empty")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({self.max_model_len})")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and num_prompt_tokens > budget:
            # Without chunking a prompt is computed in one step, which holds at most the budget: such
            # a prompt would wait forever.
            raise RequestRejected(
                f"the prompt has {num_prompt_tokens} tokens but chunked prefill is off and one step computes at "
                f"most max_num_batched_tokens ({budget}) tokens; shorten the prompt, raise "
                f"--max-num-batched-tokens or enable chunked prefill")
        needed = blocks_for_tokens(num_prompt_tokens + max_tokens, self.kv_manager.block_size)
        if needed > self.kv_manager.num_blocks:
            raise RequestRejected(
                f"the request needs {needed} KV blocks but the cache has {self.kv_manager.num_blocks}")
        quota = self.kv_manager.tenant_kv_quotas.get(tenant) if tenant is not None else None
        if quota is not None and needed > quota:
            raise RequestRejected(f"the request needs {needed} KV blocks but tenant {tenant!r} may hold at most "
                                  f"{quota} (its kv_quota in --qos-config)")

    def check_overload(self, prompt_token_ids: list[int], max_tokens: int, num_requests: int = 1,
                       arrival_time: Optional[float] = None, namespace: str = "",
                       qos_class: Optional[str] = None) -> None:
        """With TTFT shedding (the server's, or that of the request's class): raises RequestOverloaded
        if these requests (n samples of one prompt, in the prefix-cache namespace given) could not
        get their first token within the target, queued behind what the engine holds (for a
        class: behind the requests of its class and the classes above it)."""
        cls = self.qos.classes.get(qos_class) if qos_class is not None else None
        class_sheds = cls is not None and cls.on_miss == SHED
        if self.slo is None or (self.slo.shed_deadline_s() is None and not class_sheds):
            return
        uncached = len(prompt_token_ids) - self.kv_manager.peek_cached_tokens(prompt_token_ids, namespace)
        new = [PendingWork(max(1, uncached), max_tokens)] * num_requests
        waited = 0.0 if arrival_time is None else max(0.0, time.monotonic() - arrival_time)
        if self.slo.shed_deadline_s() is not None:
            reason = self.slo.reject_at_arrival(self.make_load(), new, waited)
            if reason is not None:
                self.slo.num_rejected_at_arrival += 1
                if cls is not None:
                    self.classes.observe_shed(qos_class)
                raise RequestOverloaded(reason)
        if class_sheds:
            deadline = cls.ttft_p99 * TTFT_MARGIN
            load = self.make_load(ahead_of_priority=cls.priority)
            delay = first_token_delay_s(load, new, horizon_s=deadline - waited)
            if waited + delay > deadline:
                self.classes.observe_shed(qos_class)
                raise RequestOverloaded(
                    f"server overloaded for class {qos_class!r}: the first token would come after "
                    f"~{waited + delay:.1f} s ({len(load.waiting)} requests of this class or above queued, "
                    f"{len(load.running)} running), over its {cls.ttft_p99:g} s p99 TTFT target; retry later")

    def make_load(self, ahead_of_priority: Optional[int] = None) -> EngineLoad:
        """The running and waiting requests as the latency simulation needs them (slo.py); with
        `ahead_of_priority`, only the waiting ones a request of that priority cannot overtake, and
        the running ones below it counted as preemptible (the priority policy preempts them for it)."""
        def work(request: Request) -> PendingWork:
            left = request.num_tokens - request.num_computed_tokens
            if request.num_computed_tokens == 0:
                left -= request.expected_cached_tokens
            outputs_left = max(0, request.max_tokens - len(request.output_token_ids))
            return PendingWork(left if left > 1 else 0, outputs_left)

        slo = self.slo
        waiting = self.waiting if ahead_of_priority is None else (
            r for r in self.waiting if r.priority <= ahead_of_priority)
        return EngineLoad(running=tuple(work(r) for r in self.running), waiting=tuple(work(r) for r in waiting),
                          token_budget=self.config.max_num_batched_tokens,
                          max_running=slo.expected_max_running() if slo is not None else self._max_running,
                          max_step_s=slo.max_step_s if slo is not None and self._caps_step_length else None,
                          step_cost=slo.step_cost.coefficients if slo is not None else None,
                          completion_rate=slo.completion_rate() if slo is not None else None,
                          preemptible=0 if ahead_of_priority is None or not self._by_priority else sum(
                              1 for r in self.running if r.priority > ahead_of_priority))

    @property
    def _caps_step_length(self) -> bool:
        # Without chunking a prompt runs whole in one step, so its step cannot be shortened.
        return self.slo is not None and self.config.enable_chunked_prefill and self.slo.max_step_s is not None

    def step_token_budget(self) -> int:
        """Tokens the next step may hold: max_num_batched_tokens, or less under latency targets."""
        budget = self.config.max_num_batched_tokens
        if not self._caps_step_length:
            return budget
        return self.slo.step_token_budget(budget, len(self.running) + 1)

    @property
    def _admission_limit(self) -> int:
        """Running requests beyond which no waiting one is admitted. With TTFT shedding the TPOT
        limit acts at arrival instead (the simulation assumes it): a request accepted there was
        promised its first token in time, and a cut of the limit after a burst (its prompt steps are
        slow) must not hold it in the queue until its deadline sheds it late."""
        if self.slo is not None and self.slo.shed_deadline_s() is not None:
            return self.config.max_num_seqs
        return self._max_running

    @property
    def _max_running(self) -> int:
        if self.slo is None:
            return self.config.max_num_seqs
        return self.slo.max_running

    def add_request(self, request: Request, prefetching: bool = False) -> None:
        """Queues a request; with `prefetching` it is held until `end_prefetch` (its prefix is on its
        way up from a cold tier), counted as waiting meanwhile."""
        self.check_admissible(request.num_prompt_tokens, request.max_tokens, request.tenant)
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if prefetching:
            self.prefetching[request.request_id] = request
            if request.phases is not None:
                request.phases.begin(phases.KV_PREFETCH, time.monotonic())
            return
        self._enqueue(request)

    def end_prefetch(self, request_id: str) -> None:
        """A held request's prefetch is over (loaded, missed or given up): it starts waiting."""
        request = self.prefetching.pop(request_id, None)
        if request is not None:
            if request.phases is not None:
                request.phases.end(phases.KV_PREFETCH, time.monotonic())
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if self.slo is not None:
            # For the latency simulation only: the hit as it stands now (admission looks again).
            hit = self._lookup(request)
            request.expected_cached_tokens = hit.num_tokens if hit is not None else 0
        if self.fair is not None:
            active = {r.tenant for r in itertools.chain(self.waiting, self.running, self.loading.values())}
            if request.tenant not in active:
                self.fair.activate(request.tenant, active)
        self.waiting.append(request)

    # --- one step ---------------------------------------------------------------------------
    @property
    def _by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def _priority_key(self):
        return priority_key(time.monotonic(), self.config.scheduling_priority_aging)

    def may_run_out_of_blocks(self) -> bool:
        """Whether growing the running requests in the next schedule() could fail and preempt one
        (the engine then reads back a pending token first): the blocks that schedule()'s running
        loop would ask for, in its order and under the step's token budget, against the free
        blocks; or a tenant that would go past its KV quota."""
        kv = self.kv_manager
        budget = self.step_token_budget()
        # No request grows by more than a block plus its chunk's blocks, and the chunks share the
        # budget: with that many free and no quotas, the walk below is not needed (the hot path).
        if not kv.tenant_kv_quotas and kv.num_free_blocks > len(self.running) + budget // kv.block_size:
            return False
        chunked = self.config.enable_chunked_prefill
        needed = 0
        by_tenant: dict[Optional[str], int] = {}
        for request in self.running:
            if budget <= 0:
                break
            if request.has_pending_token and self._reaches_length_limit(request):
                continue
            num_new = request.tokens_to_compute(request.num_computed_tokens)
            if not chunked and num_new > budget:
                continue
            num_new = min(num_new, budget)
            grow = kv.num_new_blocks_needed(request.request_id, request.num_kv_tokens + num_new)
            if grow:
                by_tenant[request.tenant] = by_tenant.get(request.tenant, 0) + grow
            needed += grow
            budget -= num_new
        return needed > kv.num_free_blocks or any(kv.quota_shortfall(tenant, grow) for tenant, grow in by_tenant.items())

    def wants_priority_preemption(self) -> bool:
        """Whether the next schedule() may preempt for priority (the engine then reads back a
        pending token first: a preempted request recomputes from its token list)."""
        if self._over_class_running_limit() or self._reservation_wanted() is not None:
            return True
        if self.fair is not None and self.waiting and self.running:
            return self._fairness_victim(next(iter(self._fair_order()))) is not None
        if not (self._by_priority and self.waiting and self.running):
            return False
        key = self._priority_key()
        return key(min(self.waiting, key=key)) < key(max(self.running, key=key))

    def _preempt_for_priority(self, out: SchedulerOutput, key, budget: int) -> None:
        """While the best waiting request outranks the worst running one and cannot be admitted as
        things stand (no slot, or too few free blocks for its first chunk), that running request is
        preempted (swapped or recomputed, as configured)."""
        best = min(self.waiting, key=key)
        while self.running and key(self.running[-1]) > key(best):
            if len(self.running) + len(self.loading) < self._admission_limit and self._fits(best, budget):
                return
            # A request within its class's KV reservation is not a borrower: its blocks stay.
            held = self._class_blocks() if self.reservations is not None else {}
            position = len(self.running) - 1
            while position >= 0 and not self._may_preempt_for(self.running[position], best.qos_class, held):
                position -= 1
            if position < 0 or key(self.running[position]) <= key(best):
                return
            victim = self.running.pop(position)
            self._preempt(victim)
            out.preempted.append(victim)

    def _growth_victim(self, index: int, request: Request) -> Request:
        """The request to preempt so that `request` (at `running[index]`) can grow: the last running
        one, except that a request of another class holding no more than its class's reservation
        is skipped (its blocks are that class's); taken out of `running`."""
        if self.reservations is not None:
            held = self._class_blocks()
            for position in range(len(self.running) - 1, index - 1, -1):
                if self._may_preempt_for(self.running[position], request.qos_class, held):
                    return self.running.pop(position)
        return self.running.pop()

    def _may_preempt_for(self, victim: Request, qos_class: Optional[str], held: dict[str, int]) -> bool:
        """Whether `victim` may give its blocks to a request of `qos_class`: always without class
        reservations; else if it is of that class, or its class holds more than its reservation."""
        return (self.reservations is None or victim.qos_class == qos_class
                or self.reservations.is_borrowing(victim.qos_class, held))

    def _class_blocks(self) -> dict[str, int]:
        """GPU blocks held by each class's running and loading requests."""
        held: dict[str, int] = {}
        for request in itertools.chain(self.running, self.loading.values()):
            if request.qos_class is not None:
                held[request.qos_class] = held.get(request.qos_class, 0) + len(
                    self.kv_manager.block_table(request.request_id))
        return held

    def _reservation_wanted(self) -> Optional[tuple[str, int, dict[str, int]]]:
        """The first class (by priority) with waiting work whose reservation is borrowed: (its name,
        the free blocks it wants, each class's blocks); None if there is none."""
        if self.reservations is None or not self.waiting or not self.running:
            return None
        reservations, held, free = self.reservations, None, self.kv_manager.num_free_blocks
        waiting_tokens: dict[str, int] = {}
        for request in self.waiting:
            if request.qos_class in reservations.reserved:
                waiting_tokens[request.qos_class] = waiting_tokens.get(request.qos_class, 0) + request.num_tokens
        for name in sorted(waiting_tokens, key=lambda name: self.qos.classes[name].priority):
            held = held if held is not None else self._class_blocks()
            wanted = min(reservations.unused(name, held),
                         blocks_for_tokens(waiting_tokens[name], self.kv_manager.block_size))
            if free < wanted:
                return name, wanted, held
        return None

    def _reclaim_reservations(self, out: SchedulerOutput) -> None:
        """A class with waiting work takes its lent reservation back: running requests of classes
        holding more than their own reservation are preempted, lowest-ranked first, until the free
        blocks cover what the class's waiting requests need (up to its unused reservation)."""
        wanted = self._reservation_wanted()
        while wanted is not None:
            name, blocks, held = wanted
            index = next((i for i in range(len(self.running) - 1, -1, -1)
                          if self.running[i].qos_class != name
                          and self.reservations.is_borrowing(self.running[i].qos_class, held)), None)
            if index is None:
                return
            victim = self.running.pop(index)
            self._preempt(victim)
            out.preempted.append(victim)
            wanted = self._reservation_wanted()

    def _fair_prefill_step(self, out: SchedulerOutput, budget: int) -> bool:
        """Fair policy, `fair_prefill_first`: when the fair order's next waiting request is new and
        of a tenant that holds less than its weighted share of the batch's requests and whose
        counter is at or below every other tenant's in the batch, this step runs only the new
        prompts of such tenants, not the batch's decodes. Under another tenant's
        overload, a prompt in a step beside that tenant's whole batch waits as long as that step
        takes (on a CPU, several times the prompt alone). The tenants ahead lose one step's token
        each time; a tenant that asks for more than its share is soon ahead, and waits like the
        others. True when it scheduled such a step."""
        if self.fair is None or not self.config.fair_prefill_first or not self.waiting or not self.running \
                or out.preempted:
            return False
        first = next(iter(self._fair_order()))
        if first.num_cached_tokens is not None:
            return False                # preempted or waiting again: not a new prompt
        fair, weight_of = self.fair, self.fair.config.weight_of
        running = Counter(r.tenant for r in self.running)
        waiting = {r.tenant for r in self.waiting}
        total_weight = sum(weight_of(tenant) for tenant in waiting | set(running))

        def is_behind(tenant) -> bool:
            others = set(running) - {tenant}
            return (bool(others) and running[tenant] < len(self.running) * weight_of(tenant) / total_weight
                    and fair.counter(tenant) <= min(fair.counter(other) for other in others))

        behind = {tenant for tenant in waiting if is_behind(tenant)}
        if first.tenant not in behind:
            return False
        self._admit_waiting(out, budget, only_tenants=behind, only_new=True)
        if not out.scheduled:
            return False
        out.block_copies = self.kv_manager.take_block_copies()
        return True

    def _fairness_victim(self, waiting: Request) -> Optional[int]:
        """Index in `running` of the request to preempt so that `waiting` (the fair order's next)
        can run: the newest running request (least work lost) of the tenant with the highest
        counter, if that counter stays above the waiting tenant's even after the waiting request's
        prompt is charged (so the two cannot trade places back and forth); else None."""
        fair = self.fair
        floor = fair.counter(waiting.tenant) + fair.prompt_cost(waiting.tenant, waiting.num_prompt_tokens)
        richest = max((r.tenant for r in self.running if r.tenant != waiting.tenant),
                      key=fair.counter, default=None)
        if richest is None or fair.counter(richest) <= floor:
            return None
        return max(index for index, r in enumerate(self.running) if r.tenant == richest)

    def _preempt_for_fairness(self, out: SchedulerOutput, budget: int) -> None:
        """Preemption for fair share: while the fair order's next waiting request cannot be admitted
        (no slot, or too few free blocks for its first chunk), a running request of the tenant that
        has received the most service beyond it is preempted (swapped or recomputed, as configured).
        Without it, a tenant that filled the batch while the others were idle would keep it for as
        long as its requests run, and the others' requests would wait for a slot."""
        best = next(iter(self._fair_order()))
        while self.running:
            if len(self.running) + len(self.loading) < self._admission_limit and self._fits(best, budget):
                return
            index = self._fairness_victim(best)
            if index is None:
                return
            victim = self.running.pop(index)
            self._preempt(victim)
            out.preempted.append(victim)

    def _has_tpot_promise(self, request: Request) -> bool:
        cls = self.qos.classes.get(request.qos_class) if request.qos_class is not None else None
        return cls is not None and cls.tpot_p99 is not None

    def _over_class_running_limit(self) -> bool:
        """A class's TPOT target holds the running limit, more requests run than it allows, and some
        of them have no TPOT promise."""
        return (self.classes is not None and self.slo.class_tpot_s is not None
                and len(self.running) + len(self.loading) > self.slo.max_running
                and not all(self._has_tpot_promise(r) for r in self.running))

    def _preempt_to_class_running_limit(self, out: SchedulerOutput) -> None:
        """While a class's TPOT target holds the running limit (slo.py) and more requests run than it
        allows, running requests without a TPOT promise (of a class with no tpot_p99, or of none) are
        preempted, the lowest-ranked first. One batch decodes every class, so its step time is the
        promised classes' time per token: waiting for requests without a promise to finish would
        keep the step slow for as long as their outputs take."""
        limit = self.slo.max_running
        index = len(self.running) - 1
        while index >= 0 and len(self.running) + len(self.loading) > limit:
            victim = self.running[index]
            if not self._has_tpot_promise(victim):
                del self.running[index]
                self._preempt(victim)
                out.preempted.append(victim)
            index -= 1

    def _fits(self, request: Request, budget: int) -> bool:
        hit = self._lookup(request)
        num_cached = request.num_computed_tokens if self.kv_manager.is_swapped(request.request_id) else (
            hit.num_tokens if hit is not None else 0)
        num_new = min(request.tokens_to_compute(num_cached), budget)
        needed = self.kv_manager.num_new_blocks_needed(
            request.request_id, num_cached - request.num_pruned_tokens + num_new, hit)
        return needed + self._admission_watermark_blocks <= self.kv_manager.num_free_blocks

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.step_token_budget()
        chunked = self.config.enable_chunked_prefill
        class_work = self._classes_with_work()
        if self.classes is not None:
            self.slo.class_tpot_s = min((self.qos.classes[name].tpot_p99 for name in class_work
                                         if self.qos.classes[name].tpot_p99 is not None), default=None)
        if self._by_priority:
            key = self._priority_key()
            self.running.sort(key=key)           # the back is preempted first
            if self._over_class_running_limit():
                self._preempt_to_class_running_limit(out)
            if self.reservations is not None and self.waiting and self.running:
                self._reclaim_reservations(out)
            if self.waiting and self.running:
                self._preempt_for_priority(out, key, budget)
        elif self.fair is not None and self.waiting and self.running:
            self._preempt_for_fairness(out, budget)
        preempted_for_priority = len(out.preempted)
        if self._fair_prefill_step(out, budget):
            return out

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.has_pending_token and self._reaches_length_limit(request):
                index += 1      # finishes when its pending token is read: no further step
                continue
            num_new = request.tokens_to_compute(request.num_computed_tokens)
            if not chunked and num_new > budget:
                index += 1
                continue
            num_new = min(num_new, budget)
            while not self.kv_manager.allocate_slots(request.request_id, request.num_kv_tokens + num_new,
                                                     tenant=request.tenant):
                # Victims come from the back, which this loop has not scheduled yet: for a tenant at
                # its KV quota, its own (freeing anyone else's blocks would not help it).
                victim = self._quota_victim(index, request, request.num_kv_tokens + num_new)
                if victim is None:
                    victim = self._growth_victim(index, request)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
                continue
            break

        if self.slo is not None and (self.slo.targets.shed or self.classes is not None):
            self._shed_late(out)
        # New work only when nothing was preempted for blocks this step: otherwise it would take
        # the blocks the preempted requests need to come back. (Preempted for priority, they make
        # room for the request that outranks them.)
        if len(out.preempted) == preempted_for_priority:
            held_below = self.classes.held_below(class_work) if class_work else None
            self._admit_waiting(out, budget, held_below)
            if held_below is not None and not out.scheduled and not self.running and not self.loading:
                # The classes that may run have nothing admissible: holding the others back would
                # only leave the engine idle (and stalled, with nothing running to change that).
                self._admit_waiting(out, budget)
        out.block_copies = self.kv_manager.take_block_copies()
        return out

    def complete_transfers(self, landed: list[int], failed: list[int]) -> None:
        """The worker's report on ticketed copies: loading requests whose KV has arrived join the
        running batch; a request whose copy failed goes back to the front of the queue to recompute."""
        for ticket, ok in [(t, True) for t in landed] + [(t, False) for t in failed]:
            recompute = self.kv_manager.complete_transfer(ticket, ok)
            if recompute is not None:
                request = self.requests.get(recompute)
                if request is not None:
                    self._requeue_for_recompute(request)
        # Their loaded blocks join the prefix cache with the first chunk they compute (`advance`,
        # which overlaps the GPU), not here, on the way to their first token.
        for request_id in [rid for rid in self.loading if not self.kv_manager.is_loading(rid)]:
            request = self.loading.pop(request_id)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.phases is not None:
                request.phases.end(phases.KV_LOAD, time.monotonic(), ok=True)

    def hold_for_load(self, out: SchedulerOutput, request_ids: set[str]) -> None:
        """Requests whose inline load failed as it was issued (KVCacheManager.take_back_inline) leave this
        step's batch before it runs and wait as loading ones: the load's failure report then
        sends them to recompute (`complete_transfers`)."""
        out.scheduled = [item for item in out.scheduled if item.request.request_id not in request_ids]
        for request in [r for r in self.running if r.request_id in request_ids]:
            self.running.remove(request)
            request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            self.loading[request.request_id] = request
            if request.phases is not None:
                request.phases.begin(phases.KV_LOAD, time.monotonic(), tier="host", failed_inline=True)

    def _requeue_for_recompute(self, request: Request) -> None:
        request.reset_kv()
        if self.loading.pop(request.request_id, None) is not None:
            request.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(request)
            if request.phases is not None:
                now = time.monotonic()
                request.phases.end(phases.KV_LOAD, now, ok=False)
                request.phases.begin(phases.QUEUED, now, reason="load_failed")

    def _shed_late(self, out: SchedulerOutput) -> None:
        """Rejects waiting requests that, scheduled now, would miss their TTFT deadline. Requests
        that already ran (preempted ones) keep their place: their first token is out or due."""
        now = time.monotonic()
        budget = self.config.max_num_batched_tokens
        num_decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens <= 1)
        late = [request for request in self.waiting
                if request.first_scheduled_time is None
                and self.slo.missed_deadline(request.arrival_time,
                                             max(1, request.num_prompt_tokens - request.expected_cached_tokens),
                                             num_decoding, budget, now, self._shed_deadline(request))]
        for request in late:
            self.finish(request, RequestStatus.FINISHED_REJECTED)
            out.rejected.append(request)
            if request.qos_class is not None:
                self.classes.observe_shed(request.qos_class)
        self.slo.num_rejected_in_queue += len(late)

    def _shed_deadline(self, request: Request) -> Optional[float]:
        """Seconds after arrival by which the request's first token must come, or None (never shed):
        its class's target when the class sheds, else the server's."""
        cls = self.qos.classes.get(request.qos_class) if request.qos_class is not None else None
        if cls is not None and cls.on_miss == SHED:
            server = self.slo.shed_deadline_s()
            return min(cls.ttft_p99 * TTFT_MARGIN, server) if server is not None else cls.ttft_p99 * TTFT_MARGIN
        return self.slo.shed_deadline_s()

    def _lookup(self, request: Request) -> Optional[PrefixHit]:
        if (not self.kv_manager.enable_prefix_caching or not request.uses_prefix_cache
                or self.kv_manager.is_swapped(request.request_id)):
            return None
        return self.kv_manager.find_cached_prefix(request)

    @property
    def _cache_aware(self) -> bool:
        return self.config.cache_aware_scheduling and self.kv_manager.enable_prefix_caching

    def _waiting_order(self, held_below: Optional[int] = None) -> list[Request]:
        """FIFO, or (cache-aware) longest cached prefix first among the first requests, with
        preempted and starving requests ahead in FIFO order. By priority: the first max_num_seqs
        by effective priority, of those up to `held_below` when a class holds the lower ones back
        (filtered before the cut: aged requests of a held class, ahead of every request that may
        run, would otherwise fill the list, and with nothing running the engine stalled)."""
        if self._by_priority:
            candidates = self.waiting if held_below is None else [r for r in self.waiting if r.priority <= held_below]
            return sorted(candidates, key=self._priority_key())[:self.config.max_num_seqs]
        if self.fair is not None:
            return self._fair_order()
        if not self._cache_aware:
            return list(itertools.islice(self.waiting, self.config.max_num_seqs))
        window = list(itertools.islice(self.waiting, CACHE_AWARE_WINDOW))
        limit = self.config.cache_aware_max_bypass

        def rank(item: tuple[int, Request]) -> tuple:
            position, request = item
            if request.status == RequestStatus.PREEMPTED or request.num_bypassed >= limit:
                return (0, 0, position)
            hit = self._lookup(request)
            return (1, -(hit.num_tokens if hit is not None else 0), position)

        return [request for _, request in sorted(enumerate(window), key=rank)]

    def _fair_order(self) -> Iterable[Request]:
        """Waiting requests, each time the next one (in queue order) of the tenant with the lowest
        virtual counter, the earliest head first among equals: lazily, since each admission charges
        its tenant. One pass to group the queue by tenant; then a choice among tenants, not requests."""
        fair = self.fair
        queues: dict[Optional[str], deque[Request]] = {}
        for request in self.waiting:
            queues.setdefault(request.tenant, deque()).append(request)
        while queues:
            tenant = min(queues, key=lambda t: (fair.counter(t), queues[t][0].arrival_time))
            queue = queues[tenant]
            yield queue.popleft()
            if not queue:
                del queues[tenant]

    def _classes_with_work(self) -> set[str]:
        """The request classes with requests running, loading or waiting."""
        if self.classes is None:
            return set()
        return {r.qos_class for r in itertools.chain(self.running, self.waiting, self.loading.values())
                if r.qos_class is not None}

    def _admit_waiting(self, out: SchedulerOutput, budget: int, held_below: Optional[int] = None,
                       only_tenants: Optional[set] = None, only_new: bool = False) -> None:
        """Admits waiting requests in order while slots, budget and blocks last; with `held_below`
        (a class with work misses a p99 target: kvserve/sched/qos_classes.py), only those of a
        priority up to it; with `only_tenants` / `only_new`, only those tenants' requests / requests
        never admitted before (`_fair_prefill_step`)."""
        chunked = self.config.enable_chunked_prefill
        caching = self.kv_manager.enable_prefix_caching
        fifo = (list(itertools.islice(self.waiting, CACHE_AWARE_WINDOW))
                if self._cache_aware and not self._by_priority else [])
        candidates = self._waiting_order(held_below)
        admitted: set[str] = set()
        # With class reservations: each class's blocks, and the classes with work (whose unused
        # reservations the other classes' admissions leave free).
        held = self._class_blocks() if self.reservations is not None else None
        class_work = self._classes_with_work() if held is not None else set()
        for request in candidates:
            if budget <= 0 or len(self.running) + len(self.loading) >= self._admission_limit:
                break
            if held_below is not None and request.priority > held_below:
                continue                # a class above misses its p99 target: it gets the room
            if (only_tenants is not None and request.tenant not in only_tenants) or (
                    only_new and request.num_cached_tokens is not None):
                continue
            # Looked up now, not when ranked: admitting an earlier request may have evicted blocks.
            looked_up = time.monotonic() if request.phases is not None else 0.0
            hit = self._lookup(request)
            if self.kv_manager.waits_for_incoming(request.request_id, hit):
                continue                # another request is loading these host blocks: a GPU hit once published
            num_cached = hit.num_tokens if hit is not None else 0
            if self.kv_manager.is_swapped(request.request_id):
                num_cached = request.num_computed_tokens          # its KV comes back from the host
            num_new = request.tokens_to_compute(num_cached)
            kv_base = num_cached - request.num_pruned_tokens      # a pressed request's swapped KV is shorter
            if not chunked and num_new > budget:
                # Admission bounds the prompt by the budget, but a preempted request recomputes its
                # outputs too and may exceed it: it then runs alone, once nothing else is scheduled
                # (preempted requests lead the queue, so the running ones drain first).
                if out.scheduled or request.status != RequestStatus.PREEMPTED:
                    break
            elif num_new > budget:
                num_new = budget
            needed = self.kv_manager.num_new_blocks_needed(request.request_id, kv_base + num_new, hit)
            if needed + self._admission_watermark_blocks > self.kv_manager.num_free_blocks and self.running:
                break
            if held is not None and needed + self.reservations.protected_from(
                    request.qos_class, held, class_work) > self.kv_manager.num_free_blocks:
                continue                # it would take another class's reservation: it waits
            if self.kv_manager.quota_shortfall(request.tenant, needed, hit.gpu_block_ids if hit is not None else ()):
                continue                # its tenant is at its KV quota: it waits, others may go
            # With nothing running, a load of any size runs in this step: no batch waits for it.
            if not self.kv_manager.allocate_slots(request.request_id, kv_base + num_new, hit,
                                                  request if caching else None, tenant=request.tenant,
                                                  inline_any_load=not self.running):
                break
            if held is not None and request.qos_class is not None:
                held[request.qos_class] = held.get(request.qos_class, 0) + needed
            if self.waiting[0] is request:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            admitted.add(request.request_id)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
                if self.fair is not None:
                    self.fair.charge(request.tenant, prompt_tokens=request.num_prompt_tokens - num_cached)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            if request.phases is not None:
                self._trace_admission(request, hit, num_cached, looked_up)
            if self.kv_manager.is_loading(request.request_id):
                self.loading[request.request_id] = request      # runs once its KV has landed
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        if admitted and fifo:
            self._count_bypasses(fifo, admitted)

    def _trace_admission(self, request: Request, hit: Optional[PrefixHit], num_cached: int, looked_up: float) -> None:
        """A traced request admitted: its lookup across the tiers, the end of its wait, and the
        start of the copy that brings its KV in from the host (a prefix hit or a swap-in)."""
        recorder, now = request.phases, time.monotonic()
        gpu_blocks = len(hit.gpu_block_ids) if hit is not None else 0
        host_blocks = len(hit.host_block_ids) if hit is not None else 0
        recorder.add(phases.TIER_LOOKUP, looked_up, now, gpu_blocks=gpu_blocks, host_blocks=host_blocks,
                     query_tokens=hit.num_query_tokens if hit is not None else 0, cached_tokens=num_cached)
        recorder.end(phases.PREEMPTED, now)
        recorder.end(phases.QUEUED, now, cached_tokens=num_cached)
        if self.kv_manager.is_loading(request.request_id):
            if host_blocks:
                recorder.begin(phases.KV_LOAD, now, tier="host", kind="prefix", blocks=host_blocks)
            else:
                blocks = -(-request.num_kv_tokens // self.kv_manager.block_size)
                recorder.begin(phases.KV_LOAD, now, tier="host", kind="swap_in", blocks=blocks)
        elif host_blocks:               # an inline load: its time is the first chunk's
            recorder.add(phases.KV_LOAD, now, now, tier="host", kind="prefix", blocks=host_blocks, ok=True,
                         inline=True)

    @staticmethod
    def _count_bypasses(fifo: list[Request], admitted: set[str]) -> None:
        """Each request still waiting is charged one bypass per request behind it admitted."""
        later_admitted = 0
        for request in reversed(fifo):
            if request.request_id in admitted:
                later_admitted += 1
            else:
                request.num_bypassed += later_admitted

    def _wants_swap(self, request: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "auto":
            return self.preemption_cost.prefers_swap(request.num_computed_tokens)
        return mode == "swap"

    def _quota_victim(self, index: int, request: Request, num_total_tokens: int) -> Optional[Request]:
        """When `request` (at `running[index]`) cannot grow to `num_total_tokens` because its tenant
        is at its KV quota: the tenant's last running request not yet scheduled this step (maybe
        `request`), taken out of `running`. None when the quota is not what stops it."""
        needed = self.kv_manager.num_new_blocks_needed(request.request_id, num_total_tokens)
        if not self.kv_manager.quota_shortfall(request.tenant, needed):
            return None
        for position in range(len(self.running) - 1, index - 1, -1):
            if self.running[position].tenant == request.tenant:
                return self.running.pop(position)
        return None

    def _preempt(self, request: Request) -> None:
        """Swap (its KV to the host tier, kept computed) where configured (or, with auto, cheaper)
        and the tier has room, else recompute (its KV freed, computed again on resume)."""
        swapped = self._wants_swap(request) and self.kv_manager.swap_out(request.request_id)
        if not swapped:
            self.kv_manager.free(request.request_id)
            request.reset_kv()
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        if request.phases is not None:
            request.phases.begin(phases.PREEMPTED, time.monotonic(), mode="swap" if swapped else "recompute")

    # --- after the model ran ------------------------------------------------------------------
    def advance(self, scheduled: ScheduledRequest) -> None:
        request = scheduled.request
        request.num_computed_tokens += scheduled.num_new_tokens
        # Blocks now full of computed KV become visible to other requests' lookups.
        self.kv_manager.cache_full_blocks(request.request_id, request.num_publishable_tokens)

    def append_token(self, request: Request, token_id: int, eos_token_ids: set[int]) -> None:
        """Records a sampled token and finishes the request on eos, a stop id or its length limit."""
        request.output_token_ids.append(token_id)
        if self.fair is not None:
            self.fair.charge(request.tenant, output_tokens=1)
        self._check_stop(request, token_id, eos_token_ids)

    def fill_pending_token(self, request: Request, token_id: int, eos_token_ids: set[int]) -> None:
        """Overlapped scheduling: the token sampled in place of the request's PENDING_TOKEN."""
        if not request.output_token_ids or request.output_token_ids[-1] != PENDING_TOKEN:
            raise RuntimeError(f"request {request.request_id} has no pending token to fill")
        request.output_token_ids[-1] = token_id
        if self.fair is not None:
            self.fair.charge(request.tenant, output_tokens=1)
        self._check_stop(request, token_id, eos_token_ids)

    def _check_stop(self, request: Request, token_id: int, eos_token_ids: set[int]) -> None:
        params = request.params
        if len(request.output_token_ids) >= params.min_tokens:
            if not params.ignore_eos and token_id in eos_token_ids:
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                return
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                return
        if self._reaches_length_limit(request):
            self.finish(request, RequestStatus.FINISHED_LENGTH)

    def _reaches_length_limit(self, request: Request) -> bool:
        return len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len

    def finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        request.status = status
        request.finished_time = time.monotonic()
        if self.slo is not None and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.slo.observe_completion()
        if request.qos_class is not None and status in (RequestStatus.FINISHED_STOPPED,
                                                        RequestStatus.FINISHED_LENGTH):
            self._observe_class_latency(request)
        if request in self.running:
            self.running.remove(request)
        elif self.loading.pop(request.request_id, None) is not None:
            pass
        elif self.prefetching.pop(request.request_id, None) is not None:
            pass
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv_manager.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def _observe_class_latency(self, request: Request) -> None:
        first = request.first_token_time
        ttft = first - request.arrival_time if first is not None else None
        outputs = len(request.output_token_ids)
        tpot = (request.finished_time - first) / (outputs - 1) if first is not None and outputs > 1 else None
        self.classes.observe_finished(request.qos_class, ttft, tpot)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def make_stats(self) -> SchedulerStats:
        latency = self.slo.make_stats(self.step_token_budget()) if self.slo is not None else None
        by_tenant: dict[Optional[str], int] = {}
        for request in itertools.chain(self.running, self.loading.values()):
            by_tenant[request.tenant] = by_tenant.get(request.tenant, 0) + len(
                self.kv_manager.block_table(request.request_id))
        quotas = {tenant: (self.kv_manager.kv_blocks_of(tenant), quota)
                  for tenant, quota in self.kv_manager.tenant_kv_quotas.items()}
        return SchedulerStats(len(self.running), len(self.waiting) + len(self.prefetching),
                              self.num_preemptions_total, latency, len(self.loading), by_tenant,
                              self._class_stats(), quotas)

    def _class_stats(self) -> tuple[ClassLatencyStats, ...]:
        if self.classes is None:
            return ()
        held = self._class_blocks()
        reserved = self.reservations.reserved if self.reservations is not None else {}
        return tuple(dataclasses.replace(stats, kv_reserved_blocks=reserved.get(stats.name, 0),
                                         kv_blocks=held.get(stats.name, 0))
                     for stats in self.classes.make_stats())

    @property
    def is_stalled(self) -> bool:
        """After a schedule() that scheduled nothing: whether the waiting requests can never run as
        things stand (nothing runs whose end would free blocks or slots)."""
        return bool(self.waiting) and not self.running and not self.loading

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading) + len(self.prefetching)
