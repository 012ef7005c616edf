"""Moving KV blocks between paged tensors and rows of bytes, as one operation: the interface of the
Triton block-copy kernel (kvserve/kernels/triton/block_copy.py) and its torch reference.

A block of a KV store is one slice along dim 0 of each of its *pieces* (every block-indexed tensor of
every layer and part: 56 for a 28-layer model). A *row* holds one block as bytes: the pieces' slices
one after the other, in piece order (the layout of `KVCacheStore.read_blocks`). Rows live in
*segments*, `[rows, row_nbytes]` uint8 tensors of `rows_per_segment` rows each (a host tier's
`HostRows`; a GPU staging slot is one segment); row `r` is row `r % rows_per_segment` of segment
`r // rows_per_segment`.

`copy_block_rows(pieces, block_ids, segments, row_ids, rows_per_segment, to_rows)` copies block
`block_ids[i]` of the pieces to row `row_ids[i]` (`to_rows`), or the other way. With torch ops that is
a gather and a scatter per piece and per run of rows (a thousand launches for one 8k-token load of a
7B model); the kernel does it in one launch, reading or writing pinned host rows directly.
"""

from __future__ import annotations

from typing import Sequence

import torch


def piece_nbytes(piece: torch.Tensor) -> int:
    """Bytes of one block of a piece."""
    return piece[0].numel() * piece.element_size()


def check_block_rows(pieces: Sequence[torch.Tensor], block_ids: torch.Tensor, segments: Sequence[torch.Tensor],
                     row_ids: torch.Tensor, rows_per_segment: int) -> int:
    """Raises ValueError naming what does not fit; returns the row size in bytes."""
    if not pieces or not segments:
        raise ValueError("a block copy needs at least one piece and one segment")
    if block_ids.dim() != 1 or row_ids.dim() != 1 or block_ids.numel() != row_ids.numel():
        raise ValueError(f"block ids {list(block_ids.shape)} and row ids {list(row_ids.shape)} must be "
                         f"1-d and as long")
    row_nbytes = sum(piece_nbytes(piece) for piece in pieces)
    for piece in pieces:
        if not piece.is_contiguous():
            raise ValueError("block-copy pieces must be contiguous")
    for segment in segments:
        if segment.dtype != torch.uint8 or segment.dim() != 2 or segment.shape[1] != row_nbytes:
            raise ValueError(f"a segment must be uint8 [rows, {row_nbytes}], got {segment.dtype} {list(segment.shape)}")
        if segment.shape[0] > rows_per_segment:
            raise ValueError(f"a segment has {segment.shape[0]} rows, more than rows_per_segment={rows_per_segment}")
    if block_ids.numel():
        num_blocks = min(piece.shape[0] for piece in pieces)
        if int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks:
            raise IndexError(f"block id out of range [0, {num_blocks})")
        num_rows = (len(segments) - 1) * rows_per_segment + segments[-1].shape[0]
        if int(row_ids.min()) < 0 or int(row_ids.max()) >= num_rows:
            raise IndexError(f"row id out of range [0, {num_rows})")
    return row_nbytes


def copy_block_rows(pieces: Sequence[torch.Tensor], block_ids: torch.Tensor, segments: Sequence[torch.Tensor],
                    row_ids: torch.Tensor, rows_per_segment: int, to_rows: bool) -> None:
    """The torch reference: one gather or scatter per piece, one row at a time on the rows' side."""
    check_block_rows(pieces, block_ids, segments, row_ids, rows_per_segment)
    count = block_ids.numel()
    if not count:
        return
    sizes = [piece_nbytes(piece) for piece in pieces]
    index = block_ids.to(pieces[0].device, torch.long)
    if to_rows:
        data = torch.cat([piece.index_select(0, index).reshape(count, -1).view(torch.uint8) for piece in pieces], dim=1)
        for i, row in enumerate(row_ids.tolist()):
            segment = segments[row // rows_per_segment]
            segment[row % rows_per_segment].copy_(data[i])
        return
    rows = torch.stack([segments[row // rows_per_segment][row % rows_per_segment].to(pieces[0].device)
                        for row in row_ids.tolist()])
    for piece, part in zip(pieces, rows.split(sizes, dim=1)):
        piece.index_copy_(0, index, part.contiguous().view(piece.dtype).view(count, *piece.shape[1:]))
