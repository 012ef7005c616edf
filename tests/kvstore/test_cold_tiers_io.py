"""ColdTiers' reads and writes on a real disk store: a prefix is read in chunks spread over several
threads and stops at the first bad block; each store writes on its own threads, so a stalled store
never holds another back; HostRows takes the read payloads without stacking them."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from kvserve.kvstore import cold_tier
from kvserve.kvstore.cold_block import BlockIdentity, encode_block
from kvserve.kvstore.cold_tier import ColdTiers
from kvserve.kvstore.disk_store import DiskStore
from kvserve.kvstore.host_rows import HostRows

PAYLOAD = 4096


def _identities(count: int) -> list[BlockIdentity]:
    out, parent = [], b"root"
    for index in range(count):
        block_hash = index.to_bytes(4, "little") * 4
        out.append(BlockIdentity("model", "bf16", 16, "tenant", block_hash, parent, tuple(range(index, index + 16))))
        parent = block_hash
    return out


def _payloads(count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes() for _ in range(count)]


class CountingDisk(DiskStore):
    """A real disk store that records how many reads run at once (each one held `delay_s`)."""

    def __init__(self, path, delay_s: float = 0.0) -> None:
        super().__init__(path, 64 << 20)
        self.delay_s = delay_s
        self.active = self.most_active = self.calls = 0
        self._count_lock = threading.Lock()

    def get_many(self, keys):
        with self._count_lock:
            self.active += 1
            self.calls += 1
            self.most_active = max(self.most_active, self.active)
        try:
            time.sleep(self.delay_s)
            return super().get_many(keys)
        finally:
            with self._count_lock:
                self.active -= 1


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(cold_tier, "READ_CHUNK_BYTES", 4 * PAYLOAD)      # 4 blocks per store call


def test_a_prefix_is_read_in_chunks_on_several_threads_in_order(tmp_path, small_chunks):
    disk = CountingDisk(str(tmp_path), delay_s=0.05)
    tiers = ColdTiers([disk], PAYLOAD, reads_in_flight=4)
    identities, payloads = _identities(32), _payloads(32)
    tiers.persist(list(zip(identities, payloads)))
    assert tiers.flush(10.0)
    started = time.perf_counter()
    got, sources = tiers.read(identities)
    seconds = time.perf_counter() - started
    assert [bytes(p) for p in got] == payloads and sources == ["disk"] * 32
    assert disk.calls == 8 and disk.most_active == 4
    assert seconds < 8 * 0.05            # one chunk after another would take 0.4 s
    tiers.close()


@pytest.mark.parametrize("bad", [5, 13])      # inside the second chunk; inside the fourth
def test_a_read_stops_at_the_first_damaged_block_and_removes_it(tmp_path, small_chunks, bad):
    disk = CountingDisk(str(tmp_path))
    tiers = ColdTiers([disk], PAYLOAD, reads_in_flight=4)
    identities, payloads = _identities(24), _payloads(24)
    tiers.persist(list(zip(identities, payloads)))
    assert tiers.flush(10.0)
    path = disk.file_of(tiers.key_of(identities[bad]))
    data = bytearray(open(path, "rb").read())
    data[-20] ^= 0xFF
    open(path, "wb").write(bytes(data))
    got, _ = tiers.read(identities)
    assert [bytes(p) for p in got] == payloads[:bad]
    assert disk.make_stats().corrupt == 1
    assert not disk.contains_many([tiers.key_of(identities[bad])])[0]
    tiers.close()


def test_a_read_stops_at_the_first_missing_block(tmp_path, small_chunks):
    disk = CountingDisk(str(tmp_path))
    tiers = ColdTiers([disk], PAYLOAD)
    identities, payloads = _identities(12), _payloads(12)
    tiers.persist([pair for index, pair in enumerate(zip(identities, payloads)) if index != 9])
    assert tiers.flush(10.0)
    got, _ = tiers.read(identities)
    assert [bytes(p) for p in got] == payloads[:9]
    tiers.close()


class StalledDisk(DiskStore):
    """A real disk store whose writes wait until `release` is set (a slow remote, say)."""

    def __init__(self, path) -> None:
        super().__init__(path, 64 << 20)
        self.name = "remote"
        self.release = threading.Event()

    def put_many(self, items):
        self.release.wait(10.0)
        return super().put_many(items)


def test_a_stalled_store_does_not_hold_back_the_others_writes(tmp_path):
    fast = DiskStore(str(tmp_path / "fast"), 64 << 20)
    stalled = StalledDisk(str(tmp_path / "stalled"))
    tiers = ColdTiers([fast, stalled], PAYLOAD, max_pending_writes=10)
    identities, payloads = _identities(8), _payloads(8)
    tiers.persist(list(zip(identities, payloads)))
    deadline = time.monotonic() + 5.0
    while fast.make_stats().blocks_written < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fast.make_stats().blocks_written == 8
    assert stalled.make_stats().blocks_written == 0 and tiers.writes_in_flight
    # The stalled store's queue is full past its bound: its share is dropped, the fast one's is not.
    more, more_payloads = _identities(12)[8:], _payloads(12)[8:]
    tiers.persist(list(zip(more, more_payloads)))
    assert tiers.writes_dropped == 2
    stalled.release.set()
    assert tiers.flush(10.0)
    assert fast.make_stats().blocks_written == 12 and stalled.make_stats().blocks_written == 10
    tiers.close()


def test_host_rows_write_rows_matches_scatter():
    rows = HostRows(10, 64, segment_blocks=4, pin_memory=False)
    payloads = [bytes([i]) * 64 for i in range(5)]
    ids = [9, 0, 3, 4, 7]                     # across segments, out of order
    rows.write_rows(ids, [memoryview(p) for p in payloads])
    expected = HostRows(10, 64, segment_blocks=4, pin_memory=False)
    expected.scatter(ids, torch.tensor([list(p) for p in payloads], dtype=torch.uint8))
    assert torch.equal(rows.gather(list(range(10))), expected.gather(list(range(10))))
    assert torch.equal(rows.gather([3]), torch.full((1, 64), 2, dtype=torch.uint8))


def _prefetched(tiers: ColdTiers, identities, compute_s=None):
    """The prefetch's pieces joined (checked: in prefix order, the last one final)."""
    from kvserve.kvstore.cold_tier import ColdRead
    tiers.prefetch("r", identities, compute_s)
    pieces = []
    while not pieces or not pieces[-1].final:
        got = tiers.wait(10.0)
        assert got, "the prefetch did not finish"
        pieces += got
    assert all(not p.final for p in pieces[:-1])
    ids = [i for p in pieces for i in p.identities]
    assert ids == list(identities[:len(ids)])
    return ColdRead("r", ids, [x for p in pieces for x in p.payloads], [x for p in pieces for x in p.sources],
                    pieces[-1].seconds, pieces[-1].skipped)


class SlowDisk(CountingDisk):
    name = "remote"


def test_a_read_measured_slower_than_computing_is_not_started_per_store(tmp_path):
    fast = CountingDisk(str(tmp_path / "fast"))
    slow = SlowDisk(str(tmp_path / "slow"), delay_s=0.2)
    tiers = ColdTiers([fast, slow], PAYLOAD)
    identities, payloads = _identities(8), _payloads(8)
    # Blocks 0-3 on the fast store only, 4-7 on the slow one only (written there directly).
    fast.put_many([(tiers.key_of(i), encode_block(i, p), i.namespace) for i, p in zip(identities[:4], payloads)])
    slow.put_many([(tiers.key_of(i), encode_block(i, p), i.namespace) for i, p in zip(identities[4:], payloads[4:])])
    first, second = [identities[:4]], [identities[4:]]
    # Unknown rates: both are read, and their rates measured.
    assert len(_prefetched(tiers, first[0], compute_s=1e-9).payloads) == 4
    assert len(_prefetched(tiers, second[0], compute_s=1e-9).payloads) == 4
    assert tiers.read_rates["remote"] < tiers.read_rates["disk"]
    # Computing takes 0.05 s: the slow store's read (0.2 s a call) is not started, the fast one's is.
    calls = slow.calls
    skipped = _prefetched(tiers, second[0], compute_s=0.05)
    assert skipped.skipped and not skipped.payloads and slow.calls == calls
    assert len(_prefetched(tiers, first[0], compute_s=0.05).payloads) == 4
    assert len(_prefetched(tiers, second[0], compute_s=10.0).payloads) == 4     # slower to compute: read
    assert tiers.prefetches_skipped == 1
    tiers.close()


def test_a_prefetch_arrives_chunk_by_chunk_before_its_end(tmp_path, small_chunks):
    disk = CountingDisk(str(tmp_path), delay_s=0.05)
    tiers = ColdTiers([disk], PAYLOAD, reads_in_flight=1)       # one chunk after another
    identities, payloads = _identities(16), _payloads(16)
    tiers.persist(list(zip(identities, payloads)))
    assert tiers.flush(10.0)
    tiers.prefetch("r", identities)
    first = tiers.wait(10.0)
    assert first and not first[0].final and len(first[0].payloads) == 4      # the first chunk, early
    whole = first
    while not whole[-1].final:
        whole += tiers.wait(10.0)
    assert [bytes(p) for r in whole for p in r.payloads] == payloads
    assert [i for r in whole for i in r.identities] == identities
    tiers.close()


def test_the_start_scan_removes_a_crashed_write_but_not_one_in_flight(tmp_path):
    """A temporary file older than the store is a crash's leftover; one written since is a write
    in flight (here: this process's own first writes, racing the scan) and must survive it."""
    sub = tmp_path / "ab"
    sub.mkdir()
    leftover, in_flight = sub / ".tmp-crashed", sub / ".tmp-writing"
    leftover.write_bytes(b"x" * 10)
    in_flight.write_bytes(b"y" * 10)
    os.utime(leftover, (time.time() - 3600, time.time() - 3600))
    os.utime(in_flight, (time.time() + 60, time.time() + 60))
    disk = DiskStore(str(tmp_path), 64 << 20)
    assert disk.scan_done.wait(10.0)
    assert not leftover.exists() and in_flight.exists()
    disk.close()
