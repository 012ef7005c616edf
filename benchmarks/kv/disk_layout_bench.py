"""Which disk layout for the disk KV tier is faster: one file per block (what
kvserve/kvstore/disk_store.py does) or append-only segment files with an in-memory index.

No engine: `--blocks` blocks (default 2000) of `--block-bytes` bytes (default 737,280 = the default
model's block: 16 tokens x 46,080 KV bytes per token, SmolLM2-135M with an fp32 KV cache, as
`LLM().engine.kv_bytes_per_token` reports; the disk tier's files add a ~190-byte header), random
payloads (a pool of 64 distinct random blocks, block i is pool[i % 64]: ext4 neither compresses nor
deduplicates, so this writes what distinct payloads would), written and read back two ways:

    file      one file per block in 256 subdirectories (the key's last two hex digits), each written
              to a temporary file and renamed into place (os.replace, no fsync), read with
              open().read(): DiskStore's write and read paths
    segment   append-only segment files of `--segment-mib` MiB (default 64), os.write of each block at
              the end of the open segment, an in-memory index key -> (segment, offset, length);
              read with os.pread on segments kept open (a new bytes object per block, as
              DiskStore.get_many returns); "segment coalesced" reads a run of `--run-blocks`
              consecutive blocks (one prompt's prefix, written together) with one os.preadv into a
              buffer allocated before the timing and reused for every run (what reading straight
              into host-tier memory would do)

Writes: throughput of the writes themselves (into the page cache, as DiskStore leaves them) and
with a final sync (the bytes on the device). Reads, in write order (a prefix's blocks, as a
prefetch reads them) and in random order: from the device (the page cache emptied first: `sync;
echo 3 > /proc/sys/vm/drop_caches` when allowed, else posix_fadvise DONTNEED on every file; the
JSON says which, and how much of the files was still cached, by util-linux fincore) and from the
page cache. Also the file layout's start-up cost: listing and stat-ing every file with the dentry
and inode caches dropped (what DiskStore's index rebuild does before reading headers). The layouts
alternate over `--rounds` rounds (default 4); each number is the median over rounds, with the
range; "faster" is the layout with the higher median when it is at least 10% higher ("tie"
otherwise), and the table says when the two layouts' ranges overlap (the VM's disk varies a lot
from one round to the next).

    python benchmarks/kv/disk_layout_bench.py --json benchmarks/results/kv/cpu_disk_layout_2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from typing import Callable, Optional

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)

from benchmarks.kv.page_cache import drop_caches, resident_fraction  # noqa: E402
from kvserve.eval.timing import now  # noqa: E402

DEFAULT_BLOCK_BYTES = 16 * 46080          # SmolLM2-135M-Instruct, fp32 KV: 46,080 bytes per token, 16-token blocks
POOL = 64


def key_of(i: int) -> str:
    return f"{(i * 0x9E3779B97F4A7C15) & (2**64 - 1):016x}{i:08x}"


# --------------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------------

class FileLayout:
    name = "file"

    def __init__(self, root: str) -> None:
        self.root = root

    def path_of(self, key: str) -> str:
        return os.path.join(self.root, key[-2:], key + ".kvb")

    def write(self, keys: list[str], payload: Callable[[int], bytes]) -> None:
        made = set()
        for i, key in enumerate(keys):
            path = self.path_of(key)
            directory = os.path.dirname(path)
            if directory not in made:
                os.makedirs(directory, exist_ok=True)
                made.add(directory)
            tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
            with open(tmp, "wb") as f:
                f.write(payload(i))
            os.replace(tmp, path)

    def read(self, keys: list[str]) -> int:
        nbytes = 0
        for key in keys:
            with open(self.path_of(key), "rb") as f:
                nbytes += len(f.read())
        return nbytes

    def files(self) -> list[str]:
        return [os.path.join(d.path, e.name) for d in os.scandir(self.root) if d.is_dir()
                for e in os.scandir(d.path) if e.name.endswith(".kvb")]

    def list_and_stat(self) -> int:
        count = 0
        for sub in os.scandir(self.root):
            if sub.is_dir():
                for entry in os.scandir(sub.path):
                    entry.stat()
                    count += 1
        return count

    def close(self) -> None:
        pass


class SegmentLayout:
    name = "segment"

    def __init__(self, root: str, segment_bytes: int) -> None:
        self.root = root
        self.segment_bytes = segment_bytes
        self.index: dict[str, tuple[int, int, int]] = {}       # key -> (segment, offset, length)
        self.fds: list[int] = []
        self.run_buffer: Optional[memoryview] = None      # read_runs' buffer, allocated (and touched) untimed
        os.makedirs(root, exist_ok=True)

    def _segment_path(self, number: int) -> str:
        return os.path.join(self.root, f"segment-{number:06d}.seg")

    def write(self, keys: list[str], payload: Callable[[int], bytes]) -> None:
        fd, number, offset = -1, -1, 0
        for i, key in enumerate(keys):
            data = payload(i)
            if fd < 0 or offset + len(data) > self.segment_bytes:
                if fd >= 0:
                    os.close(fd)
                number += 1
                fd = os.open(self._segment_path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                offset = 0
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            self.index[key] = (number, offset, len(data))
            offset += len(data)
        if fd >= 0:
            os.close(fd)

    def _open(self) -> None:
        if not self.fds:
            self.fds = [os.open(p, os.O_RDONLY) for p in self.files()]

    def read(self, keys: list[str]) -> int:
        self._open()
        nbytes = 0
        for key in keys:
            number, offset, length = self.index[key]
            nbytes += len(os.pread(self.fds[number], length, offset))
        return nbytes

    def read_runs(self, keys: list[str], run: int) -> int:
        """Consecutive blocks of one segment with one preadv each (keys in write order), into one
        buffer reused for every run (as a read straight into host-tier memory would be)."""
        self._open()
        nbytes = 0
        buffer = self.run_buffer
        for start in range(0, len(keys), run):
            group = [self.index[k] for k in keys[start:start + run]]
            size = sum(length for _, _, length in group)
            if buffer is None or len(buffer) < size:
                buffer = memoryview(bytearray(size))
            i = at = 0
            while i < len(group):
                number, offset, length = group[i]
                end, j = offset + length, i + 1
                while j < len(group) and group[j][0] == number and group[j][1] == end:
                    end += group[j][2]
                    j += 1
                nbytes += os.preadv(self.fds[number], [buffer[at:at + end - offset]], offset)
                at += end - offset
                i = j
        return nbytes

    def files(self) -> list[str]:
        return sorted(os.path.join(self.root, n) for n in os.listdir(self.root) if n.endswith(".seg"))

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


# --------------------------------------------------------------------------------------------------

def one_round(layout, keys: list[str], payload: Callable[[int], bytes], block_bytes: int, run: int,
              evict: bool) -> dict:
    n = len(keys)
    total = n * block_bytes
    out: dict = {}

    def rate(seconds: float, nbytes: int = total, blocks: int = n) -> dict:
        return {"seconds": round(seconds, 4), "MB_per_s": round(nbytes / seconds / 1e6, 1),
                "blocks_per_s": round(blocks / seconds, 1)}

    os.sync()
    start = now()
    layout.write(keys, payload)
    written = now() - start
    os.sync()
    synced = now() - start
    out["write"] = rate(written)
    out["write_and_sync"] = rate(synced)
    files = layout.files()
    out["files"] = len(files)
    shuffled = keys[:]
    random.Random(1).shuffle(shuffled)
    reads = [("sequential", lambda: layout.read(keys)), ("random", lambda: layout.read(shuffled))]
    if isinstance(layout, SegmentLayout):
        layout.run_buffer = memoryview(bytearray(os.urandom(run * block_bytes)))
        reads.append(("coalesced", lambda: layout.read_runs(keys, run)))
    for label, read in reads:
        for cache in (("device", "page_cache") if evict else ("page_cache",)):
            layout.close()                       # reopened by the read: an open fd is not what is measured
            if cache == "device":
                out["evict_method"] = drop_caches(files)
            else:
                layout.read(keys)                # everything cached
            resident = resident_fraction(files)
            start = now()
            nbytes = read()
            seconds = now() - start
            assert nbytes == total, (nbytes, total)
            out[f"read_{label}_{cache}"] = dict(rate(seconds), resident_before=resident)
    if isinstance(layout, FileLayout) and evict:
        drop_caches(files)
        start = now()
        count = layout.list_and_stat()
        out["list_and_stat_cold"] = {"seconds": round(now() - start, 4), "files": count}
    layout.close()
    return out


def _machine(directory: str) -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        df = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.split("\n")[1].split()
        info["file_system"] = {"device": df[0], "type": df[1]}
    except (OSError, IndexError):
        pass
    try:
        info["kvserve_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                                text=True).stdout.strip()
    except OSError:
        pass
    return info


def _median_tree(rounds: list[dict]) -> dict:
    out: dict = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            out[key] = _median_tree([r[key] for r in rounds])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rounds if r.get(key) is not None]
            if not values:
                out[key] = None
            elif all(isinstance(v, int) for v in values):
                out[key] = int(statistics.median(values))
            else:
                out[key] = round(statistics.median(values), 4)
            if key == "MB_per_s" and values:
                out["MB_per_s_range"] = [min(values), max(values)]
        else:
            out[key] = value
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES)
    parser.add_argument("--segment-mib", type=int, default=64)
    parser.add_argument("--run-blocks", type=int, default=128, help="blocks per coalesced read (a 2k-token prefix)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--page-cache", choices=("evict", "keep"), default="evict",
                        help="evict: also read from the device (page cache emptied first)")
    parser.add_argument("--dir", default=None, help="parent of the temporary directory (default: the system's, /tmp)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    pool = [os.urandom(args.block_bytes) for _ in range(POOL)]

    def payload(i: int) -> bytes:
        return pool[i % POOL]

    keys = [key_of(i) for i in range(args.blocks)]
    work = tempfile.mkdtemp(prefix="kvserve-disk-layout-", dir=args.dir)
    evict = args.page_cache == "evict"
    results: dict = {"command": "python benchmarks/kv/disk_layout_bench.py " + " ".join(
                         argv if argv is not None else sys.argv[1:]),
                     "machine": _machine(work), "directory": work, "blocks": args.blocks,
                     "block_bytes": args.block_bytes, "total_bytes": args.blocks * args.block_bytes,
                     "segment_bytes": args.segment_mib << 20, "run_blocks": args.run_blocks, "rounds": args.rounds}
    per_layout: dict[str, list[dict]] = {"file": [], "segment": []}
    started = now()
    try:
        for r in range(args.rounds):
            order = ("file", "segment") if r % 2 == 0 else ("segment", "file")
            for name in order:
                root = os.path.join(work, f"{name}-{r}")
                layout = FileLayout(root) if name == "file" else SegmentLayout(root, args.segment_mib << 20)
                per_layout[name].append(one_round(layout, keys, payload, args.block_bytes, args.run_blocks, evict))
                print(f"round {r} {name:7s}: " + json.dumps({k: v.get("MB_per_s", v) if isinstance(v, dict) else v
                                                             for k, v in per_layout[name][-1].items()}), flush=True)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["layouts"] = {name: _median_tree(rounds) for name, rounds in per_layout.items()}
    results["rounds_raw"] = per_layout
    results["total_s"] = round(now() - started, 1)

    file, seg = results["layouts"]["file"], results["layouts"]["segment"]
    rows = [("write", "write"), ("write + sync", "write_and_sync")]
    for label in ("sequential", "random"):
        for cache in (("device", "page_cache") if evict else ("page_cache",)):
            rows.append((f"read {label}, {cache}", f"read_{label}_{cache}"))
    faster = {}
    print()
    print(f"{'':28s} {'file per block':>24s} {'segments':>24s}   faster")
    for label, key in rows:
        a, b = file[key], seg[key]
        ratio = round(max(a["MB_per_s"], b["MB_per_s"]) / min(a["MB_per_s"], b["MB_per_s"]), 2)
        # Rounds on a shared VM disk vary: a difference inside the other layout's range is a tie.
        lo, hi = (a, b) if a["MB_per_s"] < b["MB_per_s"] else (b, a)
        clear = lo["MB_per_s_range"][1] < hi["MB_per_s_range"][0]
        winner = ("segment" if b is hi else "file") if ratio >= 1.1 else "tie"
        faster[key] = {"faster": winner, "ratio": ratio, "ranges_disjoint": clear}
        print(f"{label:28s} {a['MB_per_s']:9.1f} MB/s {a['blocks_per_s']:7.0f} bl/s "
              f"{b['MB_per_s']:9.1f} MB/s {b['blocks_per_s']:7.0f} bl/s   {winner} x{ratio}"
              f"{'' if clear else ' (ranges overlap)'}")
    for cache in (("device", "page_cache") if evict else ("page_cache",)):
        c = seg[f"read_coalesced_{cache}"]
        print(f"{'segment coalesced, ' + cache:28s} {'':>24s} {c['MB_per_s']:9.1f} MB/s {c['blocks_per_s']:7.0f} bl/s")
    if evict:
        print(f"page cache emptied by: {file.get('evict_method')}; cached before device reads: "
              f"file {file['read_sequential_device']['resident_before']}, segment "
              f"{seg['read_sequential_device']['resident_before']}; listing + stat of {file['files']} files "
              f"(caches dropped): {file['list_and_stat_cold']['seconds'] * 1e3:.0f} ms")
    results["faster"] = faster
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print("->", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
