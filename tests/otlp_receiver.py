"""A tiny real OTLP/HTTP trace receiver on loopback, for tests: keeps each export's spans, decoded
with the official `opentelemetry-proto` classes."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

__all__ = ["OtlpReceiver", "attributes"]


def attributes(span_or_event) -> dict:
    """A span's (or event's) attributes as a plain dict."""
    values = {}
    for item in span_or_event.attributes:
        kind = item.value.WhichOneof("value")
        values[item.key] = getattr(item.value, kind) if kind is not None else None
    return values


class OtlpReceiver:
    """`with OtlpReceiver() as receiver:` listens on 127.0.0.1:<port>; `spans` holds every span received."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                with receiver._lock:
                    receiver.requests.append(request)
                    receiver.content_types.append(self.headers.get("content-type", ""))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return [span for request in self.requests for resource in request.resource_spans
                    for scope in resource.scope_spans for span in scope.spans]

    def resources(self) -> list[dict]:
        with self._lock:
            return [attributes(resource.resource) for request in self.requests for resource in request.resource_spans]

    def wait_for_trace(self, trace_id: bytes, count: int, timeout_s: float = 15.0) -> list[Span]:
        """The spans of one trace once `count` of them arrived (or what arrived by the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [span for span in self.spans if span.trace_id == trace_id]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.05)
