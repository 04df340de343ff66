"""The degradation rung a traced request records off its admission ticket's response headers: the
rung that served it, or none when the ticket carries no degradation header (`RequestTrace.end`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tidegate.gateway.tracing import Tracing, TracingSettings
from tidegate.gateway.validation import Endpoint


class Collecting:
    def __init__(self) -> None:
        self.traces: list = []

    def submit_trace(self, trace) -> None:
        self.traces.append(trace)


@pytest.mark.parametrize(("headers", "rung"), [
    (b"x-ratelimit-limit-requests: 100\r\nx-tidegate-degradation: fallback_pool\r\n", "fallback_pool"),
    (b"x-ratelimit-limit-requests: 100\r\n", None),
    (b"", None),
])
def test_an_admitted_requests_rung_comes_from_its_tickets_headers(headers: bytes, rung: str | None) -> None:
    sink = Collecting()
    trace = Tracing(TracingSettings(), sink).start(
        SimpleNamespace(traceparent=None, tracestate=None, path=b"/v1/chat/completions"), Endpoint.CHAT,
        b"request-1")
    ticket = SimpleNamespace(tier="gold", future=None, response_headers=headers, predicted_wait_s=None,
                             dispatched_s=None)
    trace.admitted(SimpleNamespace(tenant="tenant-a", tier="gold"), ticket)
    trace.end("m", 200, None, None)
    assert sink.traces == [trace]
    assert trace.rung == rung
