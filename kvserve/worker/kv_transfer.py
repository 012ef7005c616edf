"""KVTransfers: runs the block copies between the worker's KV stores off the step's critical path.

On CUDA, copies to and from a tier run on streams of their own, so a load from host RAM streams
in while other requests keep stepping on the main stream:
- Copies out of the device store (write-backs, swap-outs) read blocks that this step's forward may
  overwrite (an evicted block has a new owner at once). Their blocks are gathered on the main
  stream into a staging slot (a device-speed copy, well under a millisecond), and the write stream
  then moves the slot to pinned host memory while the forward runs.
- Copies into the device store (loads, swap-ins) go host -> staging slot on the load stream,
  then slot -> blocks on a scatter stream (so the link moves the next slot meanwhile). The link
  copy starts at once; the scatters of a load whose blocks the step in flight may still touch
  (freed or published since the last step was issued: `BlockCopy.after_inflight`, set by the KV
  manager) first wait for everything queued on the main stream. A block evicted from the prefix
  cache is not in the step in flight: a load into it waits only for its write-back's gather (this
  step's, or the last step's on the main stream).
  The blocks belong to a request the scheduler holds back until its ticket is reported landed
  (`poll`, an event query: no host synchronisation in the step).
- Writes and loads have a stream each because the link is full duplex: a write-back queued behind
  gigabytes of loads on one stream held its staging slot (and so the main stream that gathers into
  it) and piled up past the write-back bound. The host blocks still need an order, kept per block:
  a load from a host block waits for the write that fills it, and a write into a host block waits
  for the load still reading it (`_last_write`, `_last_read`).
- Write-backs are bounded: past `max_write_back_bytes` in flight, the blocks of a write-back that
  do not fit are dropped (their host blocks reported lost, so the tier forgets them) rather than
  stalling the step. The deepest blocks (`BlockCopy.depths`) go first, so what is dropped is the
  deep end of a prefix, not a block its hits pass through.

With the block-copy kernel (kvserve/kernels/triton/block_copy.py; on CUDA when triton imports, unless
KVSERVE_BLOCK_COPY_KERNEL=0) each of those moves is one launch instead of one torch copy per piece and
per run of host rows: a load is one kernel on the load stream that reads the pinned host rows itself
(no staging slot, no scatter stream; it waits for the step in flight where `after_inflight` says so,
as the scatters did), except a load alone from long runs of host rows, which the copy engine moves
faster (`load_by_copy_engine`: memcpys into slots, one kernel launch scattering each), and a write-back's gather into a slot and the slot's put to the host rows are
one launch (the put by the copy engine where `PUT_WITH_KERNEL` is off). Loads run on a few SMs only
(`LINK_PROGRAMS`, fewer beside a running batch): the link, not the SMs, bounds them, and the main
stream's steps keep the rest.

Without CUDA every copy runs at once, in order, and its ticket is reported at the next poll: the
same scheduling path, on plain memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from kvserve import envs
from kvserve.kvstore import DEVICE_STORE, LOAD, SWAP_IN, SWAP_OUT, WRITE_BACK, BlockCopy, KVCacheStore
from kvserve.kvstore.staging import StagingRing
from kvserve.stats import TransferStats

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the load-latency histogram's buckets: a few blocks take tens of
# microseconds, a 32k-token prefix of a 7B model tens of milliseconds.
LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Write-back bytes allowed in flight before further write-backs are dropped (~80 ms of PCIe 5).
# Most of what is "in flight" waits for the forward already queued, not for the link: with the
# step launched ahead, two steps' write-backs are outstanding when a third is issued, and an 8k-token
# prefill chunk of a 7B model evicts 470 MB, a 32k-token load 1.9 GB at once. At 1 GiB, chunks of a
# prefix that was being written back were dropped, and a later hit found only part of it.
DEFAULT_MAX_WRITE_BACK_BYTES = 4 << 30
# Staging per direction on a GPU (kvstore/staging.py): a step's write-backs up to this size never
# make the main stream wait for the host copy.
DEVICE_STAGING_BYTES = 256 << 20
# Programs of a block-copy kernel that crosses the link (a load from pinned host rows, a put of a
# slot to them). A program holds its SM for the whole transfer, and the link, not the SMs, bounds
# the rate: on an H100 16 programs reached the plateau (43 GB/s; 8: 34, 4: 18), and a decode step
# beside 16 of them ran 15% slower (benchmarks/kv/block_copy_bench.py, host_load_bench.py). So a
# load alone on the GPU takes the plateau, and a load beside a running batch takes few SMs: it
# lands later, but the batch keeps its speed.
LINK_PROGRAMS = 16
LINK_PROGRAMS_BESIDE_A_BATCH = 4
# A write-back's put of a staging slot to the host rows: by the copy engine (one copy per run of
# host rows) or by the kernel (one launch, writing the rows from SMs). Stores to host memory from
# SMs slowed a GEMM beside them far more than the copy engine did (benchmarks/kv/block_copy_bench.py).
PUT_WITH_KERNEL = False
# A load that runs alone on the GPU and whose host rows lie in long runs goes by the copy engine
# (one memcpy per run into a staging slot, then one kernel launch scattering the slot): on an H100 a
# contiguous pinned memcpy reached 54.6 GB/s where the kernel plateaued at 45 (block_copy_bench), and
# a 32k-token load is most of a from-host TTFT. Beside a batch the kernel stays: with the copy engine
# there, the steps that issued loads ran 2.9x slower (host_load_bench, docs/kv_tiers.md). Scattered
# host rows (one memcpy per block) stay on the kernel too: the path needs runs of at least this many
# blocks on average.
COPY_ENGINE_MIN_MEAN_RUN = 8


def mean_run_length(ids: Sequence[int]) -> float:
    """Blocks per run of consecutive ids (one memcpy each on the copy-engine path)."""
    if not ids:
        return 0.0
    breaks = sum(1 for previous, current in zip(ids, ids[1:]) if current != previous + 1)
    return len(ids) / (breaks + 1)


# Which loads from long runs of host rows take the copy engine where the kernel runs
# (KVSERVE_LOAD_COPY_ENGINE): those in a step without a batch, all of them, or none.
COPY_ENGINE_MODES = ("alone", "always", "never")


def load_by_copy_engine(host_ids: Sequence[int], beside_a_batch: bool, kernel_runs: bool,
                        mode: str = "alone") -> bool:
    """Whether a load from these host rows goes by memcpys + scatters rather than the block-copy
    kernel (without the kernel, always; see COPY_ENGINE_MIN_MEAN_RUN and COPY_ENGINE_MODES)."""
    if not kernel_runs:
        return True
    if mode == "never" or (mode == "alone" and beside_a_batch):
        return False
    return mean_run_length(host_ids) >= COPY_ENGINE_MIN_MEAN_RUN


def block_copy_kernel(device: torch.device) -> Optional[Callable[..., None]]:
    """The Triton block-copy entry point where it runs (CUDA, triton importable, not switched off)."""
    if device.type != "cuda" or not envs.KVSERVE_BLOCK_COPY_KERNEL.is_on():
        return None
    try:
        from kvserve.kernels.triton.block_copy import copy_block_rows
    except ImportError:
        return None
    return copy_block_rows


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
    host_ids: tuple[int, ...] = ()         # on CUDA: the host blocks it writes (out) or reads (in)
    failed: bool = False                   # a lost copy, reported failed once `done` (see _lose)

    @property
    def writes_host(self) -> bool:
        return self.purpose in (WRITE_BACK, SWAP_OUT)

    def in_flight(self) -> bool:
        return self.done is not None and not self.done.query()


class KVTransfers:
    def __init__(self, stores: dict[str, KVCacheStore], device: torch.device,
                 max_write_back_bytes: int = DEFAULT_MAX_WRITE_BACK_BYTES,
                 staging_bytes: int = DEVICE_STAGING_BYTES, use_kernel: Optional[bool] = None,
                 copy_engine_loads: Optional[str] = None) -> None:
        self.stores = stores                # shared with the runner: tiers register into it
        self.device = device
        self.max_write_back_bytes = max_write_back_bytes
        self.staging_bytes = staging_bytes
        # The link's copies each way, and the scatters of loaded slots into blocks.
        on_cuda = device.type == "cuda"
        self.load_stream = torch.cuda.Stream(device) if on_cuda else None
        self.write_stream = torch.cuda.Stream(device) if on_cuda else None
        self.scatter_stream = torch.cuda.Stream(device) if on_cuda else None
        # The block-copy kernel (None: torch copies): where it runs, unless `use_kernel` is False.
        self.kernel = None if use_kernel is False else block_copy_kernel(device)
        if use_kernel and self.kernel is None:
            raise ValueError("the block-copy kernel needs CUDA and triton (and KVSERVE_BLOCK_COPY_KERNEL not 0)")
        if self.kernel is not None and DEVICE_STORE in stores:
            # Compiled now, not on the first long host hit's TTFT (block_copy.py says why).
            from kvserve.kernels.triton.block_copy import warm_block_rows
            warm_block_rows(stores[DEVICE_STORE].pieces)
        # Per host block, the copy in flight that last wrote it and the one that last read it.
        self._last_write: dict[int, _Pending] = {}
        self._last_read: dict[int, _Pending] = {}
        # While a step's copies are issued: its loads' destination blocks, and the gather events
        # of those written back off the main stream.
        self._load_targets: set[int] = set()
        self._gathered: dict[int, torch.cuda.Event] = {}
        # Device blocks gathered on the main stream by the last step's write-backs (and this step's):
        # queued before the step in flight, they may still be running when a load into one starts.
        # Older ones are done (the step before the one in flight has been read back).
        self._gathered_on_main: dict[int, torch.cuda.Event] = {}
        self._gathered_on_main_before: dict[int, torch.cuda.Event] = {}
        self._rings: dict[str, StagingRing] = {}
        self._pending: list[_Pending] = []
        self._report = TransferReport()
        self.bytes_to_device = self.bytes_to_host = 0
        self.loads = self.loaded_bytes = 0
        self.load_seconds = 0.0
        self._load_buckets = [0] * len(LOAD_SECONDS_BUCKETS)
        self.write_back_blocks_dropped = 0
        self._load_programs = LINK_PROGRAMS
        self.copy_failures = 0
        # Which loads from long runs of host rows go by the copy engine (load_by_copy_engine).
        self._copy_engine_loads = envs.KVSERVE_LOAD_COPY_ENGINE.get() if copy_engine_loads is None else copy_engine_loads
        if self._copy_engine_loads not in COPY_ENGINE_MODES:
            raise ValueError(f"KVSERVE_LOAD_COPY_ENGINE must be one of {', '.join(COPY_ENGINE_MODES)}, "
                             f"got {self._copy_engine_loads!r}")
        self._beside_a_batch = False
        self.loads_by_copy_engine = 0      # issued on the copy-engine path (the rest by the kernel)
        self.loads_inline = 0              # issued inline in their request's step (BlockCopy.inline)

    # --- issuing ------------------------------------------------------------------------------
    def run(self, copies: list[BlockCopy], beside_a_batch: bool = False) -> list[int]:
        """Issues the step's copies (in their order for each direction); returns without waiting.
        `beside_a_batch`: the step runs a forward too, which the loads must disturb little. A load
        inline in the step (`BlockCopy.inline`) makes the main stream wait for it, so the
        forward queued next reads its blocks; it takes the link at full rate, since the batch waits
        for it anyway. Returns the tickets of inline loads that failed as they were issued: their
        requests must leave the step before its forward (Scheduler.hold_for_load)."""
        if not copies:
            return []
        programs = LINK_PROGRAMS_BESIDE_A_BATCH if beside_a_batch else LINK_PROGRAMS
        self._beside_a_batch = beside_a_batch
        outs = [copy for copy in copies if copy.destination != DEVICE_STORE]
        # Loads that may start now go first: loads on one stream run in issue order, so one load
        # waiting for the step in flight (`after_inflight`) would hold back every load issued after
        # it (docs/kv_tiers.md). Loads of one step write distinct blocks, so their order is free.
        ins = sorted((copy for copy in copies if copy.destination == DEVICE_STORE),
                     key=lambda copy: copy.after_inflight)
        # This step's load destinations: blocks evicted to make room for them.
        self._load_targets = {block_id for copy in ins for block_id in copy.dst_block_ids}
        self._gathered = {}
        self._gathered_on_main_before, self._gathered_on_main = self._gathered_on_main, {}
        # Copies out first: a block evicted this step may be the target of one of this step's loads.
        lost_before = len(self._report.lost_host_blocks)
        for copy in outs:
            self._issue_logged(copy)
        # A block written back this step may already be the source of one of its loads.
        lost = set(self._report.lost_host_blocks[lost_before:])
        failed_inline: list[int] = []
        for copy in ins:
            # An inline load has the link to itself as if alone (long runs by the copy engine, else
            # the kernel on every link program): the step's forward waits for it anyway.
            self._load_programs = LINK_PROGRAMS if copy.inline else programs
            self._beside_a_batch = beside_a_batch and not copy.inline
            if lost.intersection(copy.src_block_ids):
                self._lose(copy)
                issued = None
            else:
                issued = self._issue_logged(copy)
            if not copy.inline:
                continue
            self.loads_inline += 1
            if issued is None or issued.failed:
                failed_inline.append(copy.ticket)
            elif issued.done is not None:
                torch.cuda.current_stream(self.device).wait_event(issued.done)
        self._load_programs, self._beside_a_batch = programs, beside_a_batch
        self._load_targets, self._gathered = set(), {}
        return failed_inline

    def _issue_logged(self, copy: BlockCopy) -> Optional[_Pending]:
        """Issues a copy and returns its pending record (None: nothing in flight). A copy that fails
        at run time (a CUDA or allocation error) is logged, counted and reported lost. A copy naming
        an unknown store is a bug and raises."""
        source, destination = self._store(copy.source), self._store(copy.destination)
        before = len(self._pending)
        try:
            self._issue(copy, source, destination)
        except RuntimeError:
            logger.exception("KV block copy %s -> %s (%s, %d blocks) failed", copy.source, copy.destination,
                             copy.purpose, len(copy.src_block_ids))
            self.copy_failures += 1
            self._lose(copy)
            return None
        return self._pending[-1] if len(self._pending) > before else None

    def _lose(self, copy: BlockCopy) -> None:
        if copy.ticket is not None:
            # Its blocks go back to the pool once reported: not before a write-back still gathering
            # them off the main stream has read them.
            if any(block_id in self._gathered for block_id in copy.dst_block_ids):
                last = torch.cuda.Event()
                last.record(self.write_stream)      # after every gather issued so far
                self._pending.append(_Pending(copy.ticket, copy.purpose, 0, last, failed=True))
                return
            self._report.failed.append(copy.ticket)
        elif copy.destination != DEVICE_STORE:
            self._report.lost_host_blocks.extend(copy.dst_block_ids)

    def _within_write_back_bound(self, copy: BlockCopy, block_nbytes: int) -> BlockCopy:
        """The part of a write-back that fits under the bound: its shallowest blocks (by
        `copy.depths`; else its first), in their order. The rest is dropped, its host blocks
        reported lost."""
        count = len(copy.src_block_ids)
        room = max(0, self.max_write_back_bytes - self._write_backs_in_flight()) // block_nbytes
        if room >= count:
            return copy
        by_depth = sorted(range(count), key=copy.depths.__getitem__) if copy.depths else range(count)
        kept, dropped = sorted(by_depth[:room]), sorted(by_depth[room:])
        self.write_back_blocks_dropped += len(dropped)
        self._report.lost_host_blocks.extend(copy.dst_block_ids[index] for index in dropped)
        logger.debug("write-back of %d blocks: %d dropped, the bound (%d bytes) is in flight",
                     count, len(dropped), self.max_write_back_bytes)
        return replace(copy, src_block_ids=tuple(copy.src_block_ids[index] for index in kept),
                       dst_block_ids=tuple(copy.dst_block_ids[index] for index in kept), depths=())

    def _issue(self, copy: BlockCopy, source: KVCacheStore, destination: KVCacheStore) -> None:
        if copy.purpose == WRITE_BACK:
            copy = self._within_write_back_bound(copy, source.block_nbytes)
            if not copy.src_block_ids:
                return
        nbytes = len(copy.src_block_ids) * source.block_nbytes
        if self.load_stream is None or (source.device.type != "cuda" and destination.device.type != "cuda"):
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

    def _wait_for_main_gathers(self, stream: torch.cuda.Stream, device_ids) -> None:
        """`stream` waits for the write-back gathers on the main stream (this step's or the last's)
        still due to read these device blocks."""
        events = {}
        for gathered in (self._gathered_on_main_before, self._gathered_on_main):
            if gathered:
                events.update((id(event), event) for event in map(gathered.get, device_ids) if event is not None)
        for event in events.values():
            stream.wait_event(event)

    def _wait_for(self, stream: torch.cuda.Stream, last: dict[int, _Pending], host_ids: tuple[int, ...]) -> None:
        """`stream` waits for the copies in flight that last touched these host blocks (in `last`)."""
        waited: set[int] = set()
        for host_id in host_ids:
            pending = last.get(host_id)
            if pending is not None and id(pending) not in waited:
                waited.add(id(pending))
                stream.wait_event(pending.done)

    def _copy_out(self, copy: BlockCopy, source: KVCacheStore, destination: KVCacheStore, nbytes: int) -> _Pending:
        main, side = torch.cuda.current_stream(self.device), self.write_stream
        # A load still reading a host block this copy overwrites reads it first.
        self._wait_for(side, self._last_read, copy.dst_block_ids)
        started = torch.cuda.Event(enable_timing=True)
        started.record(main)
        # Blocks this step's loads write next are gathered on the write stream, so nothing but
        # those loads' scatters waits for them (chunk by chunk, `_gathered`); the rest are gathered
        # on the main stream before the forward that may overwrite them. The copy's order is kept:
        # it keeps the host ids in runs (one memcpy each), and a load takes its blocks in eviction
        # order, so its first chunks wait only for the write-back's first.
        behind_loads = self._load_targets
        pairs = list(zip(copy.src_block_ids, copy.dst_block_ids))
        on_main = [pair for pair in pairs if pair[0] not in behind_loads]
        off_main = [pair for pair in pairs if pair[0] in behind_loads]
        if on_main:
            self._gather_and_put(self._ring("out", source), main, source, destination, on_main,
                                 self._gathered_on_main)
        if off_main:
            if copy.after_inflight:
                side.wait_stream(main)      # after the step in flight, which may still write them
            else:
                self._wait_for_main_gathers(side, [src for src, _ in off_main])
            self._gather_and_put(self._ring("out-behind-loads", source), side, source, destination, off_main,
                                 self._gathered)
        done = torch.cuda.Event(enable_timing=True)
        done.record(side)
        pending = _Pending(copy.ticket, copy.purpose, nbytes, done, started, host_ids=copy.dst_block_ids)
        self._last_write.update(dict.fromkeys(copy.dst_block_ids, pending))
        return pending

    def _gather_and_put(self, ring: StagingRing, gather_stream: torch.cuda.Stream, source: KVCacheStore,
                        destination: KVCacheStore, pairs: list[tuple[int, int]],
                        gathered_at: Optional[dict[int, torch.cuda.Event]] = None) -> None:
        """Device blocks -> ring slots on `gather_stream`, slots -> host blocks on the write stream;
        `gathered_at` learns, per device block, the event after which it may be overwritten."""
        side = self.write_stream
        gather = self._slot_gather(gather_stream, source, [src for src, _ in pairs], ring.blocks_per_slot)
        dst_ids = [dst for _, dst in pairs]
        for start, end in ring.chunks(len(pairs)):
            slot_index, slot = ring.acquire(gather_stream)
            with torch.cuda.stream(gather_stream):
                gather(start, end, slot)
            gathered = torch.cuda.Event()
            gathered.record(gather_stream)
            if gathered_at is not None:
                gathered_at.update((src, gathered) for src, _ in pairs[start:end])
            if gather_stream is not side:
                side.wait_event(gathered)
            with torch.cuda.stream(side):
                self._put(destination, dst_ids[start:end], slot[:end - start])
            ring.release(slot_index, side)

    def _slot_gather(self, gather_stream: torch.cuda.Stream, source: KVCacheStore, src_ids: list[int],
                     blocks_per_slot: int) -> Callable[[int, int, torch.Tensor], None]:
        """A function copying source blocks src_ids[start:end] into a ring slot, on the current stream:
        one kernel launch, or a torch gather per piece."""
        if self.kernel is not None:
            kernel, ids = self.kernel, torch.tensor(src_ids, dtype=torch.long)

            def gather(start: int, end: int, slot: torch.Tensor) -> None:
                kernel(source.pieces, ids[start:end], [slot], torch.arange(end - start), blocks_per_slot, to_rows=True)
            return gather
        with torch.cuda.stream(gather_stream):
            # Allocated on the stream that reads it (see _copy_in).
            src_index = source.block_index(src_ids)

        def gather(start: int, end: int, slot: torch.Tensor) -> None:
            slot[:end - start].copy_(source.gather_bytes(src_index[start:end]))
        return gather

    def _put(self, destination: KVCacheStore, host_ids: list[int], rows: torch.Tensor) -> None:
        """Staged rows -> host blocks on the current stream: by the copy engine, or (PUT_WITH_KERNEL,
        measured slower for the step beside it) by the kernel writing the pinned rows."""
        if self.kernel is not None and PUT_WITH_KERNEL:
            flat = destination.flat
            self.kernel([rows], torch.arange(len(host_ids)), flat.live_segments(),
                        torch.tensor(host_ids, dtype=torch.long), flat.segment_blocks,
                        to_rows=True, max_programs=LINK_PROGRAMS)
        else:
            destination.put_rows(host_ids, rows)

    def _copy_in_kernel(self, copy: BlockCopy, source: KVCacheStore, destination: KVCacheStore,
                        nbytes: int) -> _Pending:
        """_copy_in as one kernel on the load stream, reading the pinned host rows directly."""
        main, stream = torch.cuda.current_stream(self.device), self.load_stream
        if copy.after_inflight:
            stream.wait_stream(main)
        else:
            self._wait_for_main_gathers(stream, copy.dst_block_ids)
        self._wait_for(stream, self._last_write, copy.src_block_ids)
        gathered = self._gathered
        if gathered:                    # blocks evicted this step: their write-back gathers them first
            for event in {id(e): e for e in (gathered.get(b) for b in copy.dst_block_ids) if e is not None}.values():
                stream.wait_event(event)
        started = torch.cuda.Event(enable_timing=True)
        started.record(stream)
        with torch.cuda.stream(stream):
            self.kernel(destination.pieces, torch.tensor(copy.dst_block_ids, dtype=torch.long),
                        source.flat.live_segments(), torch.tensor(copy.src_block_ids, dtype=torch.long),
                        source.flat.segment_blocks, to_rows=False, max_programs=self._load_programs)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
        pending = _Pending(copy.ticket, copy.purpose, nbytes, done, started, host_ids=copy.src_block_ids)
        self._last_read.update(dict.fromkeys(copy.src_block_ids, pending))
        return pending

    def _copy_in(self, copy: BlockCopy, source: KVCacheStore, destination: KVCacheStore, nbytes: int) -> _Pending:
        if not load_by_copy_engine(copy.src_block_ids, self._beside_a_batch, self.kernel is not None,
                                   self._copy_engine_loads):
            return self._copy_in_kernel(copy, source, destination, nbytes)
        if self.kernel is not None:
            self.loads_by_copy_engine += 1
        # Two streams, so the link moves slot k + 1 while slot k is scattered into its blocks.
        main, copier, scatterer = torch.cuda.current_stream(self.device), self.load_stream, self.scatter_stream
        ring = self._ring("in", destination)
        src_ids = list(copy.src_block_ids)
        # Only the scatters touch the destination blocks: the link starts at once, and the scatters
        # wait for the step in flight when it may still use the blocks.
        if copy.after_inflight:
            scatterer.wait_stream(main)
        else:
            self._wait_for_main_gathers(scatterer, copy.dst_block_ids)
        # A host block written back and loaded again before the write landed: the write first.
        self._wait_for(copier, self._last_write, copy.src_block_ids)
        started = torch.cuda.Event(enable_timing=True)
        started.record(copier)
        if self.kernel is not None:
            dst_cpu_ids = torch.tensor(copy.dst_block_ids, dtype=torch.long)    # the kernel takes CPU ids
        else:
            with torch.cuda.stream(scatterer):
                # Allocated on the stream that reads it: freed by Python at return, its memory must not
                # be handed to the main stream while the scatters are still queued.
                dst_index = destination.block_index(copy.dst_block_ids)
        gathered = self._gathered
        for start, end in ring.chunks(len(src_ids)):
            slot_index, slot = ring.acquire(copier)
            with torch.cuda.stream(copier):
                rows = source.take_rows(src_ids[start:end], slot)
            copied = torch.cuda.Event()
            copied.record(copier)
            scatterer.wait_event(copied)
            if gathered:                # blocks evicted this step: their write-back gathers them first
                chunk = copy.dst_block_ids[start:end]
                for event in {id(e): e for e in (gathered.get(b) for b in chunk) if e is not None}.values():
                    scatterer.wait_event(event)
            with torch.cuda.stream(scatterer):
                if self.kernel is not None:     # one launch a slot, not one copy per layer tensor
                    self.kernel(destination.pieces, dst_cpu_ids[start:end], [slot], torch.arange(end - start),
                                ring.blocks_per_slot, to_rows=False)
                else:
                    destination.scatter_bytes(dst_index[start:end], rows)
            ring.release(slot_index, scatterer)
        done = torch.cuda.Event(enable_timing=True)
        done.record(scatterer)
        pending = _Pending(copy.ticket, copy.purpose, nbytes, done, started, host_ids=copy.src_block_ids)
        self._last_read.update(dict.fromkeys(copy.src_block_ids, pending))
        return pending

    def _store(self, name: str) -> KVCacheStore:
        store = self.stores.get(name)
        if store is None:
            raise KeyError(f"block copy names an unknown KV store {name!r} (known: {sorted(self.stores)})")
        return store

    def _write_backs_in_flight(self) -> int:
        return sum(p.nbytes for p in self._pending if p.purpose == WRITE_BACK and p.in_flight())

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
        """An event that completes once every copy into the host issued so far has landed (None
        without CUDA, where copies ran at once)."""
        if self.write_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.write_stream)
        return event

    def synchronize(self) -> None:
        """Waits for every copy issued so far (before the tier frees memory a copy may touch)."""
        for stream in (self.load_stream, self.write_stream, self.scatter_stream):
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
            if pending.in_flight():
                still.append(pending)
                continue
            self._finish(pending)
        self._pending = still
        report, self._report = self._report, TransferReport()
        return report

    def _finish(self, pending: _Pending) -> None:
        last = self._last_write if pending.writes_host else self._last_read
        for host_id in pending.host_ids:
            if last.get(host_id) is pending:
                del last[host_id]
        if pending.failed:
            self._report.failed.append(pending.ticket)
            return
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
                             tuple(zip(LOAD_SECONDS_BUCKETS, self._load_buckets)), self.write_back_blocks_dropped,
                             self.copy_failures, self.loads_by_copy_engine, self.loads_inline)
