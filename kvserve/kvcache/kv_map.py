"""Building blocks of the KV map (Engine.make_kv_map; kvserve/stats.py KVMapSnapshot): a tier's
per-block states and heat folded into a bounded number of cells, the shared index of tenants a
map's tiers refer to, a namespace's tenant for display, and the heat scale every tier uses.

The owners fill the per-block columns (KVCacheManager.make_block_maps for the GPU pool,
HostTier.block_states for the host tier); this module only shapes them, so that every tier folds
and scores the same way. The columns are numpy arrays: a pool has up to hundreds of thousands of
blocks and the map is made on the engine thread, where a Python loop per block would stall steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from kvserve.stats import KV_BLOCK_STATES, KVMapTier

FREE, RUNNING, SHARED, LOADING, CACHED, PINNED, HELD, OFFLINE = range(len(KV_BLOCK_STATES))

# The grid's size when the reader does not say: small enough for a few events a second, fine
# enough that a pool of a few thousand blocks is drawn block by block.
DEFAULT_MAX_CELLS = 4096
MAX_CELLS_LIMIT = 65536


class TenantIndex:
    """The tenants a KV map's tiers name, each once: tiers store small indices, the snapshot the names."""

    def __init__(self) -> None:
        self._index: dict[Optional[str], int] = {}

    def __call__(self, tenant: Optional[str]) -> int:
        index = self._index.get(tenant)
        if index is None:
            index = self._index[tenant] = len(self._index)
        return index

    @property
    def names(self) -> tuple[Optional[str], ...]:
        return tuple(self._index)


def namespace_tenant(namespace: str) -> Optional[str]:
    """The tenant (or share group) a prefix-cache namespace belongs to, for display; the inverse of
    prefix_cache.make_namespace without the salt. None: requests without a tenant."""
    scope = namespace.partition("\0salt:")[0]
    if scope.startswith("tenant:"):
        return scope[len("tenant:"):] or None
    return scope                  # "global", or "group:a,b"


def heat_scores(recent_uses: np.ndarray) -> np.ndarray:
    """0-100 from counts of recent uses (decayed, plus current holders): 0 cold, 50 one use, 90
    nine. Saturating, so one very hot block does not wash every other out of the scale, and
    absolute, so colours mean the same from one snapshot to the next."""
    uses = np.asarray(recent_uses, dtype=np.float64)
    return (100.0 * uses / (uses + 1.0) + 0.5).astype(np.int64)


def clamp_max_cells(max_cells: int) -> int:
    return max(1, min(int(max_cells), MAX_CELLS_LIMIT))


@dataclass
class FoldedCells:
    """A tier's blocks folded into cells: each cell covers `blocks_per_cell` consecutive blocks
    (the last may cover fewer)."""
    blocks_per_cell: int
    states: np.ndarray           # per cell: the most common state of its blocks (ties: the earlier state)
    shown: np.ndarray            # per cell: the block it shows (the first in that state): whose request and tenant
    heat: np.ndarray             # per cell: its hottest block's heat score
    state_counts: tuple[int, ...]   # exact blocks per state


def fold_cells(states: np.ndarray, heat: np.ndarray, max_cells: int) -> FoldedCells:
    num_blocks = len(states)
    num_states = len(KV_BLOCK_STATES)
    counts = np.bincount(states, minlength=num_states)
    state_counts = tuple(int(c) for c in counts[:num_states])
    per_cell = max(1, -(-num_blocks // max(1, max_cells)))
    if per_cell == 1:
        return FoldedCells(1, states, np.arange(num_blocks), heat, state_counts)
    num_cells = -(-num_blocks // per_cell)
    pad = num_cells * per_cell - num_blocks
    # The padding is a state of its own (num_states) that no count looks at.
    grid = np.concatenate([states, np.full(pad, num_states, dtype=states.dtype)]).reshape(num_cells, per_cell)
    per_state = np.stack([(grid == state).sum(axis=1) for state in range(num_states)], axis=1)
    majority = per_state.argmax(axis=1)
    shown = (grid == majority[:, None]).argmax(axis=1) + np.arange(num_cells) * per_cell
    hottest = np.concatenate([heat, np.zeros(pad, dtype=heat.dtype)]).reshape(num_cells, per_cell).max(axis=1)
    return FoldedCells(per_cell, majority, shown, hottest, state_counts)


def make_tier(name: str, num_blocks: int, folded: FoldedCells, kv_format: str,
              label: Callable[[int], tuple[int, int]]) -> KVMapTier:
    """The KVMapTier of folded cells; `label(block_id)` gives (request index, tenant index) of the
    block a cell shows, asked once a cell (not once a block)."""
    labels = [label(block_id) if state != FREE else (-1, -1)
              for block_id, state in zip(folded.shown.tolist(), folded.states.tolist())]
    return KVMapTier(name, num_blocks, folded.blocks_per_cell, tuple(folded.states.tolist()),
                     tuple(request for request, _ in labels), tuple(tenant for _, tenant in labels),
                     tuple(folded.heat.tolist()), folded.state_counts, kv_format)
