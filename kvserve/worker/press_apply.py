"""Runs a press on one request's KV in the paged cache: the tokens it keeps are compacted into the
front of the pruned region and the region's tail blocks can go back to the pool.

Layer by layer: the region's K/V are gathered (dequantized for a quantized format), the press picks
`keep` tokens per KV head (kvserve/press), and the kept K/V are stored at the region's first `keep`
slots through the store's own write path (a quantized format quantizes them again, so every format
the press can serve keeps its layout). All reads of a layer happen before its writes, so slots that
move forward never overwrite a token not yet read. The region starts on a block boundary: a
per-channel format's block scales then start fresh in the first rewritten block.
"""

from __future__ import annotations

import torch

from kvserve.kvstore import KVCacheStore, KVPart, is_quantized
from kvserve.press import Press, PressInputs


def region_slots(block_table: list[int], start: int, end: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Cache slots of KV indices [start, end) of a request whose blocks are `block_table`."""
    index = torch.arange(start, end, dtype=torch.long)
    table = torch.as_tensor(block_table, dtype=torch.long)
    return (table[index // block_size] * block_size + index % block_size).to(device)


def read_slots(part: KVPart, slots: torch.Tensor) -> torch.Tensor:
    if is_quantized(part):
        return part.gather_slots(slots).float()
    return part.view(-1, *part.shape[2:])[slots].float()


def _write(part: KVPart, slots: torch.Tensor, values: torch.Tensor) -> None:
    if is_quantized(part):
        part.store(values.to(part.dtype), slots)
    else:
        part.view(-1, *part.shape[2:]).index_copy_(0, slots, values.to(part.dtype))


def compact(kv_store: KVCacheStore, press: Press, block_table: list[int], start: int, end: int, keep: int,
            queries: list[torch.Tensor] | None, scale: float) -> int:
    """Prunes KV indices [start, end) of the request to `keep` tokens per layer and KV head, written
    at [start, start + keep). Returns how many of the region's leading tokens are untouched in
    every layer and head (their blocks may still be shared through the prefix cache)."""
    if start % kv_store.block_size:
        raise ValueError(f"a pruned region starts on a block boundary, got {start}")
    if not 1 <= keep <= end - start:
        raise ValueError(f"keep must be in [1, {end - start}], got {keep}")
    device = kv_store.device
    slots = region_slots(block_table, start, end, kv_store.block_size, device)
    kept_slots = slots[:keep]
    intact = keep
    for layer, (key_part, value_part) in enumerate(kv_store):
        inputs = PressInputs(read_slots(key_part, slots), read_slots(value_part, slots),
                             queries[layer] if queries is not None else None, scale, layer)
        out = press.compress(inputs, keep)
        _write(key_part, kept_slots, out.keys)
        _write(value_part, kept_slots, out.values)
        in_place = out.kept == torch.arange(keep, device=out.kept.device)[None, :]
        moved = (~in_place).any(dim=0).nonzero()
        if moved.numel():
            # A merge changes the token its group is kept at, which is the one before the first
            # moved token: that one is not intact either.
            intact = min(intact, max(0, int(moved[0]) - 1))
    return intact


def press_votes(kv_store: KVCacheStore, press: Press, block_table: list[int], start: int, end: int, keep: int,
                queries: list[torch.Tensor] | None, scale: float) -> torch.Tensor:
    """For the tiering mode: [blocks of end] float, how many (layer, KV head, token) the press keeps
    in each of the request's blocks when it keeps `keep` of KV indices [start, end) per layer and
    head (nothing is written)."""
    bs = kv_store.block_size
    slots = region_slots(block_table, start, end, bs, kv_store.device)
    num_blocks = -(-end // bs)
    votes = torch.zeros(num_blocks, dtype=torch.float32, device=kv_store.device)
    for layer, (key_part, value_part) in enumerate(kv_store):
        inputs = PressInputs(read_slots(key_part, slots), read_slots(value_part, slots),
                             queries[layer] if queries is not None else None, scale, layer)
        blocks = (press.compress(inputs, keep).kept.reshape(-1) + start) // bs
        votes += torch.bincount(blocks, minlength=num_blocks).float()
    return votes
