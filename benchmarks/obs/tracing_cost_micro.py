"""Tracing's CPU cost per request, measured directly: the engine recording a request's phases
(a prefill chunk, 100 decode steps kept to at most MAX_STEP_EVENTS), the server building its spans,
and the OTLP protobuf encoding the exporter does (into no network). The serve bench's on/off ratio
(tracing_overhead_bench.py) is this cost hidden in a 2-core machine's noise; this is the cost.

    python benchmarks/obs/tracing_cost_micro.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: E402

from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from kvserve.obs.tracing import RequestTracer  # noqa: E402
from kvserve.sched import phases  # noqa: E402

REQUESTS = 500
DECODE_STEPS = 100


class EncodingExporter(SpanExporter):
    """Encodes what it is given as the OTLP/HTTP exporter does, and sends nothing."""
    seconds = 0.0
    spans = 0

    def export(self, spans):
        started = time.perf_counter()
        encode_spans(spans).SerializeToString()
        EncodingExporter.seconds += time.perf_counter() - started
        EncodingExporter.spans += len(spans)
        return SpanExportResult.SUCCESS


def record() -> list:
    recorder, now = phases.RequestPhases(), time.monotonic()
    recorder.event(phases.REQUEST, now, kv_format="bf16", tenant="", qos_class="", kv_press="", samples=1, priority=0)
    recorder.begin(phases.QUEUED, now, prompt_tokens=30)
    recorder.add(phases.TIER_LOOKUP, now, now, gpu_blocks=0, host_blocks=0, query_tokens=30, cached_tokens=0)
    recorder.end(phases.QUEUED, now)
    recorder.add(phases.PREFILL_CHUNK, now, now, tokens=30, first_position=0, recompute=False, batch_size=4,
                 batch_tokens=40, step_s=0.01, bandwidth_utilization=0.3)
    recorder.begin(phases.DECODE, now)
    for _ in range(DECODE_STEPS):
        recorder.step(now, batch_size=4, batch_tokens=4, step_s=0.01, bandwidth_utilization=0.3)
    return recorder.finish(now)


def main() -> None:
    tracer = RequestTracer("http://127.0.0.1:4318", "bench", exporter=EncodingExporter())
    started = time.perf_counter()
    for _ in range(REQUESTS):
        records = record()
    engine_ms = (time.perf_counter() - started) / REQUESTS * 1e3
    output = RequestOutput("r", None, list(range(30)), None,
                           [CompletionOutput(0, "", list(range(DECODE_STEPS)), None, None, "length", None)], True,
                           RequestMetrics(0.0, 0.0, 0.0, time.monotonic()), 0, records)
    started = time.perf_counter()
    for _ in range(REQUESTS):
        tracer.start({}, "r", time.monotonic(), {}).end({"r": output})
    build_ms = (time.perf_counter() - started) / REQUESTS * 1e3
    tracer.shutdown()
    print(f"per request, {DECODE_STEPS} decode steps ({phases.MAX_STEP_EVENTS} kept as events): engine records "
          f"{engine_ms:.3f} ms, server builds spans {build_ms:.3f} ms, OTLP encoding "
          f"{EncodingExporter.seconds / REQUESTS * 1e3:.3f} ms ({EncodingExporter.spans / REQUESTS:.0f} spans)")


if __name__ == "__main__":
    main()
