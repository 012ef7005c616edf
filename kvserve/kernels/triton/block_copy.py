"""Block copy between paged KV pieces and rows of bytes in one launch (interface and torch reference:
kvserve/kernels/block_copy.py).

Why a kernel: a load of 512 blocks of a 28-layer model into the GPU was, with torch ops, one copy per
run of host rows into a staging buffer and then one `index_copy_` per piece and staging chunk; an
admitting step with four such loads and their write-backs issued ~3,000 operations and spent ~55 ms
of host time on them (benchmarks/results/kv/h200_host_load_admitting_step_profile_2026-12-03_2456abc.log).
Here the host computes one address per row, and one persistent launch moves every piece of every
block.

Rows may be in pinned host memory: with unified addressing a pinned allocation is readable and
writable from a kernel at its host address, so a load reads the host tier directly over the link (no
staging buffer, no copy engine) and a write-back writes it. `max_programs` caps the programs, so a
load streaming in over the link keeps only a few SMs busy while the main stream's decode steps run on
the others.

Work item `i * num_pieces + t` is piece `t` of block `i`; a program takes items `pid, pid + grid,
...`. Each item copies the piece's bytes in words of `WORD` bytes (the largest of 8, 4, 2, 1 that
divides every size and address).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kvserve.kernels.block_copy import check_block_rows, piece_nbytes
from kvserve.kernels.triton._common import interpreting, num_sms

_WORD_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
CHUNK_WORDS = 1024


# The counts are not specialised on (Triton would compile a variant for each of "1", "a multiple
# of 16" and "other" of each): a load's block count varies with every request, and the first load
# of a new variant paid its compile, ~90 ms on an H100, on its TTFT. The loop bounds gain nothing
# from the hints; the addresses come from loaded values anyway. So one variant per direction and
# word size, which `warm_block_rows` compiles at start.
@triton.jit(do_not_specialize=["num_blocks", "num_pieces", "items_per_program", "max_words"])
def _block_rows_kernel(meta_ptr, num_blocks, table_ptr, num_pieces, items_per_program, max_words,
                       TO_ROWS: tl.constexpr, WORD: tl.constexpr, WORD_TYPE: tl.constexpr, CHUNK: tl.constexpr):
    # meta: [2, num_blocks] int64 (row byte address, block id); table: [3, num_pieces] int64 (piece
    # base address, words per block, word offset of the piece in a row). The loop bounds come from
    # the host (items per program, the largest piece's words), not from loaded values, so the
    # loops also run in Triton's interpreter; masks cut each item to its own size.
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offsets = tl.arange(0, CHUNK)
    total = num_blocks * num_pieces
    for step in range(0, items_per_program):
        item = pid + step * grid
        live = item < total
        item = tl.where(live, item, 0)
        block_index = item // num_pieces
        piece = item - block_index * num_pieces
        row_address = tl.load(meta_ptr + block_index)
        block = tl.load(meta_ptr + num_blocks + block_index)
        base = tl.load(table_ptr + piece)
        words = tl.where(live, tl.load(table_ptr + num_pieces + piece), 0)
        offset = tl.load(table_ptr + 2 * num_pieces + piece)
        paged = (base + block * words * WORD).to(tl.pointer_type(WORD_TYPE))
        row = (row_address + offset * WORD).to(tl.pointer_type(WORD_TYPE))
        for start in range(0, max_words, CHUNK):
            index = start + offsets
            mask = index < words
            if TO_ROWS:
                tl.store(row + index, tl.load(paged + index, mask=mask), mask=mask)
            else:
                tl.store(paged + index, tl.load(row + index, mask=mask), mask=mask)


def _word_size(values: Sequence[int]) -> int:
    for word in (8, 4, 2, 1):
        if all(value % word == 0 for value in values):
            return word
    return 1


_tables: dict[tuple, torch.Tensor] = {}


def _piece_table(pieces: Sequence[torch.Tensor], word: int, device: torch.device) -> torch.Tensor:
    """[3, num_pieces] int64 on the device: base address, words per block, word offset in a row
    (cached: a store's pieces never move)."""
    key = (tuple(piece.data_ptr() for piece in pieces), tuple(piece_nbytes(piece) for piece in pieces), word, device)
    table = _tables.get(key)
    if table is None:
        sizes = [piece_nbytes(piece) // word for piece in pieces]
        offsets = [sum(sizes[:t]) for t in range(len(sizes))]
        table = torch.tensor([[piece.data_ptr() for piece in pieces], sizes, offsets], dtype=torch.int64).to(device)
        if len(_tables) > 64:
            _tables.clear()
        _tables[key] = table
    return table


def copy_block_rows(pieces: Sequence[torch.Tensor], block_ids: torch.Tensor, segments: Sequence[torch.Tensor],
                    row_ids: torch.Tensor, rows_per_segment: int, to_rows: bool,
                    max_programs: Optional[int] = None) -> None:
    """Block `block_ids[i]` of `pieces` (CUDA tensors) <-> row `row_ids[i]` of `segments` (CUDA or
    pinned host tensors), on the current stream, returning without waiting. The ids are CPU tensors.
    `max_programs` (default: four per SM) caps the grid."""
    row_nbytes = check_block_rows(pieces, block_ids, segments, row_ids, rows_per_segment)
    count = block_ids.numel()
    if not count:
        return
    device = pieces[0].device
    if device.type != "cuda" and not interpreting():
        raise ValueError("the block-copy kernel runs on CUDA tensors")
    for segment in segments:
        if segment.device.type == "cpu" and not segment.is_pinned() and not interpreting():
            raise ValueError("host rows must be pinned for the kernel to reach them")
    addresses = [piece.data_ptr() for piece in pieces] + [segment.data_ptr() for segment in segments]
    word = _word_size([row_nbytes, *map(piece_nbytes, pieces), *addresses])
    segment_addresses = torch.tensor([segment.data_ptr() for segment in segments], dtype=torch.int64)
    rows = row_ids.to(torch.int64)
    meta = torch.empty(2, count, dtype=torch.int64, pin_memory=device.type == "cuda")
    torch.add(segment_addresses[rows // rows_per_segment], (rows % rows_per_segment) * row_nbytes, out=meta[0])
    meta[1].copy_(block_ids)
    meta = meta.to(device, non_blocking=True)
    table = _piece_table(pieces, word, device)
    items = count * len(pieces)
    grid = min(items, max_programs or 4 * num_sms(device))
    max_words = max(piece_nbytes(piece) for piece in pieces) // word
    _block_rows_kernel[(grid,)](meta, count, table, len(pieces), -(-items // grid), max_words, TO_ROWS=to_rows, WORD=word,
                                WORD_TYPE=_WORD_TYPES[word], CHUNK=CHUNK_WORDS, num_warps=4)


def warm_block_rows(pieces: Sequence[torch.Tensor]) -> None:
    """Compiles the kernel's variants for a store's pieces (both directions) before the first copy
    needs them: block 0 is gathered into a scratch row and scattered back unchanged. Synchronous;
    for start-up."""
    device = pieces[0].device
    row = torch.empty(1, sum(piece_nbytes(piece) for piece in pieces), dtype=torch.uint8, device=device)
    ids = torch.zeros(1, dtype=torch.long)
    copy_block_rows(pieces, ids, [row], ids, 1, to_rows=True)
    copy_block_rows(pieces, ids, [row], ids, 1, to_rows=False)
    torch.cuda.synchronize(device)
