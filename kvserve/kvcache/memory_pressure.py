"""How much host RAM the host KV tier may keep right now: Linux memory pressure, read and acted on.

The host tier (kvcache/host_tier.py) holds KV blocks in pinned host memory. Pinned pages cannot be
swapped or reclaimed, so when the machine (or the server's cgroup) runs short of memory the kernel
can only take pages from everything else: page cache, the tokenizer's and the API server's heaps,
other tenants. Beyond a point the server stalls or the OOM killer ends it. A cached prefix is worth
far less than that, so the tier gives memory back while the machine is short and takes it again
once it is not. This module measures and decides; the tier itself releases and regrows its blocks.

What is read (every path under an injectable root, so tests use files in the real formats):

- PSI, pressure stall information: ``/proc/pressure/memory`` (the whole machine) and the
  ``memory.pressure`` of the process's own cgroup v2. ``some avg10`` is the share of the last 10 s
  in which at least one task waited for memory; it rises when reclaim or swapping starts to cost
  time, before anything fails, and that is the signal the threshold (``--kv-host-memory-pressure``)
  is compared with. Where both files exist the larger value counts: the tier's pinned pages are
  unreclaimable machine-wide, so giving them up relieves both the cgroup's and the machine's stalls.
- The cgroup v2 limit: ``memory.max`` ("max" or bytes) against ``memory.current``, for the own
  cgroup and each ancestor up to the mount root (any level's limit can trigger reclaim or the OOM
  killer), minus each level's ``inactive_file`` from ``memory.stat``: a cgroup that reads files
  fills its limit with page cache the kernel drops at no cost, and counting that as used memory
  would shrink the tier on every large file read. The smallest headroom over the levels counts.
- ``MemAvailable`` from ``/proc/meminfo``: the kernel's estimate of what can be allocated without
  swapping, the machine's headroom where no cgroup limit applies.

The own cgroup is the ``0::/path`` line of ``/proc/self/cgroup``, under the cgroup2 mount found in
``/proc/self/mountinfo`` (``/sys/fs/cgroup`` on a pure v2 system, often ``/sys/fs/cgroup/unified``
on a hybrid one), falling back to ``/sys/fs/cgroup``. cgroup v1 memory controllers are not read.

Where none of this exists (a kernel without PSI, cgroup v1 only, not Linux), ``PressureMonitor``
logs once that pressure is unavailable and reports snapshots with every field None; the sizer then
never shrinks. Reading never raises at run time: a file that vanishes or reads garbage counts as
missing for that sample.

``HostTierSizer`` turns snapshots into a target number of host blocks. It moves in chunks (1/8 of
the configured blocks by default) because PSI averages over 10 s and every change costs a pinned
(de)allocation: small steps would chase noise. It shrinks when ``some avg10`` reaches the threshold
or the headroom falls below a margin; for headroom, which is instantaneous, by as many chunks as
the shortfall needs, for PSI by one chunk; either at most once per cooldown, because ``avg10``
keeps showing a stall for seconds after it ended (and released memory may reach the counters a
little late), and shrinking on every sample would give up far more than needed. It grows
one chunk at a time, only after pressure has stayed below half the threshold, and the headroom
would stay above the margin after growing, for a whole hold time; each growth restarts the hold.
The gap between the shrink and grow conditions is the hysteresis that keeps it from flapping.
The floor is one chunk, not zero: the blocks the operator budgeted are worth keeping for the
hottest prefixes, the last 1/8 is rarely what decides a shortage the kernel cannot otherwise
solve, and the tier keeps at least one block to work with. ``min_blocks=0`` allows emptying it.
A threshold of 0 disables the whole mechanism: the target is always the configured size.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

logger = logging.getLogger(__name__)

DEFAULT_PRESSURE_THRESHOLD = 10.0           # percent of time some task stalled on memory (PSI some avg10)
DEFAULT_HEADROOM_MARGIN_BYTES = 512 << 20


# ----------------------------------------------------------------------------------------------
# Readers. Each returns None (never raises) when the file is missing or not in the expected format.

@dataclass(frozen=True)
class PsiLine:
    avg10: float
    avg60: float
    avg300: float
    total_us: int


def parse_psi(text: str) -> dict[str, PsiLine]:
    """``some avg10=0.00 avg60=0.00 avg300=0.00 total=0`` lines (and ``full ...``) -> {kind: line}.
    Lines that do not parse are skipped; fields appear in any order."""
    out: dict[str, PsiLine] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] not in ("some", "full"):
            continue
        fields = {}
        for part in parts[1:]:
            key, sep, value = part.partition("=")
            if sep:
                fields[key] = value
        try:
            out[parts[0]] = PsiLine(float(fields["avg10"]), float(fields["avg60"]), float(fields["avg300"]),
                                    int(fields["total"]))
        except (KeyError, ValueError):
            continue
    return out


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "r") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None


def read_psi(path: str) -> Optional[dict[str, PsiLine]]:
    text = _read(path)
    if text is None:
        return None
    parsed = parse_psi(text)
    return parsed if "some" in parsed else None


def read_memory_max(path: str) -> Optional[float]:
    """cgroup v2 ``memory.max``: bytes, or ``math.inf`` for "max" (no limit at this level)."""
    text = _read(path)
    if text is None:
        return None
    value = text.strip()
    if value == "max":
        return math.inf
    try:
        return int(value)
    except ValueError:
        return None


def read_int_file(path: str) -> Optional[int]:
    """A file holding one integer, such as cgroup v2 ``memory.current``."""
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def read_flat_keyed(path: str) -> Optional[dict[str, int]]:
    """``key value`` lines, such as cgroup v2 ``memory.stat``."""
    text = _read(path)
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def read_mem_available(path: str) -> Optional[int]:
    """``MemAvailable:   24213840 kB`` from /proc/meminfo, in bytes."""
    text = _read(path)
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            try:
                value = int(parts[1])
            except (IndexError, ValueError):
                return None
            unit = parts[2] if len(parts) > 2 else ""
            return value * 1024 if unit == "kB" else value
    return None


def parse_own_cgroup_v2(text: str) -> Optional[str]:
    """The cgroup v2 path from /proc/self/cgroup: the ``0::/path`` line (v1 lines are ``N:ctrl:/path``)."""
    for line in text.splitlines():
        if line.startswith("0::"):
            path = line[3:].strip()
            if path.endswith(" (deleted)"):
                path = path[:-len(" (deleted)")]
            return path if path.startswith("/") else None
    return None


def _unescape_mountinfo(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \040, \011, \012, \134.
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_cgroup2_mount(text: str) -> Optional[tuple[str, str]]:
    """(root inside the hierarchy, mount point) of the first cgroup2 mount in /proc/self/mountinfo."""
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fstype = right.split()[0] if right.split() else ""
        fields = left.split()
        if fstype == "cgroup2" and len(fields) >= 5:
            return _unescape_mountinfo(fields[3]), _unescape_mountinfo(fields[4])
    return None


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def find_own_cgroup_dir(root: str = "/", proc_cgroup: str = "proc/self/cgroup",
                        mountinfo: str = "proc/self/mountinfo") -> Optional[str]:
    """The directory of this process's cgroup v2 (under ``root``), or None where there is none."""
    text = _read(_under(root, proc_cgroup))
    if text is None:
        return None
    cgroup_path = parse_own_cgroup_v2(text)
    if cgroup_path is None:
        return None
    mount_root, mount_point = "/", "/sys/fs/cgroup"
    mounts = _read(_under(root, mountinfo))
    if mounts is not None:
        found = parse_cgroup2_mount(mounts)
        if found is not None:
            mount_root, mount_point = found
    # The path is relative to the cgroup namespace's root; the mount shows the hierarchy from
    # mount_root on (not "/" when a container bind-mounts its own part of the host's tree).
    relative = os.path.relpath(cgroup_path, mount_root) if mount_root != "/" else cgroup_path.lstrip("/")
    if relative.startswith(".."):
        relative = cgroup_path.lstrip("/")
    directory = os.path.normpath(os.path.join(_under(root, mount_point), relative))
    return directory if os.path.isdir(directory) else None


def cgroup_headroom_bytes(cgroup_dir: str, stop_at: Optional[str] = None) -> Optional[int]:
    """The least (memory.max - (memory.current - inactive_file)) over ``cgroup_dir`` and its
    ancestors up to ``stop_at`` (the mount point; default: as far as memory.max files go).
    None where no level has a numeric limit with a readable memory.current."""
    best: Optional[int] = None
    directory = os.path.normpath(cgroup_dir)
    stop = os.path.normpath(stop_at) if stop_at is not None else None
    while True:
        limit = read_memory_max(os.path.join(directory, "memory.max"))
        if limit is None and stop is None:
            break              # left the cgroup tree (or the root, which has no memory.max)
        if limit is not None and limit != math.inf:
            current = read_int_file(os.path.join(directory, "memory.current"))
            if current is not None:
                stat = read_flat_keyed(os.path.join(directory, "memory.stat")) or {}
                used = max(0, current - stat.get("inactive_file", 0))
                headroom = int(limit) - used
                best = headroom if best is None else min(best, headroom)
        if directory == stop:
            break
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return best


# ----------------------------------------------------------------------------------------------
# Sampling.

@dataclass(frozen=True)
class MemoryPressure:
    """One reading. Each field is None where its source is missing on this machine."""
    some_avg10: Optional[float] = None           # percent; max of the machine's and the own cgroup's PSI
    full_avg10: Optional[float] = None           # percent; all non-idle tasks stalled at once
    cgroup_headroom_bytes: Optional[int] = None  # least limit minus (non-reclaimable) usage over the cgroup's ancestry
    mem_available_bytes: Optional[int] = None    # /proc/meminfo MemAvailable

    @property
    def available(self) -> bool:
        return self.some_avg10 is not None or self.headroom_bytes is not None

    @property
    def headroom_bytes(self) -> Optional[int]:
        """The tighter of the cgroup headroom and MemAvailable, None where neither is known."""
        known = [v for v in (self.cgroup_headroom_bytes, self.mem_available_bytes) if v is not None]
        return min(known) if known else None


UNAVAILABLE = MemoryPressure()


class PressureMonitor:
    """Reads a ``MemoryPressure`` at most every ``min_interval_s`` (cheap small files, but the
    scheduler asks every step); between reads ``sample()`` returns the last one.

    root: prefix of every path ("/" on the real machine, a temp dir in tests).
    cgroup_dir: the cgroup v2 directory to read (already under root); default: the process's own,
        found once on the first sample. Pass "" to read no cgroup at all.
    use_system_psi / use_meminfo: read /proc/pressure/memory and /proc/meminfo.
    clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, root: str = "/", *, cgroup_dir: Optional[str] = None, min_interval_s: float = 1.0,
                 use_system_psi: bool = True, use_meminfo: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.min_interval_s = min_interval_s
        self.use_system_psi = use_system_psi
        self.use_meminfo = use_meminfo
        self.clock = clock
        self._cgroup_dir = cgroup_dir
        self._cgroup_found = cgroup_dir is not None
        self._cgroup_mount: Optional[str] = None
        self._last: Optional[MemoryPressure] = None
        self._last_at = -math.inf
        self._reported = False
        self.samples_read = 0

    @property
    def cgroup_dir(self) -> Optional[str]:
        if not self._cgroup_found:
            self._cgroup_found = True
            self._cgroup_dir = find_own_cgroup_dir(self.root)
            mounts = _read(_under(self.root, "proc/self/mountinfo"))
            found = parse_cgroup2_mount(mounts) if mounts else None
            self._cgroup_mount = os.path.normpath(_under(self.root, found[1] if found else "/sys/fs/cgroup"))
        return self._cgroup_dir or None

    @property
    def available(self) -> bool:
        return self.sample().available

    def sample(self) -> MemoryPressure:
        now = self.clock()
        if self._last is not None and now - self._last_at < self.min_interval_s:
            return self._last
        try:
            reading = self._read()
        except Exception:          # a reader bug or an odd file must not stop the engine
            logger.debug("memory pressure: reading failed", exc_info=True)
            reading = UNAVAILABLE
        self._last, self._last_at = reading, now
        self.samples_read += 1
        if not self._reported:
            self._reported = True
            self._report(reading)
        return reading

    def _read(self) -> MemoryPressure:
        psi = []
        if self.use_system_psi:
            psi.append(read_psi(_under(self.root, "proc/pressure/memory")))
        cgroup_dir = self.cgroup_dir
        headroom = None
        if cgroup_dir:
            psi.append(read_psi(os.path.join(cgroup_dir, "memory.pressure")))
            stop = self._cgroup_mount if self._cgroup_mount and cgroup_dir.startswith(self._cgroup_mount) else None
            headroom = cgroup_headroom_bytes(cgroup_dir, stop)
        some = [p["some"].avg10 for p in psi if p is not None]
        full = [p["full"].avg10 for p in psi if p is not None and "full" in p]
        mem_available = read_mem_available(_under(self.root, "proc/meminfo")) if self.use_meminfo else None
        return MemoryPressure(some_avg10=max(some) if some else None, full_avg10=max(full) if full else None,
                              cgroup_headroom_bytes=headroom, mem_available_bytes=mem_available)

    def _report(self, reading: MemoryPressure) -> None:
        if not reading.available:
            logger.warning("host KV tier: memory pressure is unavailable here (no PSI in /proc/pressure/memory, "
                           "no cgroup v2 memory limit, no MemAvailable); the tier keeps its configured size")
            return
        logger.info("host KV tier: memory pressure from %s",
                    ", ".join(name for name, value in (("PSI", reading.some_avg10),
                                                       ("cgroup v2 limit", reading.cgroup_headroom_bytes),
                                                       ("MemAvailable", reading.mem_available_bytes))
                              if value is not None))


# ----------------------------------------------------------------------------------------------
# Deciding.

@dataclass
class HostTierSizer:
    """Target number of host blocks from pressure snapshots; see the module docstring.

    max_blocks: the configured size (--kv-host-memory / block bytes); the target never exceeds it.
    block_bytes: host bytes one block holds (to convert headroom into blocks).
    threshold: PSI ``some avg10`` percent at which to shrink (--kv-host-memory-pressure); 0 disables.
    chunk_fraction: share of max_blocks released or regrown per step.
    min_blocks: the floor; None means one chunk.
    headroom_margin_bytes: shrink while cgroup headroom / MemAvailable is below this.
    shrink_cooldown_s: least time between two shrinks (avg10 lags the stall it reports).
    grow_hold_s: how long pressure must stay calm before each chunk is regrown.
    """
    max_blocks: int
    block_bytes: int
    threshold: float = DEFAULT_PRESSURE_THRESHOLD
    chunk_fraction: float = 1 / 8
    min_blocks: Optional[int] = None
    headroom_margin_bytes: int = DEFAULT_HEADROOM_MARGIN_BYTES
    shrink_cooldown_s: float = 2.0
    grow_hold_s: float = 30.0
    last_reason: str = field(default="", init=False)
    _calm_since: Optional[float] = field(default=None, init=False, repr=False)
    _last_shrink_at: float = field(default=-math.inf, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_blocks < 0 or self.block_bytes < 1:
            raise ValueError(f"HostTierSizer needs max_blocks >= 0 and block_bytes >= 1, got "
                             f"{self.max_blocks} and {self.block_bytes}")
        if self.threshold < 0 or not 0 < self.chunk_fraction <= 1:
            raise ValueError(f"HostTierSizer needs threshold >= 0 and 0 < chunk_fraction <= 1, got "
                             f"{self.threshold} and {self.chunk_fraction}")
        if self.min_blocks is None:
            self.min_blocks = self.chunk_blocks
        self.min_blocks = max(0, min(self.min_blocks, self.max_blocks))

    @property
    def enabled(self) -> bool:
        return self.threshold > 0 and self.max_blocks > 0

    @property
    def chunk_blocks(self) -> int:
        return max(1, math.ceil(self.max_blocks * self.chunk_fraction)) if self.max_blocks else 0

    def decide(self, current_blocks: int, pressure: MemoryPressure, now: float) -> int:
        """The number of host blocks the tier should have; ``current_blocks`` when nothing changes."""
        assert self.min_blocks is not None
        current = max(0, min(current_blocks, self.max_blocks))
        if not self.enabled:
            self.last_reason = "disabled"
            return self.max_blocks
        if not pressure.available:
            self._calm_since = None
            self.last_reason = "unavailable"
            return current
        some = pressure.some_avg10
        headroom = pressure.headroom_bytes
        shortfall = self.headroom_margin_bytes - headroom if headroom is not None else 0
        if shortfall > 0:
            self._calm_since = None
            if now - self._last_shrink_at < self.shrink_cooldown_s:
                self.last_reason = "low headroom, cooling down"
                return current
            chunk_bytes = self.chunk_blocks * self.block_bytes
            chunks = max(1, math.ceil(shortfall / chunk_bytes))
            return self._shrink(current, chunks, now, f"headroom {headroom} B below {self.headroom_margin_bytes} B")
        if some is not None and some >= self.threshold:
            self._calm_since = None
            if now - self._last_shrink_at < self.shrink_cooldown_s:
                self.last_reason = "pressure, cooling down"
                return current
            return self._shrink(current, 1, now, f"PSI some avg10 {some:.2f} >= {self.threshold:.2f}")
        calm = (some is None or some < self.threshold / 2) and (
            headroom is None or headroom >= self.headroom_margin_bytes + self.chunk_blocks * self.block_bytes)
        if not calm:
            self._calm_since = None
            self.last_reason = "between thresholds"
            return current
        if current >= self.max_blocks:
            self._calm_since = None
            self.last_reason = "full size"
            return current
        if self._calm_since is None:
            self._calm_since = now
        if now - self._calm_since < self.grow_hold_s:
            self.last_reason = "calm, holding"
            return current
        self._calm_since = now           # the next chunk needs another whole hold
        self.last_reason = "calm: growing"
        return min(self.max_blocks, current + self.chunk_blocks)

    def _shrink(self, current: int, chunks: int, now: float, reason: str) -> int:
        assert self.min_blocks is not None
        target = max(self.min_blocks, current - chunks * self.chunk_blocks)
        if target < current:
            self._last_shrink_at = now
            self.last_reason = reason + ": shrinking"
        else:
            self.last_reason = reason + ": at the floor"
        return min(current, target)
