"""KVTransfers: runs the block copies between the worker's KV stores off the step's critical path.

On CUDA, copies to and from a tier run on a stream of their own, so a load from host RAM streams
in while other requests keep stepping on the main stream:
- Copies out of the device store (write-backs, swap-outs) read blocks that this step's forward may
  overwrite (an evicted block has a new owner at once). Their blocks are gathered on the main
  stream into a staging slot (a device-speed copy, well under a millisecond), and the transfer
  stream then moves the slot to pinned host memory while the forward runs.
- Copies into the device store (loads, swap-ins) go host -> staging slot on the transfer stream,
  then slot -> blocks on a scatter stream (so the link moves the next slot meanwhile). A load
  whose blocks the step in flight may still touch (freed, published or evicted since the last step
  was issued: `BlockCopy.after_inflight`, set by the KV manager) first waits for everything queued
  on the main stream; any other load starts at once, so it lands a step earlier.
  The blocks belong to a request the scheduler holds back until its ticket is reported landed
  (`poll`, an event query: no host synchronisation in the step).
- One transfer stream keeps every tier copy in issue order, so a host block that a load reads is
  never overwritten by a later write-back into the same host block before the load has read it.
- Write-backs are bounded: past `max_write_back_bytes` in flight, a write-back is dropped (its
  host blocks reported lost, so the tier forgets them) rather than stalling the step.

Without CUDA every copy runs at once, in order, and its ticket is reported at the next poll: the
same scheduling path, on plain memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvserve.kvstore import DEVICE_STORE, LOAD, SWAP_IN, WRITE_BACK, BlockCopy, KVCacheStore
from kvserve.kvstore.staging import StagingRing
from kvserve.stats import TransferStats

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the load-latency histogram's buckets: a few blocks take tens of
# microseconds, a 32k-token prefix of a 7B model tens of milliseconds.
LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Write-back bytes allowed in flight before further write-backs are dropped (~20 ms of PCIe 5).
DEFAULT_MAX_WRITE_BACK_BYTES = 1 << 30
# Staging per direction on a GPU (kvstore/staging.py): a step's write-backs up to this size never
# make the main stream wait for the host copy.
DEVICE_STAGING_BYTES = 256 << 20


@dataclass
class TransferReport:
    """What became of ticketed copies since the last poll, and which host blocks were not written."""
    landed: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    lost_host_blocks: list[int] = field(default_factory=list)   # a dropped or failed write-back's targets

    def __bool__(self) -> bool:
        return bool(self.landed or self.failed or self.lost_host_blocks)


@dataclass
class _Pending:
    ticket: Optional[int]
    purpose: str
    nbytes: int
    done: Optional[torch.cuda.Event]       # None: ran synchronously
    started: Optional[torch.cuda.Event] = None
    seconds: float = 0.0                   # measured on the host when synchronous


class KVTransfers:
    def __init__(self, stores: dict[str, KVCacheStore], device: torch.device,
                 max_write_back_bytes: int = DEFAULT_MAX_WRITE_BACK_BYTES,
                 staging_bytes: int = DEVICE_STAGING_BYTES) -> None:
        self.stores = stores                # shared with the runner: tiers register into it
        self.device = device
        self.max_write_back_bytes = max_write_back_bytes
        self.staging_bytes = staging_bytes
        # The link's copies (both ways, in issue order) and the scatters of loaded slots into blocks.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.scatter_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._rings: dict[str, StagingRing] = {}
        self._pending: list[_Pending] = []
        self._report = TransferReport()
        self.bytes_to_device = self.bytes_to_host = 0
        self.loads = self.loaded_bytes = 0
        self.load_seconds = 0.0
        self._load_buckets = [0] * len(LOAD_SECONDS_BUCKETS)
        self.write_backs_dropped = 0
        self.copy_failures = 0

    # --- issuing ------------------------------------------------------------------------------
    def run(self, copies: list[BlockCopy]) -> None:
        """Issues the step's copies (in their order for each direction); returns without waiting."""
        if not copies:
            return
        outs = [copy for copy in copies if copy.destination != DEVICE_STORE]
        ins = [copy for copy in copies if copy.destination == DEVICE_STORE]
        # Copies out first: a block evicted this step may be the target of one of this step's loads.
        lost_before = len(self._report.lost_host_blocks)
        for copy in outs:
            self._issue_logged(copy)
        # A block written back this step may already be the source of one of its loads.
        lost = set(self._report.lost_host_blocks[lost_before:])
        for copy in ins:
            if lost.intersection(copy.src_block_ids):
                self._lose(copy)
            else:
                self._issue_logged(copy)

    def _issue_logged(self, copy: BlockCopy) -> None:
        """Issues a copy; a copy that fails at run time (a CUDA or allocation error) is logged,
        counted and reported lost. A copy naming an unknown store is a bug and raises."""
        source, destination = self._store(copy.source), self._store(copy.destination)
        try:
            self._issue(copy, source, destination)
        except RuntimeError:
            logger.exception("KV block copy %s -> %s (%s, %d blocks) failed", copy.source, copy.destination,
                             copy.purpose, len(copy.src_block_ids))
            self.copy_failures += 1
            self._lose(copy)

    def _lose(self, copy: BlockCopy) -> None:
        if copy.ticket is not None:
            self._report.failed.append(copy.ticket)
        elif copy.destination != DEVICE_STORE:
            self._report.lost_host_blocks.extend(copy.dst_block_ids)

    def _issue(self, copy: BlockCopy, source: KVCacheStore, destination: KVCacheStore) -> None:
        nbytes = len(copy.src_block_ids) * source.block_nbytes
        if copy.purpose == WRITE_BACK and self._write_backs_in_flight() + nbytes > self.max_write_back_bytes:
            self.write_backs_dropped += 1
            self._lose(copy)
            return
        if self.stream is None or (source.device.type != "cuda" and destination.device.type != "cuda"):
            started = time.perf_counter()
            source.copy_blocks(copy.src_block_ids, copy.dst_block_ids, destination)
            pending = _Pending(copy.ticket, copy.purpose, nbytes, None, seconds=time.perf_counter() - started)
        elif destination.flat is not None and source.flat is None:
            pending = self._copy_out(copy, source, destination, nbytes)
        elif source.flat is not None and destination.flat is None:
            pending = self._copy_in(copy, source, destination, nbytes)
        else:
            raise ValueError(f"no asynchronous path for a copy {copy.source} -> {copy.destination}")
        self._pending.append(pending)
        if copy.destination == DEVICE_STORE:
            self.bytes_to_device += nbytes
        else:
            self.bytes_to_host += nbytes

    def _ring(self, direction: str, store: KVCacheStore) -> StagingRing:
        ring = self._rings.get(direction)
        if ring is None:
            ring = self._rings[direction] = StagingRing(store.block_nbytes, self.device, self.staging_bytes)
        return ring

    def _copy_out(self, copy: BlockCopy, source: KVCacheStore, destination: KVCacheStore, nbytes: int) -> _Pending:
        main, side = torch.cuda.current_stream(self.device), self.stream
        ring = self._ring("out", source)
        src_index = source.block_index(copy.src_block_ids)
        dst_ids = list(copy.dst_block_ids)
        started = torch.cuda.Event(enable_timing=True)
        started.record(main)
        for start, end in ring.chunks(len(dst_ids)):
            slot_index, slot = ring.acquire(main)
            slot[:end - start].copy_(source.gather_bytes(src_index[start:end]))
            gathered = torch.cuda.Event()
            gathered.record(main)
            side.wait_event(gathered)
            with torch.cuda.stream(side):
                destination.put_rows(dst_ids[start:end], slot[:end - start])
            ring.release(slot_index, side)
        done = torch.cuda.Event(enable_timing=True)
        done.record(side)
        return _Pending(copy.ticket, copy.purpose, nbytes, done, started)

    def _copy_in(self, copy: BlockCopy, source: KVCacheStore, destination: KVCacheStore, nbytes: int) -> _Pending:
        # Two streams, so the link moves slot k + 1 while slot k is scattered into its blocks.
        main, copier, scatterer = torch.cuda.current_stream(self.device), self.stream, self.scatter_stream
        ring = self._ring("in", destination)
        src_ids = list(copy.src_block_ids)
        if copy.after_inflight:
            copier.wait_stream(main)
        started = torch.cuda.Event(enable_timing=True)
        started.record(copier)
        with torch.cuda.stream(scatterer):
            # Allocated on the stream that reads it: freed by Python at return, its memory must not
            # be handed to the main stream while the scatters are still queued.
            dst_index = destination.block_index(copy.dst_block_ids)
        for start, end in ring.chunks(len(src_ids)):
            slot_index, slot = ring.acquire(copier)
            with torch.cuda.stream(copier):
                rows = source.take_rows(src_ids[start:end], slot)
            copied = torch.cuda.Event()
            copied.record(copier)
            scatterer.wait_event(copied)
            with torch.cuda.stream(scatterer):
                destination.scatter_bytes(dst_index[start:end], rows)
            ring.release(slot_index, scatterer)
        done = torch.cuda.Event(enable_timing=True)
        done.record(scatterer)
        return _Pending(copy.ticket, copy.purpose, nbytes, done, started)

    def _store(self, name: str) -> KVCacheStore:
        store = self.stores.get(name)
        if store is None:
            raise KeyError(f"block copy names an unknown KV store {name!r} (known: {sorted(self.stores)})")
        return store

    def _write_backs_in_flight(self) -> int:
        return sum(p.nbytes for p in self._pending
                   if p.purpose == WRITE_BACK and p.done is not None and not p.done.query())

    def measure_link(self, tier: str, max_bytes: int = 64 << 20) -> float:
        """Bytes per second of a load from `tier` into the device store, timed once (at start, on
        blocks nobody uses yet): what --preemption-mode auto charges a swap before loads are seen."""
        source, destination = self._store(tier), self._store(DEVICE_STORE)
        count = max(1, min(source.num_blocks, destination.num_blocks, max_bytes // source.block_nbytes))
        ids = list(range(count))
        destination.copy_blocks(ids, ids, source)      # a round trip: the device blocks keep their bytes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        source.copy_blocks(ids, ids, destination)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return count * source.block_nbytes / max(time.perf_counter() - started, 1e-9)

    def fence(self) -> Optional[torch.cuda.Event]:
        """An event that completes once every copy issued so far has landed (None without CUDA,
        where copies ran at once)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        """Waits for every copy issued so far (before the tier frees memory a copy may touch)."""
        for stream in (self.stream, self.scatter_stream):
            if stream is not None:
                stream.synchronize()

    # --- completion ---------------------------------------------------------------------------
    def poll(self, wait: bool = False) -> TransferReport:
        """Tickets landed (or failed) since the last poll, without waiting; with `wait`, first
        waits for the oldest ticketed copy in flight, so a caller with nothing else to do sleeps."""
        if not self._pending and not self._report:
            return TransferReport()          # nothing issued since the last poll (no tier: every step)
        if wait:
            oldest = next((p for p in self._pending if p.ticket is not None and p.done is not None), None)
            if oldest is not None:
                oldest.done.synchronize()
        still = []
        for pending in self._pending:
            if pending.done is not None and not pending.done.query():
                still.append(pending)
                continue
            self._finish(pending)
        self._pending = still
        report, self._report = self._report, TransferReport()
        return report

    def _finish(self, pending: _Pending) -> None:
        if pending.ticket is not None:
            self._report.landed.append(pending.ticket)
        if pending.purpose in (LOAD, SWAP_IN):
            seconds = pending.seconds
            if pending.done is not None:
                seconds = pending.started.elapsed_time(pending.done) / 1000.0
            self.loads += 1
            self.loaded_bytes += pending.nbytes
            self.load_seconds += seconds
            for index, bound in enumerate(LOAD_SECONDS_BUCKETS):
                if seconds <= bound:
                    self._load_buckets[index] += 1
                    break

    def make_stats(self) -> TransferStats:
        return TransferStats(self.bytes_to_device, self.bytes_to_host, self.loads, self.load_seconds,
                             tuple(zip(LOAD_SECONDS_BUCKETS, self._load_buckets)), self.write_backs_dropped,
                             self.copy_failures)
