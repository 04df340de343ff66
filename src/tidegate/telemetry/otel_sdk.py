"""Spans through the OpenTelemetry SDK (`pip install 'tidegate[tracing]'`): for OTLP over gRPC, or any
SDK span processor and exporter (the tests hand it an `InMemorySpanExporter`).

The gateway's spans are built when a request ends, with times and ids it chose on the way (the
upstream already holds an attempt's span id in its traceparent), so they reach the processor as
finished `ReadableSpan`s instead of through a `Tracer`. Costs more CPU than the built-in exporter:
the SDK's OTLP encoder builds a protobuf object per span and attribute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from tidegate.telemetry.otlp import AttributeValue, SpanKind, SpanRecord

__all__ = ["SdkSpanSink", "sdk_exporter", "MissingTracingExtra"]

_INSTALL = "pip install 'tidegate[tracing]'"


class MissingTracingExtra(RuntimeError):
    """The SDK, or the exporter the config names, is not installed."""


def _sdk() -> Any:
    try:
        from opentelemetry import trace as api
        from opentelemetry.sdk import trace as sdk
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    except ImportError:
        raise MissingTracingExtra(f"tracing.exporter: sdk needs the OpenTelemetry SDK ({_INSTALL})") from None
    return api, sdk, Resource, InstrumentationScope


class SdkSpanSink:
    """A `SpanSink` that hands finished spans to an SDK span processor (a BatchSpanProcessor for export)."""

    def __init__(self, processor: Any, resource: Mapping[str, AttributeValue], scope_version: str) -> None:
        api, sdk, resource_class, scope_class = _sdk()
        self._api = api
        self._readable = sdk.ReadableSpan
        self.processor = processor
        self._resource = resource_class.create(dict(resource))
        self._scope = scope_class("tidegate", scope_version)
        self._kinds = {SpanKind.INTERNAL: api.SpanKind.INTERNAL, SpanKind.SERVER: api.SpanKind.SERVER,
                       SpanKind.CLIENT: api.SpanKind.CLIENT}
        self._sdk_event = sdk.Event

    def submit_trace(self, trace: Any) -> None:
        """An ended request's trace (gateway/tracing.py `RequestTrace`): its spans, built now."""
        self.submit(trace.spans())

    def submit(self, spans: list[SpanRecord]) -> None:
        api = self._api
        for span in spans:
            flags = api.TraceFlags(span.flags)
            state = api.TraceState.from_header([span.tracestate.decode()]) if span.tracestate else None
            context = api.SpanContext(span.trace_id, span.span_id, False, flags, state)
            parent = api.SpanContext(span.trace_id, span.parent_id, span.remote_parent, flags, state) \
                if span.parent_id else None
            status = api.Status(api.StatusCode.ERROR, span.error) if span.error is not None else api.Status()
            events = [self._sdk_event(name, attributes, time_ns) for name, time_ns, attributes in span.events]
            attributes = {**span.attributes, **(span.request_attributes or {})}
            self.processor.on_end(self._readable(
                span.name, context=context, parent=parent, resource=self._resource, attributes=attributes,
                events=events, kind=self._kinds[span.kind], status=status, start_time=span.start_ns,
                end_time=span.end_ns, instrumentation_scope=self._scope))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        # the batch processor's last export blocks on the network: off the event loop
        await asyncio.get_running_loop().run_in_executor(None, self.processor.shutdown)


def sdk_exporter(protocol: str, endpoint: str, headers: Mapping[str, str], timeout_s: float) -> Any:
    """The SDK's OTLP span exporter for `protocol` (http/protobuf, grpc)."""
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            return OTLPSpanExporter(endpoint=endpoint, headers=dict(headers) or None, timeout=timeout_s,
                                    insecure=endpoint.startswith("http://"))
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        from tidegate.telemetry.otlp import traces_url
        return HttpExporter(endpoint=traces_url(endpoint), headers=dict(headers) or None, timeout=timeout_s)
    except ImportError:
        package = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" \
            else "opentelemetry-exporter-otlp-proto-http"
        raise MissingTracingExtra(f"tracing over {protocol} through the SDK needs {package} ({_INSTALL}"
                                  + (", then pip install opentelemetry-exporter-otlp-proto-grpc)" if protocol == "grpc"
                                     else ")")) from None
