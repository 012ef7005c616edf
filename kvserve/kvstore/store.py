"""KVCacheStore: the one owner of a model's KV bytes.

Per layer, two parts (K and V; for MLA the latent and the RoPE key). A part is held in the form its
kernels read: a plain paged tensor `[num_blocks, block_size, kv_heads, width]` for full-precision
formats, or a `QuantizedKVCache` (payload, scales, full-precision window ring, error-feedback
residual) for quantized ones. The store decides that form once, at allocation, from the spec; code
above asks the store (`LayerKV.full_precision`, `is_quantized`) instead of testing types itself.

What a block is: every block-indexed tensor of every layer and part (plain tensor, or payload +
scales), so moving a block moves all of it. Static per-channel scales are per layer, identical in
any two stores of one spec, and never move. Per-sequence state (the window ring and the residual
of a running sequence, indexed by a row, not a block) moves with `copy_rows`.

Transfers:
- `copy_blocks(src_ids, dst_ids, dst_store)` between two stores of the same layout on any devices
  (GPU <-> pinned host): on one device, per tensor gather + scatter; across devices, the blocks are
  packed into one byte buffer on the source device, moved in one copy, and unpacked.
- `read_blocks(ids)` / `write_blocks(ids, data)`: blocks to and from a flat host byte buffer
  `[n, block_nbytes]` (uint8), one row per block, as a disk or network tier stores them.

A tier's store never attends, so it keeps blocks in that byte layout itself (`allocate_flat`): one
pinned `[num_blocks, block_nbytes]` tensor. A copy from the GPU then gathers the blocks into one
buffer on the GPU and moves each run of consecutive host blocks in one asynchronous copy; a copy to
the GPU moves runs into a GPU staging buffer and scatters them there. Both are ordered on the
current CUDA stream, so a later copy or forward sees them complete; host-side reads of a flat store
(`read_blocks`) wait for copies in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Sequence, Union

import torch

from kvserve.kvstore.formats import SCALE_DTYPE, KVFormat
from kvserve.kvstore.host_rows import Buffer, HostRows
from kvserve.kvstore.quantized_part import QuantizedKVCache
from kvserve.kvstore.spec import KVCacheSpec

KVPart = Union[torch.Tensor, QuantizedKVCache]
# The names block copies give the worker's stores.
DEVICE_STORE, HOST_STORE = "device", "host"
BlockIds = Union[Sequence[int], torch.Tensor]


# Why blocks move, which decides what a copy may do under load and what its failure costs:
# a write-back may be dropped (the block is simply not cached on the host); a load or a swap-in
# carries a ticket the scheduler waits on; a swap-out's failure makes its request recompute.
WRITE_BACK, LOAD, SWAP_OUT, SWAP_IN = "write-back", "load", "swap-out", "swap-in"
COPY_PURPOSES = (WRITE_BACK, LOAD, SWAP_OUT, SWAP_IN)


@dataclass(frozen=True)
class BlockCopy:
    """Blocks to copy between two named KV stores (the worker's: DEVICE_STORE is the paged cache
    the model reads; a tier registers its own), issued before a step's forward. A copy with a
    ticket is reported back when it has landed (or failed): kvserve/worker/kv_transfer.py."""
    source: str
    destination: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    purpose: str = WRITE_BACK
    ticket: Optional[int] = None
    # The step in flight may still write or read some of the copy's device blocks (freed or
    # published since it was issued): a copy into the device store, or a write-back gathering them
    # off the main stream, waits for it. Otherwise it starts at once.
    after_inflight: bool = True
    # A write-back's source blocks' depths in their prefix chains (empty: unknown). Cut short under
    # back-pressure, it drops the deepest first: the host keeps the fronts that hits pass through.
    depths: tuple[int, ...] = ()
    # A load whose request computes in this same step: the step's forward waits for it on the
    # device (KVCacheManager.inline_load_max_blocks). Otherwise the request waits for its ticket.
    inline: bool = False

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(f"a block copy needs as many source blocks ({len(self.src_block_ids)}) "
                             f"as destination blocks ({len(self.dst_block_ids)})")
        if self.purpose not in COPY_PURPOSES:
            raise ValueError(f"unknown block copy purpose {self.purpose!r}; one of {COPY_PURPOSES}")


def is_quantized(part: KVPart) -> bool:
    """Whether a part is stored in a quantized format (else it is a plain paged tensor)."""
    return isinstance(part, QuantizedKVCache)


class LayerKV(NamedTuple):
    """One layer's two parts, in the forms the kernels read (unpacks as `key, value = layer`)."""

    key: KVPart
    value: KVPart

    @property
    def full_precision(self) -> bool:
        """Both parts are plain tensors: the fused full-precision kernels may write and read them."""
        return not (is_quantized(self.key) or is_quantized(self.value))


@dataclass(frozen=True)
class StoreLayout:
    """What two stores must share for blocks to move between them byte for byte."""

    spec_kind: str
    formats: tuple[tuple[KVFormat, KVFormat], ...]
    num_kv_heads: int
    part_dims: tuple[int, int]
    model_dtype: torch.dtype
    block_size: int
    window: int
    sinks: int
    error_feedback: bool


class KVCacheStore:
    """The paged KV of every layer, allocated from a spec, with block and row transfer."""

    def __init__(self, spec: KVCacheSpec, layers: list[LayerKV], num_blocks: int, block_size: int,
                 num_rows: int, device: torch.device, flat: HostRows | None = None,
                 block_bytes: list[int] | None = None) -> None:
        self.spec = spec
        self.flat = flat                 # a tier's store: its blocks as rows of bytes (host_rows.py), else None
        self.layers = layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_rows = num_rows
        self.device = device
        self.layout = StoreLayout(type(spec).__name__, tuple(tuple(pair) for pair in spec.layer_formats),
                                  spec.num_kv_heads, tuple(spec.part_dims()), spec.model_dtype, block_size,
                                  spec.window, spec.sinks, spec.error_feedback)
        self._block_tensors = [tensor for layer in layers for part in layer for tensor in _block_tensors(part)]
        self._block_bytes = block_bytes if block_bytes is not None else \
            [tensor[0].numel() * tensor.element_size() for tensor in self._block_tensors]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device | str,
                 num_rows: int = 0, pin_memory: bool = False) -> "KVCacheStore":
        """Zeroed blocks for every layer and part (int4 payloads hold the code of 0.0, so a block
        never written reads as zeros), and `num_rows` rows of per-sequence state where the spec
        keeps any. `pin_memory` (host stores only) makes copies to and from a GPU asynchronous."""
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ValueError("pin_memory applies to host stores only")
        if spec.needs_rows and num_rows < 1:
            raise ValueError("a KV format with a window, sinks or error feedback needs num_rows >= 1")
        allocator = _Allocator(spec, num_blocks, block_size, device, num_rows, pin_memory)
        layers, parts = [], []
        for layer, part_name, fmt, dim in spec.part_layouts():
            parts.append(allocator.part(layer, part_name, fmt, dim))
            if len(parts) == 2:
                layers.append(LayerKV(*parts))
                parts = []
        return cls(spec, layers, num_blocks, block_size, num_rows if spec.needs_rows else 0, device)

    @classmethod
    def allocate_flat(cls, spec: KVCacheSpec, num_blocks: int, block_size: int,
                      pin_memory: bool = False, segment_blocks: int | None = None) -> "KVCacheStore":
        """A host store of whole blocks in the byte layout of `read_blocks` (a tier's store: it moves
        blocks, never attends), in segments of `segment_blocks` (default: one) that `resize_flat`
        frees and allocates again. Holds no per-sequence rows."""
        probe = cls.allocate(spec, 1, block_size, "meta", num_rows=1 if spec.needs_rows else 0)
        flat = HostRows(num_blocks, probe.block_nbytes, segment_blocks or num_blocks, pin_memory)
        return cls(spec, [], num_blocks, block_size, 0, torch.device("cpu"), flat, probe._block_bytes)

    def resize_flat(self, num_blocks: int) -> int:
        """A tier's store keeps blocks [0, num_blocks) (whole segments) in memory and frees the rest;
        returns how many blocks are live. Copies in flight must have finished."""
        live = self.flat.resize(num_blocks)
        if self.flat.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()
            # Freed pinned memory stays cached by torch unless emptied: it would never reach the OS.
            torch._C._host_emptyCache()
        return live

    # --- the layers, as the model reads them ----------------------------------------------------
    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def __iter__(self) -> Iterator[LayerKV]:
        return iter(self.layers)

    @property
    def pieces(self) -> list[torch.Tensor]:
        """Every block-indexed tensor, in the order of a block's bytes in `read_blocks` (a tier's
        store has none: its blocks are `flat`'s rows)."""
        return self._block_tensors

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers and parts: a row of `read_blocks`."""
        return sum(self._block_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole store: blocks and per-sequence state."""
        rows = sum(t.numel() * t.element_size() for part in self.quantized_parts()
                   for t in (part.window, part.residual) if t is not None)
        return self.block_nbytes * self.num_blocks + rows

    def quantized_parts(self) -> list[QuantizedKVCache]:
        return [part for layer in self.layers for part in layer if is_quantized(part)]

    # --- per-sequence state -----------------------------------------------------------------------
    def clear_residuals(self, rows: Sequence[int]) -> None:
        """Zero the error-feedback residual of `rows` (a sequence starting from position 0)."""
        if not rows or not self.spec.error_feedback:
            return
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        for part in self.quantized_parts():
            if part.residual is not None:
                part.residual.index_fill_(0, index, 0.0)

    def fill_window_rows(self, row: int, block_table: Sequence[int], num_tokens: int) -> None:
        """The full-precision ring of `row`, for a sequence whose first `num_tokens` tokens are
        already in its blocks (a prefix-cache hit, a load from a tier): the ring positions among
        them (the sinks, the last `window`) get their values read back from the blocks. The
        quantization error of those tokens then stays in; that is what a hit costs a window format
        (docs/kv_tiers.md)."""
        spec = self.spec
        if not (spec.window or spec.sinks) or num_tokens < 1:
            return
        ring, bs = spec.sinks + spec.window, self.block_size
        recent = torch.arange(max(0, num_tokens - spec.window), num_tokens) if spec.window else torch.arange(0)
        sinks = torch.arange(min(spec.sinks, num_tokens))
        positions = torch.cat((recent, sinks))
        destinations = torch.cat((row * ring + spec.sinks + (recent % spec.window if spec.window else recent),
                                  row * ring + sinks))
        table = torch.as_tensor(list(block_table), dtype=torch.long)
        slots = (table[positions // bs] * bs + positions % bs).to(self.device)
        destinations = destinations.to(self.device)
        for part in self.quantized_parts():
            if part.window is not None:
                part.window.index_copy_(0, destinations, part.gather_slots(slots).to(part.window.dtype))

    def copy_rows(self, src_rows: Sequence[int], dst_rows: Sequence[int], dst: "KVCacheStore") -> None:
        """Per-sequence state (window ring rows, residuals) of `src_rows` into `dst_rows` of `dst`."""
        self.check_same_layout(dst)
        if self.flat is not None or dst.flat is not None:
            raise ValueError("a flat (tier) store holds no per-sequence rows")
        if len(src_rows) != len(dst_rows):
            raise ValueError(f"copy_rows got {len(src_rows)} source rows and {len(dst_rows)} destination rows")
        for name, rows, store in (("source", src_rows, self), ("destination", dst_rows, dst)):
            if any(not 0 <= row < store.num_rows for row in rows):
                raise IndexError(f"{name} row out of range [0, {store.num_rows})")
        if not src_rows:
            return
        ring = self.spec.sinks + self.spec.window
        src_ring = _ring_index(src_rows, ring, self.device)
        dst_ring = _ring_index(dst_rows, ring, dst.device)
        src_index = torch.as_tensor(list(src_rows), dtype=torch.long, device=self.device)
        dst_index = torch.as_tensor(list(dst_rows), dtype=torch.long, device=dst.device)
        for mine, theirs in zip(self.quantized_parts(), dst.quantized_parts()):
            if mine.window is not None:
                theirs.window.index_copy_(0, dst_ring, mine.window.index_select(0, src_ring).to(dst.device))
            if mine.residual is not None:
                theirs.residual.index_copy_(0, dst_index, mine.residual.index_select(0, src_index).to(dst.device))

    # --- blocks -----------------------------------------------------------------------------------
    def copy_blocks(self, src_ids: BlockIds, dst_ids: BlockIds, dst: "KVCacheStore") -> None:
        """Blocks `src_ids` of this store into blocks `dst_ids` of `dst` (same layout, any device)."""
        self.check_same_layout(dst)
        src_index = self.block_index(src_ids)
        dst_index = dst.block_index(dst_ids)
        if src_index.numel() != dst_index.numel():
            raise ValueError(f"copy_blocks got {src_index.numel()} source and {dst_index.numel()} destination blocks")
        if not src_index.numel():
            return
        if self.flat is None and dst.flat is None and self.device == dst.device:
            for mine, theirs in zip(self._block_tensors, dst._block_tensors):
                theirs.index_copy_(0, dst_index, mine.index_select(0, src_index))
            return
        if dst.flat is not None:
            dst.put_rows(dst_index.tolist(), self.gather_bytes(src_index))
            return
        if self.flat is not None:
            staged = torch.empty(src_index.numel(), self.block_nbytes, dtype=torch.uint8, device=dst.device)
            dst.scatter_bytes(dst_index, self.take_rows(src_index.tolist(), staged))
            return
        dst.scatter_bytes(dst_index, self.gather_bytes(src_index).to(dst.device))

    # A flat (tier) store's rows, moved as runs of consecutive ids: one asynchronous copy per run
    # when the other side is a GPU and the store is pinned.
    def put_rows(self, ids: list[int], data: torch.Tensor) -> None:
        """Rows of `data` (on any device) into the flat store's blocks `ids`."""
        for rows, offset, count in self.flat.runs(ids):
            rows.copy_(data[offset:offset + count], non_blocking=True)

    def take_rows(self, ids: list[int], out: torch.Tensor) -> torch.Tensor:
        """The flat store's blocks `ids` into the first rows of `out` (on any device); returns them."""
        for rows, offset, count in self.flat.runs(ids):
            out[offset:offset + count].copy_(rows, non_blocking=True)
        return out[:len(ids)]

    def read_blocks(self, block_ids: BlockIds) -> torch.Tensor:
        """Blocks -> a host byte buffer [len(block_ids), block_nbytes] (uint8), one row per block."""
        self._wait_for_copies()
        return self.gather_bytes(self.block_index(block_ids)).cpu()

    def write_blocks(self, block_ids: BlockIds, data: torch.Tensor) -> None:
        """A byte buffer from `read_blocks` (of a store with the same layout) -> blocks `block_ids`."""
        index = self.block_index(block_ids)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape != (index.numel(), self.block_nbytes):
            raise ValueError(f"write_blocks wants uint8 [{index.numel()}, {self.block_nbytes}], "
                             f"got {data.dtype} {list(data.shape)}")
        if index.numel():
            self._wait_for_copies()
            self.scatter_bytes(index, data.to(self.device))

    def _wait_for_copies(self) -> None:
        """A flat store's asynchronous copies to and from a GPU must land before the host touches it."""
        if self.flat is not None and self.flat.is_pinned() and torch.cuda.is_available():
            torch.cuda.synchronize()

    def gather_bytes(self, index: torch.Tensor) -> torch.Tensor:
        """Blocks `index` (on this store's device) -> [n, block_nbytes] uint8 on this device."""
        if self.flat is not None:
            return self.flat.gather(index.tolist())
        count = index.numel()
        pieces = [tensor.index_select(0, index).reshape(count, -1).view(torch.uint8)
                  for tensor in self._block_tensors]
        return torch.cat(pieces, dim=1)

    def write_block_bytes(self, block_ids: list[int], payloads: Sequence[Buffer]) -> None:
        """A tier's store only: block `block_ids[i]` <- `payloads[i]` (bytes of `block_nbytes`)."""
        if self.flat is None:
            raise TypeError("write_block_bytes is for a tier's store (rows of bytes)")
        self.flat.write_rows(block_ids, payloads)

    def scatter_bytes(self, index: torch.Tensor, data: torch.Tensor) -> None:
        """[n, block_nbytes] uint8 on this device -> blocks `index`."""
        if self.flat is not None:
            self.flat.scatter(index.tolist(), data)
            return
        count = index.numel()
        for tensor, piece in zip(self._block_tensors, data.split(self._block_bytes, dim=1)):
            size = tensor.element_size()
            if piece.stride(0) % size or piece.storage_offset() % size:
                piece = piece.contiguous()      # a dtype view needs aligned rows
            # The strided view goes to index_copy_ as it is: a contiguous copy first would cost a
            # kernel launch and an allocation per tensor, per chunk of a load (thousands a step).
            tensor.index_copy_(0, index, piece.view(tensor.dtype).view(count, *tensor.shape[1:]))

    def block_index(self, block_ids: BlockIds) -> torch.Tensor:
        """Block ids, checked against the store's size, as an index tensor on its device."""
        index = torch.as_tensor(block_ids, dtype=torch.long).reshape(-1)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise IndexError(f"block id out of range [0, {self.num_blocks})")
        # Not blocking: a pageable copy is staged at once, while a blocking one would wait for all
        # the work queued on the stream (a launched-ahead step), stalling the host behind the GPU.
        return index.to(self.device, non_blocking=True)

    def check_same_layout(self, other: "KVCacheStore") -> None:
        if other.layout != self.layout:
            raise ValueError(f"KV stores differ in layout: {self.layout} vs {other.layout}")
        for mine, theirs in zip(self.quantized_parts(), other.quantized_parts()):
            if mine.static_scale is not None and not torch.equal(mine.static_scale.cpu(), theirs.static_scale.cpu()):
                raise ValueError("KV stores differ in their static scales")


def _block_tensors(part: KVPart) -> list[torch.Tensor]:
    """The tensors of a part indexed by block on dim 0."""
    if not is_quantized(part):
        return [part]
    return [part.payload] + ([part.scales] if part.scales is not None else [])


def _ring_index(rows: Sequence[int], ring: int, device: torch.device) -> torch.Tensor:
    rows_t = torch.as_tensor(list(rows), dtype=torch.long)
    return (rows_t[:, None] * ring + torch.arange(ring)[None, :]).reshape(-1).to(device)


class _Allocator:
    """Allocation of one store's parts (kept apart so KVCacheStore's methods are its transfers)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device,
                 num_rows: int, pin_memory: bool) -> None:
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.device, self.num_rows, self.pin = device, num_rows, pin_memory

    def zeros(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=self.device, pin_memory=self.pin)

    def part(self, layer: int, part_name: str, fmt: KVFormat, dim: int) -> KVPart:
        spec, heads = self.spec, self.spec.num_kv_heads
        paged = (self.num_blocks, self.block_size, heads)
        if not fmt.quantized:
            return self.zeros(*paged, dim, dtype=fmt.storage_dtype(spec.model_dtype))
        payload = self.zeros(*paged, fmt.payload_width(dim), dtype=fmt.storage_dtype(spec.model_dtype))
        if fmt.name == "int4":
            payload.fill_(0x88)          # codes of 0.0: a never-written slot reads as zeros
        shape = fmt.scales_shape(self.block_size, heads, dim)     # per token, or per channel and block
        scales = None
        if shape is not None:
            scales = self.zeros(self.num_blocks, *shape, dtype=SCALE_DTYPE)
            if not fmt.per_channel:      # per channel: scale 0 and zero 0, so an unwritten block reads zeros
                scales.fill_(1.0)
        static = None
        if fmt.static_scales:
            name = f"layers.{layer}.{part_name}"
            if name not in spec.static_scales:
                raise ValueError(f"the KV scales file has no scales for {name}")
            static = spec.static_scales[name].to(device=self.device, dtype=torch.float32).contiguous()
        window = residual = None
        if spec.needs_rows and (spec.window or spec.sinks):
            # The last row takes the writes that must be dropped, so a store never branches.
            window = self.zeros(self.num_rows * (spec.sinks + spec.window) + 1, heads, dim, dtype=spec.model_dtype)
        if spec.needs_rows and spec.error_feedback:
            residual = self.zeros(self.num_rows + 1, heads, dim, dtype=torch.float32)
        return QuantizedKVCache(fmt, payload, scales, dim, spec.model_dtype, static, spec.window, spec.sinks,
                                window, residual)
