"""RedisStore against a real redis-server (tests/redis_fixture.py): round trips, TTLs, tenant quotas,
a full server (evicting and refusing), and an outage (killed, hung, restarted)."""

from __future__ import annotations

import logging
import time

import pytest
from redis_fixture import RedisServers

from kvserve.kvstore.cold_store import ColdStore, block_key
from kvserve.kvstore.redis_store import RedisStore, quota_key

LOGGER = "kvserve.kvstore.redis_store"


def key(i: int, namespace: str = "tenant-a") -> str:
    return block_key("model-fp", "bf16", 16, namespace, i.to_bytes(16, "little"))


def value(i: int, size: int = 1000) -> bytes:
    return bytes([i % 251]) * size + i.to_bytes(8, "little")


def timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


@pytest.fixture
def redis_server_factory():
    """`factory(maxmemory=..., policy=...)` starts a redis-server; all are stopped after the test."""
    with RedisServers() as servers:
        yield servers.start


@pytest.fixture
def redis_server(redis_server_factory):
    return redis_server_factory()


@pytest.fixture
def stores():
    made: list[RedisStore] = []

    def make(url: str, **options) -> RedisStore:
        store = RedisStore(url, **options)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def test_round_trip_and_contains(redis_server, stores):
    store = stores(redis_server.url)
    assert isinstance(store, ColdStore) and store.name == "remote"
    items = [(key(i), value(i), "tenant-a") for i in range(5)]
    assert store.put_many(items) == 5
    got = store.get_many([key(i) for i in range(7)])
    assert got[:5] == [value(i) for i in range(5)]
    assert got[5:] == [None, None]
    assert store.contains_many([key(4), key(5), key(0)]) == [True, False, True]
    assert store.get_many([]) == [] and store.contains_many([]) == [] and store.put_many([]) == 0

    # Stored as they are, under their keys: another replica (a plain client) sees the same bytes.
    assert redis_server.client().get(key(3)) == value(3)
    assert redis_server.client().ttl(key(3)) == -1          # no TTL configured: none set

    store.discard(key(0))
    assert store.get_many([key(0)]) == [None]
    stats = store.make_stats()
    assert stats.available and stats.name == "remote" and stats.capacity_bytes == 0
    assert (stats.blocks_written, stats.entries) == (5, 4)
    assert stats.bytes_written == stats.used_bytes == sum(len(value(i)) for i in range(5))
    assert (stats.hits, stats.misses) == (5, 3)
    assert stats.bytes_read == sum(len(value(i)) for i in range(5))
    assert (stats.corrupt, stats.errors, stats.writes_dropped, stats.evictions) == (1, 0, 0, 0)


def test_ttl_is_set_on_blocks_and_quota_counters(redis_server, stores):
    store = stores(redis_server.url, ttl_s=120, tenant_quota_bytes=10**9)
    assert store.put_many([(key(i), value(i), "tenant-a") for i in range(3)]) == 3
    client = redis_server.client()
    for i in range(3):
        assert 110 <= client.ttl(key(i)) <= 120
    assert 110 <= client.ttl(quota_key("tenant-a")) <= 120
    assert int(client.get(quota_key("tenant-a"))) == 3 * len(value(0))

    fractional = stores(redis_server.url, ttl_s=30.5)
    assert fractional.put_many([(key(9), value(9), "tenant-a")]) == 1
    assert 29_000 <= client.pttl(key(9)) <= 30_500


def test_a_block_already_stored_is_not_rewritten_nor_charged_again(redis_server, stores):
    """A replica that recomputed a block another one stored: the SET is skipped (NX), so neither
    the value, its TTL nor the namespace's quota counter changes."""
    store = stores(redis_server.url, ttl_s=120, tenant_quota_bytes=10**9)
    assert store.put_many([(key(1), value(1), "tenant-a")]) == 1
    client = redis_server.client()
    client.expire(key(1), 50)
    other = stores(redis_server.url, ttl_s=120, tenant_quota_bytes=10**9)
    assert other.put_many([(key(1), value(2), "tenant-a"), (key(2), value(2), "tenant-a")]) == 1
    assert client.get(key(1)) == value(1) and client.ttl(key(1)) <= 50
    assert int(client.get(quota_key("tenant-a"))) == len(value(1)) + len(value(2))
    assert other.make_stats().writes_dropped == 0 and other.make_stats().blocks_written == 1


def test_tenant_quota_drops_writes_past_it(redis_server, stores):
    size = len(value(0))
    store = stores(redis_server.url, tenant_quota_bytes=3 * size)
    # Below the quota until the third value lands: the fourth and later are dropped, in one call
    # and in later calls alike.
    assert store.put_many([(key(i), value(i), "tenant-a") for i in range(5)]) == 3
    assert store.put_many([(key(5), value(5), "tenant-a")]) == 0
    assert store.contains_many([key(i) for i in range(6)]) == [True] * 3 + [False] * 3
    assert store.make_stats().writes_dropped == 3

    # Another namespace has a quota of its own.
    assert store.put_many([(key(i, "tenant-b"), value(i), "tenant-b") for i in range(2)]) == 2
    assert store.get_many([key(1, "tenant-b")]) == [value(1)]

    # The counter lives in Redis: another replica (another store on the same server) sees it.
    other = stores(redis_server.url, tenant_quota_bytes=3 * size)
    assert other.put_many([(key(7), value(7), "tenant-a"), (key(7, "tenant-b"), value(7), "tenant-b")]) == 1
    assert other.contains_many([key(7), key(7, "tenant-b")]) == [False, True]
    stats = store.make_stats()
    assert stats.available and stats.errors == 0 and stats.blocks_written == 5


def test_full_server_with_lru_evicts_and_never_raises(redis_server_factory, stores):
    server = redis_server_factory(maxmemory="1mb", policy="allkeys-lru")
    store = stores(server.url)
    written = 0
    for batch in range(40):
        written += store.put_many([(key(batch * 10 + i), value(i, 10_000), "tenant-a") for i in range(10)])
    stats = store.make_stats()
    assert server.proc.poll() is None and server.client().ping()
    assert stats.available and stats.errors == 0
    assert written == stats.blocks_written and written > 0
    assert written + stats.writes_dropped == 400
    info = server.client().info()
    assert info["evicted_keys"] > 0                          # Redis made room by itself
    assert info["used_memory"] < 2 * 1024 * 1024
    assert server.client().dbsize() < 400


def test_full_server_without_eviction_drops_writes_not_the_tier(redis_server_factory, stores, caplog):
    server = redis_server_factory(maxmemory="1mb", policy="noeviction")
    store = stores(server.url)
    caplog.set_level(logging.INFO, logger=LOGGER)
    written = 0
    for batch in range(40):
        written += store.put_many([(key(batch * 10 + i), value(i, 10_000), "tenant-a") for i in range(10)])
    stats = store.make_stats()
    assert written > 0 and stats.writes_dropped > 0                 # refused with OOM: dropped
    assert written + stats.writes_dropped == 400
    assert stats.available and stats.errors == 0                    # not an outage
    got = store.get_many([key(n) for n in range(400)])              # reads go on
    assert sum(v is not None for v in got) == written
    assert all(v == value(n % 10, 10_000) for n, v in enumerate(got) if v is not None)
    assert store.make_stats().hits == written
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_killed_server_answers_misses_fast_then_comes_back(redis_server, stores, caplog):
    store = stores(redis_server.url, timeout_s=0.5, retry_after_s=1.0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert store.put_many([(key(1), value(1), "tenant-a")]) == 1

    redis_server.kill()
    for _ in range(3):
        got, took = timed(store.get_many, [key(1), key(2)])
        assert got == [None, None] and took < 1.5
        present, took = timed(store.contains_many, [key(1)])
        assert present == [False] and took < 1.5
        written, took = timed(store.put_many, [(key(3), value(3), "tenant-a")])
        assert written == 0 and took < 1.5
        _, took = timed(store.discard, key(1))
        assert took < 1.5
    stats = store.make_stats()
    assert not stats.available
    assert stats.errors == 1          # one attempt, then misses without the network until the retry
    assert stats.writes_dropped == 3 and stats.misses == 6 and stats.hits == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert redis_server.url in warnings[0].getMessage()

    # Still down after the retry interval: one more attempt, no second warning.
    time.sleep(1.1)
    assert store.get_many([key(1)]) == [None]
    assert store.make_stats().errors == 2
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    redis_server.restart()            # same port, empty (no persistence)
    assert store.get_many([key(1)]) == [None]              # within the retry interval: not tried
    assert not store.make_stats().available
    time.sleep(1.1)
    assert store.put_many([(key(4), value(4), "tenant-a")]) == 1
    assert store.get_many([key(4)]) == [value(4)]
    stats = store.make_stats()
    assert stats.available and stats.errors == 2
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "back" in r.getMessage()]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_hung_server_costs_one_timeout_per_retry_interval(redis_server, stores, caplog):
    store = stores(redis_server.url, timeout_s=0.5, retry_after_s=30.0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert store.put_many([(key(1), value(1), "tenant-a")]) == 1
    redis_server.pause()              # accepts connections, never answers
    try:
        got, took = timed(store.get_many, [key(1)])
        assert got == [None] and 0.4 < took < 1.5             # the socket timeout
        start = time.monotonic()
        for i in range(20):
            assert store.get_many([key(1)]) == [None]
            assert store.put_many([(key(i), value(i), "tenant-a")]) == 0
        assert time.monotonic() - start < 0.5                 # no network while down
    finally:
        redis_server.resume()
    stats = store.make_stats()
    assert not stats.available and stats.errors == 1 and stats.writes_dropped == 20
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_many_threads_share_one_store(redis_server, stores):
    from concurrent.futures import ThreadPoolExecutor

    store = stores(redis_server.url)

    def work(t: int) -> bool:
        items = [(key(t * 100 + i), value(t * 100 + i), "tenant-a") for i in range(20)]
        ok = store.put_many(items) == 20
        return ok and store.get_many([k for k, _, _ in items]) == [v for _, v, _ in items]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(16)))
    stats = store.make_stats()
    assert stats.blocks_written == 320 and stats.hits == 320 and stats.errors == 0


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "127.0.0.1:6379", "memcached://host:11211", ""])
def test_bad_url_is_refused_by_name(url):
    with pytest.raises(ValueError, match="not a Redis URL") as info:
        RedisStore(url)
    assert repr(url) in str(info.value)


def test_bad_port_is_refused_and_password_not_shown():
    with pytest.raises(ValueError) as info:
        RedisStore("redis://user:s3cret@127.0.0.1:notaport/0")
    assert "s3cret" not in str(info.value) and "127.0.0.1" in str(info.value)


def test_unix_socket_url_is_accepted():
    store = RedisStore("unix:///nonexistent/redis.sock", timeout_s=0.2)
    try:
        assert store.get_many([key(1)]) == [None]
        assert store.make_stats().errors == 1 and not store.make_stats().available
    finally:
        store.close()


def test_writes_go_in_pipelines_of_bounded_bytes(redis_server, stores, monkeypatch):
    """A long prefix is several round trips, each under the timeout, not one of gigabytes."""
    from kvserve.kvstore import redis_store
    monkeypatch.setattr(redis_store, "PIPELINE_BYTES", 2500)        # two 1008-byte values per pipeline
    store = stores(redis_server.url)
    pipelines = []
    real_pipeline = store._client.pipeline
    monkeypatch.setattr(store._client, "pipeline", lambda **kw: pipelines.append(1) or real_pipeline(**kw))
    assert store.put_many([(key(i), value(i), "tenant-a") for i in range(7)]) == 7
    assert len(pipelines) == 4
    assert store.get_many([key(i) for i in range(7)]) == [value(i) for i in range(7)]


def test_the_c_reply_parser_is_installed():
    """hiredis (redis[hiredis] in pyproject.toml) reads large values ~3x faster than redis-py's own parser."""
    from redis.utils import HIREDIS_AVAILABLE
    assert HIREDIS_AVAILABLE
