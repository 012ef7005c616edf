"""KV reservations per request class (`kv_reservation_blocks` / `kv_reservation_fraction` of a class in
--qos-config): GPU blocks that no other class may take while the class has work.

A class with work (requests running, loading or waiting) keeps its reservation less what its own
requests hold: admissions of the other classes must leave that much free. A class with no work
lends its reservation to everyone. When a class with waiting work finds its reservation borrowed
(too few free blocks for its next request, up to its unused reservation), the scheduler preempts
borrowers: running requests of classes holding more than their own reservation, lowest-ranked
first (kvserve/sched/scheduler.py, `_reclaim_reservations`).
"""

from __future__ import annotations

from typing import Iterable, Optional

from kvserve.sched.qos_config import QoSConfig


class ClassReservations:
    def __init__(self, reserved: dict[str, int]) -> None:
        self.reserved = reserved          # class -> blocks

    @classmethod
    def from_config(cls, qos: QoSConfig, num_blocks: int, source: Optional[str]) -> Optional["ClassReservations"]:
        """None when no class reserves blocks; ValueError when the reservations exceed the pool."""
        reserved = qos.kv_reservations(num_blocks)
        if not reserved:
            return None
        if sum(reserved.values()) > num_blocks:
            listed = ", ".join(f"{name} {blocks}" for name, blocks in sorted(reserved.items()))
            raise ValueError(f"--qos-config {source}: the classes' KV reservations ({listed}) sum to "
                             f"{sum(reserved.values())} blocks, more than the KV cache's {num_blocks}")
        return cls(reserved)

    def unused(self, name: str, held: dict[str, int]) -> int:
        """Of the class's reservation, the blocks its requests do not hold."""
        return max(0, self.reserved.get(name, 0) - held.get(name, 0))

    def protected_from(self, name: Optional[str], held: dict[str, int], with_work: Iterable[str]) -> int:
        """Free blocks a request of class `name` (None: no class) must leave alone: the unused
        reservations of the other classes with work."""
        return sum(self.unused(other, held) for other in with_work if other != name)

    def is_borrowing(self, name: Optional[str], held: dict[str, int]) -> bool:
        """Whether the class holds more than its own reservation (a class without one: any block)."""
        return held.get(name, 0) > self.reserved.get(name, 0) if name is not None else True
