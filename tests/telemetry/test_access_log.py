"""The access log's line carries the request's trace id, so that a line leads to its spans."""

from __future__ import annotations

import os
from types import SimpleNamespace

import orjson

from tidegate.gateway.tracing import Tracing, TracingSettings, start_trace
from tidegate.gateway.validation import Endpoint
from tidegate.telemetry.logs import AccessLog

CLIENT_TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _lines(trace_ids: list[int | None]) -> list[dict]:
    read_end, write_end = os.pipe()
    log = AccessLog(True, fd=write_end)
    for trace_id in trace_ids:
        log.record(b"req-1", b"POST", b"/v1/chat/completions", "m", 200, 0.0125, "m#0", trace_id)
    log.flush()
    os.close(write_end)
    with os.fdopen(read_end, "rb") as lines:
        return [orjson.loads(line) for line in lines.read().splitlines()]


def test_a_traced_request_logs_its_trace_id_as_w3c_hex() -> None:
    traced, untraced = _lines([0x4BF92F3577B34DA6A3CE929D0E0E4736, None])
    assert traced["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert traced["request_id"] == "req-1" and traced["status"] == 200
    assert "trace_id" not in untraced


def _request(traceparent: bytes | None) -> SimpleNamespace:
    return SimpleNamespace(traceparent=traceparent, tracestate=None, path=b"/v1/chat/completions")


def test_every_kind_of_trace_names_its_trace_id() -> None:
    class Sink:
        def submit_trace(self, trace) -> None:
            pass

    recorded = Tracing(TracingSettings(), Sink())
    unsampled = Tracing(TracingSettings(sampling_ratio=0.0), Sink())
    for tracing, traceparent in ((None, CLIENT_TRACEPARENT), (recorded, CLIENT_TRACEPARENT),
                                 (unsampled, b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")):
        trace = start_trace(tracing, _request(traceparent), Endpoint.CHAT, b"req-1")
        assert trace is not None and trace.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    started_here = start_trace(recorded, _request(None), Endpoint.CHAT, b"req-2")
    assert started_here.trace_id not in (0, 0x4BF92F3577B34DA6A3CE929D0E0E4736)
    assert start_trace(None, _request(None), Endpoint.CHAT, b"req-3") is None  # tracing off: nothing
