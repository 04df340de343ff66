"""Request tracing: W3C `traceparent` in from clients and out to upstreams, and OpenTelemetry spans of a
request's way through the gateway, exported over OTLP (docs/observability.md, "Tracing").

Cheap by construction. Tracing off, a request the client sent no `traceparent` with costs one check
in `Proxy.handle`, and a `ContextVar` read per upstream attempt. Tracing on, the request path only
stores times and facts on a `RequestTrace` (a slotted record, in the request's context); its spans
are built and encoded once, when the request ends, and a background task exports them in batches.

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
import time
from collections.abc import Callable, Hashable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, Protocol

from tidegate.errors import TidegateError
from tidegate.gateway.validation import Endpoint
from tidegate.policy.degradation import DEGRADATION_HEADER
from tidegate.telemetry.otlp import AttributeValue, SpanKind, SpanRecord
from tidegate.telemetry.trace_context import (
    FLAG_SAMPLED,
    clean_tracestate,
    format_traceparent,
    new_span_id,
    new_trace_id,
    parse_traceparent,
)

if TYPE_CHECKING:
    from tidegate.gateway.dispatch import Replica
    from tidegate.gateway.http import HttpRequest
    from tidegate.gateway.overload import Ticket
    from tidegate.policy.identity import Identity

__all__ = ["CURRENT_TRACE", "Tracing", "TracingSettings", "SpanSink", "RequestTrace", "PassThrough", "start_trace"]

# the trace of the request the running task serves; None when it has none. Read only from the
# request's own task (and tasks it starts), never from protocol callbacks: a pooled upstream
# connection's callbacks run in whatever context opened the connection
CURRENT_TRACE: ContextVar[RequestTrace | PassThrough | None] = ContextVar("tidegate_trace", default=None)

_OPERATIONS = {Endpoint.CHAT: "chat", Endpoint.COMPLETIONS: "text_completion", Endpoint.EMBEDDINGS: "embeddings"}
_ROUTES = {operation: "/v1" + endpoint.value for endpoint, operation in _OPERATIONS.items()}
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_RUNG = re.compile(DEGRADATION_HEADER.encode() + rb": ([a-z_]+)")
_LOW64 = 0xFFFF_FFFF_FFFF_FFFF
_ATTRIBUTE_SETS = 4096  # distinct attribute sets kept; past it they are made anew


class SpanSink(Protocol):
    """Where finished spans go: the built-in OTLP/HTTP exporter, or the OpenTelemetry SDK."""

    def submit(self, spans: list[SpanRecord]) -> None: ...


class TracingSettings:
    __slots__ = ("sampling_ratio", "parent_based", "propagate")

    def __init__(self, sampling_ratio: float = 1.0, parent_based: bool = True, propagate: bool = True) -> None:
        self.sampling_ratio = sampling_ratio
        self.parent_based = parent_based  # a caller's traceparent decides: its sampled flag is followed
        self.propagate = propagate  # upstreams get a traceparent (and the client's tracestate)


class PassThrough:
    """A request that is not recorded: the upstream gets the same trace header lines on every attempt
    (the client's own, tracing off; or the gateway's unsampled context, tracing on)."""

    __slots__ = ("lines", "token")

    def __init__(self, lines: bytes) -> None:
        self.lines = lines
        self.token: Token | None = None

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
        if self.token is not None:
            CURRENT_TRACE.reset(self.token)


class _Attempt:
    __slots__ = ("span_id", "replica", "sent_s", "ended_s", "outcome", "first_token_s")

    def __init__(self, span_id: int, replica: Replica, sent_s: float) -> None:
        self.span_id = span_id
        self.replica = replica
        self.sent_s = sent_s
        self.ended_s: float | None = None
        self.outcome = "ok"
        self.first_token_s: float | None = None


class RequestTrace:
    """One recorded request: its ids, and the times and facts its spans are built from at its end.
    Each hook stores a little and returns; nothing here awaits."""

    __slots__ = ("tracing", "token", "trace_id", "span_id", "parent_id", "tracestate", "operation", "path",
                 "request_id", "started_s", "anchor_s", "anchor_ns", "attempts", "first_token_s", "tenant", "tier",
                 "ticket", "admitted_s", "verdict", "input_tokens", "output_tokens", "usage")

    def __init__(self, tracing: Tracing, trace_id: int, parent_id: int, tracestate: bytes | None,
                 endpoint: Endpoint, path: bytes, request_id: bytes, started_s: float) -> None:
        self.tracing = tracing
        self.token: Token | None = None
        self.trace_id = trace_id
        self.span_id = new_span_id()
        self.parent_id = parent_id  # the client's span; 0: the trace starts here
        self.tracestate = tracestate
        self.operation = _OPERATIONS[endpoint]
        self.path = path
        self.request_id = request_id
        self.started_s = started_s
        # the gateway's clock is monotonic; spans need Unix time: one reading of each, side by side
        self.anchor_s = tracing.clock()
        self.anchor_ns = time.time_ns()
        self.attempts: list[_Attempt] = []
        self.first_token_s: float | None = None
        self.tenant: str | None = None
        self.tier: str | None = None  # None: the default tier, until a ticket names it
        self.ticket: Ticket | None = None
        self.admitted_s: float | None = None
        self.verdict: str | None = None
        self.input_tokens: int | None = None  # as the upstream reported them
        self.output_tokens: int | None = None
        self.usage: Any = None  # overload control's `_Usage`: a stream's completion tokens

    # -- hooks on the request's way (Proxy)
    def admitted(self, identity: Identity, ticket: Ticket | None = None, usage: Any = None) -> None:
        """Overload control is about to decide (no ticket yet), or admitted it (`ticket`; `usage`: what
        counts a stream's completion tokens)."""
        self.tenant = identity.tenant
        self.tier = identity.tier
        if ticket is not None:
            self.ticket = ticket
            self.tier = ticket.tier
            self.usage = usage
            self.admitted_s = self.tracing.clock()
            self.verdict = "queued" if ticket.future is not None else "assigned"

    def upstream_headers(self, replica: Replica) -> bytes:
        """An attempt starts on `replica`: the trace header lines for its request, with its own span id."""
        attempt = _Attempt(new_span_id(), replica, self.tracing.clock())
        previous = self.attempts[-1] if self.attempts else None
        if previous is not None and previous.ended_s is None:
            previous.ended_s = attempt.sent_s  # resent on a fresh connection without a verdict
        self.attempts.append(attempt)
        if not self.tracing.settings.propagate:
            return b""
        line = b"traceparent: " + format_traceparent(self.trace_id, attempt.span_id, FLAG_SAMPLED) + b"\r\n"
        return line if self.tracestate is None else line + b"tracestate: " + self.tracestate + b"\r\n"

    def attempt_ended(self, failure: str | None) -> None:
        if self.attempts:
            attempt = self.attempts[-1]
            attempt.ended_s = self.tracing.clock()
            attempt.outcome = failure or "ok"

    def first_token(self) -> None:
        now_s = self.tracing.clock()
        if self.first_token_s is None:
            self.first_token_s = now_s
        if self.attempts and self.attempts[-1].first_token_s is None:
            self.attempts[-1].first_token_s = now_s

    def answered(self, body: bytes) -> None:
        """A whole answer: the token counts of its `usage`, which closes an OpenAI answer (found from
        the end: a long answer is not scanned)."""
        at = body.rfind(b'"prompt_tokens"')
        found = _PROMPT_TOKENS.match(body, at) if at >= 0 else None
        if found is not None:
            self.input_tokens = int(found.group(1))
        if self.usage is None:  # overload control's `_Usage` reads completion_tokens already
            at = body.rfind(b'"completion_tokens"')
            found = _COMPLETION_TOKENS.match(body, at) if at >= 0 else None
            if found is not None:
                self.output_tokens = int(found.group(1))

    def end(self, model: str | None, status: int, replica_id: str | None, error: BaseException | None) -> None:
        """The request is answered: its spans are built and handed to the sink."""
        if self.token is not None:
            CURRENT_TRACE.reset(self.token)
        tracing = self.tracing
        try:
            tracing.sink.submit(self.spans(model, status, replica_id, error, tracing.clock()))
        except Exception:  # a tracing fault must never fail a request
            tracing.failed += 1

    # -- spans
    def _ns(self, at_s: float) -> int:
        return self.anchor_ns + int((at_s - self.anchor_s) * 1e9)

    def spans(self, model: str | None, status: int, replica_id: str | None, error: BaseException | None,
              now_s: float) -> list[SpanRecord]:
        """The request's spans. Their attributes that repeat across requests come from the tracer's
        attribute sets, each built (and encoded by the exporter) once per distinct set; what is the
        request's own (its id, its token counts) goes in `request_attributes`."""
        tracing, trace_id, root_id, state = self.tracing, self.trace_id, self.span_id, self.tracestate or b""
        model = model or "unknown"
        ticket, tenant, tier = self.ticket, self.tenant, self.tier
        rung = _rung(ticket.response_headers if ticket is not None else getattr(error, "headers", b""))
        error_type = None
        if status >= 400:
            error_type = error.code if isinstance(error, TidegateError) and error.code else str(status)
        # answered without a replica of its own: the response cache, a request it joined, or overload
        # control's cached-answer rung
        answered_by = ("cache" if rung is None else rung) if status == 200 and replica_id is None \
            and not self.attempts else None
        key = ("root", self.operation, model, status, tenant, tier, replica_id, rung, error_type, answered_by)
        attributes = tracing.attribute_set(key, self._root_attributes)
        own: dict[str, AttributeValue] = {"tidegate.request_id": self.request_id.decode("latin-1")}
        if self.input_tokens is not None:
            own["gen_ai.usage.input_tokens"] = self.input_tokens
        output_tokens, usage = self.output_tokens, self.usage
        if output_tokens is None and usage is not None:
            output_tokens = usage.reported
            if output_tokens is None and self.first_token_s is not None:  # a stream without usage: its events
                own["tidegate.output_tokens_estimate"] = usage.completion_tokens()
        if output_tokens is not None:
            own["gen_ai.usage.output_tokens"] = output_tokens
        events = () if self.first_token_s is None else (("first_token", self._ns(self.first_token_s), {}),)
        failed = status >= 500 or status == 499
        spans = [SpanRecord(f"{self.operation} {model}", trace_id, root_id, self.parent_id, SpanKind.SERVER,
                            self._ns(self.started_s), self._ns(now_s), attributes, events,
                            error=(str(error) or str(status)) if failed else None, tracestate=state,
                            remote_parent=self.parent_id != 0, attributes_key=key, request_attributes=own)]
        # admission: overload control's decision, from arrival to its verdict (refusals end there)
        first_sent_s = self.attempts[0].sent_s if self.attempts else None
        if tenant is not None:
            verdict = self.verdict or _refusal_verdict(error, status)
            decided_s = self.admitted_s if self.admitted_s is not None else (first_sent_s or now_s)
            key = ("admission", tenant, tier, verdict, rung)
            spans.append(SpanRecord("tidegate.admission", trace_id, new_span_id(), root_id, SpanKind.INTERNAL,
                                    spans[0].start_ns, self._ns(decided_s),
                                    tracing.attribute_set(key, _admission_attributes), tracestate=state,
                                    attributes_key=key))
        # the wait for a replica: admitted -> dispatched (overload control; none when it was assigned one
        # at arrival), or, without overload control, arrival -> first attempt (the wait for a free slot)
        queued_s = self.admitted_s if self.verdict == "queued" else (self.started_s if tenant is None else None)
        dispatched_s = ticket.dispatched_s if ticket is not None and ticket.dispatched_s is not None else first_sent_s
        if queued_s is not None and dispatched_s is not None:
            key = ("queue", tier)
            predicted = None
            if ticket is not None and ticket.predicted_wait_s is not None:
                predicted = {"tidegate.queue.predicted_wait_s": round(ticket.predicted_wait_s, 6)}
            spans.append(SpanRecord("tidegate.queue", trace_id, new_span_id(), root_id, SpanKind.INTERNAL,
                                    self._ns(queued_s), self._ns(max(queued_s, dispatched_s)),
                                    tracing.attribute_set(key, _queue_attributes), tracestate=state,
                                    attributes_key=key, request_attributes=predicted))
        for number, attempt in enumerate(self.attempts, 1):
            replica = attempt.replica
            ended_s = attempt.ended_s if attempt.ended_s is not None else now_s
            outcome = attempt.outcome if attempt.ended_s is not None else ("cancelled" if status == 499 else "ok")
            key = ("attempt", self.operation, replica, number, outcome)
            attempt_events = () if attempt.first_token_s is None \
                else (("first_token", self._ns(attempt.first_token_s), {}),)
            spans.append(SpanRecord(f"{self.operation} {replica.upstream_model}", trace_id, attempt.span_id, root_id,
                                    SpanKind.CLIENT, self._ns(attempt.sent_s), self._ns(ended_s),
                                    tracing.attribute_set(key, _attempt_attributes), attempt_events,
                                    error=None if outcome == "ok" else outcome, tracestate=state, attributes_key=key))
        return spans

    @staticmethod
    def _root_attributes(key: tuple) -> dict[str, AttributeValue]:
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


def _admission_attributes(key: tuple) -> dict[str, AttributeValue]:
    _, tenant, tier, verdict, rung = key
    attributes: dict[str, AttributeValue] = {"tidegate.tenant": tenant, "tidegate.admission.verdict": verdict}
    if tier is not None:
        attributes["tidegate.tier"] = tier
    if rung is not None:
        attributes["tidegate.degradation"] = rung
    return attributes


def _queue_attributes(key: tuple) -> dict[str, AttributeValue]:
    return {} if key[1] is None else {"tidegate.tier": key[1]}


def _attempt_attributes(key: tuple) -> dict[str, AttributeValue]:
    _, operation, replica, number, outcome = key
    endpoint = replica.connections.endpoint
    return {"gen_ai.operation.name": operation, "gen_ai.request.model": replica.upstream_model,
            "server.address": endpoint.host, "server.port": endpoint.port, "tidegate.replica": replica.replica_id,
            "tidegate.attempt": number, "tidegate.outcome": outcome}


def _rung(headers: bytes) -> str | None:
    found = _RUNG.search(headers) if headers and b"degradation" in headers else None
    return found.group(1).decode() if found is not None else None


def _refusal_verdict(error: BaseException | None, status: int) -> str:
    """Overload control's verdict for a request it did not admit, from the answer it raised."""
    if status == 429:
        return "rate_limited"
    if status == 413:
        return "too_large"
    if status == 200:
        return "cached_answer"
    if error is not None and _rung(getattr(error, "headers", b"")) is not None:
        return "degraded"
    return "refused" if status >= 400 else "admitted"


class Tracing:
    """The gateway's tracer: samples requests, starts their traces, sends their spans to the sink."""

    def __init__(self, settings: TracingSettings, sink: SpanSink, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.sink = sink
        self.clock = clock
        self.failed = 0  # spans of requests whose export hand-off raised
        # threshold of TraceIdRatioBased: a trace id's low 64 bits below it are sampled
        self._ratio_bound = round(settings.sampling_ratio * 2**64)
        self._attribute_sets: dict[Hashable, dict[str, AttributeValue]] = {}

    def attribute_set(self, key: Hashable, build: Callable[[Any], dict[str, AttributeValue]]
                      ) -> dict[str, AttributeValue]:
        """The attributes `build(key)` makes, made once per key and shared: never change one."""
        found = self._attribute_sets.get(key)
        if found is None:
            if len(self._attribute_sets) >= _ATTRIBUTE_SETS:
                self._attribute_sets.clear()
            found = self._attribute_sets[key] = build(key)
        return found

    def begin(self, request: HttpRequest, endpoint: Endpoint, request_id: bytes, started_s: float
              ) -> RequestTrace | PassThrough:
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
            return RequestTrace(self, trace_id, parent_id, tracestate, endpoint, request.path, request_id, started_s)
        if not settings.propagate:
            return PassThrough(b"")
        # not recorded: the upstream still hears the trace and that it is not sampled (W3C flags 00),
        # under one span id that stands for the gateway
        line = b"traceparent: " + format_traceparent(trace_id, new_span_id(), 0) + b"\r\n"
        return PassThrough(line if tracestate is None else line + b"tracestate: " + tracestate + b"\r\n")


def _pass_through(request: HttpRequest) -> PassThrough | None:
    """Tracing off: a valid client traceparent (and its tracestate) go to the upstream unchanged."""
    if parse_traceparent(request.traceparent) is None:
        return None
    assert request.traceparent is not None
    lines = b"traceparent: " + request.traceparent.strip(b" \t") + b"\r\n"
    tracestate = clean_tracestate(request.tracestate)
    return PassThrough(lines if tracestate is None else lines + b"tracestate: " + tracestate + b"\r\n")


def start_trace(tracing: Tracing | None, request: HttpRequest, endpoint: Endpoint, request_id: bytes,
                started_s: float) -> RequestTrace | PassThrough | None:
    """The request's trace, made current for its task (and the tasks it starts); `end` it in a `finally`."""
    trace = tracing.begin(request, endpoint, request_id, started_s) if tracing is not None else _pass_through(request)
    if trace is not None:
        trace.token = CURRENT_TRACE.set(trace)
    return trace
