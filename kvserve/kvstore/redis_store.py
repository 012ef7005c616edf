"""The remote KV tier: KV blocks in a Redis server that several kvserve replicas share, so a prefix
one replica computed is a hit on the others (and outlives a replica's restart).

Values are opaque here (kvstore/cold_block.py encodes and checks them); each is one Redis string
under its `cold_store.block_key`. Every call is one pipelined round trip (MGET, a pipeline of
EXISTS, a pipeline of SETs), on redis-py's connection pool, which several threads use at once.

Keys carry everything that decides whether the bytes fit a request: the model fingerprint, the KV
format, the block size and the tenant namespace (tenant or share group plus cache_salt). Replicas of
other models, and other tenants, share the same Redis without ever hitting each other's blocks; a
request with another cache_salt never sees them either.

Recommended Redis settings (redis.conf, or `--maxmemory` / `--maxmemory-policy`):

    maxmemory 8gb                   # whatever the machine can spare for the cache
    maxmemory-policy allkeys-lru    # or allkeys-lfu
    save ""                         # a cache: no snapshots, no AOF
    appendonly no

A shared cache without a memory bound and an evicting policy grows until the kernel OOM-kills the
server (every replica loses its tier at once); with `noeviction` a full server refuses every write
(counted as dropped writes here, reads go on). With `allkeys-lru`, Redis itself drops the least
recently used blocks, which is what a cache wants; the `ttl_s` option adds an expiry to every block
on top (0: none).

The tier never fails a request: a connection error or a timeout (`timeout_s`) counts an error, logs
one warning for the outage, and answers misses / drops writes; while the server is down, calls
answer at once without touching the network, and one call every `retry_after_s` tries it again, so
a dead server costs at most one timeout per `retry_after_s`. When it answers, the tier is back
(one info line).

`tenant_quota_bytes` (> 0) bounds the bytes each namespace writes, counted in Redis itself so every
replica sharing the server shares the quota: a counter per namespace, raised by each value's size
on write and expiring with the data.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from typing import Any, Optional, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.stats import ColdStoreStats

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix")
QUOTA_PREFIX = "kvserve:quota:"
PIPELINE_BYTES = 8 << 20        # values per SET pipeline (reads: ColdTiers asks for READ_CHUNK_BYTES at a time)
# Errors that mean the server did not answer (or answered nonsense): an outage.
_OUTAGE_ERRORS = (redis.RedisError, OSError)


def quota_key(namespace: str) -> str:
    """The Redis key of a namespace's byte counter (the namespace is hashed: it may hold anything)."""
    return QUOTA_PREFIX + hashlib.blake2b(namespace.encode(), digest_size=12).hexdigest()


def redact_url(url: str) -> str:
    """`url` with its password (user:password@ or ?password=) replaced, for logs and errors."""
    url = re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)


def _is_oom(exc: BaseException) -> bool:
    """Redis's maxmemory refusal ("OOM command not allowed when used memory > 'maxmemory'")."""
    oom_type = getattr(redis.exceptions, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(exc, oom_type)) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith("OOM"))


class RedisStore:
    name = "remote"

    def __init__(self, url: str, ttl_s: float = 0, tenant_quota_bytes: int = 0, timeout_s: float = 0.5,
                 retry_after_s: float = 2.0) -> None:
        self.url = redact_url(url)
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in SCHEMES:
            raise ValueError(f"remote KV tier URL {self.url!r} is not a Redis URL: expected redis://host:port[/db], "
                             "rediss://host:port[/db] (TLS) or unix:///path/to/redis.sock")
        if ttl_s < 0:
            raise ValueError(f"remote KV tier TTL must be 0 (none) or more seconds, got {ttl_s}")
        if tenant_quota_bytes < 0:
            raise ValueError(f"remote KV tier tenant quota must be 0 (none) or more bytes, got {tenant_quota_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"remote KV tier timeout must be above 0 seconds, got {timeout_s}")
        if retry_after_s < 0:
            raise ValueError(f"remote KV tier retry interval must be 0 or more seconds, got {retry_after_s}")
        self.ttl_s = float(ttl_s)
        self.tenant_quota_bytes = int(tenant_quota_bytes)
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        try:
            # from_url builds a ConnectionPool (thread-safe: each command or pipeline takes a
            # connection of its own). No retries inside redis-py: one attempt per call, so a dead or
            # hung server costs one timeout, and our own back-off decides when to try again.
            self._client = redis.Redis.from_url(
                url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                health_check_interval=30, retry=Retry(NoBackoff(), 0), retry_on_error=[])
        except ValueError as exc:
            raise ValueError(f"remote KV tier URL {self.url!r}: {exc}") from None
        self._lock = threading.Lock()
        self._available = True
        self._closed = False
        self._retry_at = 0.0          # while unavailable: when the next call may try the server again
        self.hits = self.misses = self.bytes_read = self.bytes_written = self.blocks_written = 0
        self.writes_dropped = self.corrupt = self.errors = 0
        self._entries = 0

    # --- availability -------------------------------------------------------------------------------
    def _may_try(self) -> bool:
        """Whether this call may touch the network: always while available; while unavailable, one
        call per `retry_after_s` (it claims the attempt, the others answer at once)."""
        with self._lock:
            if self._closed:
                return False
            if self._available:
                return True
            now = time.monotonic()
            if now < self._retry_at:
                return False
            self._retry_at = now + self.retry_after_s
            return True

    def _answered(self) -> None:
        if self._available:
            return
        with self._lock:
            back = not self._available and not self._closed
            self._available = True
        if back:
            logger.info("remote KV tier back: %s answers again", self.url)

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            self._retry_at = time.monotonic() + self.retry_after_s
            first = self._available
            self._available = False
        if first:
            logger.warning("remote KV tier at %s unreachable: %s: %s; requests go on as misses (retried every %g s)",
                           self.url, type(exc).__name__, exc, self.retry_after_s)
        else:
            logger.debug("remote KV tier at %s still unreachable: %s", self.url, exc)

    @property
    def available(self) -> bool:
        return self._available and not self._closed

    # --- ColdStore ------------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        if not keys:
            return []
        values: Optional[list[Any]] = None
        if self._may_try():
            try:
                values = self._client.mget(list(keys))
            except _OUTAGE_ERRORS as exc:
                self._failed(exc)
            else:
                self._answered()
        if values is None:
            with self._lock:
                self.misses += len(keys)
            return [None] * len(keys)
        out: list[Optional[bytes]] = [v if isinstance(v, bytes) else None for v in values]
        found = [v for v in out if v is not None]
        with self._lock:
            self.hits += len(found)
            self.misses += len(out) - len(found)
            self.bytes_read += sum(len(v) for v in found)
        return out

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        if not self._may_try():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            results = pipe.execute()
        except _OUTAGE_ERRORS as exc:
            self._failed(exc)
            return [False] * len(keys)
        self._answered()
        return [bool(r) for r in results]

    def put_many(self, items: Sequence[tuple[str, bytes, str]]) -> int:
        if not items:
            return 0
        if not self._may_try():
            with self._lock:
                self.writes_dropped += len(items)
            return 0
        try:
            todo = self._within_quota(items)
            if todo:
                results = self._write(todo)
        except _OUTAGE_ERRORS as exc:
            self._failed(exc)
            with self._lock:
                self.writes_dropped += len(items)
            return 0
        self._answered()
        dropped = len(items) - len(todo)        # over their namespace's quota
        if not todo:
            with self._lock:
                self.writes_dropped += dropped
            return 0
        written = nbytes = 0
        outage: Optional[BaseException] = None
        for (_key, value, _namespace), result in zip(todo, results):
            if result is True:
                written += 1
                nbytes += len(value)
                continue
            if result is None:
                continue                        # already there: nothing to write
            dropped += 1
            if isinstance(result, Exception) and not _is_oom(result):
                outage = outage or result
        with self._lock:
            self.blocks_written += written
            self.bytes_written += nbytes
            self._entries += written
            self.writes_dropped += dropped
        if outage is not None:     # the server answered with an error other than "full"
            self._failed(outage)
        return written

    def _within_quota(self, items: Sequence[tuple[str, bytes, str]]) -> list[tuple[str, bytes, str]]:
        """The items whose namespace's counter is below the quota (one MGET of the counters); the
        rest are dropped. The counter is read before the write, so concurrent writers (threads,
        replicas) may pass the quota by a batch each: a soft bound."""
        if not self.tenant_quota_bytes:
            return list(items)
        namespaces = list(dict.fromkeys(namespace for _, _, namespace in items))
        counts = self._client.mget([quota_key(ns) for ns in namespaces])
        used = {ns: int(c) if c is not None else 0 for ns, c in zip(namespaces, counts)}
        todo = []
        for item in items:
            namespace = item[2]
            if used[namespace] >= self.tenant_quota_bytes:
                continue
            used[namespace] += len(item[1])
            todo.append(item)
        return todo

    def _write(self, items: Sequence[tuple[str, bytes, str]]) -> list[Any]:
        """One pipeline of SET NX (a block already there is immutable: neither rewritten, nor its
        TTL reset, nor charged to the quota again); with a quota, a second one charges the values
        actually written. Returns the SETs' results (True written, None already there, or the
        server's error for that command)."""
        expiry: dict[str, Any] = {}
        if self.ttl_s:
            if self.ttl_s.is_integer():
                expiry = {"ex": int(self.ttl_s)}
            else:
                expiry = {"px": max(1, round(self.ttl_s * 1000))}
        # Pipelines of at most PIPELINE_BYTES: the timeout bounds one round trip, and a round trip
        # of a whole long prefix (GBs) would outlast any sensible timeout.
        results: list[Any] = []
        start = 0
        while start < len(items):
            pipe = self._client.pipeline(transaction=False)
            nbytes = 0
            end = start
            while end < len(items) and (end == start or nbytes + len(items[end][1]) <= PIPELINE_BYTES):
                key, value, _namespace = items[end]
                pipe.set(key, value, nx=True, **expiry)
                nbytes += len(value)
                end += 1
            # Per-command errors come back in the list (a full server refuses SETs with OOM, which is
            # not an outage); a connection error or a timeout still raises.
            results += pipe.execute(raise_on_error=False)
            start = end
        if self.tenant_quota_bytes:
            try:
                self._charge([item for item, result in zip(items, results) if result is True], expiry)
            except _OUTAGE_ERRORS as exc:
                # The values were written; only their charge is lost (the counter under-counts by
                # them): an outage for what follows, not dropped writes.
                self._failed(exc)
        return results

    def _charge(self, written: Sequence[tuple[str, bytes, str]], expiry: dict[str, Any]) -> None:
        # kvserve's own accounting, shared by every replica on this Redis. It over-counts once Redis
        # evicts data (maxmemory) before the counter expires: a namespace may be refused writes it
        # would have room for, never granted more than its quota, which is the safe side. The
        # counter expires with the data (refreshed on every write).
        if not written:
            return
        pipe = self._client.pipeline(transaction=False)
        counters: list[str] = []
        for _key, value, namespace in written:
            counter = quota_key(namespace)
            pipe.incrby(counter, len(value))
            if counter not in counters:
                counters.append(counter)
        for counter in counters:
            if "ex" in expiry:
                pipe.expire(counter, expiry["ex"])
            elif "px" in expiry:
                pipe.pexpire(counter, expiry["px"])
        pipe.execute(raise_on_error=False)

    def discard(self, key: str) -> None:
        with self._lock:
            self.corrupt += 1
        if not self._may_try():
            return
        try:
            removed = self._client.delete(key)
        except _OUTAGE_ERRORS as exc:
            self._failed(exc)
            return
        self._answered()
        if removed:
            with self._lock:
                self._entries = max(0, self._entries - 1)

    def make_stats(self) -> ColdStoreStats:
        # entries / used_bytes: what this process wrote (less what it discarded); the server holds
        # what every replica wrote, less what it evicted or expired (its INFO says how much).
        with self._lock:
            return ColdStoreStats(self.name, self._available and not self._closed, self._entries, self.bytes_written,
                                  0, self.hits, self.misses, self.bytes_read, self.bytes_written,
                                  self.blocks_written, self.writes_dropped, 0, self.corrupt, self.errors)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._client.close()
        except _OUTAGE_ERRORS:
            pass
