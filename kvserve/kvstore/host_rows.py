"""HostRows: a tier store's blocks as rows of bytes `[block_nbytes]`, held in equal segments so
that the tier can hand whole segments back to the operating system under memory pressure and take
them again later (one pinned allocation could only be freed whole).

Block `b` lives in segment `b // segment_blocks` at row `b % segment_blocks`. Only a prefix of
the segments is live at a time (`num_live_blocks`); the tier never names a block past it.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Union

import numpy as np
import torch

Buffer = Union[bytes, bytearray, memoryview]     # collections.abc.Buffer from Python 3.12


class HostRows:
    def __init__(self, num_blocks: int, block_nbytes: int, segment_blocks: int, pin_memory: bool) -> None:
        if num_blocks < 1 or segment_blocks < 1:
            raise ValueError(f"host rows need num_blocks >= 1 and segment_blocks >= 1, got {num_blocks}, "
                             f"{segment_blocks}")
        self.num_blocks = num_blocks
        self.block_nbytes = block_nbytes
        self.segment_blocks = min(segment_blocks, num_blocks)
        self.pin_memory = pin_memory
        num_segments = -(-num_blocks // self.segment_blocks)
        self._segments: list[torch.Tensor | None] = [self._allocate(i) for i in range(num_segments)]

    def _allocate(self, index: int) -> torch.Tensor:
        rows = min(self.segment_blocks, self.num_blocks - index * self.segment_blocks)
        return torch.zeros(rows, self.block_nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    @property
    def num_live_blocks(self) -> int:
        live = 0
        for segment in self._segments:
            if segment is None:
                break
            live += segment.shape[0]
        return live

    def live_segments(self) -> list[torch.Tensor]:
        """The live segments, in order: blocks [0, num_live_blocks) (what a block-copy kernel reads)."""
        live = []
        for segment in self._segments:
            if segment is None:
                break
            live.append(segment)
        return live

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._segments if s is not None)

    def is_pinned(self) -> bool:
        return self.pin_memory

    def resize(self, num_blocks: int) -> int:
        """Keeps the segments holding blocks [0, num_blocks) (rounded up to whole segments) live,
        frees the rest and allocates missing ones; returns the live block count. The caller makes
        sure nothing in flight touches a segment it frees."""
        keep = -(-max(0, min(num_blocks, self.num_blocks)) // self.segment_blocks)
        for index in range(len(self._segments)):
            if index < keep and self._segments[index] is None:
                self._segments[index] = self._allocate(index)
            elif index >= keep:
                self._segments[index] = None
        return self.num_live_blocks

    def runs(self, ids: list[int]) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(rows of one segment, offset in `ids`, count) for each run of consecutive ids that stays
        within one segment."""
        offset = 0
        size = self.segment_blocks
        while offset < len(ids):
            first = ids[offset]
            segment = self._segments[first // size]
            if segment is None:
                raise IndexError(f"host block {first} is in a released segment")
            end = offset + 1
            while end < len(ids) and ids[end] == ids[end - 1] + 1 and ids[end] // size == first // size:
                end += 1
            row = first % size
            yield segment[row:row + end - offset], offset, end - offset
            offset = end

    def gather(self, ids: list[int]) -> torch.Tensor:
        out = torch.empty(len(ids), self.block_nbytes, dtype=torch.uint8)
        for rows, offset, count in self.runs(ids):
            out[offset:offset + count].copy_(rows)
        return out

    def scatter(self, ids: list[int], data: torch.Tensor) -> None:
        for rows, offset, count in self.runs(ids):
            rows.copy_(data[offset:offset + count])

    def write_rows(self, ids: list[int], payloads: Sequence[Buffer]) -> None:
        """Block `ids[i]` <- the bytes of `payloads[i]` (each `block_nbytes` long): one copy each,
        straight from the reader's buffers (stacking them into one tensor first would copy twice)."""
        size = self.segment_blocks
        for block, payload in zip(ids, payloads):
            segment = self._segments[block // size]
            if segment is None:
                raise IndexError(f"host block {block} is in a released segment")
            segment[block % size].numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
