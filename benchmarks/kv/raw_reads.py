"""The storage's own read rate, next to which the disk and remote KV tiers' loads are judged: the
same bytes read with no format, no checks and no engine, as fast as plain reads go.

- files: the disk tier's block files themselves, out of the page cache, read whole on many threads;
- sequential: one large file written here, out of the page cache, read in 16 MiB chunks on many threads;
- redis: values of the tier's block size written under fresh keys, read back with MGETs of 16 MiB
  on one connection per thread.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from benchmarks.kv.page_cache import evict_page_cache

CHUNK_BYTES = 16 << 20
THREADS = 16


def _rate(nbytes: int, seconds: float) -> dict:
    return {"bytes": nbytes, "seconds": round(seconds, 4), "GB_per_s": round(nbytes / seconds / 1e9, 3)}


def read_files(paths: list[str], threads: int = THREADS) -> dict:
    evict_page_cache(paths)

    def read(path: str) -> int:
        with open(path, "rb", buffering=0) as f:
            return len(f.read())

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(read, paths))
    return {"files": len(paths), "threads": threads, **_rate(nbytes, time.perf_counter() - started)}


def read_sequential(directory: str, nbytes: int, threads: int = THREADS) -> dict:
    path = os.path.join(directory, f"raw-{uuid.uuid4().hex}.bin")
    chunk = os.urandom(CHUNK_BYTES)
    count = max(1, nbytes // CHUNK_BYTES)
    try:
        with open(path, "wb") as f:
            for _ in range(count):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        evict_page_cache([path])
        fd = os.open(path, os.O_RDONLY)
        try:
            def read(index: int) -> int:
                return len(os.pread(fd, CHUNK_BYTES, index * CHUNK_BYTES))

            started = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                total = sum(pool.map(read, range(count)))
            seconds = time.perf_counter() - started
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
    return {"threads": threads, "chunk_bytes": CHUNK_BYTES, **_rate(total, seconds)}


def read_redis(url: str, value_nbytes: int, nbytes: int, threads: int = THREADS) -> dict:
    import redis
    client = redis.Redis.from_url(url)
    value = os.urandom(value_nbytes)
    keys = [f"raw-read:{uuid.uuid4().hex}" for _ in range(max(1, nbytes // value_nbytes))]
    per_call = max(1, CHUNK_BYTES // value_nbytes)
    batches = [keys[i:i + per_call] for i in range(0, len(keys), per_call)]
    try:
        for batch in batches:
            client.mset({key: value for key in batch})
        clients = [redis.Redis.from_url(url) for _ in range(threads)]

        def read(index: int) -> int:
            values = clients[index % threads].mget(batches[index])
            return sum(len(v) for v in values if v is not None)

        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, range(len(batches))))
        seconds = time.perf_counter() - started
    finally:
        for batch in batches:
            client.delete(*batch)
    return {"threads": threads, "value_bytes": value_nbytes, "values": len(keys), **_rate(total, seconds)}
