"""The page cache around the disk KV tier's files, for benchmarks that read them cold or warm."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from typing import Optional


def block_files(disk_dir: str) -> list[str]:
    """The disk tier's block files (kvserve/kvstore/disk_store.py's layout)."""
    return sorted(glob.glob(os.path.join(disk_dir, "*", "*.kvb")))


def evict_page_cache(paths: list[str]) -> None:
    """posix_fadvise(DONTNEED) on each file, after a sync (dirty pages, fresh writes, are not dropped)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches(paths: list[str]) -> str:
    """Empties the page cache: drop_caches (also the dentry and inode caches) where allowed (root),
    else `evict_page_cache(paths)`; returns which it was."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        evict_page_cache(paths)
        return "fadvise"


def load_page_cache(paths: list[str]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 22):
                pass


def resident_fraction(paths: list[str]) -> Optional[float]:
    """Fraction of the files' bytes in the page cache (util-linux fincore), None without it."""
    if not paths or shutil.which("fincore") is None:
        return None
    resident = total = 0
    for start in range(0, len(paths), 200):
        done = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE",
                               *paths[start:start + 200]], capture_output=True, text=True)
        if done.returncode:
            return None
        for line in done.stdout.split("\n"):
            if line.strip():
                res, size = line.split()
                resident += int(res)
                total += int(size)
    return round(resident / total, 4) if total else None
