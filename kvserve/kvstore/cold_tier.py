"""The tiers below host RAM, driven from the engine's thread without ever blocking it.

`ColdTiers` holds the cold stores in lookup order (disk first: local and cheaper; then remote) and two
thread pools:
- reads (`prefetch`): a request's prefix blocks, looked up in every store (one round trip per store
  for the whole prefix), read where they are, verified (`cold_block.decode_block`: identity and
  checksum; a failed check is a miss and the entry is removed) and handed back through `poll` as one
  `ColdRead`, the longest run of blocks from the first missing one's left;
- writes (`persist`): blocks copied out of the host tier, encoded and written to every store. The
  queue is bounded (`max_pending_writes` blocks): past it a write is dropped and counted, never
  waited for.
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
from typing import Sequence

from kvserve.kvstore.cold_block import BlockIdentity, ColdBlockError, decode_block, encode_block
from kvserve.kvstore.cold_store import ColdStore, block_key
from kvserve.stats import ColdStoreStats

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_WRITES = 4096


@dataclass
class ColdRead:
    """What a prefetch found: `payloads[i]` is block `identities[i]`'s bytes (verified), for the
    leading blocks of the request's list that some store held."""
    request_id: str
    identities: list[BlockIdentity]
    payloads: list[memoryview]
    sources: list[str]           # the store each block came from
    seconds: float


class ColdTiers:
    def __init__(self, stores: Sequence[ColdStore], payload_nbytes: int, read_threads: int = 4,
                 write_threads: int = 2, max_pending_writes: int = DEFAULT_MAX_PENDING_WRITES) -> None:
        if not stores:
            raise ValueError("ColdTiers needs at least one store")
        self.stores = list(stores)
        self.payload_nbytes = payload_nbytes
        self._reads = ThreadPoolExecutor(read_threads, thread_name_prefix="kv-cold-read")
        self._writes = ThreadPoolExecutor(write_threads, thread_name_prefix="kv-cold-write")
        self._done: queue.SimpleQueue[ColdRead] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending_writes = 0
        self.max_pending_writes = max_pending_writes
        self.writes_dropped = 0
        self.prefetches_done = self.prefetch_hits = 0

    # --- reads --------------------------------------------------------------------------------------
    def prefetch(self, request_id: str, identities: Sequence[BlockIdentity]) -> None:
        """Starts reading the blocks of `identities` (a prefix, in order) on a worker thread; the
        result arrives through `poll`, also when nothing was found."""
        self._reads.submit(self._read, request_id, list(identities))

    def _read(self, request_id: str, identities: list[BlockIdentity]) -> None:
        started = time.perf_counter()
        try:
            payloads, sources = self._read_prefix(identities)
        except Exception:                      # a bug, not a store fault (stores never raise): a miss
            logger.exception("cold KV tier: prefetch of %d blocks failed", len(identities))
            payloads, sources = [], []
        with self._lock:
            self.prefetches_done += 1
            self.prefetch_hits += bool(payloads)
        self._done.put(ColdRead(request_id, identities[:len(payloads)], payloads, sources,
                                time.perf_counter() - started))

    def _read_prefix(self, identities: list[BlockIdentity]) -> tuple[list[memoryview], list[str]]:
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
        payloads: list[memoryview] = []
        sources: list[str] = []
        start = 0
        while start < run:                       # consecutive blocks of one store: one call
            store = holder[start]
            end = start
            while end < run and holder[end] is store:
                end += 1
            for i, value in zip(range(start, end), store.get_many(keys[start:end])):
                payload = self._verified(store, keys[i], value, identities[i])
                if payload is None:
                    return payloads, sources
                payloads.append(payload)
                sources.append(store.name)
            start = end
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
        """Prefetches finished since the last poll, without waiting."""
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
    def persist(self, blocks: Sequence[tuple[BlockIdentity, bytes]]) -> None:
        """Queues the blocks' writes to every store; drops (and counts) what the queue has no room for."""
        with self._lock:
            room = max(0, self.max_pending_writes - self._pending_writes)
            taken = list(blocks[:room])
            self.writes_dropped += len(blocks) - len(taken)
            self._pending_writes += len(taken)
        if taken:
            self._writes.submit(self._write, taken)

    def _write(self, blocks: list[tuple[BlockIdentity, bytes]]) -> None:
        try:
            items = [(self.key_of(identity), encode_block(identity, payload), identity.namespace)
                     for identity, payload in blocks]
            for store in self.stores:
                store.put_many(items)
        except Exception:
            logger.exception("cold KV tier: writing %d blocks failed", len(blocks))
        finally:
            with self._lock:
                self._pending_writes -= len(blocks)

    @property
    def writes_in_flight(self) -> bool:
        with self._lock:
            return self._pending_writes > 0

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every queued write is done (shutdown, tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending_writes == 0:
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
        self._writes.shutdown(wait=True)
        for store in self.stores:
            store.close()
