"""kvserve.eval.timing, the one timing helper of the benchmarks and kvserve.eval (CPU parts; the CUDA
ones are the same calls around CUDA events and graphs)."""

from __future__ import annotations

import statistics
import time

from kvserve.eval import timing


def test_stopwatch_and_wall_times_measure_the_calls():
    with timing.Stopwatch() as watch:
        time.sleep(0.02)
    assert 0.015 < watch.seconds < 1.0 and abs(watch.ms - 1e3 * watch.seconds) < 1e-9
    calls = []
    times = timing.wall_times(lambda: calls.append(time.sleep(0.005)), repeats=3, warmup=2, device="cpu")
    assert len(calls) == 5 and len(times) == 3 and all(0.004 < t < 1.0 for t in times)
    assert 0.004 < timing.median_of(lambda: time.sleep(0.005), repeats=3) < 1.0
    assert 0.004 < timing.wall_mean_s(lambda: time.sleep(0.005), repeats=2) < 1.0


def test_percentile_interpolates_between_order_statistics():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert timing.percentile([], 50) is None
    assert timing.percentile([7.0], 99) == 7.0
    assert timing.percentile(values, 0) == 1.0 and timing.percentile(values, 100) == 5.0
    assert timing.percentile(values, 50) == timing.median(values) == 3.0
    inclusive = statistics.quantiles(values, n=100, method="inclusive")   # the same definition
    for q in (1, 10, 37, 99):
        assert abs(timing.percentile(values, q) - inclusive[q - 1]) < 1e-12
