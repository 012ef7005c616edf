"""One timing helper for every measurement: the scripts in benchmarks/ and kvserve.eval's own.

Host clock (any device): `now()` is the clock all of them read (time.perf_counter). A `Stopwatch`
waits for the device's queued work before it starts and before it stops, so what it measures is
the work itself, not how far ahead of the device the host ran; `wall_times` / `median_of` time a
function call by call that way, `wall_mean_s` times back-to-back calls as one span (for calls too
short to time one by one).

GPU clock (CUDA): `cuda_event_times_ms` / `cuda_event_mean_ms` put CUDA events around each call or
around a run of calls (GPU time, without the host's launch cost); `capture_graph` captures a
function into a CUDA graph after warming it up on a side stream, which is how a decode step runs;
`do_bench_ms` is triton.testing.do_bench's median (L2 flushed before each repetition) and
`graph_do_bench_ms` the same over a captured graph's replays.

Statistics: `median`, `percentile` (linear interpolation between order statistics).

This module imports nothing from kvserve, and torch only inside the functions that touch a device,
so benchmarks/cpu/vllm_cpu_baseline.py can load it by its path in vLLM's own environment.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

now = time.perf_counter


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    return (device if isinstance(device, str) else getattr(device, "type", str(device))).startswith("cuda")


def synchronize(device: Any = None) -> None:
    """Wait until `device` (a torch.device or its name) has finished its queued work; nothing for the
    CPU or None."""
    if _is_cuda(device):
        import torch
        torch.cuda.synchronize(device)


class Stopwatch:
    """`with Stopwatch(device) as watch: ...` then `watch.seconds` / `watch.ms`; the device is
    synchronized on entry and on exit."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.started = 0.0
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        synchronize(self.device)
        self.started = now()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = now() - self.started

    @property
    def ms(self) -> float:
        return self.seconds * 1e3


def wall_times(fn: Callable[[], Any], repeats: int, warmup: int = 0, device: Any = None) -> list[float]:
    """Seconds of each of `repeats` calls of fn() (after `warmup` untimed ones), the device
    synchronized around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Stopwatch(device) as watch:
            fn()
        times.append(watch.seconds)
    return times


def median_of(fn: Callable[[], Any], repeats: int, warmup: int = 1, device: Any = None) -> float:
    """Median seconds of fn() over `repeats` calls (wall_times)."""
    return median(wall_times(fn, repeats, warmup, device))


def wall_mean_s(fn: Callable[[], Any], repeats: int, device: Any = None) -> float:
    """Seconds per call of `repeats` back-to-back calls timed as one span (device synced at both ends)."""
    with Stopwatch(device) as watch:
        for _ in range(repeats):
            fn()
    return watch.seconds / repeats


def _event_pair():
    import torch
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def cuda_event_times_ms(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> list[float]:
    """GPU milliseconds of each of `repeats` calls of fn(), a CUDA event pair around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = _event_pair()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def cuda_event_mean_ms(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> float:
    """GPU milliseconds per call of `repeats` back-to-back calls, one CUDA event pair around them all."""
    for _ in range(warmup):
        fn()
    start, end = _event_pair()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def capture_graph(fn: Callable[[], Any], warmup: int = 1):
    """fn() run `warmup` times on a side stream (compiles, allocates), then captured into a CUDA
    graph; returns the torch.cuda.CUDAGraph (call .replay())."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def do_bench_ms(fn: Callable[[], Any], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() by triton.testing.do_bench (L2 flushed before each repetition)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_do_bench_ms(fn: Callable[[], Any], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """do_bench_ms of fn() replayed from a CUDA graph: the GPU time without Python's launch overhead,
    which is what a graph-captured decode step pays (eager launches of small kernels can take longer
    on the host than on the GPU; do_bench then measures the host)."""
    fn()                                       # compile outside the capture
    return do_bench_ms(capture_graph(fn).replay, warmup_ms, rep_ms)


def median(values) -> float:
    return statistics.median(values)


def percentile(values: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100), linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
