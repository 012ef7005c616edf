"""The tiers below host RAM: where KV blocks go when the host tier has them, and outlive it.

A cold store keeps opaque values (kvstore/cold_block.py encodes a block: identity header, payload,
checksum) under string keys (`block_key`). It never raises on a lookup or a write: a store that
cannot answer (a disk error, a remote server down or slow) counts the error and answers a miss or
drops the write, so a request goes on as a miss. Two implementations: `DiskStore` (files in a
directory, kvstore/disk_store.py) and `RedisStore` (a Redis server shared by replicas,
kvstore/redis_store.py). Their callers run on worker threads (kvstore/cold_tier.py): every method
may be called from several threads at once.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Protocol, Sequence, runtime_checkable

from kvserve.stats import ColdStoreStats


@runtime_checkable
class ColdStore(Protocol):
    name: str                    # "disk" or "remote": metric labels, logs

    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """The values stored under `keys` (None where missing or unreadable), in one round trip
        where the store allows (one pipelined MGET for Redis)."""
        ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored, without reading the values (a prefix's length is found
        before its blocks are read)."""
        ...

    def put_many(self, items: Sequence[tuple[str, bytes, str]]) -> int:
        """Stores (key, value, namespace) items; returns how many were written. A store that is
        full, over the namespace's quota, or down drops the rest (counted)."""
        ...

    def discard(self, key: str) -> None:
        """Removes a value that failed its checks (counted as corrupt)."""
        ...

    def make_stats(self) -> ColdStoreStats: ...

    def close(self) -> None: ...


def block_key(model_fingerprint: str, kv_format: str, block_size: int, namespace: str, block_hash: bytes) -> str:
    """The key of one cached block. Everything that decides whether its bytes fit a request is in
    it: the model (config and weights), the KV format, the block size, and the tenant namespace
    (tenant or share group, plus cache_salt), so neither another model nor another tenant can hit
    it, on one machine or across replicas sharing a store. The namespace is hashed (it may hold any
    characters); the block's chained hash already depends on every token before it."""
    scope = hashlib.blake2b(f"{model_fingerprint}|{kv_format}|{block_size}|{namespace}".encode(),
                            digest_size=12).hexdigest()
    return f"kvserve:{scope}:{block_hash.hex()}"
