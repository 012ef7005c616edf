"""The engine's side of KV compression: which requests a press prunes, when, and what that frees.

A request's press (its own `kv_press` or the server's `--kv-press`) runs once its prompt is computed:
in the step that computes the last prompt token, the attention layers record the queries of the
prompt's last `kv_press_window` tokens (for presses that score by attention), and after the step
the request's KV past its protected prefix is pruned to what the press keeps, compacted to the
front (kvserve/worker/press_apply.py), and the blocks past it go back to the pool before the next
step is scheduled. With a token budget (`kv_keep_tokens`) the press runs again, on the current
decode query, whenever the KV has grown `kv_press_slack` tokens past the budget. A request that
recomputes after a preemption is pressed at its prompt's end again (its chunks stop there until
then), so with a keep ratio its outputs are recomputed over the same pressed KV.

With `kv_press_mode` "tier" the press demotes whole blocks to the host tier instead of dropping
tokens, and blocks come back when the decode's queries rank them high (engine/kv_tiering.py).

Positions stay the original ones: the request's next token is at `num_computed_tokens`, its KV is
`num_kv_tokens` long. The protected prefix is the whole blocks the request found in the prefix
cache: shared blocks are never rewritten. Blocks the press rewrites are never published to the
prefix cache; the leading ones it left intact are (Request.publish_limit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvserve.engine.kv_tiering import Tiering, TierCounts, TierState
from kvserve.press import PRESSES, Press, make_press, press_names
from kvserve.sampling_params import SamplingParams
from kvserve.stats import PressStats
from kvserve.worker.press_apply import compact

if TYPE_CHECKING:
    from kvserve.config import CacheConfig
    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvstore import KVCacheSpec
    from kvserve.sched.output import SchedulerOutput
    from kvserve.sched.request import Request
    from kvserve.worker.runner import ModelRunner

NO_PRESS = "none"         # a request's kv_press that turns the server's default off
DROP, TIER = "drop", "tier"
PRESS_MODES = (DROP, TIER)


@dataclass
class PressPlan:
    """How one request is pruned. `applied`: its prompt-end press has run (or was skipped)."""
    press: Press
    keep_ratio: Optional[float]
    keep_tokens: Optional[int]
    mode: str = DROP
    applied: bool = False
    tier: Optional[TierState] = None          # mode "tier", once its blocks were tiered

    def reset(self, request: "Request") -> None:
        """Its KV is computed again from the start (recompute preemption): pruned again at its
        prompt's end, where the chunks stop until then (Request.press_stop)."""
        self.applied = False
        self.tier = None
        request.publish_limit = 0
        request.press_stop = request.num_prompt_tokens


@dataclass
class _Counts(TierCounts):
    applied: int = 0
    skipped: int = 0
    tokens_pruned: int = 0
    blocks_freed: int = 0


class PressControl:
    def __init__(self, cache: "CacheConfig", kv_spec: "KVCacheSpec", model_kind: str,
                 host_tier: bool = False) -> None:
        self.default_press = cache.kv_press
        self.default_mode = cache.kv_press_mode
        self.host_tier = host_tier
        self.default_ratio, self.default_tokens = cache.kv_keep_ratio, cache.kv_keep_tokens
        self.min_tokens, self.window, self.slack = cache.kv_press_min_tokens, cache.kv_press_window, cache.kv_press_slack
        self.block_size = cache.block_size
        self.scale = kv_spec.head_dim ** -0.5
        self.tiering = Tiering(cache.block_size, cache.kv_press_window, cache.kv_tier_interval,
                               cache.kv_tier_recall_blocks, self.scale)
        self._unsupported = None
        if model_kind != "gqa":
            self._unsupported = "the presses prune per-head K/V caches (Llama, Qwen2); this model caches MLA latents"
        elif kv_spec.needs_rows:
            self._unsupported = ("this KV format keeps per-sequence rows (a full-precision window or error "
                                 "feedback), which a press cannot compact; use --kv-quant-key-layout channel or "
                                 "--kv-quant-window 0")
        self._counts: dict[str, _Counts] = {}
        self.check_defaults(self.default_press, self.default_ratio, self.default_tokens, self.default_mode)

    def check_defaults(self, press: Optional[str], ratio: Optional[float], tokens: Optional[int], mode: str) -> None:
        """The server's press defaults (--kv-press, --kv-keep-ratio / --kv-keep-tokens, --kv-press-mode)
        can run here: at start, and before the admin config API changes them."""
        if press not in (None, NO_PRESS):
            self._check(press, "--kv-press")
            if ratio is None and tokens is None:
                raise ValueError("--kv-press needs --kv-keep-ratio or --kv-keep-tokens (how much it keeps)")
        self._check_mode(mode, "--kv-press-mode")

    def set_defaults(self, press: Optional[str], ratio: Optional[float], tokens: Optional[int], mode: str) -> None:
        """New press defaults (the admin config API), for requests admitted from now on: a running
        request keeps the plan it was admitted with."""
        self.check_defaults(press, ratio, tokens, mode)
        self.default_press, self.default_ratio, self.default_tokens, self.default_mode = press, ratio, tokens, mode

    def _check_mode(self, mode: str, field: str) -> str:
        if mode not in PRESS_MODES:
            raise ValueError(f"{field} {mode!r} is not a press mode; one of: {', '.join(PRESS_MODES)}")
        if mode == TIER and not self.host_tier:
            raise ValueError(f"{field} {mode!r} demotes KV blocks to the host KV tier, which is off "
                             f"(--kv-host-memory)")
        return mode

    def _check(self, name: str, field: str) -> Press:
        """The press; a ValueError whose first word is `field` (the server's 400 names it) otherwise."""
        if name not in PRESSES:
            raise ValueError(f"{field} {name!r} is not a press; one of: {', '.join(press_names())}, {NO_PRESS}")
        if self._unsupported is not None:
            raise ValueError(f"{field} {name!r} cannot run here: {self._unsupported}")
        return make_press(name)

    # --- per request --------------------------------------------------------------------------------
    def plan_for(self, params: SamplingParams) -> Optional[PressPlan]:
        """The request's plan (None: not pruned); ValueError naming the field for what cannot run."""
        name = params.kv_press if params.kv_press is not None else self.default_press
        if name in (None, NO_PRESS):
            if params.kv_keep_ratio is not None or params.kv_keep_tokens is not None:
                raise ValueError("kv_keep_ratio and kv_keep_tokens need a press (kv_press, or the server's --kv-press)")
            return None
        press = self._check(name, "kv_press")
        mode = self._check_mode(params.kv_press_mode if params.kv_press_mode is not None else self.default_mode,
                                "kv_press_mode")
        ratio, tokens = params.kv_keep_ratio, params.kv_keep_tokens
        if ratio is None and tokens is None:
            ratio, tokens = self.default_ratio, self.default_tokens
        if ratio is None and tokens is None:
            raise ValueError("kv_keep_ratio (or kv_keep_tokens) is needed with a press: how much of the KV it keeps "
                             "(in the request, or the server's --kv-keep-ratio / --kv-keep-tokens)")
        return PressPlan(press, ratio, tokens, mode)

    def due(self, sched_out: "SchedulerOutput") -> dict[str, int]:
        """Requests whose press runs after this step, with the query rows their press needs recorded
        (0 for presses that read keys only)."""
        due: dict[str, int] = {}
        ranking_step = self.tiering.tick()
        for item in sched_out.scheduled:
            request = item.request
            plan = request.press
            if plan is None:
                continue
            if not plan.applied:
                if request.num_computed_tokens + item.num_new_tokens < request.num_prompt_tokens:
                    continue                               # its prompt's end is not in this step
                # Tier mode ranks blocks on the last prompt token's query, whatever the press reads.
                rows = self.window if plan.press.needs_queries else (1 if plan.mode == TIER else 0)
                due[request.request_id] = rows
                continue
            elif plan.tier is not None:
                tier_rows = self.tiering.due(item.samples_token, ranking_step)
                if tier_rows is not None:
                    due[request.request_id] = tier_rows          # the bounds read the query, whatever the press
                continue
            elif plan.mode == TIER:
                continue                                   # left whole at its prompt's end
            elif item.samples_token and plan.keep_tokens is not None and \
                    request.num_kv_tokens + item.num_new_tokens > plan.keep_tokens + self.slack:
                rows = 1                                   # the decode step's own query
            else:
                continue
            due[request.request_id] = rows if plan.press.needs_queries else 0
        return due

    def apply(self, requests: list["Request"], runner: "ModelRunner", kv_manager: "KVCacheManager") -> None:
        """After the step (and `Scheduler.advance`): prunes each due request's KV and frees its tail."""
        # Requests tiered at an earlier step: ranked together. The others are pressed (or start
        # tiering) one by one below.
        tiered = [r for r in requests if r.press is not None and r.press.tier is not None and not r.is_finished]
        if tiered:
            self._tier_step(tiered, runner, kv_manager)
        ranked = {request.request_id for request in tiered}
        for request in requests:
            plan = request.press
            if plan is None or request.is_finished or request.request_id in ranked:
                continue
            first = not plan.applied
            plan.applied = True
            request.press_stop = None
            # Whole blocks it found in the prefix cache, and any it published since (a request whose
            # first press was skipped, pruned later by its budget): shared blocks are never rewritten.
            protected = max((request.num_cached_tokens or 0) // self.block_size * self.block_size,
                            kv_manager.num_published_tokens(request.request_id))
            end = request.num_kv_tokens
            region = end - protected
            counts = self._counts.setdefault(plan.press.name, _Counts())
            keep = self._keep(plan, protected, region)
            if keep >= region or (first and region < self.min_tokens):
                if first:
                    counts.skipped += 1
                    request.publish_limit = None          # nothing rewritten: every block may be shared
                continue
            observed = runner.observed.get(request.request_id)
            queries = observed if plan.press.needs_queries else None
            if plan.press.needs_queries and not queries:
                # Nothing was observed for it (cannot happen in a step `due` planned): left whole
                # rather than scored on nothing.
                counts.skipped += first
                if first:
                    request.publish_limit = None
                continue
            if queries is not None:
                queries = [q[-region:] for q in queries]   # a window longer than the region: its own tokens only
            if plan.mode == TIER:
                last_query = [q[-1] for q in observed] if observed else None
                plan.tier = self.tiering.start(request, plan.press, runner.kv_store, kv_manager, protected, keep,
                                               queries, last_query, counts)
                if plan.tier is None:
                    counts.skipped += 1
                    request.publish_limit = None
                else:
                    counts.applied += 1
                    # The table no longer follows the token order past the protected prefix.
                    request.publish_limit = protected
                continue
            table = kv_manager.block_table(request.request_id)
            intact = compact(runner.kv_store, plan.press, table, protected, end, keep, queries, self.scale)
            limit = (protected + intact) // self.block_size * self.block_size
            request.publish_limit = limit if request.publish_limit is None else min(request.publish_limit, limit)
            request.num_pruned_tokens += region - keep
            counts.applied += first
            counts.tokens_pruned += region - keep
            counts.blocks_freed += kv_manager.truncate(request.request_id, protected + keep)

    def _tier_step(self, requests: list["Request"], runner: "ModelRunner", kv_manager: "KVCacheManager") -> None:
        """Tiered requests' ranking step, in three passes over them, so the step's summaries are one
        pass over the layers and its copies to the host and its recalls one copy each."""
        tiering = self.tiering
        filled = [tiering.sync(request, request.press.tier, kv_manager, self._counts[request.press.press.name])
                  for request in requests]
        tiering.summarize(runner.kv_store, filled)
        for request in requests:
            plan = request.press
            protected = plan.tier.first_region * self.block_size
            keep = self._keep(plan, protected, request.num_computed_tokens - protected)
            tiering.rank(request, plan.tier, kv_manager, keep, runner.observed.get(request.request_id),
                         self._counts[plan.press.name])

    @staticmethod
    def _keep(plan: PressPlan, protected: int, region: int) -> int:
        if plan.keep_tokens is not None:
            return max(1, min(region, plan.keep_tokens - protected))
        return max(1, min(region, round(plan.keep_ratio * region)))

    def make_stats(self) -> tuple[PressStats, ...]:
        return tuple(PressStats(name, **dataclasses.asdict(counts)) for name, counts in sorted(self._counts.items()))
