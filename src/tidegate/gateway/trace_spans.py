"""Ended request traces (gateway/tracing.py) straight into OTLP span bytes, many at a time.

Why its own encoder: a traced request's spans are few, and what they carry repeats from request to
request: names, kinds and attributes (model, tenant, tier, replica, status), which spans there are, and
even their sizes. What differs is a handful of values: the ids, the times, the request's own
attributes (its id, token counts). So the encoder keeps, per distinct arrangement of a request's spans
(a `_Layout`), the bytes of all of them as a template with holes, and fills the holes of one request
with one `struct` call. No span object, attribute dict or protobuf object is made per request, and
each request costs a few dozen interpreter steps whatever its number of spans.

Why at once, as each request ends: a trace kept until the next export, with what it refers to, ages
into the garbage collector's older generations, and their collections cost more than the encoding
(gateway/tracing.py, `RequestTrace.end`). Bytes are not traversed.

The bytes are exactly those of `telemetry.otlp.encode_span` for the spans `RequestTrace.spans` builds
(tests/gateway/test_trace_spans.py checks it, and decodes them with the official classes).
"""

from __future__ import annotations

import struct
from collections.abc import Hashable
from operator import itemgetter
from typing import TYPE_CHECKING

from tidegate.gateway.tracing import (
    ADMISSION_SPAN,
    ATTEMPT_ENDED_NS,
    ATTEMPT_FIRST_TOKEN_NS,
    ATTEMPT_OUTCOME,
    ATTEMPT_REPLICA,
    ATTEMPT_SENT_NS,
    ATTEMPT_SPAN_BYTE,
    ATTEMPT_STREAMED,
    QUEUE_SPAN,
    ROOT_SPAN,
    admission_attributes,
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

__all__ = ["TraceEncoder"]

_FIRST_TOKEN_NAME = length_field(b"\x12", b"first_token")
# Span.flags (16), fixed32: sampled, and whether the parent's context came from another process (0x100
# says the bit 0x200 is set on purpose): only a root under a client's span has a remote parent
_LOCAL_FLAGS = struct.pack("<BBI", 0x85, 0x01, 0x101)
_REMOTE_FLAGS = struct.pack("<BBI", 0x85, 0x01, 0x301)
_PREDICTED_WAIT = "tidegate.queue.predicted_wait_s"
_LAYOUTS = 4096  # distinct layouts kept; past it they are made anew
_REQUEST_ID = "tidegate.request_id"
_VARINTS_KEPT = 1 << 14  # token counts below it take their varint from a table (2 bytes at most)
_VARINTS = [bytes((value,)) for value in range(0x80)] + [bytes(((value & 0x7F) | 0x80, value >> 7))
                                                        for value in range(0x80, _VARINTS_KEPT)]

# a hole's struct code by what fills it: a span's ids up to the byte that names it (the trace id,
# Span.span_id's tag, the span base: 7 of a span id's 8 bytes), a span base (a parent's), a parent
# span id, a time (fixed64 Unix nanoseconds), a double; bytes of a length the layout knows
_IDS, _BASE, _PARENT, _TIME, _DOUBLE = "25s", "7s", "8s", "Q", "d"
_SIZES = {_IDS: 25, _BASE: 7, _PARENT: 8, _TIME: 8, _DOUBLE: 8}
_SPAN_ID_TAG = b"\x12\x08"  # Span.span_id (2), 8 bytes: between the trace id and the span id's base
_IDS_PACK = struct.Struct("<16s2s7s").pack  # trace id, span id's tag, base: the `_IDS` hole's bytes
# what shapes an attempt's span beyond its holes: replica, outcome (None: ended with the request), a first token
_ATTEMPT_SHAPE = itemgetter(ATTEMPT_REPLICA, ATTEMPT_OUTCOME, ATTEMPT_STREAMED)
# A hole: its struct code and the Python expression that fills it, in the scope of `_Layout.fill`:
# `t` the trace (its times are Unix ns already), `a` its attempts, and what `TraceEncoder.encode_trace`
# prepared: `ids` (the trace id, the span id's tag, its base), `base` (the span ids' first 7), `rid`
# (the request id, or its whole attribute), `inp`, `out` (token counts' varints), `err` (bytes)
Hole = tuple[str, str]
_FILL_ARGUMENTS = "t, ids, base, rid, inp, out, err"


class _Layout:
    """The spans of requests that share everything but ids, times and their own attributes' bytes: a
    template of constant bytes with holes between them. `fill(t, ids, base, rid, inp, out, err)` returns
    one request's bytes: a function made for this layout (as `dataclasses` makes its methods), one
    `struct` call whose arguments are the template's constants and the holes' expressions, so that no
    list of values is assembled a request."""

    __slots__ = ("fill", "source")

    def __init__(self, spans: list[list[bytes | Hole]]) -> None:
        fmt, arguments, constants, constant = ["<"], [], {}, b""
        for segments in spans:
            size = sum(len(part) if isinstance(part, bytes) else _hole_size(part[0]) for part in segments)
            for part in [b"\x12" + varint(size)] + segments:  # framed as an element of ScopeSpans.spans
                if isinstance(part, bytes):
                    constant += part
                else:
                    name = f"k{len(constants)}"
                    constants[name] = constant
                    fmt += (f"{len(constant)}s", part[0])
                    arguments += (name, part[1])
                    constant = b""
        name = f"k{len(constants)}"
        constants[name] = constant
        fmt.append(f"{len(constant)}s")
        arguments.append(name)
        self.source = f"def fill({_FILL_ARGUMENTS}):\n    a = t.attempts\n    return pack({', '.join(arguments)})\n"
        scope = {"pack": struct.Struct("".join(fmt)).pack, **constants}
        exec(compile(self.source, "<trace layout>", "exec"), scope)  # our own expressions only
        self.fill = scope["fill"]


def _hole_size(code: str) -> int:
    return _SIZES.get(code) or int(code[:-1])


class TraceEncoder:
    """Encodes ended `RequestTrace`s; holds the layouts and shapes seen (bounded)."""

    def __init__(self) -> None:
        self._layouts: dict[Hashable, _Layout] = {}
        key = key_field(_PREDICTED_WAIT)
        self._predicted_wait_head = b"\x4a" + varint(len(key) + 11) + key + b"\x12\x09\x21"

    def encode(self, traces: list[RequestTrace]) -> bytes:
        """The spans of `traces`, each framed as an element of `ScopeSpans.spans`, joined."""
        return b"".join(map(self.encode_trace, traces))

    def encode_trace(self, trace: RequestTrace) -> bytes:
        """The spans of one ended trace, framed as elements of `ScopeSpans.spans`."""
        trace_id = trace.id_bytes or trace.trace_id.to_bytes(16, "big")
        # what every span's ids share: the trace id, the span id's tag and its first 7 bytes (a trace that
        # starts here: its trace id's, which the 7-byte field takes); one struct hole
        ids = _IDS_PACK(trace_id, _SPAN_ID_TAG, trace.span_base or trace_id)
        state, error = trace.tracestate, trace.error
        if error:
            error = error.encode()
        queued_ns = trace.queued_ns
        # the request's own attributes: its id (as it is, where its length fits one byte) and token counts
        request_id = trace.request_id
        request_id_form = len(request_id)
        if request_id_form >= 100 or not request_id.isascii():
            request_id = span_attribute(_REQUEST_ID, request_id.decode("latin-1"))
            request_id_form = -len(request_id)  # the whole attribute, encoded here
        tokens = trace.input_tokens
        input_tokens = None if tokens is None else (_VARINTS[tokens] if tokens < _VARINTS_KEPT else varint(tokens))
        tokens = trace.output_tokens
        if tokens is None:
            tokens = trace.output_estimate
            output_form = 0 if tokens is None else -1  # -1: an estimate
        else:
            output_form = 1
        output_tokens = None if tokens is None else (_VARINTS[tokens] if tokens < _VARINTS_KEPT else varint(tokens))

        # every fact that shapes the bytes beyond the holes (root_key's answered_by follows from them, and
        # whether admission came with a ticket from the verdict), then each attempt's (`_ATTEMPT_SHAPE`), as
        # one tuple: unpacked into the key (`*map`), they made a list grown item by item (~1k instructions).
        # The usual single attempt's shape is read by subscripts, not through `_ATTEMPT_SHAPE` and a tuple
        # around it (~0.5k); a tuple of its facts never equals a tuple of attempts' shapes
        attempts = trace.attempts
        if len(attempts) == 1:
            first = attempts[0]
            shapes = first[ATTEMPT_REPLICA], first[ATTEMPT_OUTCOME], first[ATTEMPT_STREAMED]
        else:
            shapes = tuple(map(_ATTEMPT_SHAPE, attempts))
        key = (trace.operation, trace.model, trace.status, trace.tenant, trace.tier, trace.replica_id, trace.rung,
               trace.error_type, trace.verdict, None if queued_ns is None else trace.predicted_wait_s is None,
               trace.parent_id == 0, trace.first_token_ns is None, request_id_form,
               input_tokens and len(input_tokens), output_form, output_tokens and len(output_tokens),
               state and len(state), error and len(error), shapes)
        try:
            layout = self._layouts[key]
        except KeyError:  # a new arrangement (rare: a subscript is cheaper than get() when found)
            if len(self._layouts) >= _LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[key] = self._layout(trace, request_id_form, input_tokens, output_form,
                                                       output_tokens)
        return layout.fill(trace, ids, trace.span_base or trace_id, request_id, input_tokens, output_tokens, error)

    def _layout(self, trace: RequestTrace, request_id_form: int, input_tokens: bytes | None, output_form: int,
                output_tokens: bytes | None) -> _Layout:
        """The layout of `trace`'s spans, each hole with the expression that fills it (`Hole`)."""
        state = trace.tracestate
        state_part: list[bytes | Hole] = [b"\x1a" + varint(len(state)), (f"{len(state)}s", "t.tracestate")] \
            if state else []
        ids: list[bytes | Hole] = [b"\x0a\x10", (_IDS, "ids")]  # the trace id, then the span id's first 7 bytes
        under_root: list[bytes | Hole] = [*state_part, b"\x22\x08", (_BASE, "base"), bytes((ROOT_SPAN,))]

        def times(started: str, ended: str) -> list[bytes | Hole]:
            return [b"\x39", (_TIME, started), b"\x41", (_TIME, ended)]

        def first_token(at: str) -> list[bytes | Hole]:
            return [b"\x5a\x16\x09", (_TIME, at), _FIRST_TOKEN_NAME]

        root: list[bytes | Hole] = [*ids, bytes((ROOT_SPAN,)), *state_part]
        if trace.parent_id:
            root += (b"\x22\x08", (_PARENT, "t.parent_id.to_bytes(8, 'big')"))
        attributes = span_attributes(trace.tracing.attribute_set(root_key(trace), root_attributes))
        root += (_named(f"{trace.operation} {trace.model}", SpanKind.SERVER), *times("t.started_ns", "t.ended_ns"),
                 attributes)
        if request_id_form < 0:  # encoded whole
            root.append((f"{-request_id_form}s", "rid"))
        else:  # one length byte at every level
            size = request_id_form
            root += (b"\x4a" + bytes((size + 25,)) + key_field(_REQUEST_ID) + bytes((0x12, size + 2, 0x0A, size)),
                     (f"{size}s", "rid"))
        if input_tokens is not None:
            root += (_integer_head("gen_ai.usage.input_tokens", len(input_tokens)), (f"{len(input_tokens)}s", "inp"))
        if output_tokens is not None:
            name = "gen_ai.usage.output_tokens" if output_form > 0 else "tidegate.output_tokens_estimate"
            root += (_integer_head(name, len(output_tokens)), (f"{len(output_tokens)}s", "out"))
        if trace.first_token_ns is not None:
            root += first_token("t.first_token_ns")
        if trace.error:  # Status: 2 message, 3 code (2 = ERROR)
            size = len(trace.error.encode())
            status_size = 1 + len(varint(size)) + size + 2
            root += (b"\x7a" + varint(status_size) + b"\x12" + varint(size), (f"{size}s", "err"), b"\x18\x02")
        root.append(_REMOTE_FLAGS if trace.parent_id else _LOCAL_FLAGS)
        spans = [root]

        if trace.tenant is not None:  # decided (as `admission_decided_ns`): admitted, or the first attempt, or the end
            if trace.admitted_ns is not None:
                decided = "t.admitted_ns"
            else:
                decided = f"a[0][{ATTEMPT_SENT_NS}]" if trace.attempts else "t.ended_ns"
            attributes = span_attributes(trace.tracing.attribute_set(admission_key(trace), admission_attributes))
            spans.append([*ids, bytes((ADMISSION_SPAN,)), *under_root, _named("tidegate.admission", SpanKind.INTERNAL),
                          *times("t.started_ns", decided), attributes, _LOCAL_FLAGS])
        if trace.queued_ns is not None:
            attributes = span_attributes(trace.tracing.attribute_set(("queue", trace.tier), queue_attributes))
            span = [*ids, bytes((QUEUE_SPAN,)), *under_root, _named("tidegate.queue", SpanKind.INTERNAL),
                    *times("t.queued_ns", "t.dispatched_ns"), attributes]
            if trace.predicted_wait_s is not None:
                span += (self._predicted_wait_head, (_DOUBLE, "round(t.predicted_wait_s, 6)"))
            spans.append(span + [_LOCAL_FLAGS])
        for index, attempt in enumerate(trace.attempts):
            outcome = attempt_end(trace, attempt)[1]
            replica = attempt[ATTEMPT_REPLICA]
            key = ("attempt", trace.operation, replica, index + 1, outcome)
            attributes = span_attributes(trace.tracing.attribute_set(key, attempt_attributes))
            ended = "t.ended_ns" if attempt[ATTEMPT_ENDED_NS] is None \
                else f"a[{index}][{ATTEMPT_ENDED_NS}]"  # outlived: ended with the request
            span = [*ids, bytes((attempt[ATTEMPT_SPAN_BYTE],)), *under_root,
                    _named(f"{trace.operation} {replica.upstream_model}", SpanKind.CLIENT),
                    *times(f"a[{index}][{ATTEMPT_SENT_NS}]", ended), attributes]
            if attempt[ATTEMPT_FIRST_TOKEN_NS] is not None:
                span += first_token(f"a[{index}][{ATTEMPT_FIRST_TOKEN_NS}]")
            if outcome != "ok":
                span.append(length_field(b"\x7a", length_field(b"\x12", outcome.encode()) + b"\x18\x02"))
            spans.append(span + [_LOCAL_FLAGS])
        return _Layout(spans)


def _integer_head(name: str, size: int) -> bytes:
    """An integer attribute up to its value's varint of `size` bytes (KeyValue: key, AnyValue: int_value)."""
    key = key_field(name)
    return b"\x4a" + varint(len(key) + 3 + size) + key + bytes((0x12, 1 + size, 0x18))


def _named(name: str, kind: SpanKind) -> bytes:
    """A span's name and kind (fields 5, 6)."""
    return length_field(b"\x2a", name.encode()) + bytes((0x30, kind))
