"""Request tracing: W3C `traceparent` in from clients and out to upstreams, and OpenTelemetry spans of a
request's way through the gateway, exported over OTLP (docs/observability.md, "Tracing").

Cheap by construction. Tracing off, a request the client sent no `traceparent` with costs two checks
in `Proxy.handle`. Tracing on, the request path only stores times and facts on a `RequestTrace` (a
slotted record the proxy passes along the request's way, not a context variable: setting and resetting
one cost some 2k instructions a request, and each read another few hundred); at its end
the built-in exporter encodes its spans (gateway/trace_spans.py: a template per arrangement of spans,
filled by one `struct` call) and queues the bytes, which its background task exports in batches.

The spans of one request (names and attributes after OpenTelemetry's GenAI and HTTP conventions):
- `{operation} {model}` (SERVER), the root, or a child of the client's span: arrival to the answer's
  end; status, tenant, tier, tokens in and out, the degradation rung, the final replica; events
  `first_token` (streams) and the verdict of the response cache;
- `tidegate.admission`: overload control's decision (tenant, tier, verdict, rung);
- `tidegate.queue`: admitted to dispatched to a replica (or, without overload control, arrival to the
  first attempt: the wait for a free slot);
- `{operation} {upstream model}` (CLIENT), one per upstream attempt, retries included: replica,
  attempt number, outcome, event `first_token`. Its id is the parent id of the `traceparent` the
  upstream gets, so that vLLM's or SGLang's own spans hang under the attempt that caused them.
"""

from __future__ import annotations

import re
import struct
import time
from binascii import hexlify
from collections.abc import Callable, Hashable
from math import floor
from typing import TYPE_CHECKING, Any, Protocol

from tidegate.errors import TidegateError
from tidegate.gateway.validation import Endpoint
from tidegate.policy.degradation import DEGRADATION_HEADER
from tidegate.telemetry.otlp import AttributeValue, SpanKind, SpanRecord
from tidegate.telemetry.trace_context import (
    clean_tracestate,
    new_span_base,
    new_trace_id,
    parse_traceparent,
    random_bits,
)

if TYPE_CHECKING:
    from tidegate.gateway.dispatch import Replica
    from tidegate.gateway.http import HttpRequest
    from tidegate.gateway.overload import Ticket
    from tidegate.policy.identity import Identity

__all__ = ["Tracing", "TracingSettings", "SpanSink", "RequestTrace", "PassThrough", "start_trace",
           "root_key", "ROOT_SPAN", "ADMISSION_SPAN", "QUEUE_SPAN", "root_attributes", "root_own_attributes",
           "admission_key", "admission_decided_ns", "attempt_end",
           "admission_attributes", "queue_attributes", "attempt_attributes", "ATTEMPT_SPAN_BYTE", "ATTEMPT_REPLICA",
           "ATTEMPT_SENT_NS", "ATTEMPT_ENDED_NS", "ATTEMPT_OUTCOME", "ATTEMPT_STREAMED", "ATTEMPT_FIRST_TOKEN_NS"]

_OPERATIONS = {Endpoint.CHAT: "chat", Endpoint.COMPLETIONS: "text_completion", Endpoint.EMBEDDINGS: "embeddings"}
_ROUTES = {operation: "/v1" + endpoint.value for endpoint, operation in _OPERATIONS.items()}
_RUNG = re.compile(DEGRADATION_HEADER.encode() + rb": ([a-z_]+)")
_LOW64 = 0xFFFF_FFFF_FFFF_FFFF
_ALL_SAMPLED = 2**64  # a ratio bound every trace id's low 64 bits fall under
_OFFSET_MAX_AGE_NS = 1_000_000_000  # the monotonic clock's offset to Unix time is read again this old
_ATTRIBUTE_SETS = 4096  # distinct attribute sets kept; past it they are made anew
# The spans' times: Unix time in integer nanoseconds, as OTLP carries it and as OpenTelemetry's SDK reads
# it (a monotonic reading would cost an addition a time to shift). A module global, not the tracer's
# attribute: the hooks read it five times a request, and a call of a global costs ~200 instructions
# less than one through `self.tracing` (tests set it to a fake clock).
clock_ns = time.time_ns
# A request's span ids: 7 random bytes of its own (its `span_base`) and a last byte that says which
# span: unique within the request, random across requests, and one draw of randomness a request, not
# one a span. A trace that starts here takes its span base from its trace id's first 7 bytes (random,
# and apart from the last 7 that ratio sampling reads); under a client's span it draws its own.
ROOT_SPAN, ADMISSION_SPAN, QUEUE_SPAN = 0x01, 0x02, 0x03
FIRST_ATTEMPT_SPAN = 0x11  # then 0x12 for the retry, ...
_MAX_ATTEMPT_SPAN = 0xFF
_HEX_BYTE = [b"%02x" % value for value in range(256)]
# an attempt's traceparent line, by one struct call (a slice and a join of its parts cost ~0.9k more): head,
# trace id, "-", span id (its base, then the byte that names the span), flags and the line's end
_TRACEPARENT = struct.Struct("16s32s1s14s2s5s").pack


class SpanSink(Protocol):
    """Where ended request traces go: the built-in OTLP/HTTP exporter (it encodes each as it comes and
    exports them in batches), or the OpenTelemetry SDK (`RequestTrace.spans`)."""

    def submit_trace(self, trace: RequestTrace) -> None: ...


class TracingSettings:
    __slots__ = ("sampling_ratio", "parent_based", "propagate")

    def __init__(self, sampling_ratio: float = 1.0, parent_based: bool = True, propagate: bool = True) -> None:
        self.sampling_ratio = sampling_ratio
        self.parent_based = parent_based  # a caller's traceparent decides: its sampled flag is followed
        self.propagate = propagate  # upstreams get a traceparent (and the client's tracestate)


class PassThrough:
    """A request that is not recorded: the upstream gets the same trace header lines on every attempt
    (the client's own, tracing off; or the gateway's unsampled context, tracing on)."""

    __slots__ = ("lines", "trace_id")  # made by `_passing`, which sets both

    def upstream_headers(self, replica: Replica) -> bytes:
        return self.lines

    def attempt_ended(self, failure: str | None) -> None:
        pass

    def first_token(self) -> None:
        pass

    def answered(self, body: bytes) -> None:
        pass

    def admitted(self, identity: Identity, ticket: Ticket | None = None, usage: Any = None) -> None:
        pass

    def end(self, model: str | None, status: int, replica_id: str | None, error: BaseException | None) -> None:
        pass


def _passing(lines: bytes, trace_id: int) -> PassThrough:
    """A new `PassThrough`: its lines, and its trace id for the access log. Made here and not by an
    `__init__`, as `_recorded` makes a `RequestTrace`: every request sampling leaves out is one."""
    passing = PassThrough()
    passing.lines = lines
    passing.trace_id = trace_id
    return passing


# An upstream attempt's record: a list, not an object, because a record made for every request must be
# cheap (a slotted object's constructor costs some 2k instructions more), read through these indices.
# [the last byte of its span id (`RequestTrace.span_id`), the replica, outcome (None until it ended; an
# attempt the request outlived without a verdict ends with it), whether a first token came, sent, ended,
# first token] (times: tracer ns). The replica, outcome and first token's presence shape its span's bytes
# and lie side by side: the encoder reads them in one `itemgetter` call (gateway/trace_spans.py).
(ATTEMPT_SPAN_BYTE, ATTEMPT_REPLICA, ATTEMPT_OUTCOME, ATTEMPT_STREAMED, ATTEMPT_SENT_NS, ATTEMPT_ENDED_NS,
 ATTEMPT_FIRST_TOKEN_NS) = range(7)


class RequestTrace:
    """One recorded request: its ids, and the times and facts its spans are built from. Each hook
    stores a little and returns; nothing here awaits. `end` reads what the spans need of the request's
    end and hands the record to the sink, which encodes it (gateway/trace_spans.py)."""

    __slots__ = (
        # set on the request's way
        "tracing", "trace_id", "id_bytes", "parent_id", "tracestate", "operation", "request_id", "started_ns",
        "attempts", "first_token_ns", "tenant", "tier", "ticket", "admitted_ns", "verdict", "input_tokens",
        "output_tokens", "usage",
        "span_base",
        # set by `end`
        "ended_ns", "model", "status", "replica_id", "error",
        "error_type", "rung", "output_estimate", "queued_ns", "dispatched_ns", "predicted_wait_s", "span_count")
    # made by `_recorded`, which sets every slot but those `end` sets

    # -- hooks on the request's way (Proxy)
    def admitted(self, identity: Identity, ticket: Ticket | None = None, usage: Any = None) -> None:
        """Overload control admitted the request (`ticket`; `usage`: what counts a stream's completion
        tokens), or (no ticket) refused it or answered it itself; the proxy calls it once, either way."""
        self.tenant = identity.tenant
        if ticket is None:
            self.tier = identity.tier
        else:
            self.ticket = ticket
            self.tier = ticket.tier
            self.usage = usage
            self.admitted_ns = clock_ns()
            self.verdict = "queued" if ticket.future is not None else "assigned"

    def upstream_headers(self, replica: Replica) -> bytes:
        """An attempt starts on `replica`: the trace header lines for its request, with its own span id."""
        attempts = self.attempts
        sent_ns = clock_ns()
        if attempts:
            last = attempts[-1]
            if last[ATTEMPT_ENDED_NS] is None:  # resent on a fresh connection without a verdict
                last[ATTEMPT_ENDED_NS] = sent_ns
                last[ATTEMPT_OUTCOME] = "ok"
            span_byte = FIRST_ATTEMPT_SPAN + len(attempts)
            if span_byte > _MAX_ATTEMPT_SPAN:
                span_byte = _MAX_ATTEMPT_SPAN
        else:
            span_byte = FIRST_ATTEMPT_SPAN
        attempts.append([span_byte, replica, None, False, sent_ns, None, None])
        if not self.tracing.propagate:
            return b""
        id_bytes = self.id_bytes
        if id_bytes is None:  # bytes to hex costs half of formatting the number as hex
            id_bytes = self.id_bytes = self.trace_id.to_bytes(16, "big")
        trace_hex = hexlify(id_bytes)
        # a trace that starts here: its span ids' base is the id's first 14 hex digits, which the field of
        # 14 bytes takes from the whole (no slice)
        base_hex = trace_hex if self.span_base is None else self.span_base.hex().encode()
        line = _TRACEPARENT(b"traceparent: 00-", trace_hex, b"-", base_hex, _HEX_BYTE[span_byte], b"-01\r\n")
        return line if self.tracestate is None else line + b"tracestate: " + self.tracestate + b"\r\n"

    def span_id(self, span_byte: int) -> int:
        """The id of the request's span that `span_byte` names (ROOT_SPAN, ..., an attempt's `span_byte`)."""
        base = self.span_base if self.span_base is not None else self.trace_id.to_bytes(16, "big")[:7]
        return int.from_bytes(base + bytes((span_byte,)), "big")

    def attempt_ended(self, failure: str | None) -> None:
        if self.attempts:
            attempt = self.attempts[-1]
            attempt[ATTEMPT_ENDED_NS] = clock_ns()
            attempt[ATTEMPT_OUTCOME] = failure or "ok"

    def first_token(self) -> None:
        now_ns = clock_ns()
        if self.first_token_ns is None:
            self.first_token_ns = now_ns
        if self.attempts and self.attempts[-1][ATTEMPT_FIRST_TOKEN_NS] is None:
            attempt = self.attempts[-1]
            attempt[ATTEMPT_FIRST_TOKEN_NS] = now_ns
            attempt[ATTEMPT_STREAMED] = True

    def answered(self, body: bytes) -> None:
        """A whole answer without overload control (with it, its `_Usage` reads them, and `end` takes
        them from there): the token counts of its `usage`, which closes an OpenAI answer (found from the
        end: a long answer is not scanned)."""
        self.input_tokens = _usage_count(body, b'"prompt_tokens"')
        self.output_tokens = _usage_count(body, b'"completion_tokens"')

    def end(self, model: str | None, status: int, replica_id: str | None, error: BaseException | None) -> None:
        """The request is answered: what its spans need of the error, the ticket and the usage is read now
        and they are let go, the spans are counted (the exporter's bound counts them), and the record goes
        to the sink. The built-in exporter encodes it at once, so that nothing of the request outlives it
        but bytes: a record kept until the next export (and the ticket and usage it held) aged into the
        garbage collector's older generations, whose collections then walked them again and again
        (docs/observability.md, "The collector"). One method, not one a step: a call costs as much as
        reading a few facts."""
        tracing = self.tracing
        try:
            self.ended_ns = clock_ns()
            self.model = model or "unknown"
            self.status = status
            self.replica_id = replica_id
            if status >= 400 or error is not None:
                self._failed(status, error)
            ticket, usage = self.ticket, self.usage
            spans = 1 + len(self.attempts)  # the root and one per attempt
            if ticket is not None:
                headers = ticket.response_headers
                # else None, as `admitted` left it; find(), not `in`: on bytes, `in` first tries the needle as
                # an integer, and the TypeError it raises and clears costs ~2k instructions
                if headers and headers.find(b"degradation") >= 0:
                    self.rung = _rung(headers)
                self.ticket = None
            if usage is not None:
                if self.input_tokens is None:
                    self.input_tokens = usage.prompt_tokens
                if self.output_tokens is None:
                    reported = self.output_tokens = usage.reported
                    if reported is None and self.first_token_ns is not None:  # a stream without usage: its events
                        self.output_estimate = usage.completion_tokens()
                self.usage = None
            # the wait for a replica: admitted -> dispatched (overload control; none when it was assigned one
            # at arrival), or, without overload control, arrival -> first attempt (the wait for a free slot)
            if self.tenant is None:
                queued_ns = self.started_ns
            else:
                spans += 1  # overload control decided: the admission span
                verdict = self.verdict
                if verdict is None:  # answered 200 without a ticket: overload control's cached answer
                    verdict = self.verdict = _refusal_verdict(None, status, self.rung)
                queued_ns = self.admitted_ns if verdict == "queued" else None
            if queued_ns is not None:
                if ticket is not None and ticket.dispatched_s is not None:
                    # overload control's monotonic seconds, on the tracer's clock; floor, not int(): the same
                    # integer for a time (never negative), in a C call instead of a type's
                    dispatched_ns = floor(ticket.dispatched_s * 1e9) + tracing.clock_offset_ns(self.ended_ns)
                else:
                    attempts = self.attempts
                    dispatched_ns = attempts[0][ATTEMPT_SENT_NS] if attempts else None
                if dispatched_ns is not None:
                    spans += 1  # the queue's span
                    self.queued_ns = queued_ns
                    self.dispatched_ns = dispatched_ns if dispatched_ns > queued_ns else queued_ns
                    self.predicted_wait_s = ticket.predicted_wait_s if ticket is not None else None
            self.span_count = spans
            tracing.sink.submit_trace(self)
        except Exception:  # a tracing fault must never fail a request
            tracing.failed += 1

    def _failed(self, status: int, error: BaseException | None) -> None:
        """What the spans say of an error, read now: the error (and its traceback) is not kept."""
        headers = getattr(error, "headers", b"") if self.ticket is None else b""
        self.rung = _rung(headers) if headers and headers.find(b"degradation") >= 0 else None  # find(): see `end`
        if status >= 400:
            self.error_type = error.code if isinstance(error, TidegateError) and error.code else str(status)
            self.error = (str(error) or str(status)) if status >= 500 or status == 499 else None
        if self.tenant is not None and self.verdict is None:
            self.verdict = _refusal_verdict(error, status, self.rung)

    # -- spans, as records (the SDK's sink, and the tests that check the encoder against it)
    def spans(self) -> list[SpanRecord]:
        """The request's spans, once `end`ed."""
        tracing, trace_id, root_id, state = self.tracing, self.trace_id, self.span_id(ROOT_SPAN), self.tracestate or b""
        key = root_key(self)
        attributes = tracing.attribute_set(key, root_attributes)
        own = root_own_attributes(self)
        start_ns = self.started_ns
        events = () if self.first_token_ns is None else (("first_token", self.first_token_ns, {}),)
        spans = [SpanRecord(f"{self.operation} {self.model}", trace_id, root_id, self.parent_id, SpanKind.SERVER,
                            start_ns, self.ended_ns, attributes, events, error=self.error, tracestate=state,
                            remote_parent=self.parent_id != 0, attributes_key=key, request_attributes=own)]
        if self.tenant is not None:
            key = admission_key(self)
            spans.append(SpanRecord("tidegate.admission", trace_id, self.span_id(ADMISSION_SPAN), root_id,
                                    SpanKind.INTERNAL,
                                    start_ns, admission_decided_ns(self),
                                    tracing.attribute_set(key, admission_attributes), tracestate=state,
                                    attributes_key=key))
        if self.queued_ns is not None:
            key = ("queue", self.tier)
            predicted = None
            if self.predicted_wait_s is not None:
                predicted = {"tidegate.queue.predicted_wait_s": round(self.predicted_wait_s, 6)}
            spans.append(SpanRecord("tidegate.queue", trace_id, self.span_id(QUEUE_SPAN), root_id, SpanKind.INTERNAL,
                                    self.queued_ns, self.dispatched_ns,
                                    tracing.attribute_set(key, queue_attributes), tracestate=state,
                                    attributes_key=key, request_attributes=predicted))
        for number, attempt in enumerate(self.attempts, 1):
            ended_ns, outcome = attempt_end(self, attempt)
            replica, first_token_ns = attempt[ATTEMPT_REPLICA], attempt[ATTEMPT_FIRST_TOKEN_NS]
            key = ("attempt", self.operation, replica, number, outcome)
            attempt_events = () if first_token_ns is None else (("first_token", first_token_ns, {}),)
            spans.append(SpanRecord(f"{self.operation} {replica.upstream_model}", trace_id,
                                    self.span_id(attempt[ATTEMPT_SPAN_BYTE]),
                                    root_id, SpanKind.CLIENT, attempt[ATTEMPT_SENT_NS], ended_ns,
                                    tracing.attribute_set(key, attempt_attributes), attempt_events,
                                    error=None if outcome == "ok" else outcome, tracestate=state, attributes_key=key))
        return spans


def _recorded(tracing: Tracing, trace_id: int, parent_id: int, tracestate: bytes | None, operation: str,
              request_id: bytes) -> RequestTrace:
    """A new `RequestTrace`. Made here and not by an `__init__`: calling a class whose `__init__` is Python
    code enters the interpreter anew (~2k instructions a request more than these stores)."""
    trace = RequestTrace()
    trace.tracing = tracing
    trace.trace_id = trace_id
    trace.id_bytes = None  # its 16 bytes, once an attempt's traceparent needed them
    trace.parent_id = parent_id  # the client's span; 0: the trace starts here
    trace.tracestate = tracestate
    # None: the first 7 bytes of the trace id (a trace that starts here); else 7 random bytes
    trace.span_base = None if parent_id == 0 else new_span_base()
    trace.operation = operation
    trace.request_id = request_id
    trace.started_ns = clock_ns()  # the root span's start (the admission span's too)
    trace.attempts = []  # ATTEMPT_* records
    trace.first_token_ns = None
    trace.tenant = None
    trace.tier = None  # None: the default tier, until a ticket names it
    trace.ticket = None
    trace.admitted_ns = None
    trace.verdict = None
    trace.input_tokens = None  # as the upstream reported them
    trace.output_tokens = None
    trace.usage = None  # overload control's `_Usage`: a stream's completion tokens
    # read off the request's end, by `end`
    trace.rung = None
    trace.error = None
    trace.error_type = None
    trace.output_estimate = None
    trace.queued_ns = None
    return trace


# -- the facts of an ended RequestTrace, as its spans show them (shared by `spans` and the encoder)
def root_key(trace: RequestTrace) -> tuple:
    """What names the root span's attribute set. Answered without a replica of its own: the response
    cache, a request it joined, or overload control's cached-answer rung."""
    rung = trace.rung
    answered_by = ("cache" if rung is None else rung) if trace.status == 200 and trace.replica_id is None \
        and not trace.attempts else None
    return ("root", trace.operation, trace.model, trace.status, trace.tenant, trace.tier, trace.replica_id, rung,
            trace.error_type, answered_by)


def root_own_attributes(trace: RequestTrace) -> dict[str, AttributeValue]:
    own: dict[str, AttributeValue] = {"tidegate.request_id": trace.request_id.decode("latin-1")}
    if trace.input_tokens is not None:
        own["gen_ai.usage.input_tokens"] = trace.input_tokens
    if trace.output_tokens is not None:
        own["gen_ai.usage.output_tokens"] = trace.output_tokens
    elif trace.output_estimate is not None:
        own["tidegate.output_tokens_estimate"] = trace.output_estimate
    return own


def admission_key(trace: RequestTrace) -> tuple:
    return ("admission", trace.tenant, trace.tier, trace.verdict, trace.rung)


def admission_decided_ns(trace: RequestTrace) -> int:
    """Overload control's verdict: admitted, or (refusals end there) the first attempt, or the end."""
    if trace.admitted_ns is not None:
        return trace.admitted_ns
    return trace.attempts[0][ATTEMPT_SENT_NS] if trace.attempts else trace.ended_ns


def attempt_end(trace: RequestTrace, attempt: list) -> tuple[int, str]:
    """When an attempt ended and how: one the request outlived without a verdict ended with it."""
    if attempt[ATTEMPT_ENDED_NS] is not None:
        return attempt[ATTEMPT_ENDED_NS], attempt[ATTEMPT_OUTCOME]
    return trace.ended_ns, "cancelled" if trace.status == 499 else "ok"


def root_attributes(key: tuple) -> dict[str, AttributeValue]:
    _, operation, model, status, tenant, tier, replica_id, rung, error_type, answered_by = key
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation, "gen_ai.request.model": model, "http.request.method": "POST",
        "http.route": _ROUTES[operation], "http.response.status_code": status}
    for name, value in (("tidegate.tenant", tenant), ("tidegate.tier", tier), ("tidegate.replica", replica_id),
                        ("tidegate.degradation", rung), ("error.type", error_type),
                        ("tidegate.answered_by", answered_by)):
        if value is not None:
            attributes[name] = value
    return attributes


def admission_attributes(key: tuple) -> dict[str, AttributeValue]:
    _, tenant, tier, verdict, rung = key
    attributes: dict[str, AttributeValue] = {"tidegate.tenant": tenant, "tidegate.admission.verdict": verdict}
    if tier is not None:
        attributes["tidegate.tier"] = tier
    if rung is not None:
        attributes["tidegate.degradation"] = rung
    return attributes


def queue_attributes(key: tuple) -> dict[str, AttributeValue]:
    return {} if key[1] is None else {"tidegate.tier": key[1]}


def attempt_attributes(key: tuple) -> dict[str, AttributeValue]:
    _, operation, replica, number, outcome = key
    endpoint = replica.connections.endpoint
    return {"gen_ai.operation.name": operation, "gen_ai.request.model": replica.upstream_model,
            "server.address": endpoint.host, "server.port": endpoint.port, "tidegate.replica": replica.replica_id,
            "tidegate.attempt": number, "tidegate.outcome": outcome}


def _usage_count(body: bytes, name: bytes) -> int | None:
    """The count `"name": 123` of an answer's usage, found from its end; None when it has none."""
    at = body.rfind(name)
    if at < 0:
        return None
    at += len(name)
    digits = body[at:at + 24].split(b",", 1)[0].split(b"}", 1)[0].strip(b" \t\r\n:")
    return int(digits) if digits.isdigit() else None


def _rung(headers: bytes) -> str | None:
    found = _RUNG.search(headers)
    return found.group(1).decode() if found is not None else None


def _refusal_verdict(error: BaseException | None, status: int, rung: str | None) -> str:
    """Overload control's verdict for a request it did not admit, from the answer it raised."""
    if status == 429:
        return "rate_limited"
    if status == 413:
        return "too_large"
    if status == 200:
        return "cached_answer"
    if error is not None and rung is not None:
        return "degraded"
    return "refused" if status >= 400 else "admitted"


class Tracing:
    """The gateway's tracer: samples requests, starts their traces, sends their spans to the sink."""

    def __init__(self, settings: TracingSettings, sink: SpanSink) -> None:
        self.settings = settings
        self.sink = sink
        # the one time a span takes from overload control's monotonic clock (a ticket's dispatch, in
        # seconds) is shifted onto the tracer's by this offset, read again when a second old
        self._offset_ns = 0
        self._offset_read_ns: int | None = None
        self.propagate = settings.propagate  # read on every attempt
        self.failed = 0  # spans of requests whose export hand-off raised
        # threshold of TraceIdRatioBased: a trace id's low 64 bits below it are sampled
        self._ratio_bound = round(settings.sampling_ratio * 2**64)
        self._samples_all = self._ratio_bound >= _ALL_SAMPLED
        self._attribute_sets: dict[Hashable, dict[str, AttributeValue]] = {}

    def clock_offset_ns(self, now_ns: int) -> int:
        """What shifts a monotonic time onto the tracer's clock; read again (the wall clock may have been
        set) when a second older than `now_ns` (the tracer's)."""
        read_ns = self._offset_read_ns
        if read_ns is None or not 0 <= now_ns - read_ns < _OFFSET_MAX_AGE_NS:
            self._offset_read_ns = now_ns
            self._offset_ns = clock_ns() - time.monotonic_ns()
        return self._offset_ns

    def attribute_set(self, key: Hashable, build: Callable[[Any], dict[str, AttributeValue]]
                      ) -> dict[str, AttributeValue]:
        """The attributes `build(key)` makes, made once per key and shared: never change one."""
        found = self._attribute_sets.get(key)
        if found is None:
            if len(self._attribute_sets) >= _ATTRIBUTE_SETS:
                self._attribute_sets.clear()
            found = self._attribute_sets[key] = build(key)
        return found

    def start(self, request: HttpRequest, endpoint: Endpoint, request_id: bytes) -> RequestTrace | PassThrough:
        """The request's trace (`begin`), for the proxy to pass along its way; `end` it in a `finally`. A
        request without a client's trace: the short way (every trace sampled: no arithmetic)."""
        if request.traceparent is None:
            trace_id = random_bits(128) or 1
            if self._samples_all or (trace_id & _LOW64) < self._ratio_bound:  # sampled_by_ratio
                return _recorded(self, trace_id, 0, None, _OPERATIONS[endpoint], request_id)
            return self._unsampled(trace_id, None, None)
        return self.begin(request, endpoint, request_id)

    def begin(self, request: HttpRequest, endpoint: Endpoint, request_id: bytes) -> RequestTrace | PassThrough:
        settings = self.settings
        parent = parse_traceparent(request.traceparent) if request.traceparent is not None else None
        tracestate = clean_tracestate(request.tracestate) if parent is not None else None
        if parent is not None:
            trace_id, parent_id = parent.trace_id, parent.parent_id
            sampled = parent.sampled if settings.parent_based else (trace_id & _LOW64) < self._ratio_bound
        else:
            trace_id, parent_id = new_trace_id(), 0
            sampled = (trace_id & _LOW64) < self._ratio_bound  # sampled_by_ratio, its bound computed once
        if sampled:
            return _recorded(self, trace_id, parent_id, tracestate, _OPERATIONS[endpoint], request_id)
        return self._unsampled(trace_id, None if parent_id == 0 else new_span_base(), tracestate)

    def _unsampled(self, trace_id: int, span_base: bytes | None, tracestate: bytes | None) -> PassThrough:
        """A request sampling leaves out: the upstream still hears the trace and that it is not sampled (W3C
        flags 00), under one span id that stands for the gateway, made as a recorded request's root span's
        is (`span_base`, None: the trace id's first 7 bytes; then ROOT_SPAN). Every request a ratio under 1
        leaves out comes here, so it costs what a recorded request's `traceparent` does, not a formatting
        of numbers (docs/observability.md, "What sampling saves")."""
        if not self.propagate:
            return _passing(b"", trace_id)
        trace_hex = hexlify(trace_id.to_bytes(16, "big"))
        base_hex = trace_hex if span_base is None else span_base.hex().encode()
        line = _TRACEPARENT(b"traceparent: 00-", trace_hex, b"-", base_hex, _HEX_BYTE[ROOT_SPAN], b"-00\r\n")
        return _passing(line if tracestate is None else line + b"tracestate: " + tracestate + b"\r\n", trace_id)


def _pass_through(request: HttpRequest) -> PassThrough | None:
    """Tracing off: a valid client traceparent (and its tracestate) go to the upstream unchanged."""
    parent = parse_traceparent(request.traceparent)
    if parent is None:
        return None
    assert request.traceparent is not None
    lines = b"traceparent: " + request.traceparent.strip(b" \t") + b"\r\n"
    tracestate = clean_tracestate(request.tracestate)
    return _passing(lines if tracestate is None else lines + b"tracestate: " + tracestate + b"\r\n",
                    parent.trace_id)


def start_trace(tracing: Tracing | None, request: HttpRequest, endpoint: Endpoint, request_id: bytes
                ) -> RequestTrace | PassThrough | None:
    """The request's trace (tracing off: a client's traceparent to pass on, or None); `end` it in a `finally`."""
    if tracing is not None:
        return tracing.start(request, endpoint, request_id)
    return _pass_through(request)
