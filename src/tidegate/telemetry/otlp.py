"""OTLP trace protobuf, written by hand: spans into the bytes of an `ExportTraceServiceRequest`
(opentelemetry/proto/collector/trace/v1), the body of an OTLP/HTTP export.

Why not the OpenTelemetry SDK's encoder: it builds a protobuf object per span, attribute and value,
about 22 µs a span here (bench/gateway_overhead.py --tracing), more than the whole budget of a traced
request. The wire format of the handful of messages a span needs is small and stable, so a span is
encoded here once, at the request's end, straight to bytes; tests decode it with the official
`opentelemetry-proto` classes and compare it with the SDK's own encoding.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["SpanKind", "SpanRecord", "encode_span", "encode_export_request", "traces_url", "AttributeValue",
           "varint", "length_field", "key_field", "span_attribute", "span_attributes", "export_request_head"]

AttributeValue = str | bool | int | float


class SpanKind(IntEnum):
    """opentelemetry.proto.trace.v1.Span.SpanKind"""

    INTERNAL = 1
    SERVER = 2
    CLIENT = 3


@dataclass(slots=True)
class SpanRecord:
    """One finished span: ids, times in Unix nanoseconds, attributes, events (name, time, attributes)."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int  # 0: a root span
    kind: SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue]
    events: Sequence[tuple[str, int, dict[str, AttributeValue]]] = ()
    error: str | None = None  # status ERROR with this message; None: status unset
    tracestate: bytes = b""
    flags: int = 0x01  # W3C trace flags (sampled)
    remote_parent: bool = False  # the parent span is the caller's, from its traceparent
    # names `attributes` exactly (spans with the same key have the same attributes), so that they are
    # encoded once per key; None: encoded attribute by attribute
    attributes_key: Hashable | None = None
    # more attributes, this span's own (ids, measured values): never cached as a set
    request_attributes: dict[str, AttributeValue] | None = None


_pack_double = struct.Struct("<d").pack


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    if value < 0x4000:  # most lengths: a span is a few hundred bytes
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + _varint(len(payload)) + payload


_KEYS: dict[str, bytes] = {}  # attribute key -> its encoded `KeyValue.key` field: keys are few and constant


def _key(name: str) -> bytes:
    encoded = _KEYS.get(name)
    if encoded is None:
        encoded = _KEYS[name] = _field(b"\x0a", name.encode())
    return encoded


def _any_value(value: AttributeValue) -> bytes:
    # AnyValue: 1 string, 2 bool, 3 int64 (varint, two's complement), 4 double
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if value is True or value is False:
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)
    return b"\x21" + _pack_double(value)


_ENCODED_LIMIT = 16_384  # encoded attributes kept; past it the cache starts over


def _attributes(tag: bytes, attributes: dict[str, AttributeValue], cache: dict[tuple[str, AttributeValue], bytes]
                ) -> bytes:
    """Repeated KeyValue under `tag`. Each (key, value) pair is encoded once and then looked up: a
    gateway's attributes repeat (models, tenants, tiers, replicas, statuses, token counts); strings
    and floats of one request's own (ids, times) are encoded as they come, not to churn the cache. A
    key must keep one type: (key, True) and (key, 1) are the same pair to a dict."""
    out = []
    for item in attributes.items():
        encoded = cache.get(item)
        if encoded is None:
            name, value = item
            encoded = _field(tag, _key(name) + _field(b"\x12", _any_value(value)))
            if len(cache) >= _ENCODED_LIMIT:
                cache.clear()
            cache[item] = encoded
        out.append(encoded)
    return b"".join(out)


# the parts a span encoder of its own (gateway/trace_spans.py) writes the same bytes with
varint = _varint
length_field = _field
key_field = _key


def span_attribute(name: str, value: AttributeValue) -> bytes:
    """One element of `Span.attributes` (field 9)."""
    return _field(b"\x4a", _key(name) + _field(b"\x12", _any_value(value)))


def span_attributes(attributes: dict[str, AttributeValue]) -> bytes:
    """`Span.attributes`, every pair encoded anew: for a set that is then kept encoded."""
    return b"".join(span_attribute(name, value) for name, value in attributes.items())


def _own_attributes(attributes: dict[str, AttributeValue]) -> bytes:
    """A span's own attributes under Span.attributes: integers (token counts) repeat, the rest not."""
    out = []
    for item in attributes.items():
        name, value = item
        if value.__class__ is int:
            encoded = _SPAN_ATTRIBUTES.get(item)
            if encoded is None:
                encoded = _SPAN_ATTRIBUTES[item] = _field(b"\x4a", _key(name) + _field(b"\x12", _any_value(value)))
        elif value.__class__ is str and len(value) < 120:  # an id: one length byte at every level
            text = value.encode()
            key = _key(name)
            size = len(text)
            encoded = b"\x4a" + _varint(len(key) + size + 4) + key + bytes((0x12, size + 2, 0x0A, size)) + text
        else:
            encoded = _field(b"\x4a", _key(name) + _field(b"\x12", _any_value(value)))
        out.append(encoded)
    return b"".join(out)


def _attribute_block(span: SpanRecord) -> bytes:
    """The encoded `attributes` of a span, once per `attributes_key`."""
    key = span.attributes_key
    if key is None:
        return _attributes(b"\x4a", span.attributes, _SPAN_ATTRIBUTES)
    block = _BLOCKS.get(key)
    if block is None:
        if len(_BLOCKS) >= _ENCODED_LIMIT:
            _BLOCKS.clear()
        block = _BLOCKS[key] = _attributes(b"\x4a", span.attributes, _SPAN_ATTRIBUTES)
    return block


_SPAN_ATTRIBUTES: dict[tuple[str, AttributeValue], bytes] = {}
_EVENT_ATTRIBUTES: dict[tuple[str, AttributeValue], bytes] = {}
_EVENT_NAMES: dict[str, bytes] = {}
_SPAN_NAMES: dict[tuple[str, int], bytes] = {}  # (name, kind) -> encoded fields 5 and 6
_BLOCKS: dict[Hashable, bytes] = {}  # a span's attributes_key -> its encoded attributes


_IDS = struct.Struct(">BBQQBBQ").pack  # trace_id (1, 16 bytes) and span_id (2, 8 bytes), big-endian
_PARENT = struct.Struct(">BBQ").pack  # parent_span_id (4)
_TIMES = struct.Struct("<BQBQ").pack  # start (7) and end (8) time, fixed64
_FLAGS = struct.Struct("<BBI").pack  # flags (16), fixed32
_EVENT_TIME = struct.Struct("<BQ").pack
_LOW64 = 0xFFFF_FFFF_FFFF_FFFF


def encode_span(span: SpanRecord) -> bytes:
    """opentelemetry.proto.trace.v1.Span, framed as an element of `ScopeSpans.spans` (field 2): ready to
    be joined into `encode_export_request`."""
    trace_id = span.trace_id
    parts = [_IDS(0x0A, 16, trace_id >> 64, trace_id & _LOW64, 0x12, 8, span.span_id)]
    if span.tracestate:
        parts.append(_field(b"\x1a", span.tracestate))
    if span.parent_id:
        parts.append(_PARENT(0x22, 8, span.parent_id))
    named = _SPAN_NAMES.get((span.name, span.kind))
    if named is None:
        if len(_SPAN_NAMES) >= _ENCODED_LIMIT:
            _SPAN_NAMES.clear()
        named = _SPAN_NAMES[span.name, span.kind] = _field(b"\x2a", span.name.encode()) + b"\x30" + bytes((span.kind,))
    parts += (named, _TIMES(0x39, span.start_ns, 0x41, span.end_ns), _attribute_block(span))
    if span.request_attributes:
        parts.append(_own_attributes(span.request_attributes))
    for name, time_ns, attributes in span.events:
        event_name = _EVENT_NAMES.get(name)
        if event_name is None:
            event_name = _EVENT_NAMES[name] = _field(b"\x12", name.encode())
        event = _EVENT_TIME(0x09, time_ns) + event_name
        if attributes:
            event += _attributes(b"\x1a", attributes, _EVENT_ATTRIBUTES)
        parts.append(_field(b"\x5a", event))
    if span.error is not None:  # Status: 2 message, 3 code (2 = ERROR)
        parts.append(_field(b"\x7a", _field(b"\x12", span.error.encode()) + b"\x18\x02"))
    # flags: the W3C trace flags, and whether the parent's context came from another process (0x100
    # says the bit 0x200 is set on purpose)
    parts.append(_FLAGS(0x85, 0x01, (span.flags & 0xFF) | (0x300 if span.remote_parent else 0x100)))
    encoded = b"".join(parts)
    return b"\x12" + _varint(len(encoded)) + encoded


def encode_export_request(resource: dict[str, AttributeValue], scope_name: str, scope_version: str,
                          spans: list[bytes]) -> bytes:
    """An ExportTraceServiceRequest of spans from `encode_span`, of one resource and instrumentation scope."""
    return b"".join(export_request_head(resource, scope_name, scope_version, sum(map(len, spans))) + spans)


def export_request_head(resource: dict[str, AttributeValue], scope_name: str, scope_version: str,
                        spans_size: int) -> list[bytes]:
    """The ExportTraceServiceRequest up to its spans, `spans_size` bytes of them (from `encode_span`),
    which follow it: so that a large export is joined once."""
    scope = _field(b"\x0a", _field(b"\x0a", scope_name.encode()) + _field(b"\x12", scope_version.encode()))
    resource_field = _field(b"\x0a", _attributes(b"\x0a", resource, {}))
    scope_spans_size = len(scope) + spans_size
    scope_spans_head = b"\x12" + _varint(scope_spans_size) + scope
    resource_spans_size = len(resource_field) + len(scope_spans_head) + scope_spans_size - len(scope)
    return [b"\x0a" + _varint(resource_spans_size) + resource_field + scope_spans_head]


def traces_url(endpoint: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT's rule: a base URL gets `/v1/traces`; one that names it is kept."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"
