"""The batch span encoder (gateway/trace_spans.py) against the general one: for requests traced through
the same hooks the proxy calls, the same bytes as `encode_span` of `RequestTrace.spans`, readable by
the official proto classes; and the exporter's queue of ended traces."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from tidegate.errors import UpstreamError
from tidegate.gateway import tracing as tracing_module
from tidegate.gateway.overload import DegradedReplyError, TenantRateLimitError
from tidegate.gateway.trace_export import OtlpHttpExporter
from tidegate.gateway.trace_spans import TraceEncoder
from tidegate.gateway.tracing import ATTEMPT_SPAN_BYTE, RequestTrace, Tracing, TracingSettings
from tidegate.gateway.validation import Endpoint
from tidegate.telemetry.otlp import encode_export_request, encode_span



class FakeClock:  # the tracer's nanoseconds; `seconds` a monotonic clock as overload control reads it
    def __init__(self) -> None:
        self.now_ns = 999_500_000_000

    def __call__(self) -> int:
        self.now_ns += 1_500_000
        return self.now_ns

    def seconds(self) -> float:
        return self() / 1e9


class Replica:  # what the tracer reads of a gateway replica; hashable, as replicas are
    def __init__(self, number: int) -> None:
        self.replica_id = f"pool#{number}@10.0.0.{number}:8000"
        self.upstream_model = "upstream-model"
        self.connections = SimpleNamespace(endpoint=SimpleNamespace(host=f"10.0.0.{number}", port=8000))


class Usage:
    def __init__(self, reported: int | None, events: int, prompt_tokens: int | None = None) -> None:
        self.reported = reported
        self.events = events
        self.prompt_tokens = prompt_tokens

    def completion_tokens(self) -> int:
        return self.reported if self.reported is not None else max(0, self.events - 1)


class Collecting:
    def __init__(self) -> None:
        self.traces: list[RequestTrace] = []

    def submit_trace(self, trace: RequestTrace) -> None:
        self.traces.append(trace)


def _request(traceparent: bytes | None = None, tracestate: bytes | None = None) -> SimpleNamespace:
    return SimpleNamespace(traceparent=traceparent, tracestate=tracestate, path=b"/v1/chat/completions")


def _ticket(tier: str, queued: bool, headers: bytes = b"", predicted_wait_s: float | None = 0.0123456789,
            dispatched_s: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(tier=tier, future=object() if queued else None, response_headers=headers,
                           predicted_wait_s=predicted_wait_s, dispatched_s=dispatched_s)


def _traced(tracing: Tracing, sink: Collecting, case: str, number: int) -> RequestTrace:
    """One request through the hooks, as the proxy calls them, in one of the ways a request goes."""
    clock = tracing_module.clock_ns.seconds
    parent = case in ("client parent", "retried") and b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    trace = tracing.begin(_request(parent or None, b"vendor=abc" if parent else None),
                          Endpoint.COMPLETIONS if case == "completion" else Endpoint.CHAT,
                          b"req-%d" % number if case != "odd id" else (b"r" * 300 if number % 2 else b"\xe9-%d" % number))
    assert isinstance(trace, RequestTrace)
    identity = SimpleNamespace(tenant=f"tenant-{number % 3}", tier="gold" if number % 2 else None)
    status, error, replica_id, model = 200, None, None, "m"
    if case in ("fifo", "completion", "odd id", "client parent"):  # no overload control
        replica = Replica(number % 2)
        trace.upstream_headers(replica)
        trace.attempt_ended(None)
        trace.answered(b'{"usage":{"prompt_tokens":%d,"completion_tokens":%d}}' % (number, 2 * number))
        replica_id = replica.replica_id
    elif case == "refused":
        trace.admitted(identity)
        status, error = 503, DegradedReplyError("busy", retry_after_s=1.0,
                                                 headers=b"x-tidegate-degradation: preset_reply\r\n")
    elif case == "rate limited":
        trace.admitted(identity)
        status, error = 429, TenantRateLimitError("slow down", retry_after_s=1.0, headers=b"")
    elif case in ("queued stream", "assigned stream", "stream without usage", "retried"):
        queued = case != "assigned stream"
        usage = Usage(None if case == "stream without usage" else 40 + number, 17,
                      None if case == "stream without usage" else 9 + number)
        trace.admitted(identity, _ticket("gold", queued, dispatched_s=clock() if queued else None), usage)
        replica = Replica(number % 3)
        trace.upstream_headers(replica)
        if case == "retried":
            trace.attempt_ended("connect")
            replica = Replica(7)
            trace.upstream_headers(replica)
        trace.first_token()
        trace.attempt_ended(None)
        replica_id = replica.replica_id
    elif case == "broken":
        trace.admitted(identity, _ticket("bronze", False, predicted_wait_s=None), Usage(None, 0))
        trace.upstream_headers(Replica(1))
        status, error = 502, UpstreamError("upstream replica failed: reset")
    elif case == "client gone":
        trace.upstream_headers(Replica(2))
        trace.first_token()
        status = 499
    else:
        raise AssertionError(case)
    trace.end(model, status, replica_id, error)
    assert sink.traces[-1] is trace
    return trace


CASES = ("fifo", "completion", "odd id", "client parent", "refused", "rate limited", "queued stream",
         "assigned stream", "stream without usage", "retried", "broken", "client gone")


@pytest.fixture
def tracing(monkeypatch) -> tuple[Tracing, Collecting]:
    monkeypatch.setattr(tracing_module, "clock_ns", FakeClock())
    sink = Collecting()
    return Tracing(TracingSettings(), sink), sink


@pytest.mark.parametrize("case", CASES)
def test_same_bytes_as_the_general_encoder(tracing, case) -> None:
    tracer, sink = tracing
    encoder = TraceEncoder()
    for number in range(4):  # shapes made, then found again
        trace = _traced(tracer, sink, case, number)
        spans = trace.spans()
        assert len(spans) == trace.span_count
        assert encoder.encode([trace]) == b"".join(encode_span(span) for span in spans)


def test_a_batch_is_its_requests_spans_in_order(tracing) -> None:
    tracer, sink = tracing
    traces = [_traced(tracer, sink, case, number) for number in range(3) for case in CASES]
    batch = TraceEncoder().encode(traces)
    assert batch == b"".join(encode_span(span) for trace in traces for span in trace.spans())


def test_the_official_classes_read_the_spans(tracing) -> None:
    trace_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    tracer, sink = tracing
    retried = _traced(tracer, sink, "retried", 1)
    queued = _traced(tracer, sink, "queued stream", 2)
    body = encode_export_request({"service.name": "tidegate"}, "tidegate", "0.1.0",
                                 [TraceEncoder().encode([retried, queued])])
    spans = trace_pb2.ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
    assert [span.name for span in spans] == ["chat m", "tidegate.admission", "tidegate.queue", "chat upstream-model",
                                             "chat upstream-model"] + ["chat m", "tidegate.admission",
                                                                       "tidegate.queue", "chat upstream-model"]
    root, admission, queue, first, second = spans[:5]
    assert root.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736" and root.parent_span_id.hex() == "00f067aa0ba902b7"
    assert root.trace_state == "vendor=abc" and root.flags == 0x301 and root.kind == 2
    for child in (admission, queue, first, second):
        assert child.parent_span_id == root.span_id and child.trace_id == root.trace_id
    values = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in root.attributes}
    assert values["tidegate.request_id"] == "req-1" and values["gen_ai.usage.output_tokens"] == 41
    assert values["tidegate.tier"] == "gold" and values["http.response.status_code"] == 200
    assert [event.name for event in root.events] == ["first_token"]
    assert root.start_time_unix_nano < root.events[0].time_unix_nano < root.end_time_unix_nano
    assert first.status.code == 2 and first.status.message == "connect" and not second.HasField("status")
    assert {a.key: a.value.int_value for a in second.attributes if a.key == "tidegate.attempt"} == {"tidegate.attempt": 2}
    assert {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in queue.attributes} == {
        "tidegate.tier": "gold", "tidegate.queue.predicted_wait_s": 0.012346}
    # the attempt's span id is the one its upstream was sent in traceparent
    assert spans[8].span_id == queued.span_id(queued.attempts[0][ATTEMPT_SPAN_BYTE]).to_bytes(8, "big")


def _exporter(**limits: int) -> OtlpHttpExporter:
    return OtlpHttpExporter("http://127.0.0.1:9", {"service.name": "tidegate"}, scope_version="0",
                            registry=CollectorRegistry(), **limits)


def _counted(exporter: OtlpHttpExporter, outcome: str) -> float:
    return exporter.spans.labels(outcome)._value.get()


def test_the_queue_drops_whole_requests_past_its_bound_and_counts_their_spans(tracing) -> None:
    tracer, sink = tracing
    exporter = _exporter(max_queue_spans=10, max_batch_spans=4)
    traces = [_traced(tracer, sink, "queued stream", number) for number in range(3)]  # 4 spans each
    for trace in traces:
        exporter.submit_trace(trace)
    assert len(exporter._pending) == 2 and exporter._pending_spans == 8
    assert _counted(exporter, "dropped") == 4


def test_an_ended_trace_is_encoded_at_once_and_lets_the_request_go(tracing) -> None:
    """What waits for the next export is bytes: a trace that kept its ticket and usage until then aged
    into the collector's older generations (`RequestTrace.end`)."""
    tracer, sink = tracing
    trace = _traced(tracer, sink, "queued stream", 1)
    assert trace.ticket is None and trace.usage is None
    exporter = _exporter()
    exporter.submit_trace(trace)
    (encoded,) = exporter._pending
    assert exporter._pending_counts == [trace.span_count] == [4]
    assert encoded == TraceEncoder().encode_trace(trace)


def test_batches_take_whole_requests_up_to_the_batch_size(tracing) -> None:
    tracer, sink = tracing
    exporter = _exporter(max_batch_spans=9)
    for number in range(5):
        exporter.submit_trace(_traced(tracer, sink, "queued stream", number))  # 4 spans each
    exported: list[int] = []

    async def export(spans: list[bytes], count: int) -> None:
        exported.append(count)

    exporter._export = export  # type: ignore[method-assign]
    asyncio.run(exporter.flush(partial=False))
    assert exported == [8, 8] and exporter._pending_spans == 4
    asyncio.run(exporter.flush())
    assert exported == [8, 8, 4] and exporter._pending_spans == 0


def test_a_request_with_more_spans_than_a_batch_goes_alone(tracing) -> None:
    tracer, sink = tracing
    exporter = _exporter(max_batch_spans=3)
    for number in range(2):
        exporter.submit_trace(_traced(tracer, sink, "queued stream", number))  # 4 spans each
    exported: list[tuple[int, int]] = []

    async def export(spans: list[bytes], count: int) -> None:
        exported.append((len(spans), count))

    exporter._export = export  # type: ignore[method-assign]
    asyncio.run(exporter.flush())
    assert exported == [(1, 4), (1, 4)] and exporter._pending == exporter._pending_counts == []


@pytest.mark.parametrize("body", [
    b'{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":16,"total_tokens":28}}',
    b'{"choices": [],\n "usage": {\n  "completion_tokens" : 16,\n  "prompt_tokens" : 12\n }\n}'])
def test_a_whole_answer_without_overload_control_gives_its_token_counts(tracing, body) -> None:
    tracer, _ = tracing
    trace = tracer.start(_request(), Endpoint.CHAT, b"req")
    trace.answered(body)
    assert (trace.input_tokens, trace.output_tokens) == (12, 16)
    trace.answered(b'{"choices":[]}')  # no usage: nothing read
    assert (trace.input_tokens, trace.output_tokens) == (None, None)
    trace.end("m", 200, None, None)
