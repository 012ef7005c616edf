"""The host tier's memory-pressure monitor and sizer (kvcache/memory_pressure.py): readers of the
real PSI / cgroup v2 / meminfo formats on files in a temp root, the sizer's shrink, grow,
hysteresis and floor on an injected clock, and, where this machine lets root create one, a real
cgroup v2 child with a memory limit and a process filling it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid

import pytest

from kvserve.kvcache.memory_pressure import (HostTierSizer, MemoryPressure, PressureMonitor, cgroup_headroom_bytes,
                                             find_own_cgroup_dir, parse_cgroup2_mount, parse_own_cgroup_v2, parse_psi,
                                             read_mem_available, read_memory_max, read_psi)

MiB = 1 << 20
GiB = 1 << 30

# Copied from real machines: /proc/pressure/memory (kernel 6.18), a cgroup v2 memory.pressure, a
# hybrid (v1 + unified) /proc/self/cgroup and mountinfo, and a pure v2 system's.
PROC_PSI = ("some avg10=1.29 avg60=0.34 avg300=0.30 total=4569284935\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
HYBRID_SELF_CGROUP = ("9:name=systemd:/\n8:pids:/\n7:blkio:/\n6:freezer:/\n5:devices:/\n"
                      "4:memory:/process_api/6b152f2ed0a0a25635cd5ae67f47758e\n3:cpuset:/\n2:cpuacct:/\n1:cpu:/\n0::/\n")
HYBRID_MOUNTINFO = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
                    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
V2_SELF_CGROUP = "0::/system.slice/kvserve.service\n"
V2_MOUNTINFO = ("22 28 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
                "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
                "rw,nsdelegate,memory_recursiveprot\n")
MEMINFO = ("MemTotal:       24683652 kB\nMemFree:        23414996 kB\nMemAvailable:   24213840 kB\n"
           "Buffers:           22408 kB\nCached:           834052 kB\n")
MEMORY_STAT = ("anon 1073741824\nfile 536870912\nkernel 20971520\nkernel_stack 1048576\nshmem 0\n"
               "active_anon 1048576000\ninactive_anon 25165824\nactive_file 134217728\ninactive_file 402653184\n"
               "unevictable 0\npgfault 123456\n")


def _write(root, relative: str, text: str) -> str:
    path = os.path.join(str(root), relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)
    return path


def _psi(some: float, full: float = 0.0) -> str:
    return (f"some avg10={some:.2f} avg60=0.00 avg300=0.00 total=123\n"
            f"full avg10={full:.2f} avg60=0.00 avg300=0.00 total=45\n")


def _v2_machine(root, limit="4294967296", current=3 * GiB, stat=MEMORY_STAT, cgroup_psi=_psi(0.0),
                parent_limit="max") -> str:
    """A pure cgroup v2 machine under root, the process in system.slice/kvserve.service."""
    _write(root, "proc/pressure/memory", PROC_PSI)
    _write(root, "proc/meminfo", MEMINFO)
    _write(root, "proc/self/cgroup", V2_SELF_CGROUP)
    _write(root, "proc/self/mountinfo", V2_MOUNTINFO)
    _write(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory hugetlb pids rdma misc\n")
    _write(root, "sys/fs/cgroup/memory.pressure", _psi(0.0))
    _write(root, "sys/fs/cgroup/system.slice/memory.max", parent_limit + "\n")
    _write(root, "sys/fs/cgroup/system.slice/memory.current", f"{current}\n")
    own = "sys/fs/cgroup/system.slice/kvserve.service"
    _write(root, f"{own}/memory.max", f"{limit}\n")
    _write(root, f"{own}/memory.current", f"{current}\n")
    _write(root, f"{own}/memory.stat", stat)
    _write(root, f"{own}/memory.pressure", cgroup_psi)
    return os.path.join(str(root), own)


# ---------------------------------------------------------------------------------------------- readers

def test_parse_real_psi():
    psi = parse_psi(PROC_PSI)
    assert psi["some"].avg10 == pytest.approx(1.29) and psi["some"].avg60 == pytest.approx(0.34)
    assert psi["some"].avg300 == pytest.approx(0.30) and psi["some"].total_us == 4569284935
    assert psi["full"].avg10 == 0.0 and psi["full"].total_us == 0


def test_parse_psi_some_only_and_garbage(tmp_path):
    # Older kernels' cpu.pressure has no "full" line; a truncated or foreign file is no PSI.
    assert set(parse_psi("some avg10=3.50 avg60=1.00 avg300=0.20 total=99\n")) == {"some"}
    assert parse_psi("some avg10=x avg60=1 avg300=1 total=1\nnonsense\n\n") == {}
    assert read_psi(_write(tmp_path, "bad", "full avg10=1.00 avg60=0 avg300=0 total=0\n")) is None
    assert read_psi(str(tmp_path / "missing")) is None


def test_memory_max_current_meminfo(tmp_path):
    assert read_memory_max(_write(tmp_path, "a/memory.max", "max\n")) == float("inf")
    assert read_memory_max(_write(tmp_path, "b/memory.max", "268435456\n")) == 268435456
    assert read_memory_max(_write(tmp_path, "c/memory.max", "lots\n")) is None
    assert read_memory_max(str(tmp_path / "d/memory.max")) is None
    assert read_mem_available(_write(tmp_path, "meminfo", MEMINFO)) == 24213840 * 1024
    assert read_mem_available(_write(tmp_path, "old-meminfo", "MemTotal: 100 kB\nMemFree: 50 kB\n")) is None


def test_own_cgroup_lines():
    assert parse_own_cgroup_v2(HYBRID_SELF_CGROUP) == "/"
    assert parse_own_cgroup_v2(V2_SELF_CGROUP) == "/system.slice/kvserve.service"
    assert parse_own_cgroup_v2("4:memory:/a\n1:cpu:/\n") is None          # cgroup v1 only
    assert parse_cgroup2_mount(HYBRID_MOUNTINFO) == ("/", "/sys/fs/cgroup/unified")
    assert parse_cgroup2_mount(V2_MOUNTINFO) == ("/", "/sys/fs/cgroup")
    assert parse_cgroup2_mount("36 25 0:31 / /mnt/my\\040cgroups rw - cgroup2 none rw\n") == ("/", "/mnt/my cgroups")


def test_find_own_cgroup_dir(tmp_path):
    own = _v2_machine(tmp_path)
    assert find_own_cgroup_dir(str(tmp_path)) == own
    # Hybrid: "0::/" is the root of the unified hierarchy, wherever mountinfo says it is mounted.
    hybrid = tmp_path / "hybrid"
    _write(hybrid, "proc/self/cgroup", HYBRID_SELF_CGROUP)
    _write(hybrid, "proc/self/mountinfo", HYBRID_MOUNTINFO)
    _write(hybrid, "sys/fs/cgroup/unified/memory.pressure", _psi(0.0))
    assert find_own_cgroup_dir(str(hybrid)) == os.path.join(str(hybrid), "sys/fs/cgroup/unified")
    # A container that mounts its own part of the host's tree at /sys/fs/cgroup, no cgroup namespace.
    ctr = tmp_path / "ctr"
    _write(ctr, "proc/self/cgroup", "0::/kubepods/pod1/abc\n")
    _write(ctr, "proc/self/mountinfo", "35 24 0:30 /kubepods/pod1/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n")
    _write(ctr, "sys/fs/cgroup/memory.max", "1073741824\n")
    assert find_own_cgroup_dir(str(ctr)) == os.path.join(str(ctr), "sys/fs/cgroup")
    # cgroup v1 only, or no /proc at all.
    v1 = tmp_path / "v1"
    _write(v1, "proc/self/cgroup", "4:memory:/a\n1:cpu:/\n")
    assert find_own_cgroup_dir(str(v1)) is None
    assert find_own_cgroup_dir(str(tmp_path / "nothing")) is None


def test_headroom_discounts_inactive_file_and_takes_tightest_level(tmp_path):
    own = _v2_machine(tmp_path, limit=str(4 * GiB), current=3 * GiB + 512 * MiB)
    # 4 GiB - (3.5 GiB - 384 MiB of inactive page cache) = 896 MiB.
    assert cgroup_headroom_bytes(own) == 4 * GiB - (3 * GiB + 512 * MiB - 402653184)
    # A tighter ancestor (system.slice at 3.75 GiB, no memory.stat there) decides.
    _write(tmp_path, "sys/fs/cgroup/system.slice/memory.max", f"{3 * GiB + 768 * MiB}\n")
    assert cgroup_headroom_bytes(own) == 256 * MiB
    # No numeric limit anywhere: no cgroup headroom.
    _write(tmp_path, "sys/fs/cgroup/system.slice/memory.max", "max\n")
    _write(tmp_path, "sys/fs/cgroup/system.slice/kvserve.service/memory.max", "max\n")
    assert cgroup_headroom_bytes(own) is None


# ---------------------------------------------------------------------------------------------- monitor

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_monitor_reads_a_v2_machine(tmp_path):
    own = _v2_machine(tmp_path, limit=str(4 * GiB), current=3 * GiB, cgroup_psi=_psi(12.5, 4.25))
    monitor = PressureMonitor(str(tmp_path), clock=Clock())
    assert monitor.cgroup_dir == own
    reading = monitor.sample()
    # The cgroup's PSI is above the machine's: the larger counts.
    assert reading.some_avg10 == pytest.approx(12.5) and reading.full_avg10 == pytest.approx(4.25)
    assert reading.cgroup_headroom_bytes == 4 * GiB - (3 * GiB - 402653184)
    assert reading.mem_available_bytes == 24213840 * 1024
    assert reading.headroom_bytes == reading.cgroup_headroom_bytes and reading.available


def test_monitor_is_rate_limited(tmp_path):
    own = _v2_machine(tmp_path)
    clock = Clock()
    monitor = PressureMonitor(str(tmp_path), min_interval_s=1.0, clock=clock)
    assert monitor.sample().some_avg10 == pytest.approx(1.29)
    _write(tmp_path, os.path.relpath(os.path.join(own, "memory.pressure"), str(tmp_path)), _psi(40.0))
    clock.now += 0.5
    assert monitor.sample().some_avg10 == pytest.approx(1.29) and monitor.samples_read == 1
    clock.now += 0.6
    assert monitor.sample().some_avg10 == pytest.approx(40.0) and monitor.samples_read == 2


def test_monitor_unavailable_logs_once_and_sizer_holds(tmp_path, caplog):
    monitor = PressureMonitor(str(tmp_path / "bare"), clock=Clock())
    with caplog.at_level(logging.INFO, logger="kvserve.kvcache.memory_pressure"):
        readings = [monitor.sample() for _ in range(3)]
        monitor.clock.now += 10
        readings.append(monitor.sample())
    assert all(r == MemoryPressure() and not r.available for r in readings)
    assert sum("unavailable" in record.getMessage() for record in caplog.records) == 1
    sizer = HostTierSizer(max_blocks=64, block_bytes=MiB)
    assert [sizer.decide(64, r, t) for t, r in enumerate(readings)] == [64] * 4


def test_monitor_survives_garbage_and_vanishing_files(tmp_path):
    own = _v2_machine(tmp_path)
    clock = Clock()
    monitor = PressureMonitor(str(tmp_path), clock=clock)
    assert monitor.sample().available
    for name in ("memory.max", "memory.current", "memory.pressure"):
        _write(tmp_path, os.path.relpath(os.path.join(own, name), str(tmp_path)), "\x00\xff garbage\n")
    os.remove(os.path.join(str(tmp_path), "proc/pressure/memory"))
    os.remove(os.path.join(str(tmp_path), "proc/meminfo"))
    clock.now += 5
    assert monitor.sample() == MemoryPressure()


def test_monitor_hybrid_machine_psi_and_meminfo_only(tmp_path):
    # This kind of host: memory controller on cgroup v1, the unified hierarchy without it.
    _write(tmp_path, "proc/pressure/memory", PROC_PSI)
    _write(tmp_path, "proc/meminfo", MEMINFO)
    _write(tmp_path, "proc/self/cgroup", HYBRID_SELF_CGROUP)
    _write(tmp_path, "proc/self/mountinfo", HYBRID_MOUNTINFO)
    _write(tmp_path, "sys/fs/cgroup/unified/memory.pressure", _psi(0.0))
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    reading = PressureMonitor(str(tmp_path), clock=Clock()).sample()
    assert reading.some_avg10 == pytest.approx(1.29) and reading.cgroup_headroom_bytes is None
    assert reading.headroom_bytes == 24213840 * 1024


# ---------------------------------------------------------------------------------------------- sizer

def _pressure(some=None, headroom=None) -> MemoryPressure:
    return MemoryPressure(some_avg10=some, full_avg10=0.0 if some is not None else None,
                          cgroup_headroom_bytes=headroom)


def test_sizer_shrinks_in_chunks_with_cooldown_to_the_floor():
    sizer = HostTierSizer(max_blocks=64, block_bytes=MiB, threshold=10.0, shrink_cooldown_s=2.0)
    assert sizer.chunk_blocks == 8 and sizer.min_blocks == 8
    high = _pressure(some=25.0)
    assert sizer.decide(64, high, now=0.0) == 56
    assert sizer.decide(56, high, now=1.0) == 56            # avg10 still shows the stall it reported
    assert sizer.decide(56, high, now=2.0) == 48
    blocks, now = 48, 2.0
    for _ in range(20):
        now += 2.0
        blocks = sizer.decide(blocks, high, now)
    assert blocks == 8 and "floor" in sizer.last_reason
    assert sizer.decide(64, _pressure(some=10.0), now=100.0) == 56    # at the threshold counts
    assert sizer.decide(64, _pressure(some=9.99), now=200.0) == 64


def test_sizer_floor_zero_and_rounding():
    sizer = HostTierSizer(max_blocks=10, block_bytes=MiB, min_blocks=0, shrink_cooldown_s=0.0)
    assert sizer.chunk_blocks == 2                          # ceil(10 / 8)
    blocks = 10
    for t in range(10):
        blocks = sizer.decide(blocks, _pressure(some=50.0), float(t))
    assert blocks == 0
    one = HostTierSizer(max_blocks=1, block_bytes=MiB)
    assert one.chunk_blocks == 1 and one.decide(1, _pressure(some=90.0), 0.0) == 1


def test_sizer_shrinks_for_low_headroom_by_the_shortfall():
    sizer = HostTierSizer(max_blocks=64, block_bytes=MiB, headroom_margin_bytes=32 * MiB)
    # 32 MiB margin, 11 MiB left: 21 MiB short is three 8 MiB chunks, at once.
    assert sizer.decide(64, _pressure(some=0.0, headroom=11 * MiB), now=0.0) == 40
    assert sizer.decide(64, _pressure(headroom=31 * MiB), now=10.0) == 56     # PSI unknown: headroom alone
    assert sizer.decide(64, _pressure(headroom=-5 * GiB), now=20.0) == 8      # past the limit: to the floor
    assert sizer.decide(64, _pressure(some=0.0, headroom=40 * MiB), now=30.0) == 64


def test_sizer_grows_back_after_hold_with_hysteresis():
    sizer = HostTierSizer(max_blocks=64, block_bytes=MiB, threshold=10.0, grow_hold_s=30.0,
                          headroom_margin_bytes=32 * MiB)
    blocks = sizer.decide(64, _pressure(some=30.0), now=0.0)
    assert blocks == 56
    # Between threshold/2 and the threshold: neither shrinks nor grows, however long.
    for t in range(3, 200, 3):
        assert sizer.decide(blocks, _pressure(some=7.0), float(t)) == 56
    # Calm (below threshold/2): waits the hold, then one chunk, then a whole hold again.
    assert sizer.decide(blocks, _pressure(some=1.0), 200.0) == 56
    assert sizer.decide(blocks, _pressure(some=1.0), 229.0) == 56
    blocks = sizer.decide(blocks, _pressure(some=1.0), 230.0)
    assert blocks == 64
    sizer2 = HostTierSizer(max_blocks=64, block_bytes=MiB, grow_hold_s=30.0)
    small = 16
    assert sizer2.decide(small, _pressure(some=0.0), 0.0) == 16
    assert sizer2.decide(small, _pressure(some=0.0), 30.0) == 24
    assert sizer2.decide(24, _pressure(some=0.0), 45.0) == 24
    # Pressure returning mid-hold restarts it.
    assert sizer2.decide(24, _pressure(some=6.0), 50.0) == 24
    assert sizer2.decide(24, _pressure(some=0.0), 55.0) == 24
    assert sizer2.decide(24, _pressure(some=0.0), 84.0) == 24
    assert sizer2.decide(24, _pressure(some=0.0), 85.0) == 32
    assert sizer2.decide(64, _pressure(some=0.0), 1000.0) == 64      # never above the configured size


def test_sizer_grows_only_with_room_for_the_chunk():
    sizer = HostTierSizer(max_blocks=64, block_bytes=MiB, grow_hold_s=10.0, headroom_margin_bytes=32 * MiB)
    # 35 MiB left: above the margin (no shrink) but one 8 MiB chunk more would go below it.
    for t in range(0, 100, 5):
        assert sizer.decide(32, _pressure(some=0.0, headroom=35 * MiB), float(t)) == 32
    assert sizer.decide(32, _pressure(some=0.0, headroom=40 * MiB), 100.0) == 32
    assert sizer.decide(32, _pressure(some=0.0, headroom=40 * MiB), 110.0) == 40


def test_sizer_disabled_and_unavailable():
    off = HostTierSizer(max_blocks=64, block_bytes=MiB, threshold=0.0)
    assert not off.enabled
    assert off.decide(64, _pressure(some=99.0, headroom=-GiB), 0.0) == 64
    sizer = HostTierSizer(max_blocks=64, block_bytes=MiB, grow_hold_s=1.0)
    assert sizer.decide(40, MemoryPressure(), 0.0) == 40 and sizer.decide(40, MemoryPressure(), 100.0) == 40
    with pytest.raises(ValueError):
        HostTierSizer(max_blocks=8, block_bytes=0)


# ---------------------------------------------------------------------------------------------- a real cgroup v2

def _cgroup2_mount() -> str:
    if not sys.platform.startswith("linux"):
        pytest.skip("not Linux: no cgroup v2")
    try:
        with open("/proc/self/mountinfo") as handle:
            found = parse_cgroup2_mount(handle.read())
    except OSError:
        found = None
    if found is None:
        pytest.skip("no cgroup2 filesystem is mounted here")
    if os.geteuid() != 0 or not os.access(found[1], os.W_OK):
        pytest.skip(f"cgroup v2 at {found[1]} is not writable by this user")
    return found[1]


def _words(path: str) -> list[str]:
    with open(path) as handle:
        return handle.read().split()


def _child(parent: str):
    path = os.path.join(parent, f"kvserve-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
    except OSError as error:
        pytest.skip(f"cannot create a child cgroup under {parent}: {error}")
    return path


def _remove(path: str, process) -> None:
    if process is not None and process.poll() is None:
        process.kill()
    if process is not None:
        process.wait(timeout=10)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
    try:
        os.rmdir(path)
    except OSError:
        pass


# Waits for a line, fills `size` bytes (touched: bytes * n writes every page), says so, waits again.
FILLER = ("import sys\nsys.stdin.readline()\nblob = b'\\x01' * int(sys.argv[1])\n"
          "print('ready', flush=True)\nsys.stdin.readline()\n")


def _spawn(size: int):
    return subprocess.Popen([sys.executable, "-c", FILLER, str(size)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_real_cgroup_v2_discovery_and_psi():
    """Any writable cgroup v2 (with or without the memory controller): a process moved into a
    fresh child is found there from its /proc/PID/cgroup, and the child's memory.pressure parses."""
    mount = _cgroup2_mount()
    child = _child(mount)
    process = _spawn(0)
    try:
        with open(os.path.join(child, "cgroup.procs"), "w") as handle:
            handle.write(str(process.pid))
        found = find_own_cgroup_dir("/", proc_cgroup=f"proc/{process.pid}/cgroup",
                                    mountinfo=f"proc/{process.pid}/mountinfo")
        assert found == child
        if not os.path.exists(os.path.join(child, "memory.pressure")):
            pytest.skip("this kernel keeps no PSI for cgroups (psi=0 or CONFIG_PSI off)")
        psi = read_psi(os.path.join(child, "memory.pressure"))
        assert psi is not None and {"some", "full"} <= set(psi) and psi["some"].avg10 >= 0.0
    finally:
        _remove(child, process)


def test_real_cgroup_v2_memory_limit_shrinks_the_tier():
    """A child cgroup with memory.max = 96 MiB; a process in it fills 72 MiB: the monitor, pointed
    at the child, sees the headroom below the 48 MiB margin and the sizer shrinks; once the
    process is gone the headroom is back."""
    mount = _cgroup2_mount()
    controllers = _words(os.path.join(mount, "cgroup.controllers"))
    if "memory" not in controllers:
        pytest.skip(f"cgroup v2 at {mount} has no memory controller (available: {' '.join(controllers) or 'none'}); "
                    "on this host it is bound to a cgroup v1 hierarchy, so no v2 memory.max can be set")
    subtree = os.path.join(mount, "cgroup.subtree_control")
    enabled_here = False
    if "memory" not in _words(subtree):
        try:
            with open(subtree, "w") as handle:
                handle.write("+memory")
            enabled_here = True
        except OSError as error:
            pytest.skip(f"cannot enable the memory controller for children of {mount}: {error}")
    child = _child(mount)
    process = None
    try:
        limit, fill, margin = 96 * MiB, 72 * MiB, 48 * MiB
        try:
            with open(os.path.join(child, "memory.max"), "w") as handle:
                handle.write(str(limit))
        except OSError as error:
            pytest.skip(f"cannot set memory.max in {child}: {error}")
        if os.path.exists(os.path.join(child, "memory.swap.max")):
            with open(os.path.join(child, "memory.swap.max"), "w") as handle:
                handle.write("0")           # fill RAM, not swap
        clock = Clock()
        monitor = PressureMonitor(cgroup_dir=child, use_system_psi=False, use_meminfo=False, clock=clock)
        empty = monitor.sample()
        assert empty.cgroup_headroom_bytes is not None and empty.cgroup_headroom_bytes > limit - 8 * MiB
        process = _spawn(fill)
        with open(os.path.join(child, "cgroup.procs"), "w") as handle:
            handle.write(str(process.pid))
        process.stdin.write("go\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "ready"
        clock.now += 5
        full = monitor.sample()
        assert full.cgroup_headroom_bytes is not None and full.cgroup_headroom_bytes < margin
        assert full.some_avg10 is not None and full.some_avg10 >= 0.0
        sizer = HostTierSizer(max_blocks=64, block_bytes=MiB, headroom_margin_bytes=margin)
        assert sizer.decide(64, full, clock.now) < 64
        process.kill()
        process.wait(timeout=10)          # the filler's memory is uncharged as it exits
        clock.now += 5
        assert monitor.sample().cgroup_headroom_bytes > margin
    finally:
        _remove(child, process)
        if enabled_here:
            try:
                with open(subtree, "w") as handle:
                    handle.write("-memory")
            except OSError:
                pass
