"""The hand-written OTLP protobuf encoder against the official proto classes and the SDK's encoder."""

from __future__ import annotations

import pytest

from tidegate.telemetry.otlp import SpanKind, SpanRecord, encode_export_request, encode_span

trace_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tidegate.telemetry.otel_sdk import SdkSpanSink  # noqa: E402

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736


def _spans() -> list[SpanRecord]:
    root = SpanRecord("chat tiny", TRACE_ID, 0x1111, 0x00F067AA0BA902B7, SpanKind.SERVER, 1_700_000_000_000_000_000,
                      1_700_000_000_250_000_000,
                      {"gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny", "http.response.status_code": 503,
                       "tidegate.flag": True, "tidegate.ratio": 0.25, "tidegate.negative": -7},
                      (("first_token", 1_700_000_000_100_000_000, {"tidegate.n": 3}),), error="upstream failed",
                      tracestate=b"vendor=abc", remote_parent=True, attributes_key=("root", 1),
                      request_attributes={"tidegate.request_id": "r-1", "gen_ai.usage.input_tokens": 12,
                                          "tidegate.long": "x" * 300})
    attempt = SpanRecord("chat upstream-model", TRACE_ID, 0x2222, 0x1111, SpanKind.CLIENT, 1_700_000_000_010_000_000,
                         1_700_000_000_200_000_000, {"server.port": 8000, "tidegate.attempt": 1},
                         tracestate=b"vendor=abc")
    return [root, attempt]


def _decode(spans: list[bytes]):
    body = encode_export_request({"service.name": "tidegate", "service.version": "0.1.0"}, "tidegate", "0.1.0", spans)
    return trace_pb2.ExportTraceServiceRequest.FromString(body)


def test_official_classes_read_every_field() -> None:
    request = _decode([encode_span(span) for span in _spans()])
    resource_spans = request.resource_spans[0]
    assert {a.key: a.value.string_value for a in resource_spans.resource.attributes} == {
        "service.name": "tidegate", "service.version": "0.1.0"}
    scope_spans = resource_spans.scope_spans[0]
    assert scope_spans.scope.name == "tidegate"
    root, attempt = scope_spans.spans
    assert root.trace_id == TRACE_ID.to_bytes(16, "big") and root.span_id == (0x1111).to_bytes(8, "big")
    assert root.parent_span_id == (0x00F067AA0BA902B7).to_bytes(8, "big")
    assert root.trace_state == "vendor=abc" and root.name == "chat tiny" and root.kind == 2
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (1_700_000_000_000_000_000, 1_700_000_000_250_000_000)
    values = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in root.attributes}
    assert values == {"gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny", "http.response.status_code": 503,
                      "tidegate.flag": True, "tidegate.ratio": 0.25, "tidegate.negative": -7,
                      "tidegate.request_id": "r-1", "gen_ai.usage.input_tokens": 12, "tidegate.long": "x" * 300}
    assert root.events[0].name == "first_token" and root.events[0].time_unix_nano == 1_700_000_000_100_000_000
    assert root.status.code == 2 and root.status.message == "upstream failed"
    assert root.flags == 0x301  # sampled, parent's context known to be remote
    assert attempt.kind == 3 and attempt.parent_span_id == (0x1111).to_bytes(8, "big") and attempt.flags == 0x101


def test_same_spans_as_the_sdk_encoder_makes() -> None:
    exporter = InMemorySpanExporter()
    SdkSpanSink(SimpleSpanProcessor(exporter), {"service.name": "tidegate"}, "0.1.0").submit(_spans())
    theirs = encode_spans(exporter.get_finished_spans()).resource_spans[0].scope_spans[0].spans
    ours = _decode([encode_span(span) for span in _spans()]).resource_spans[0].scope_spans[0].spans
    assert len(ours) == len(theirs) == 2
    for mine, sdk in zip(ours, theirs):
        # the SDK leaves the W3C trace flags out of Span.flags (bits 0-7); the rest is the same message
        assert mine.flags & 0xFF == 0x01 and mine.flags & ~0xFF == sdk.flags
        mine.flags = sdk.flags
        assert sorted(mine.attributes, key=lambda a: a.key) == sorted(sdk.attributes, key=lambda a: a.key)
        del mine.attributes[:], sdk.attributes[:]
        if not mine.HasField("status") and sdk.status.code == 0 and not sdk.status.message:
            sdk.ClearField("status")  # the SDK writes an empty status; unset is the same status
        assert mine == sdk
