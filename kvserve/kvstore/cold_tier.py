"""The tiers below host RAM, driven from the engine's thread without ever blocking it.

`ColdTiers` holds the cold stores in lookup order (disk first: local and cheaper; then remote) and
its thread pools:
- reads (`prefetch`): a request's prefix blocks, looked up in every store (one round trip per store
  for the whole prefix), read where they are in chunks of about `READ_CHUNK_BYTES`, up to
  `reads_in_flight` chunks at once (one file read or one MGET after another is bound by a single
  round trip's latency, not by the disk's or the network's bandwidth), verified on the reading
  thread (`cold_block.decode_block`: identity and checksum; a failed check is a miss and the entry is
  removed) and handed back through `poll` chunk by chunk, in prefix order, as `ColdRead`s whose
  last is `final`: the longest run of blocks from the first missing one's left;
- writes (`persist`): blocks copied out of the host tier, encoded and written to each store on that
  store's own threads, so a slow remote never holds the disk back. Each store's queue is bounded
  (`max_pending_writes` blocks): past it a write is dropped and counted, never waited for.
Blocks are immutable (named by their chained hash), so a block written once needs no further write
and no invalidation.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from kvserve.kvstore.cold_block import BlockIdentity, ColdBlockError, decode_block, encode_block
from kvserve.kvstore.cold_store import ColdStore, block_key
from kvserve.stats import ColdStoreStats

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_WRITES = 4096
RATE_SMOOTHING = 0.3                 # weight of a new read-rate observation
READ_CHUNK_BYTES = 16 << 20          # one store call of a prefetch: large enough to stream, small enough to spread
WRITE_CHUNK_BYTES = 16 << 20


@dataclass
class ColdRead:
    """What a prefetch found: `payloads[i]` is block `identities[i]`'s bytes (verified), for the
    leading blocks of the request's list that some store held."""
    request_id: str
    identities: list[BlockIdentity]
    payloads: list[memoryview]
    sources: list[str]           # the store each block came from
    seconds: float
    skipped: bool = False        # not read: reading it from where it is was measured slower than computing it
    # A prefetch arrives in pieces, in prefix order, as its chunks are read (the engine places each
    # in the host tier at once, so that copy overlaps the later reads); the last one is `final`.
    final: bool = True


class ColdTiers:
    def __init__(self, stores: Sequence[ColdStore], payload_nbytes: int, prefetch_threads: int = 4,
                 reads_in_flight: int = 16, write_threads: int = 2,
                 max_pending_writes: int = DEFAULT_MAX_PENDING_WRITES) -> None:
        if not stores:
            raise ValueError("ColdTiers needs at least one store")
        self.stores = list(stores)
        self.payload_nbytes = payload_nbytes
        # A prefetch waits on its chunks: the chunks run on their own pool, never the prefetches'.
        self._reads = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="kv-cold-prefetch")
        self._chunks = ThreadPoolExecutor(reads_in_flight, thread_name_prefix="kv-cold-read")
        self._writes = {store.name: ThreadPoolExecutor(write_threads, thread_name_prefix=f"kv-cold-write-{store.name}")
                        for store in self.stores}
        self._done: queue.SimpleQueue[ColdRead] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {store.name: 0 for store in self.stores}     # blocks queued per store
        self.max_pending_writes = max_pending_writes
        self.writes_dropped = 0
        self.prefetches_done = self.prefetch_hits = self.prefetches_skipped = 0
        # Each store's measured read rate (bytes/s, from prefetches served by that store alone).
        self.read_rates: dict[str, float] = {}

    # --- reads --------------------------------------------------------------------------------------
    def prefetch(self, request_id: str, identities: Sequence[BlockIdentity],
                 compute_s: Optional[float] = None) -> None:
        """Starts reading the blocks of `identities` (a prefix, in order) on a worker thread; the
        result arrives through `poll`, also when nothing was found. `compute_s`: what computing
        these tokens is expected to take; once the stores holding them are known, a read expected
        to take longer (each store's measured rate) is not started (`ColdRead.skipped`)."""
        self._reads.submit(self._read, request_id, list(identities), compute_s)

    def _read(self, request_id: str, identities: list[BlockIdentity], compute_s: Optional[float] = None) -> None:
        started = time.perf_counter()
        skipped = False
        posted = 0

        def post(payloads: list[memoryview], sources: list[str]) -> None:
            nonlocal posted
            self._done.put(ColdRead(request_id, identities[posted:posted + len(payloads)], payloads, sources,
                                    time.perf_counter() - started, final=False))
            posted += len(payloads)

        try:
            payloads, sources, skipped = self._read_prefix(identities, compute_s, post)
        except Exception:                      # a bug, not a store fault (stores never raise): a miss
            logger.exception("cold KV tier: prefetch of %d blocks failed", len(identities))
            payloads, sources = [], []
        seconds = time.perf_counter() - started
        with self._lock:
            self.prefetches_done += 1
            self.prefetch_hits += bool(payloads)
            self.prefetches_skipped += skipped
            if payloads and seconds > 0 and len(set(sources)) == 1:
                rate = sum(len(p) for p in payloads) / seconds
                self.read_rates[sources[0]] = smooth_rate(self.read_rates.get(sources[0]), rate)
        # What was not posted yet (a read on the calling thread posts nothing), then the end.
        rest = len(payloads) - posted
        self._done.put(ColdRead(request_id, identities[posted:len(payloads)], payloads[posted:] if rest else [],
                                sources[posted:] if rest else [], seconds, skipped, final=True))

    def _expected_read_s(self, holder: Sequence[Optional[ColdStore]], run: int) -> Optional[float]:
        """Seconds to read the first `run` blocks from their stores at the measured rates (None while
        a store holding some of them has no rate yet)."""
        with self._lock:
            rates = dict(self.read_rates)
        total = 0.0
        for store in {h.name: h for h in holder[:run]}.values():
            rate = rates.get(store.name)
            if not rate:
                return None
            total += sum(1 for h in holder[:run] if h is store) * self.payload_nbytes / rate
        return total

    def _read_prefix(self, identities: list[BlockIdentity], compute_s: Optional[float] = None,
                     on_chunk: Optional[Callable[[list[memoryview], list[str]], None]] = None
                     ) -> tuple[list[memoryview], list[str], bool]:
        """(payloads, their stores, skipped) of the prefix's leading blocks; `on_chunk` gets each
        chunk's part, in order, as soon as it and the chunks before it are read."""
        keys = [self.key_of(identity) for identity in identities]
        # Which store holds each block: the first in lookup order that has it.
        holder: list[ColdStore | None] = [None] * len(keys)
        for store in self.stores:
            todo = [i for i, h in enumerate(holder) if h is None]
            if not todo:
                break
            for i, present in zip(todo, store.contains_many([keys[i] for i in todo])):
                if present:
                    holder[i] = store
        run = next((i for i, h in enumerate(holder) if h is None), len(holder))
        if run and compute_s is not None:
            expected = self._expected_read_s(holder, run)
            if expected is not None and expected > compute_s:
                return [], [], True
        chunk = max(1, READ_CHUNK_BYTES // max(1, self.payload_nbytes))
        pieces = []                              # consecutive blocks of one store, at most `chunk` long
        start = 0
        while start < run:
            store = holder[start]
            end = start
            while end < run and end - start < chunk and holder[end] is store:
                end += 1
            pieces.append((store, start, end))
            start = end
        futures = [self._chunks.submit(self._read_chunk, store, keys[start:end], identities[start:end])
                   for store, start, end in pieces]
        payloads: list[memoryview] = []
        sources: list[str] = []
        complete = True
        for (store, start, end), future in zip(pieces, futures):
            if not complete:                     # stopped at a missing or bad block: the rest is not used
                future.cancel()
                continue
            got = future.result()
            payloads += got
            sources += [store.name] * len(got)
            complete = len(got) == end - start
            if on_chunk is not None and got:
                on_chunk(got, [store.name] * len(got))
        return payloads, sources, False

    def _read_chunk(self, store: ColdStore, keys: list[str], identities: list[BlockIdentity]) -> list[memoryview]:
        """The verified payloads of the leading blocks of `keys` that `store` returned intact."""
        out = []
        for key, value, identity in zip(keys, store.get_many(keys), identities):
            payload = self._verified(store, key, value, identity)
            if payload is None:
                break
            out.append(payload)
        return out

    def read(self, identities: Sequence[BlockIdentity]) -> tuple[list[memoryview], list[str]]:
        """The same read as a prefetch, on the calling thread (benchmarks: a tier's read bandwidth)."""
        payloads, sources, _ = self._read_prefix(list(identities))
        return payloads, sources

    def _verified(self, store: ColdStore, key: str, value: bytes | None,
                  identity: BlockIdentity) -> memoryview | None:
        if value is None:
            return None
        try:
            return decode_block(value, identity, self.payload_nbytes)
        except ColdBlockError as exc:
            logger.warning("%s KV tier: %s is not the block asked for (%s); removed, counted as a miss",
                           store.name, key, exc)
            store.discard(key)
            return None

    def poll(self) -> list[ColdRead]:
        """Prefetch pieces read since the last poll (a prefetch's last one is `final`), without waiting."""
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def wait(self, timeout_s: float) -> list[ColdRead]:
        """Like `poll`, but waits up to `timeout_s` for the first one (nothing else to do)."""
        try:
            first = self._done.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return [first] + self.poll()

    # --- writes -------------------------------------------------------------------------------------
    def persist(self, blocks: Sequence[tuple[BlockIdentity, bytes | memoryview]]) -> None:
        """Queues the blocks' writes to every store, in chunks; drops (and counts, once per store)
        what a store's queue has no room for."""
        if not blocks:
            return
        chunk = max(1, WRITE_CHUNK_BYTES // max(1, self.payload_nbytes))
        for store in self.stores:
            with self._lock:
                room = max(0, self.max_pending_writes - self._pending[store.name])
                taken = list(blocks[:room])
                self.writes_dropped += len(blocks) - len(taken)
                self._pending[store.name] += len(taken)
            for start in range(0, len(taken), chunk):
                self._writes[store.name].submit(self._write, store, taken[start:start + chunk])

    def _write(self, store: ColdStore, blocks: list[tuple[BlockIdentity, bytes | memoryview]]) -> None:
        try:
            store.put_many([(self.key_of(identity), encode_block(identity, payload), identity.namespace)
                            for identity, payload in blocks])
        except Exception:
            logger.exception("cold KV tier: writing %d blocks to the %s tier failed", len(blocks), store.name)
        finally:
            with self._lock:
                self._pending[store.name] -= len(blocks)

    @property
    def writes_in_flight(self) -> bool:
        with self._lock:
            return any(self._pending.values())

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every queued write is done (shutdown, tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.writes_in_flight:
                return True
            time.sleep(0.005)
        return False

    # --- keys, stats, shutdown ---------------------------------------------------------------------
    @staticmethod
    def key_of(identity: BlockIdentity) -> str:
        return block_key(identity.model_fingerprint, identity.kv_format, identity.block_size, identity.namespace,
                         identity.block_hash)

    def make_stats(self) -> tuple[ColdStoreStats, ...]:
        return tuple(store.make_stats() for store in self.stores)

    def close(self) -> None:
        self.flush(timeout_s=10.0)
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._chunks.shutdown(wait=False, cancel_futures=True)
        for pool in self._writes.values():
            pool.shutdown(wait=True)
        for store in self.stores:
            store.close()


def smooth_rate(current: Optional[float], value: float) -> float:
    return value if current is None else (1 - RATE_SMOOTHING) * current + RATE_SMOOTHING * value
