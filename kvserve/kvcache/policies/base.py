"""What every eviction policy ranks by, and the policy interface.

One access = one request using a cached block, stamped when the request lets go of it (finish,
abort or preemption). All blocks of a request are released at one instant, so ties are common; the
evictor breaks them deeper-first, then oldest release first. Policies are pure functions of a
block's `AccessStats` (plus small global state for LFU's age), so one history per block serves every
policy and the adaptive policy can switch between them by re-keying the evictor's heap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

MAX_HISTORY = 8          # access times kept per block: the largest K lru-k may use
NEVER = -math.inf        # the priority of a block never accessed: first to go


@dataclass(slots=True)
class AccessStats:
    """Access history of one cached block (or one shadow-cache entry)."""
    depth: int                                   # index of the block in its prefix chain
    count: int = 0
    times: list[float] = field(default_factory=list)     # the last MAX_HISTORY access times
    # Fan-out, kept only where a policy ranks by it (`EvictionPolicy.tracks_fanout`):
    last_child: Optional[bytes] = None           # hash of the block that last continued this one
    branch_pending: bool = False                 # a request opened a new branch below; its access is due
    newest_branched: bool = False                # the newest access opened a branch
    branches: tuple[float, ...] = ()             # earlier accesses that opened one (last MAX_HISTORY)

    def record(self, now: float) -> None:
        self.count += 1
        times = self.times
        if self.newest_branched:
            # The newest access is about to become an earlier one: keep it as a branch access.
            self.branches = (self.branches + (times[-1],))[-MAX_HISTORY:]
        self.newest_branched, self.branch_pending = self.branch_pending, False
        times.append(now)
        if len(times) > MAX_HISTORY:
            del times[0]


def note_continuation(parent: AccessStats, child: bytes) -> bool:
    """Records that the block `child` continues `parent`'s prefix. True when that opens a new
    branch: the parent was continued by another block before (a first continuation, such as the
    next turn of a conversation, is not a branch; a second conversation on a system prompt is)."""
    previous, parent.last_child = parent.last_child, child
    return previous is not None and previous != child


class EvictionPolicy:
    """Lower priority = evicted first. Subclasses set `name` and implement `priority`."""
    name = ""
    tracks_fanout = False        # whether the cache must keep AccessStats' fan-out fields up to date

    def priority(self, stats: AccessStats) -> float:
        raise NotImplementedError

    def on_evict(self, priority: float) -> None:
        """Called with the priority of each evicted block (LFU-DA's aging uses it)."""

    @property
    def label(self) -> str:
        """Name with parameters, used in metrics labels and logs."""
        return self.name

    # Hooks for policies that learn from the request stream (adaptive); no-ops here.
    def observe_lookup(self, block_hashes: list[bytes], now: float) -> None:
        """A request looked up these (prompt) blocks."""

    def observe_release(self, block_hashes: list[bytes], first_depth: int, now: float) -> None:
        """A request released blocks beyond its looked-up prompt (e.g. generated-token blocks)."""

    def clone(self) -> "EvictionPolicy":
        """A fresh instance with the same parameters and no state."""
        raise NotImplementedError
