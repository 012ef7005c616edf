"""StagingRing: buffers allocated once that block transfers pass through, a chunk of whole blocks
at a time, so a transfer never allocates (pinned host memory is slow to allocate, and a GPU buffer
as large as a 32k-token prefix could not be found in an HBM the KV cache already fills).

A ring of `num_slots` slots of `blocks_per_slot` blocks each. A transfer takes the next slot,
fills it, consumes it, and hands it back with the CUDA event after which the slot may be reused;
the next taker's stream waits for that event, so several streams (or a thread filling a pinned
slot for a disk tier) can share the ring without host synchronisation. Without CUDA, copies are
synchronous and the events are None.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

class StagingRing:
    def __init__(self, block_nbytes: int, device: torch.device | str, total_bytes: int,
                 num_slots: int = 2, pin_memory: bool = False) -> None:
        if block_nbytes < 1 or num_slots < 1:
            raise ValueError(f"a staging ring needs block_nbytes >= 1 and num_slots >= 1, got {block_nbytes}, {num_slots}")
        self.device = torch.device(device)
        self.blocks_per_slot = max(1, total_bytes // (num_slots * block_nbytes))
        self.slots = [torch.empty(self.blocks_per_slot, block_nbytes, dtype=torch.uint8, device=self.device,
                                  pin_memory=pin_memory) for _ in range(num_slots)]
        self._released: list[Optional[torch.cuda.Event]] = [None] * num_slots
        self._next = 0

    def chunks(self, count: int) -> Iterator[tuple[int, int]]:
        """(start, end) of the pieces a transfer of `count` blocks is cut into, one slot each."""
        for start in range(0, count, self.blocks_per_slot):
            yield start, min(count, start + self.blocks_per_slot)

    def acquire(self, stream: Optional[torch.cuda.Stream] = None) -> tuple[int, torch.Tensor]:
        """The next slot (index, buffer); `stream` (the one that will use it) waits until the slot's
        last user is done with it."""
        index = self._next
        self._next = (index + 1) % len(self.slots)
        released = self._released[index]
        if released is not None:
            if stream is not None:
                stream.wait_event(released)
            else:
                released.synchronize()
        return index, self.slots[index]

    def release(self, index: int, stream: Optional[torch.cuda.Stream] = None) -> None:
        """The slot is free once the work queued so far on `stream` has run (now, without one)."""
        if stream is None:
            self._released[index] = None
            return
        event = torch.cuda.Event()
        event.record(stream)
        self._released[index] = event
