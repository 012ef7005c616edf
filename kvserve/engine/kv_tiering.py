"""Attention-score tiering: the press mode that demotes KV blocks to the host tier instead of
dropping tokens, and brings them back when the decode's queries need them (kv_press_mode "tier").

A tiered request's KV blocks are of three kinds. Hot: the first block (attention sinks), the blocks
of the last `kv_press_window` tokens and the one that takes the next token; always on the GPU.
Warm: other full blocks on the GPU, as many as the keep ratio (or token budget) allows. Cold: the
rest, in host blocks the request holds (engine's host tier), with a summary of their keys (per
layer, KV head and channel: min and max, worker/key_summaries.py) kept on the device.

At the prompt's end the press scores the tokens as it would to prune them; a block's vote is how
many of its tokens the press would keep (over layers and heads). Every full block is copied to the
host once (a full block never changes), so demoting is freeing a GPU block. Blocks are ranked on a
query by Quest's bound on their attention logits: per layer and query head the blocks are ordered
by bound, and a block's rank is its best in any of those orders (each head's favourite blocks come
first: a retrieval head's needle is one head's top block, not many heads' middling one), then how
many orders put it within the budget, then whether it is resident (so blocks do not flap). At the
prompt's end the ranking runs on the last prompt token's query with the press's choice as the
resident set; since nothing has left the GPU yet, the warm set is simply the best-ranked blocks.
Then every `kv_tier_interval` decode steps the step's own query is recorded and ranked on, and up
to `kv_tier_recall_blocks` cold blocks that rank within the budget are recalled: copied into fresh
GPU blocks on the load stream while the request keeps decoding over what it has; once a copy
has landed the block takes the place of the worst-ranked warm block (which is freed; its host
copy stays). Attention reads only the table, whose order does not
matter (RoPE is in the keys): the table's blocks are the resident ones, the request's KV length
their tokens, and its positions stay the original ones (Request.num_pruned_tokens counts the
cold tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from kvserve.worker.key_summaries import block_bounds, block_key_summaries, block_row_ranks
from kvserve.worker.press_apply import press_votes

if TYPE_CHECKING:
    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvstore import KVCacheStore
    from kvserve.press import Press
    from kvserve.sched.request import Request

# A resident block's bonus when ranked: less than one vote, so it wins ties only.
RESIDENT_BONUS = 0.5


@dataclass
class TierState:
    """One tiered request's blocks by logical number: block b holds its tokens [b * bs, (b + 1) * bs)."""
    table_logicals: list[int]                 # the logical block at each position of the request's table
    next_logical: int                         # the number the table's next new block gets
    first_region: int                         # logical blocks below it are its shared prefix: stay resident
    host_of: dict[int, int] = field(default_factory=dict)     # logical -> host block holding its copy
    summaries: Optional[torch.Tensor] = None  # [capacity, layers, kv_heads, 2, head_dim], row = logical
    num_summarized: int = 0                   # logical blocks [0, num_summarized) have summaries
    recalls: dict[int, tuple[int, Optional[int]]] = field(default_factory=dict)  # recall id -> (logical, victim)


@dataclass
class TierCounts:
    tokens_demoted: int = 0
    tokens_recalled: int = 0


class Tiering:
    def __init__(self, block_size: int, window: int, interval: int, max_recalls: int, scale: float) -> None:
        self.block_size, self.window, self.interval, self.max_recalls = block_size, window, interval, max_recalls
        self.scale = scale
        self.clock = 0                          # steps scheduled (see tick)

    def _not_hot(self, region: np.ndarray, num_positions: int) -> np.ndarray:
        """Which of the full logical blocks `region` may leave the GPU: all but the first and those
        of the last `window` tokens (hot)."""
        return (region != 0) & (region < max(0, num_positions - self.window) // self.block_size)

    # --- at the prompt's end ------------------------------------------------------------------------
    def start(self, request: "Request", press: "Press", kv_store: "KVCacheStore", kv_manager: "KVCacheManager",
              protected: int, keep: int, queries: Optional[list[torch.Tensor]],
              last_query: Optional[list[torch.Tensor]], counts: TierCounts) -> Optional[TierState]:
        """Demotes the blocks the press scores worst; None (nothing changed) when none would be, or
        the host tier cannot take the request's blocks."""
        bs = self.block_size
        rid = request.request_id
        end = request.num_kv_tokens                        # nothing pruned yet: positions == KV indices
        table = kv_manager.block_table(rid)
        first, num_full = protected // bs, end // bs
        region = np.arange(first, num_full)
        not_hot = self._not_hot(region, end)
        candidates = region[not_hot].tolist()
        budget = max(0, -(-keep // bs) - int((~not_hot).sum()))
        if len(candidates) <= budget:
            return None
        host_ids = kv_manager.copy_to_host(rid, candidates)
        if host_ids is None:
            return None
        votes = press_votes(kv_store, press, table, protected, end, keep,
                            queries if press.needs_queries else None, self.scale)
        candidate_votes = votes.cpu().numpy()[candidates]
        ranked = [candidates[i] for i in np.argsort(-candidate_votes, kind="stable")]   # ties keep the earlier
        state = TierState(list(range(len(table))), len(table), first, dict(zip(candidates, host_ids)))
        self._summarize(state, kv_store, table, num_full)
        if last_query:
            # The ranking a decode step would run, on the last prompt token's query, with the press's
            # choice as the resident set: nothing has left the GPU yet, so every recall is free
            # and none is capped. The press's choice decides among equals.
            chosen = set(ranked[:budget])
            ranked = self._rank(state, np.asarray(candidates, dtype=np.int64),
                                np.fromiter((b in chosen for b in candidates), dtype=bool, count=len(candidates)),
                                last_query, budget).tolist()
        cold = sorted(ranked[budget:])
        kv_manager.demote(rid, cold)
        cold_set = set(cold)
        state.table_logicals = [b for b in state.table_logicals if b not in cold_set]
        request.num_pruned_tokens += len(cold) * bs
        counts.tokens_demoted += len(cold) * bs
        return state

    # --- during decode ------------------------------------------------------------------------------
    def tick(self) -> bool:
        """One scheduled step; True when it is a ranking step. Every tiered request ranks on the same
        steps, so the other steps run as plain decodes (launched ahead, CUDA graphs) for all of them."""
        self.clock += 1
        return self.clock % self.interval == 0

    @staticmethod
    def due(samples_token: bool, ranking_step: bool) -> Optional[int]:
        """Query rows to record in this step for a tiered request (1: it is ranked after it), or None
        when nothing is due. Recalls that landed are placed at the next ranking step."""
        return 1 if samples_token and ranking_step else None

    def sync(self, request: "Request", state: TierState, kv_manager: "KVCacheManager", counts: TierCounts
             ) -> tuple[TierState, list[int], int]:
        """After a decode step, first part: the blocks the scheduler appended get logical numbers,
        landed recalls are placed, blocks that filled are copied to the host. Returns what
        `summarize` needs: (state, their device blocks, the request's full blocks)."""
        table = kv_manager.block_table(request.request_id)
        while len(state.table_logicals) < len(table):          # blocks the scheduler appended
            state.table_logicals.append(state.next_logical)
            state.next_logical += 1
        self._place_recalls(request, state, kv_manager, counts)
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= state.num_summarized:
            return state, [], num_full
        fresh = list(range(state.num_summarized, num_full))
        at = {b: p for p, b in enumerate(state.table_logicals)}
        host_ids = kv_manager.copy_to_host(request.request_id, [at[b] for b in fresh])
        if host_ids is not None:                               # else they stay resident
            state.host_of.update(zip(fresh, host_ids))
        table = kv_manager.block_table(request.request_id)
        return state, [table[at[b]] for b in fresh], num_full

    @staticmethod
    def summarize(kv_store: "KVCacheStore", filled: list[tuple[TierState, list[int], int]]) -> None:
        """Second part, for every tiered request of the step at once (one pass over the layers):
        the key summaries of the blocks that filled."""
        block_ids = [block for _, blocks, _ in filled for block in blocks]
        if not block_ids:
            return
        rows = block_key_summaries(kv_store, block_ids)
        start = 0
        for state, blocks, num_full in filled:
            if blocks:
                Tiering._store_summaries(state, rows[start:start + len(blocks)], num_full)
                start += len(blocks)

    def rank(self, request: "Request", state: TierState, kv_manager: "KVCacheManager", keep: int,
             queries: Optional[list[torch.Tensor]], counts: TierCounts) -> None:
        """Third part, with the step's query: ranks the blocks, demotes and recalls (the recalls of
        every request of the step, queued in a row, travel in one copy)."""
        bs = self.block_size
        rid = request.request_id
        positions = request.num_computed_tokens
        num_full = positions // bs
        if not queries:
            return
        # In arrays over logical blocks: a request has thousands of them, ranked every few steps.
        region = np.arange(state.first_region, num_full)
        not_hot = self._not_hot(region, positions)
        has_host = np.zeros(len(region), dtype=bool)
        if state.host_of:
            with_copy = np.fromiter(state.host_of, dtype=np.int64, count=len(state.host_of))
            has_host[with_copy[(with_copy >= state.first_region) & (with_copy < num_full)] - state.first_region] = True
        candidates = region[not_hot & has_host]
        # Full blocks without a host copy (the host tier had no room) stay, and count against it.
        stuck = int((not_hot & ~has_host).sum())
        budget = max(0, -(-keep // bs) - int((~not_hot).sum()) - stuck)
        if not len(candidates):
            return
        in_table = np.zeros(state.next_logical, dtype=bool)
        in_table[state.table_logicals] = True
        resident = in_table.copy()
        promised = np.zeros(state.next_logical, dtype=bool)      # a recall in flight replaces them
        for logical, victim in state.recalls.values():
            resident[logical] = True
            if victim is not None:
                promised[victim] = True
        order = self._rank(state, candidates, resident[candidates], [q[-1] for q in queries], budget)
        wanted = np.zeros(state.next_logical, dtype=bool)
        wanted[order[:budget]] = True
        # Resident blocks the ranking does not want, worst first.
        backwards = order[::-1]
        surplus = backwards[in_table[backwards] & ~wanted[backwards] & ~promised[backwards]].tolist()
        warm = int((resident[candidates] & ~promised[candidates]).sum())
        best = order[:budget]
        to_recall = best[~resident[best]][:self.max_recalls].tolist()
        victims = surplus[:max(0, warm + len(to_recall) - budget)]
        paired, demote_now = victims[:len(to_recall)], victims[len(to_recall):]
        for index_in_recalls, logical in enumerate(to_recall):
            recall_id = kv_manager.recall(rid, state.host_of[logical])
            if recall_id is None:
                break                                          # no GPU block free: next ranking
            victim = paired[index_in_recalls] if index_in_recalls < len(paired) else None
            state.recalls[recall_id] = (logical, victim)
        if demote_now:
            at = {b: p for p, b in enumerate(state.table_logicals)}
            kv_manager.demote(rid, [at[b] for b in demote_now])
            dropped = set(demote_now)
            state.table_logicals = [b for b in state.table_logicals if b not in dropped]
            request.num_pruned_tokens += len(demote_now) * bs
            counts.tokens_demoted += len(demote_now) * bs

    @staticmethod
    def _rank(state: TierState, candidates: np.ndarray, is_resident: np.ndarray, query: list[torch.Tensor],
              budget: int) -> np.ndarray:
        """Candidates (logical blocks), best first: by the block's best rank among the bounds of any
        (layer, query head), so each head's favourite blocks come first (a retrieval head's needle is
        one head's top block, not many heads' middling one); then by how many rows put it among their
        `budget` highest; a resident block first among equals (so blocks do not flap). On the
        device, with one read back (the order)."""
        device = state.summaries.device
        bounds = block_bounds(query, state.summaries[:state.num_summarized])
        bounds = bounds.index_select(-1, torch.from_numpy(candidates).to(device))
        ranks = block_row_ranks(bounds)                                  # [rows, n]
        best = ranks.min(dim=0).values.double()
        votes = (ranks < budget).sum(dim=0).double()
        votes += RESIDENT_BONUS * torch.from_numpy(is_resident.astype(np.float64)).to(device)
        # Sort by best rank, then by votes: lexicographic through one float key (votes < rows + 1).
        key = best * (ranks.shape[0] + 1) - votes
        return candidates[torch.argsort(key, stable=True).cpu().numpy()]

    def _place_recalls(self, request: "Request", state: TierState, kv_manager: "KVCacheManager",
                       counts: TierCounts) -> None:
        bs = self.block_size
        rid = request.request_id
        for recall_id, block_id in kv_manager.take_recalls(rid):
            logical, victim = state.recalls.pop(recall_id)
            if block_id is None:
                continue                                       # the copy failed (counted): it stays cold
            counts.tokens_recalled += bs
            if victim is not None and victim in state.table_logicals:
                position = state.table_logicals.index(victim)
                kv_manager.replace_block(rid, position, block_id)
                state.table_logicals[position] = logical
                counts.tokens_demoted += bs
                continue
            # No block makes room for it (the budget grew): it goes before the block that takes the
            # next token, or last if that block is full.
            position = len(state.table_logicals) - (1 if request.num_kv_tokens % bs else 0)
            kv_manager.insert_block(rid, position, block_id)
            state.table_logicals.insert(position, logical)
            request.num_pruned_tokens -= bs

    def _summarize(self, state: TierState, kv_store: "KVCacheStore", table: list[int], num_full: int) -> None:
        """Key summaries of logical blocks [num_summarized, num_full), all resident (just filled)."""
        if num_full <= state.num_summarized:
            return
        at = {b: p for p, b in enumerate(state.table_logicals)}
        fresh = range(state.num_summarized, num_full)
        self._store_summaries(state, block_key_summaries(kv_store, [table[at[b]] for b in fresh]), num_full)

    @staticmethod
    def _store_summaries(state: TierState, rows: torch.Tensor, num_full: int) -> None:
        """Rows for logical blocks [num_summarized, num_full)."""
        if state.summaries is None or state.summaries.shape[0] < num_full:
            grown = torch.zeros((max(num_full, 2 * (state.summaries.shape[0] if state.summaries is not None else 0)),
                                 *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
            if state.summaries is not None:
                grown[:state.num_summarized] = state.summaries[:state.num_summarized]
            state.summaries = grown
        state.summaries[state.num_summarized:num_full] = rows
        state.num_summarized = num_full
