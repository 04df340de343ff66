"""Ended request traces (gateway/tracing.py) straight into OTLP span bytes, many at a time.

Why its own encoder: a traced request's spans are few and always of the same four kinds, and most of
each span repeats across requests (its name, kind and attributes: model, tenant, tier, replica,
status). A `SpanShape` holds those parts of one span, encoded once per distinct set; a span is then
its ids and times packed with `struct`, between the shape's bytes, plus the few attributes that are
the request's own (its id, token counts). No `SpanRecord`, attribute dict or protobuf object is made
per request.

Why in batches: the exporter's task encodes the requests ended since its last export in one loop,
off the requests' way. Interleaved with the request path, the same Python work costs 2.5-3x what it
costs in a loop of its own here (caches and branch predictors cold after a request's other work);
in a batch the encoder's code and shapes stay warm.

The bytes are exactly those of `telemetry.otlp.encode_span` for the spans `RequestTrace.spans`
builds (tests/gateway/test_trace_spans.py checks it, and decodes them with the official classes).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from tidegate.gateway.tracing import (
    admission_attributes,
    admission_decided_s,
    admission_key,
    attempt_attributes,
    attempt_end,
    queue_attributes,
    root_attributes,
    root_key,
)
from tidegate.telemetry.otlp import SpanKind, key_field, length_field, span_attribute, span_attributes, varint

if TYPE_CHECKING:
    from tidegate.gateway.tracing import RequestTrace

__all__ = ["SpanShape", "TraceEncoder"]

_IDS = struct.Struct(">BBQQBBQ").pack  # trace_id (1, 16 bytes) and span_id (2, 8 bytes), big-endian
_PARENT = struct.Struct(">BBQ").pack  # parent_span_id (4)
_TIMES = struct.Struct("<BQBQ").pack  # start (7) and end (8) time, fixed64
_FLAGS = struct.Struct("<BBI").pack  # flags (16), fixed32
_FIRST_TOKEN = struct.Struct("<BBBQ").pack  # an event (11): its time (1), then its name (below)
_FIRST_TOKEN_NAME = length_field(b"\x12", b"first_token")
_DOUBLE = struct.Struct("<d").pack
_LOW64 = 0xFFFF_FFFF_FFFF_FFFF
# Span.flags: sampled, and whether the parent's context came from another process (0x100 says the
# bit 0x200 is set on purpose): only a root under a client's span has a remote parent
_LOCAL_FLAGS = _FLAGS(0x85, 0x01, 0x101)
_REMOTE_FLAGS = _FLAGS(0x85, 0x01, 0x301)
_PREDICTED_WAIT = b"tidegate.queue.predicted_wait_s"
_SHAPES = 4096  # distinct shapes kept; past it they are made anew
# a span's frame as an element of ScopeSpans.spans (field 2), by the span's size: spans are a few
# hundred bytes; one past the table is framed as it comes
_FRAMES = [b"\x12" + varint(size) for size in range(4096)]
_OWN = 4096  # encoded (name, integer) attributes kept


class SpanShape:
    """What spans with the same attributes share: the encoded name and kind (fields 5, 6) and the
    encoded attributes (field 9)."""

    __slots__ = ("named", "attributes")

    def __init__(self, name: str, kind: SpanKind, attributes: bytes) -> None:
        self.named = length_field(b"\x2a", name.encode()) + bytes((0x30, kind))
        self.attributes = attributes


class TraceEncoder:
    """Encodes ended `RequestTrace`s; holds the shapes seen (bounded)."""

    def __init__(self) -> None:
        self._shapes: dict[Hashable, SpanShape] = {}
        self._own: dict[tuple[bytes, int], bytes] = {}
        self._request_id_key = key_field("tidegate.request_id")
        self._predicted_wait_head = (b"\x4a" + varint(len(key_field(_PREDICTED_WAIT.decode())) + 11)
                                     + key_field(_PREDICTED_WAIT.decode()) + b"\x12\x09\x21")

    def _shape(self, key: Hashable, name: str, kind: SpanKind, build: Callable[[tuple], dict]) -> SpanShape:
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= _SHAPES:
                self._shapes.clear()
            shape = self._shapes[key] = SpanShape(name, kind, span_attributes(build(key)))  # type: ignore[arg-type]
        return shape

    def _integer(self, name: str, value: int) -> bytes:
        item = (name, value)
        encoded = self._own.get(item)  # type: ignore[arg-type]
        if encoded is None:
            if len(self._own) >= _OWN:
                self._own.clear()
            encoded = self._own[item] = span_attribute(name, value)  # type: ignore[index]
        return encoded

    def encode(self, traces: list[RequestTrace], anchor_s: float, anchor_ns: int) -> bytes:
        """The spans of `traces`, each framed as an element of `ScopeSpans.spans`, joined. `anchor_s`,
        `anchor_ns`: one reading of the tracer's monotonic clock and of Unix time, side by side."""
        return b"".join(self.encode_chunks(traces, anchor_s, anchor_ns))

    def encode_chunks(self, traces: list[RequestTrace], anchor_s: float, anchor_ns: int) -> list[bytes]:
        """`encode`, in pieces not joined (the exporter joins them once, into its request)."""
        out: list[bytes] = []
        append = out.append
        frames = _FRAMES
        shapes = self._shapes
        for trace in traces:
            trace.settle()
            # times: monotonic seconds to Unix nanoseconds, as RequestTrace.spans does
            trace_id, root_id, parent_id = trace.trace_id, trace.span_id, trace.parent_id
            hi, lo = trace_id >> 64, trace_id & _LOW64
            state = trace.tracestate
            state_field = length_field(b"\x1a", state) if state else b""
            under_root = state_field + _PARENT(0x22, 8, root_id)
            start_ns = anchor_ns + int((trace.started_s - anchor_s) * 1e9)

            # the root span
            key = root_key(trace)
            shape = shapes.get(key)
            if shape is None:
                shape = self._shape(key, f"{trace.operation} {trace.model}", SpanKind.SERVER, root_attributes)
            request_id = trace.request_id
            size = len(request_id)
            if size < 100 and request_id.isascii():  # one length byte at every level
                own = (b"\x4a" + bytes((size + 25,)) + self._request_id_key + bytes((0x12, size + 2, 0x0A, size))
                       + request_id)
            else:
                own = span_attribute("tidegate.request_id", request_id.decode("latin-1"))
            if trace.input_tokens is not None:
                own += self._integer("gen_ai.usage.input_tokens", trace.input_tokens)
            if trace.output_tokens is not None:
                own += self._integer("gen_ai.usage.output_tokens", trace.output_tokens)
            elif trace.output_estimate is not None:
                own += self._integer("tidegate.output_tokens_estimate", trace.output_estimate)
            if trace.first_token_s is not None:
                own += _FIRST_TOKEN(0x5A, 22, 0x09, anchor_ns + int((trace.first_token_s - anchor_s) * 1e9)) \
                    + _FIRST_TOKEN_NAME
            if trace.error is not None:
                own += length_field(b"\x7a", length_field(b"\x12", trace.error.encode()) + b"\x18\x02")
            body = b"".join((_IDS(0x0A, 16, hi, lo, 0x12, 8, root_id), state_field,
                             _PARENT(0x22, 8, parent_id) if parent_id else b"", shape.named,
                             _TIMES(0x39, start_ns, 0x41, anchor_ns + int((trace.ended_s - anchor_s) * 1e9)),
                             shape.attributes, own, _REMOTE_FLAGS if parent_id else _LOCAL_FLAGS))
            size = len(body)
            append(frames[size] if size < 4096 else b"\x12" + varint(size))
            append(body)

            if trace.tenant is not None:  # the admission span
                key = admission_key(trace)
                shape = shapes.get(key)
                if shape is None:
                    shape = self._shape(key, "tidegate.admission", SpanKind.INTERNAL, admission_attributes)
                decided_ns = anchor_ns + int((admission_decided_s(trace) - anchor_s) * 1e9)
                body = b"".join((_IDS(0x0A, 16, hi, lo, 0x12, 8, trace.admission_id), under_root, shape.named,
                                 _TIMES(0x39, start_ns, 0x41, decided_ns), shape.attributes, _LOCAL_FLAGS))
                size = len(body)
                append(frames[size] if size < 4096 else b"\x12" + varint(size))
                append(body)

            if trace.queued_s is not None:  # the queue span
                key = ("queue", trace.tier)
                shape = shapes.get(key)
                if shape is None:
                    shape = self._shape(key, "tidegate.queue", SpanKind.INTERNAL, queue_attributes)
                predicted = b"" if trace.predicted_wait_s is None \
                    else self._predicted_wait_head + _DOUBLE(round(trace.predicted_wait_s, 6))
                body = b"".join((_IDS(0x0A, 16, hi, lo, 0x12, 8, trace.queue_id), under_root, shape.named,
                                 _TIMES(0x39, anchor_ns + int((trace.queued_s - anchor_s) * 1e9), 0x41,
                                        anchor_ns + int((trace.dispatched_s - anchor_s) * 1e9)),
                                 shape.attributes, predicted, _LOCAL_FLAGS))
                size = len(body)
                append(frames[size] if size < 4096 else b"\x12" + varint(size))
                append(body)

            for number, attempt in enumerate(trace.attempts, 1):  # a CLIENT span per attempt
                ended_s, outcome = attempt_end(trace, attempt)
                replica = attempt.replica
                key = ("attempt", trace.operation, replica, number, outcome)
                shape = shapes.get(key)
                if shape is None:
                    shape = self._shape(key, f"{trace.operation} {replica.upstream_model}", SpanKind.CLIENT,
                                        attempt_attributes)
                tail = b""
                if attempt.first_token_s is not None:
                    tail = _FIRST_TOKEN(0x5A, 22, 0x09, anchor_ns + int((attempt.first_token_s - anchor_s) * 1e9)) \
                        + _FIRST_TOKEN_NAME
                if outcome != "ok":
                    tail += length_field(b"\x7a", length_field(b"\x12", outcome.encode()) + b"\x18\x02")
                body = b"".join((_IDS(0x0A, 16, hi, lo, 0x12, 8, attempt.span_id), under_root, shape.named,
                                 _TIMES(0x39, anchor_ns + int((attempt.sent_s - anchor_s) * 1e9), 0x41,
                                        anchor_ns + int((ended_s - anchor_s) * 1e9)),
                                 shape.attributes, tail, _LOCAL_FLAGS))
                size = len(body)
                append(frames[size] if size < 4096 else b"\x12" + varint(size))
                append(body)
        return out
