"""The disk KV tier's bytes: one file per block in a directory, under a size cap, surviving restarts.

A file is named by its key (`cold_store.block_key`), in one of 256 subdirectories (the key's last
two hex digits) so no directory grows past what a file system lists quickly. A write goes to a
temporary file that `os.replace` renames into place, so a reader sees a whole file or none; a file
torn by a crash mid-write, or damaged later, fails its checksum on read (`cold_block.decode_block`)
and is removed as a miss.

At start the index (key -> size, least recently used first, by file modification time) is rebuilt
from the directory on a background thread within `scan_budget_s`; until a file is indexed it can
still be read (a lookup opens the file by name), only the size cap does not count it yet. Files
whose header cannot be read are removed, and so are temporary files a crashed writer left: those
modified over a second before this store opened (one written since is a write in flight, here or in another
process sharing the directory, and removing it would drop that write). Over the cap, least recently used files go first. A full
disk (ENOSPC, EDQUOT) stops writes, not the server: writes are dropped (counted) until
`retry_after_s` has passed, then tried again.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from typing import Optional, Sequence

from kvserve.kvstore.cold_block import ColdBlockError, header_nbytes, read_identity
from kvserve.stats import ColdStoreStats

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Enough for a header with a block of up to a few hundred tokens; a longer header is read whole.
_HEADER_PROBE = 8192


class DiskStore:
    name = "disk"

    def __init__(self, path: str, capacity_bytes: int, retry_after_s: float = 10.0,
                 scan_budget_s: float = 30.0) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the disk KV tier needs a size above 0 (--kv-disk-size), got {capacity_bytes}")
        self.path = os.path.abspath(path)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--kv-disk-path {path}: cannot create it ({exc.strerror})") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise ValueError(f"--kv-disk-path {path}: not writable")
        self.capacity_bytes = capacity_bytes
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()     # key -> file size, least recently used first
        self._used = 0
        self._full_until = 0.0
        self.hits = self.misses = self.bytes_read = self.bytes_written = self.blocks_written = 0
        self.writes_dropped = self.evictions = self.corrupt = self.errors = 0
        self.scan_done = threading.Event()
        # Wall clock, as files' modification times are; a second early because file systems stamp
        # times from a coarse clock that may lag time.time() (a leftover younger than that waits for
        # the next start).
        self._tmp_cutoff = time.time() - 1.0
        self._scanner = threading.Thread(target=self._scan, args=(scan_budget_s,), name="kv-disk-scan", daemon=True)
        self._scanner.start()

    # --- layout ---------------------------------------------------------------------------------
    def file_of(self, key: str) -> str:
        name = key.replace(":", "-")
        return os.path.join(self.path, name[-2:], name + SUFFIX)

    @staticmethod
    def _key_of(file_name: str) -> str:
        return file_name[:-len(SUFFIX)].replace("-", ":")

    # --- the index, rebuilt at start ----------------------------------------------------------------
    def _scan(self, budget_s: float) -> None:
        deadline = time.monotonic() + budget_s
        found: list[tuple[float, str, int]] = []
        removed = 0
        try:
            for sub in os.scandir(self.path):
                if not sub.is_dir():
                    continue
                for entry in os.scandir(sub.path):
                    if time.monotonic() > deadline:
                        logger.warning("disk KV tier: index rebuild stopped after %.0f s (%d files indexed); "
                                       "the rest are still read, not counted against the size cap",
                                       budget_s, len(found))
                        raise StopIteration
                    if entry.name.startswith(".tmp-"):
                        self._remove_if_left_by_a_crash(entry.path)
                        continue
                    if not entry.name.endswith(SUFFIX):
                        continue
                    readable = self._header_readable(entry.path)
                    if readable is None:
                        continue                       # removed meanwhile (a reader found it damaged)
                    if not readable:
                        removed += self._remove(entry.path)     # a reader may have removed it first
                        continue
                    stat = entry.stat()
                    found.append((stat.st_mtime, self._key_of(entry.name), stat.st_size))
        except StopIteration:
            pass
        except OSError as exc:
            logger.warning("disk KV tier: index rebuild failed: %s", exc)
        found.sort()
        with self._lock:
            known = self._index
            self._index = OrderedDict((key, size) for _, key, size in found if key not in known)
            self._index.update(known)         # written or read since start: more recent
            self._used = sum(self._index.values())
            self.corrupt += removed
            victims = self._evict_locked(0)     # an earlier run under a larger cap
        for victim in victims:
            self._remove(self.file_of(victim))
        if found or removed:
            logger.info("disk KV tier at %s: %d blocks (%.1f MiB) from an earlier run, %d unreadable removed",
                        self.path, len(found), sum(size for _, _, size in found) / 2**20, removed)
        self.scan_done.set()

    def _remove_if_left_by_a_crash(self, path: str) -> None:
        try:
            if os.stat(path).st_mtime < self._tmp_cutoff:
                self._remove(path)
        except FileNotFoundError:
            pass                                   # renamed into place meanwhile

    @staticmethod
    def _header_readable(path: str) -> Optional[bool]:
        """Whether the file's header parses; None if the file is gone."""
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER_PROBE)
                need = header_nbytes(head) if len(head) >= 10 else _HEADER_PROBE + 1
                if need > len(head):
                    head += f.read(need - len(head))
            read_identity(head)
            return True
        except FileNotFoundError:
            return None
        except (OSError, ColdBlockError, ValueError, IndexError):
            return False

    # --- ColdStore ----------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        values: list[Optional[bytes]] = []
        for key in keys:
            try:
                with open(self.file_of(key), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                data = None
            except OSError as exc:
                logger.warning("disk KV tier: reading %s failed: %s", self.file_of(key), exc)
                with self._lock:
                    self.errors += 1
                data = None
            with self._lock:
                if data is None:
                    self.misses += 1
                else:
                    self.hits += 1
                    self.bytes_read += len(data)
                    if key in self._index:
                        self._index.move_to_end(key)
                    else:                                  # not scanned yet, or another process's
                        self._index[key] = len(data)
                        self._used += len(data)
            values.append(data)
        return values

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self.file_of(key)) for key in keys]

    def put_many(self, items: Sequence[tuple[str, bytes, str]]) -> int:
        written = 0
        for key, value, _namespace in items:
            if self._write(key, value):
                written += 1
        return written

    def _write(self, key: str, value: bytes) -> bool:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True                          # a block is immutable: one copy is enough
            if len(value) > self.capacity_bytes or time.monotonic() < self._full_until:
                self.writes_dropped += 1
                return False
            victims = self._evict_locked(len(value))
        for victim in victims:
            self._remove(self.file_of(victim))
        path = self.file_of(key)
        tmp = os.path.join(os.path.dirname(path), f".tmp-{uuid.uuid4().hex}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except OSError as exc:
            self._remove(tmp)
            with self._lock:
                self.writes_dropped += 1
                if exc.errno in _FULL_ERRNOS:
                    if time.monotonic() >= self._full_until:
                        logger.warning("disk KV tier at %s: the disk is full; writes stop for %.0f s",
                                       self.path, self.retry_after_s)
                    self._full_until = time.monotonic() + self.retry_after_s
                else:
                    self.errors += 1
                    logger.warning("disk KV tier: writing %s failed: %s", path, exc)
            return False
        with self._lock:
            self._index[key] = len(value)
            self._used += len(value)
            self.bytes_written += len(value)
            self.blocks_written += 1
        return True

    def _evict_locked(self, incoming: int) -> list[str]:
        """Drops least recently used entries from the index until `incoming` more bytes fit; returns
        their keys (the caller removes the files outside the lock)."""
        victims = []
        while self._index and self._used + incoming > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self.evictions += 1
            victims.append(key)
        return victims

    def discard(self, key: str) -> None:
        # Counted by whoever removes the file: the start-up index rebuild may find it first.
        removed = self._remove(self.file_of(key))
        with self._lock:
            self.corrupt += removed
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    @staticmethod
    def _remove(path: str) -> bool:
        """Whether this call removed the file (False: it was gone already, or cannot be removed)."""
        try:
            os.remove(path)
            return True
        except OSError:
            return False

    def make_stats(self) -> ColdStoreStats:
        with self._lock:
            return ColdStoreStats("disk", time.monotonic() >= self._full_until, len(self._index), self._used,
                                  self.capacity_bytes, self.hits, self.misses, self.bytes_read, self.bytes_written,
                                  self.blocks_written, self.writes_dropped, self.evictions, self.corrupt,
                                  self.errors)

    def close(self) -> None:
        self._scanner.join(timeout=1.0)
