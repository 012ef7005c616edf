"""Request classes at run time (`classes` in --qos-config; kvserve/sched/qos_config.py): each class's
measured p99 TTFT and TPOT over a sliding window, and whether it misses its targets.

The scheduler reads these to hold the classes' targets with what it measures, not a mean:
- a class runs at its priority (lower first), with the priority policy's ordering and preemption;
- a request of a class that sheds (`on_miss: shed`) is rejected at arrival (503) when the steps
  ahead of it, simulated over the requests of its class and the classes above it (the ones it
  cannot overtake), would give its first token after the class's TTFT target, and in the queue
  once it can no longer start in time;
- while a class with work (running or waiting) misses a p99 target in its window, requests of the
  classes below it are not admitted: the capacity goes to the class that misses, lower priority
  first. Running requests are never preempted for it, and the window forgets, so the lower
  classes come back once the missing class is met again or has no work.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Callable, Optional

from kvserve.sched.qos_config import QoSClass
from kvserve.stats import ClassLatencyStats

# A p99 needs samples: below this many in the window a class is not judged.
MIN_SAMPLES = 20
WINDOW_SAMPLES = 512          # the newest samples kept per class and metric
WINDOW_S = 30.0               # and none older than this


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Window:
    """Samples (time, seconds) of one class and metric; the p99 is kept until the window changes
    (the scheduler asks every step, a sample comes once per finished request)."""

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW_SAMPLES)
        self._p99: Optional[float] = None
        self._fresh = True

    def add(self, now: float, value: float) -> None:
        self.samples.append((now, value))
        self._fresh = False

    def p99(self, now: float) -> Optional[float]:
        while self.samples and self.samples[0][0] < now - WINDOW_S:
            self.samples.popleft()
            self._fresh = False
        if not self._fresh:
            self._p99 = (percentile([value for _, value in self.samples], 0.99)
                         if len(self.samples) >= MIN_SAMPLES else None)
            self._fresh = True
        return self._p99


class ClassLatency:
    def __init__(self, classes: dict[str, QoSClass], clock: Callable[[], float] = time.monotonic) -> None:
        self.classes = classes
        self.clock = clock
        self._ttft = {name: _Window() for name in classes}
        self._tpot = {name: _Window() for name in classes}
        self.finished = collections.Counter()
        self.shed = collections.Counter()
        self.met = collections.Counter()
        self._holding: set[str] = set()

    def observe_finished(self, name: str, ttft_s: Optional[float], tpot_s: Optional[float]) -> None:
        now = self.clock()
        cls = self.classes[name]
        self.finished[name] += 1
        if ttft_s is not None:
            self._ttft[name].add(now, ttft_s)
        if tpot_s is not None:
            self._tpot[name].add(now, tpot_s)
        if ((cls.ttft_p99 is None or (ttft_s is not None and ttft_s <= cls.ttft_p99))
                and (cls.tpot_p99 is None or tpot_s is None or tpot_s <= cls.tpot_p99)):
            self.met[name] += 1

    def observe_shed(self, name: str, count: int = 1) -> None:
        self.shed[name] += count

    def missing(self, name: str) -> bool:
        """Its measured p99 TTFT or TPOT is over its target (False while the window is too thin)."""
        now, cls = self.clock(), self.classes[name]
        ttft, tpot = self._ttft[name].p99(now), self._tpot[name].p99(now)
        return ((cls.ttft_p99 is not None and ttft is not None and ttft > cls.ttft_p99)
                or (cls.tpot_p99 is not None and tpot is not None and tpot > cls.tpot_p99))

    def held_below(self, classes_with_work: set[str]) -> Optional[int]:
        """The priority under which admissions wait: that of the most important class with work that
        misses a target; None when none does."""
        self._holding = {name for name in classes_with_work if self.missing(name)}
        if not self._holding:
            return None
        return min(self.classes[name].priority for name in self._holding)

    def make_stats(self) -> tuple[ClassLatencyStats, ...]:
        now = self.clock()
        return tuple(ClassLatencyStats(name, cls.priority, cls.ttft_p99, cls.tpot_p99, self._ttft[name].p99(now),
                                       self._tpot[name].p99(now), self.finished[name], self.shed[name],
                                       self.met[name], name in self._holding)
                     for name, cls in sorted(self.classes.items()))
