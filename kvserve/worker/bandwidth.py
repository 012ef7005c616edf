"""Memory bandwidth per engine step: the bytes a step had to read (weights by their stored dtype,
plus the KV its attention read, in the cache's format) over the step's time, against the copy
bandwidth this machine measures once at start.

Decode is bound by these reads: a step's utilisation says how close it runs to the memory's
limit, and so how much a bigger batch, a smaller KV format or fewer weight bytes can still buy
(docs/observability.md#bandwidth).
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from kvserve.model.moe import DeepseekMoE
from kvserve.stats import BandwidthStats

# Upper bounds of the per-step utilisation histogram (a fraction of the measured copy bandwidth;
# a step can pass 1.0 when its reads hit a cache, e.g. a small model on a CPU).
UTILIZATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, float("inf"))
# The gauge is the utilisation over the steps of this last stretch of time: one step alone is noisy.
GAUGE_WINDOW_S = 1.0

# Copy sizes: well past the last-level cache, so the copy runs at the memory's rate.
_GPU_COPY_BYTES = 1 << 30
_CPU_COPY_BYTES = 128 << 20


@functools.lru_cache(maxsize=None)
def measure_copy_bandwidth(device: str) -> tuple[float, str]:
    """(bytes per second, how) of a device-to-device copy on `device`, counting what it reads and
    what it writes: the traffic a memory-bound step can at best sustain. Measured once per process
    and device (a GPU: tens of milliseconds; a CPU: about a tenth of a second)."""
    dev = torch.device(device)
    nbytes = _GPU_COPY_BYTES if dev.type == "cuda" else _CPU_COPY_BYTES
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.copy_(src)                           # first touch: page faults and lazy init stay out
    best = float("inf")
    for _ in range(3 if dev.type == "cuda" else 2):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / 5)
        else:
            started = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - started)
    del src, dst
    if dev.type == "cuda":
        torch.cuda.empty_cache()     # the KV cache is sized from the memory left free after this
    how = f"{dev.type} copy {nbytes >> 20} MiB, read + write"
    return 2 * nbytes / best, how


@dataclass(frozen=True)
class WeightProfile:
    """The weight bytes a forward reads: every dense weight once, each MoE layer only the experts
    the step's tokens are routed to."""
    dense_bytes: int
    # Per MoE layer: (experts, experts per token, bytes of one expert's weights).
    moe_layers: tuple[tuple[int, int, int], ...] = ()

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Weight bytes a step of `num_tokens` tokens reads. With routing taken as uniform, the
        experts a layer touches are E * (1 - (1 - k/E)^T) in expectation."""
        total = self.dense_bytes
        for num_experts, top_k, expert_bytes in self.moe_layers:
            touched = num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)
            total += int(touched * expert_bytes)
        return total


def weight_profile(model: nn.Module) -> WeightProfile:
    """What `model`'s forward reads of its weights: every module's own weights and biases, as
    parameters or as the buffers a load repacked them into (the CPU path's `packed_weight`), once each. An input
    embedding reads only its tokens' rows (left out); tied to the LM head, the head reads it whole."""
    moe_layers = []
    counted: set[int] = set()
    dense = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        own: list[torch.Tensor] = []
        if isinstance(module, DeepseekMoE):
            moe_layers.append((module.num_experts, module.top_k, module.w13[0].nbytes + module.w2[0].nbytes))
            own = [module.gate_weight]
        else:
            own = list(module.parameters(recurse=False))
            own += [buf for name, buf in module.named_buffers(recurse=False) if "weight" in name or name == "bias"]
        for tensor in own:
            if id(tensor) not in counted:
                counted.add(id(tensor))
                dense += tensor.nbytes
    return WeightProfile(dense, tuple(moe_layers))


class BandwidthMeter:
    """Per-step bytes and times, their totals and the utilisation histogram (the engine's own)."""

    def __init__(self, weights: WeightProfile, kv_bytes_per_token: int, peak_bytes_per_s: float,
                 peak_source: str) -> None:
        self.weights = weights
        self.kv_bytes_per_token = kv_bytes_per_token
        self.peak_bytes_per_s = peak_bytes_per_s
        self.peak_source = peak_source
        self.steps = 0
        self.bytes_read_total = 0
        self.seconds_total = 0.0
        self.last_bytes = 0
        self.last_seconds = 0.0
        self._bucket_counts = [0] * len(UTILIZATION_BUCKETS)
        self._utilization_sum = 0.0
        self._window: collections.deque[tuple[float, int, float]] = collections.deque()

    def step_bytes(self, num_tokens: int, num_kv_tokens: int) -> int:
        """Bytes a step of `num_tokens` new tokens reads when its attention reads `num_kv_tokens`
        tokens' KV (each request's context, the new tokens included, summed)."""
        return self.weights.bytes_for_tokens(num_tokens) + self.kv_bytes_per_token * num_kv_tokens

    def observe(self, bytes_read: int, seconds: float, now: Optional[float] = None) -> float:
        """One step; returns its utilisation."""
        seconds = max(seconds, 1e-9)
        utilization = bytes_read / seconds / self.peak_bytes_per_s
        self.steps += 1
        self.bytes_read_total += bytes_read
        self.seconds_total += seconds
        self.last_bytes, self.last_seconds = bytes_read, seconds
        self._utilization_sum += utilization
        for index, bound in enumerate(UTILIZATION_BUCKETS):
            if utilization <= bound:
                self._bucket_counts[index] += 1
                break
        now = time.monotonic() if now is None else now
        self._window.append((now, bytes_read, seconds))
        while self._window and self._window[0][0] < now - GAUGE_WINDOW_S:
            self._window.popleft()
        return utilization

    def recent_utilization(self) -> float:
        """Over the steps of the last GAUGE_WINDOW_S: their bytes over their time, against the peak."""
        seconds = sum(entry[2] for entry in self._window)
        if seconds <= 0:
            return 0.0
        return sum(entry[1] for entry in self._window) / seconds / self.peak_bytes_per_s

    def make_stats(self) -> Optional[BandwidthStats]:
        if self.steps == 0:
            return None
        return BandwidthStats(
            peak_bytes_per_s=self.peak_bytes_per_s, peak_source=self.peak_source, steps=self.steps,
            bytes_read_total=self.bytes_read_total, weight_bytes_per_step=self.weights.bytes_for_tokens(1),
            last_bytes_read=self.last_bytes, last_step_s=self.last_seconds,
            recent_utilization=self.recent_utilization(),
            utilization_buckets=tuple(zip(UTILIZATION_BUCKETS, self._bucket_counts)),
            utilization_sum=self._utilization_sum, seconds_total=self.seconds_total)
