"""Requests a sampling ratio leaves out: what the upstream hears of their trace, and which are kept."""

from __future__ import annotations

from types import SimpleNamespace

from tidegate.gateway.tracing import PassThrough, RequestTrace, Tracing, TracingSettings
from tidegate.gateway.validation import Endpoint

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class Sink:
    def submit_trace(self, trace) -> None:
        pass


def _request(traceparent: bytes | None = None, tracestate: bytes | None = None) -> SimpleNamespace:
    return SimpleNamespace(traceparent=traceparent, tracestate=tracestate, path=b"/v1/chat/completions")


def _traceparent(lines: bytes) -> list[str]:
    line = lines.split(b"\r\n")[0]
    assert line.startswith(b"traceparent: ")
    return line[len(b"traceparent: "):].decode().split("-")


def test_a_trace_left_out_here_names_the_gateway_span_its_root_would_have_had() -> None:
    tracing = Tracing(TracingSettings(sampling_ratio=0.0), Sink())
    span_ids = set()
    for number in range(50):
        trace = tracing.start(_request(), Endpoint.CHAT, b"req-%d" % number)
        assert isinstance(trace, PassThrough)
        lines = trace.upstream_headers(None)
        assert lines == trace.upstream_headers(None)  # every attempt hears the same
        version, trace_id, span_id, flags = _traceparent(lines)
        assert (version, flags, int(trace_id, 16)) == ("00", "00", trace.trace_id)
        # the span id a recorded request's root span has: the trace id's first 7 bytes, then 01
        assert span_id == trace_id[:14] + "01"
        span_ids.add(span_id)
    assert len(span_ids) == 50


def test_under_a_clients_unsampled_span_the_gateways_span_id_is_its_own() -> None:
    tracing = Tracing(TracingSettings(sampling_ratio=1.0), Sink())
    traceparent = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-00".encode()
    span_ids = set()
    for number in range(20):
        trace = tracing.start(_request(traceparent, b"vendor=abc"), Endpoint.CHAT, b"req-%d" % number)
        assert isinstance(trace, PassThrough)  # parent-based: the client's decision is followed
        lines = trace.upstream_headers(None)
        version, trace_id, span_id, flags = _traceparent(lines)
        assert (version, trace_id, flags) == ("00", CLIENT_TRACE, "00")
        assert span_id != "00f067aa0ba902b7" and not span_id.startswith(CLIENT_TRACE[:14])
        assert lines.endswith(b"tracestate: vendor=abc\r\n")
        span_ids.add(span_id)
    assert len(span_ids) == 20  # the client's trace is shared by its requests: random, not derived from it


def test_a_ratio_keeps_its_share_and_propagation_off_sends_nothing() -> None:
    tracing = Tracing(TracingSettings(sampling_ratio=0.25, propagate=False), Sink())
    traces = [tracing.start(_request(), Endpoint.CHAT, b"req-%d" % number) for number in range(4000)]
    kept = sum(isinstance(trace, RequestTrace) for trace in traces)
    assert 800 < kept < 1200  # 1,000 expected; 1,200 is over 7 standard deviations away
    left_out = [trace for trace in traces if isinstance(trace, PassThrough)]
    assert left_out and all(trace.upstream_headers(None) == b"" for trace in left_out)
