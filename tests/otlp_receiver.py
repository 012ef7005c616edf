"""A real OTLP/HTTP trace receiver for tests: a loopback HTTP server that takes what an
OpenTelemetry exporter posts to /v1/traces and decodes it with opentelemetry-proto."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str                 # hex, as in a traceparent
    span_id: str
    parent_span_id: str           # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    service: str = ""


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class OTLPReceiver:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                spans = []
                for resource_spans in request.resource_spans:
                    service = _attributes(resource_spans.resource.attributes).get("service.name", "")
                    for scope in resource_spans.scope_spans:
                        for span in scope.spans:
                            spans.append(ReceivedSpan(
                                span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                                span.start_time_unix_nano, span.end_time_unix_nano, _attributes(span.attributes),
                                [(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in span.events],
                                service))
                with lock:
                    receiver.spans.extend(spans)
                    receiver.posts += 1
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 20.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(list(self.spans)):
                return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"the spans did not arrive within {timeout} s: got {[s.name for s in self.spans]}")

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.trace_id == trace_id]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
