"""OpenTelemetry request traces (--otlp-traces-endpoint; docs/observability.md#tracing).

One span per HTTP request (`llm_request`, a child of the caller's span when the request carries a
W3C `traceparent`), and under it one span per phase the engine recorded for it
(kvserve/sched/phases.py): queued, tier_lookup, kv_prefetch, kv_load (tier, blocks, bytes),
each prefill_chunk, decode (its sampled steps as events, each with its batch and bandwidth),
preempted, and the server's own stream_end (from the engine's last token to the response's end).

The engine stamps phases with time.monotonic() in whichever process it runs; the spans are built
here, on the server, once the request is over, with explicit start and end times, so tracing adds
nothing to the engine's step but a few appends per traced request. Export is OTLP over
HTTP/protobuf on the SDK's batch processor thread. The SDK is imported only when tracing is on.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from typing import Any, Mapping, Optional

from kvserve.engine.outputs import RequestOutput
from kvserve.sched import phases

logger = logging.getLogger(__name__)

SERVICE_NAME = "kvserve"
# The path an OTLP/HTTP collector takes traces on, added to an endpoint given without a path
# (http://collector:4318), as the OTLP exporter's environment variables do.
TRACES_PATH = "/v1/traces"
EXPORT_DELAY_MS = 1000


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to; a clear error for what is not an http(s) URL."""
    parsed = urllib.parse.urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL of an OTLP/HTTP collector "
                         f"(e.g. http://127.0.0.1:4318), got {endpoint!r}")
    if parsed.path in ("", "/"):
        parsed = parsed._replace(path=TRACES_PATH)
    return urllib.parse.urlunparse(parsed)


class RequestTracer:
    """The server's tracer: a TracerProvider exporting to one OTLP/HTTP endpoint."""

    def __init__(self, endpoint: str, model_name: str, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        url = traces_url(endpoint)
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=url, timeout=10)
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        # Within a second of a request's end, its trace is out (the SDK's default waits five).
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("kvserve")
        self.propagator = TraceContextTextMapPropagator()
        self.model_name = model_name
        logger.info("tracing requests to %s (OTLP/HTTP)", url)

    def start(self, headers: Mapping[str, str], request_id: str, arrival_time: float,
              attributes: dict[str, Any]) -> "RequestTrace":
        """The trace of one HTTP request that reached the server at `arrival_time`
        (time.monotonic()); its parent is the request's `traceparent`, if any."""
        from opentelemetry.trace import SpanKind
        parent = self.propagator.extract(carrier=dict(headers))
        offset = wall_offset_ns()
        root = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER,
                                      start_time=offset + int(arrival_time * 1e9),
                                      attributes={"gen_ai.request.model": self.model_name,
                                                  "gen_ai.request.id": request_id, **attributes})
        return RequestTrace(self, root, offset)

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter."""
        self.provider.shutdown()


def wall_offset_ns() -> int:
    """Wall-clock minus monotonic nanoseconds now: added to a time.monotonic() stamp, the
    wall-clock time a span carries. Taken once per trace, so that two phases stamped at one
    instant stay at one instant (two readings differ by the nanoseconds between them)."""
    return time.time_ns() - time.monotonic_ns()


class RequestTrace:
    """One request's spans, built when its stream ends (a kvserve.engine.client.StreamTrace)."""

    def __init__(self, tracer: RequestTracer, root: Any, offset_ns: int) -> None:
        self._tracer = tracer
        self.root = root
        self._offset_ns = offset_ns
        self._ended = False

    def _ns(self, stamp: float) -> int:
        """A time.monotonic() stamp as this trace's wall-clock nanoseconds."""
        return self._offset_ns + int(stamp * 1e9)

    @property
    def is_recording(self) -> bool:
        """False when the caller's traceparent asked not to sample it: the engine need not record."""
        return self.root.is_recording()

    def fail(self, status_code: int, message: str) -> None:
        """The request ended in an error before or while it ran."""
        from opentelemetry.trace import Status, StatusCode
        self.root.set_attribute("http.response.status_code", status_code)
        self.root.set_status(Status(StatusCode.ERROR, message))
        self.end({})

    def end(self, final_outputs: dict[str, RequestOutput]) -> None:
        if self._ended:
            return
        self._ended = True
        end_ns = self._ns(time.monotonic())
        try:
            self._build(final_outputs, end_ns)
        except Exception:        # a trace must never break a response
            logger.exception("could not build the trace of a request")
        self.root.end(end_time=end_ns)

    def _build(self, final_outputs: dict[str, RequestOutput], end_ns: int) -> None:
        from opentelemetry import trace
        root = self.root
        context = trace.set_span_in_context(root)
        prompt_tokens = completion_tokens = cached_tokens = 0
        last_finish: Optional[float] = None
        for index, output in enumerate(final_outputs.values()):
            prompt_tokens += len(output.prompt_token_ids)
            completion_tokens += sum(len(sample.token_ids) for sample in output.outputs)
            cached_tokens += output.num_cached_tokens or 0
            if output.metrics is not None and output.metrics.finished_time is not None:
                last_finish = max(last_finish or 0.0, output.metrics.finished_time)
            extra = {"kvserve.prompt_index": index} if len(final_outputs) > 1 else {}
            self._phase_spans(output.phases or [], context, extra)
        root.set_attribute("gen_ai.usage.prompt_tokens", prompt_tokens)
        root.set_attribute("gen_ai.usage.completion_tokens", completion_tokens)
        root.set_attribute("kvserve.cached_tokens", cached_tokens)
        if last_finish is not None:
            self._tracer.tracer.start_span("stream_end", context=context, start_time=self._ns(last_finish),
                                           attributes={"kvserve.outputs": len(final_outputs)}).end(end_time=end_ns)

    def _phase_spans(self, records: list, context: Any, extra: dict[str, Any]) -> None:
        tracer = self._tracer.tracer
        steps = [record for record in records if record[0] == phases.DECODE_STEP]
        decode_span = None
        for name, start, end, attrs in records:
            if name == phases.REQUEST:
                for key, value in attrs.items():
                    if value != "":
                        self.root.set_attribute(f"kvserve.{key}", value)
                continue
            if end is None:
                continue                 # decode steps go on the decode span below
            span = tracer.start_span(name, context=context, start_time=self._ns(start),
                                     attributes={**{f"kvserve.{k}": v for k, v in attrs.items()}, **extra})
            if name == phases.DECODE:
                decode_span = span
                for _, stamp, _, step in steps:
                    span.add_event(phases.DECODE_STEP, {f"kvserve.{k}": v for k, v in step.items()},
                                   timestamp=self._ns(stamp))
            span.end(end_time=self._ns(end))
        if decode_span is None and steps:
            for _, stamp, _, step in steps:
                self.root.add_event(phases.DECODE_STEP, {f"kvserve.{k}": v for k, v in step.items()},
                                    timestamp=self._ns(stamp))
