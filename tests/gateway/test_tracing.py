"""Tracing through `tidegate serve`: spans exported over OTLP/HTTP to a real receiver on loopback, and the
W3C traceparent the mock upstreams receive (their `/mock/requests`)."""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("opentelemetry.proto")
pytest.importorskip("opentelemetry.sdk")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway_harness import Upstream, upstream_pool  # noqa: E402
from otlp_receiver import OtlpReceiver, attributes  # noqa: E402
from support import free_port, start_process, tidegate_argv  # noqa: E402

from tidegate.config import ConfigError, parse_config  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # Span.SpanKind
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def start_traced_gateway(processes, tmp_path_factory):
    def start(pools: list[dict], tracing: dict | None, **sections: object) -> str:
        port = free_port()
        config = {"server": {"port": port, "access_log": False}, "pools": pools, **sections}
        if tracing is not None:
            config["tracing"] = tracing
        path = tmp_path_factory.mktemp("traced") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        processes.append(start_process(tidegate_argv("serve", "--config", str(path)),
                                       ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=30))
        return f"127.0.0.1:{port}"

    return start


@pytest.fixture(scope="module")
def mocks(start_mock) -> tuple[Upstream, Upstream]:
    return start_mock(tokens=5), start_mock("--error-rate", "1.0")


@pytest.fixture(scope="module")
def traced(start_traced_gateway, mocks, receiver) -> str:
    good, bad = mocks
    return start_traced_gateway(
        [upstream_pool("m", good), upstream_pool("flaky", good, bad, health_path=None)],
        {"enabled": True, "endpoint": receiver.endpoint, "export_interval_s": 0.1,
         "resource_attributes": {"deployment.environment": "test"}},
        health={"failure_threshold": 1000, "failure_ratio": 1.0})  # the failing mock is never ejected here


def _post(address: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection(address, timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(body),
                       {"content-type": "application/json", **(headers or {})})
    response = connection.getresponse()
    answer = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), answer


def _upstream_saw(upstream: Upstream, request_id: str) -> dict:
    connection = http.client.HTTPConnection(f"127.0.0.1:{upstream.port}", timeout=10)
    connection.request("GET", "/mock/requests")
    seen = json.loads(connection.getresponse().read())
    connection.close()
    return next(entry for entry in seen if entry["x-request-id"] == request_id)


def _trace_of(receiver: OtlpReceiver, request_id: str, spans: int, timeout_s: float = 15.0) -> list:
    """The spans of the trace whose root span names `request_id`, once `spans` of them arrived."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        roots = [s for s in receiver.spans if attributes(s).get("tidegate.request_id") == request_id]
        if roots:
            return receiver.wait_for_trace(roots[0].trace_id, spans, timeout_s=deadline - time.monotonic())
        time.sleep(0.05)  # the exporter's next batch
    raise AssertionError(f"no span names request {request_id}")


def _by_kind(spans: list) -> tuple:
    root = next(s for s in spans if s.kind == SERVER)
    attempts = sorted((s for s in spans if s.kind == CLIENT), key=lambda s: attributes(s)["tidegate.attempt"])
    inner = {s.name: s for s in spans if s.kind not in (SERVER, CLIENT)}
    return root, attempts, inner


def test_client_trace_continues_through_the_gateway_into_the_upstream(traced, receiver, mocks) -> None:
    status, headers, answer = _post(traced, {"model": "m", "messages": MESSAGES},
                                    {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=opaque"})
    assert status == 200
    usage = json.loads(answer)["usage"]
    spans = receiver.wait_for_trace(bytes.fromhex(TRACE_ID), 3)
    root, attempts, inner = _by_kind(spans)
    # the root is the client's span's child, with the GenAI facts of the answer
    assert root.parent_span_id.hex() == CLIENT_SPAN and root.name == "chat m" and root.trace_state == "vendor=opaque"
    assert root.flags & 0x200  # its parent is remote
    facts = attributes(root)
    assert facts["gen_ai.operation.name"] == "chat" and facts["gen_ai.request.model"] == "m"
    assert facts["http.response.status_code"] == 200 and facts["tidegate.request_id"] == headers["x-request-id"]
    assert facts["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert facts["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
    assert facts["tidegate.tenant"] == "anonymous" and facts["tidegate.tier"]
    # admission decided at arrival, then one attempt: children of the root, inside it in time
    admission = inner["tidegate.admission"]
    assert attributes(admission)["tidegate.admission.verdict"] == "assigned"
    assert attributes(admission)["tidegate.tenant"] == "anonymous"
    (attempt,) = attempts
    assert admission.parent_span_id == attempt.parent_span_id == root.span_id
    assert attempt.name == "chat m" and attributes(attempt)["tidegate.outcome"] == "ok"
    assert attributes(attempt)["server.port"] == mocks[0].port
    for child in (admission, attempt):
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano \
            <= root.end_time_unix_nano
    # the upstream continues the same trace under the attempt's span, with the client's tracestate
    seen = _upstream_saw(mocks[0], headers["x-request-id"])
    assert seen["traceparent"] == f"00-{TRACE_ID}-{attempt.span_id.hex()}-01"
    assert seen["tracestate"] == "vendor=opaque"
    assert {"service.name": "tidegate", "deployment.environment": "test"}.items() <= receiver.resources()[0].items()


def test_a_trace_starts_at_the_gateway_when_the_client_sends_none(traced, receiver, mocks) -> None:
    status, headers, answer = _post(traced, {"model": "m", "messages": MESSAGES, "stream": True})
    assert status == 200 and b"[DONE]" in answer
    root, (attempt,), _ = _by_kind(_trace_of(receiver, headers["x-request-id"], 3))
    assert root.parent_span_id == b""
    # a stream's first token: an event on the request's span and on the attempt's
    assert [e.name for e in root.events] == [e.name for e in attempt.events] == ["first_token"]
    assert attempt.start_time_unix_nano <= attempt.events[0].time_unix_nano <= attempt.end_time_unix_nano
    seen = _upstream_saw(mocks[0], headers["x-request-id"])
    assert seen["traceparent"] == f"00-{root.trace_id.hex()}-{attempt.span_id.hex()}-01"
    assert seen["tracestate"] is None


def test_a_retry_is_an_attempt_span_of_its_own_with_its_own_traceparent(traced, receiver, mocks) -> None:
    good, bad = mocks
    for _ in range(12):  # the router picks either replica first; once it picks the failing one, it retries
        status, headers, _ = _post(traced, {"model": "flaky", "messages": MESSAGES})
        assert status == 200
        spans = _trace_of(receiver, headers["x-request-id"], 3)
        root, attempts, _ = _by_kind(spans)
        if len(attempts) == 1:
            continue
        spans = receiver.wait_for_trace(root.trace_id, 4)
        root, (first, second), _ = _by_kind(spans)
        assert attributes(first)["tidegate.outcome"] == "status_5xx" and first.status.code == 2
        assert attributes(first)["server.port"] == bad.port
        assert attributes(second)["tidegate.outcome"] == "ok" and attributes(second)["tidegate.attempt"] == 2
        assert first.end_time_unix_nano <= second.start_time_unix_nano
        assert _upstream_saw(bad, headers["x-request-id"])["traceparent"].split("-")[2] == first.span_id.hex()
        assert _upstream_saw(good, headers["x-request-id"])["traceparent"].split("-")[2] == second.span_id.hex()
        return
    pytest.fail("no request was sent to the failing replica first in 12 tries")


def test_a_refused_request_is_traced_with_its_error(traced, receiver) -> None:
    status, headers, _ = _post(traced, {"model": "no-such-model", "messages": MESSAGES})
    assert status == 404
    (root,) = _trace_of(receiver, headers["x-request-id"], 1)
    facts = attributes(root)
    assert facts["http.response.status_code"] == 404 and facts["error.type"] == "model_not_found"
    assert root.status.code == 0  # a client's mistake is not the server's error


def test_a_request_overload_control_refuses_has_its_admission_span(start_traced_gateway, mocks, receiver) -> None:
    """The proxy tells the trace whose request it was only on the way out of a refusal (one hook call
    a request, not two): the 429's spans still name the tenant and the verdict."""
    good, _ = mocks
    address = start_traced_gateway(
        [upstream_pool("m", good)], {"enabled": True, "endpoint": receiver.endpoint, "export_interval_s": 0.1},
        tenants={"capped": {"api_keys": ["sk-capped"], "tier": "standard", "requests_per_minute": 1}})
    key = {"authorization": "Bearer sk-capped"}
    first_status, first_headers, _ = _post(address, {"model": "m", "messages": MESSAGES}, key)
    status, headers, _ = _post(address, {"model": "m", "messages": MESSAGES}, key)
    assert (first_status, status) == (200, 429)
    root, attempts, inner = _by_kind(_trace_of(receiver, headers["x-request-id"], 2))
    admission = inner["tidegate.admission"]
    assert attempts == [] and attributes(root)["http.response.status_code"] == 429
    assert attributes(admission)["tidegate.admission.verdict"] == "rate_limited"
    assert attributes(admission)["tidegate.tenant"] == "capped" and attributes(admission)["tidegate.tier"] == "standard"
    admitted_root, _, admitted_inner = _by_kind(_trace_of(receiver, first_headers["x-request-id"], 3))
    assert attributes(admitted_inner["tidegate.admission"])["tidegate.admission.verdict"] == "assigned"


def test_tracing_off_passes_the_client_traceparent_on_unchanged(start_traced_gateway, mocks) -> None:
    address = start_traced_gateway([upstream_pool("m", mocks[0])], None)
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    _, headers, _ = _post(address, {"model": "m", "messages": MESSAGES},
                          {"traceparent": traceparent, "tracestate": "vendor=opaque"})
    seen = _upstream_saw(mocks[0], headers["x-request-id"])
    assert (seen["traceparent"], seen["tracestate"]) == (traceparent, "vendor=opaque")
    _, headers, _ = _post(address, {"model": "m", "messages": MESSAGES}, {"traceparent": "00-garbage"})
    assert _upstream_saw(mocks[0], headers["x-request-id"])["traceparent"] is None
    _, headers, _ = _post(address, {"model": "m", "messages": MESSAGES})
    assert _upstream_saw(mocks[0], headers["x-request-id"])["traceparent"] is None


def test_unsampled_requests_pass_the_decision_upstream(start_traced_gateway, mocks, receiver) -> None:
    address = start_traced_gateway([upstream_pool("m", mocks[0])],
                                   {"enabled": True, "endpoint": receiver.endpoint, "sampling_ratio": 0.0})
    _, headers, _ = _post(address, {"model": "m", "messages": MESSAGES})
    version, trace_id, span_id, flags = _upstream_saw(mocks[0], headers["x-request-id"])["traceparent"].split("-")
    assert (version, flags, len(trace_id), len(span_id)) == ("00", "00", 32, 16)
    # a caller's sampled flag decides (parent-based), whatever the ratio
    _, headers, _ = _post(address, {"model": "m", "messages": MESSAGES},
                          {"traceparent": f"00-{'a' * 32}-{CLIENT_SPAN}-01"})
    assert _trace_of(receiver, headers["x-request-id"], 2)


def test_the_sdk_exporter_sends_the_same_spans(start_traced_gateway, mocks) -> None:
    with OtlpReceiver() as own_receiver:
        address = start_traced_gateway([upstream_pool("m", mocks[0])],
                                       {"enabled": True, "endpoint": own_receiver.endpoint, "exporter": "sdk",
                                        "export_interval_s": 0.1})
        _, headers, _ = _post(address, {"model": "m", "messages": MESSAGES})
        root, (attempt,), inner = _by_kind(_trace_of(own_receiver, headers["x-request-id"], 3))
        assert root.name == "chat m" and "tidegate.admission" in inner
        assert own_receiver.content_types[0] == "application/x-protobuf"


def test_tracing_config_is_checked() -> None:
    pools = "pools:\n  - name: m\n    backends:\n      - type: upstream\n        url: http://127.0.0.1:1/v1\n"
    assert not parse_config(pools).tracing.enabled
    with pytest.raises(ConfigError, match="grpc needs exporter: sdk"):
        parse_config(pools + "tracing:\n  enabled: true\n  protocol: grpc\n")
    with pytest.raises(ConfigError, match="sampling_ratio"):
        parse_config(pools + "tracing:\n  sampling_ratio: 2\n")
    with pytest.raises(ConfigError, match="endpoint"):
        parse_config(pools + "tracing:\n  endpoint: collector:4318\n")
