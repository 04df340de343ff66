"""Replicas that fail, stall or go away, and clients that stop reading, through a real gateway."""

from __future__ import annotations

import socket
import time
import urllib.request

import openai
import pytest

from gateway_harness import Gateway, Upstream, upstream_pool

from tidegate.ports import free_port as _free_port

MESSAGES = [{"role": "user", "content": "hello"}]


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=20)


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def _sum(metrics: dict[str, float], prefix: str, *fragments: str) -> float:
    return sum(value for name, value in metrics.items()
               if name.startswith(prefix) and all(fragment in name for fragment in fragments))


def _served(upstream: Upstream) -> float:
    return _metrics(f"http://127.0.0.1:{upstream.port}")["mock_requests_total"]


def test_5xx_before_any_byte_is_retried_on_another_replica_and_counted(start_mock, start_gateway) -> None:
    good, bad = start_mock(), start_mock("--error-rate", "1.0")
    gateway = start_gateway([upstream_pool("m", good, bad, health_path=None)],
                            health={"failure_threshold": 1000, "failure_ratio": 1.0})  # never ejected here
    client = _client(gateway)
    for stream in (False, True) * 5:
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
        else:
            assert client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
    metrics = _metrics(gateway.base)
    assert _sum(metrics, "tidegate_upstream_errors_total", 'kind="status_5xx"') >= 1
    assert _sum(metrics, "tidegate_upstream_retries_total", 'reason="status_5xx"') >= 1


def test_flaky_replica_is_ejected_and_stays_out(start_mock, start_gateway) -> None:
    goods = [start_mock(), start_mock()]
    flaky = start_mock("--error-rate", "0.3", "--seed", "5")
    gateway = start_gateway([upstream_pool("m", *goods, flaky, health_path=None)], health={"cooldown_s": 30})
    client = _client(gateway)
    for _ in range(150):  # all succeed: the flaky replica's errors are retried elsewhere
        client.chat.completions.create(model="m", messages=MESSAGES)
    before = _served(flaky), sum(_served(g) for g in goods)
    for _ in range(60):
        client.chat.completions.create(model="m", messages=MESSAGES)
    flaky_share = (_served(flaky) - before[0]) / (_served(flaky) - before[0] + sum(_served(g) for g in goods) - before[1])
    assert flaky_share < 0.05


def test_stream_that_stalls_after_tokens_times_out_between_them(start_mock, start_gateway) -> None:
    stalls = start_mock("--stall-after", "3", tokens=16)
    gateway = start_gateway([upstream_pool("m", stalls, health_path=None)],
                            server={"stream_idle_timeout_s": 0.5})
    stream = _client(gateway).chat.completions.create(model="m", messages=MESSAGES, stream=True)
    received = []
    with pytest.raises(openai.APIError, match="timed out mid-stream"):
        for chunk in stream:
            received.append(chunk.choices[0].delta.content if chunk.choices else None)
    assert len([text for text in received if text]) == 3
    assert _sum(_metrics(gateway.base), "tidegate_replica_outstanding") == 0


def test_whole_answer_from_a_stalled_replica_times_out(start_mock, start_gateway) -> None:
    stalls = start_mock("--stall-after", "3", tokens=16)
    gateway = start_gateway([upstream_pool("m", stalls, health_path=None)],
                            server={"whole_answer_timeout_s": 0.5})
    with pytest.raises(openai.APIStatusError) as caught:
        _client(gateway).chat.completions.create(model="m", messages=MESSAGES)
    assert caught.value.status_code == 504
    assert _sum(_metrics(gateway.base), "tidegate_replica_outstanding") == 0


def test_client_that_stops_reading_is_dropped_and_its_slot_freed(start_mock, start_gateway) -> None:
    # one slot; a streaming client that reads nothing must not hold it for the request's whole time
    endless = start_mock(tokens=200_000)
    gateway = start_gateway([upstream_pool("m", endless, health_path=None, slot_limit=1)],
                            server={"client_write_timeout_s": 0.5, "queue_timeout_s": 20})
    body = (b'{"model":"m","stream":true,"max_tokens":200000,'
            b'"messages":[{"role":"user","content":"hi"}]}')
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", gateway.port))
    try:
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%b" % (len(body), body))
        time.sleep(0.3)  # the stream starts and fills the socket buffers
        started = time.monotonic()
        reply = _client(gateway).completions.create(model="m", prompt="hi", max_tokens=4)
        waited_s = time.monotonic() - started
        assert reply.choices[0].text
        assert waited_s < 20 / 2  # freed by the write timeout, long before the queue timeout
        assert _sum(_metrics(gateway.base), "tidegate_client_connections_closed_total", 'reason="write_timeout"') == 1
    finally:
        stalled.close()


def test_pool_with_no_routable_replica_refuses_at_once(start_gateway) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    gateway = start_gateway([upstream_pool("m", dead, health_path=None)],
                            health={"failure_threshold": 1})
    client = _client(gateway)
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="m", messages=MESSAGES)  # connection refused: ejected
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="m", messages=MESSAGES)
    waited_s = time.monotonic() - started
    assert caught.value.status_code == 503
    assert "no replica" in caught.value.message
    assert caught.value.response.headers.get("retry-after")
    assert waited_s < 4.0 / 4  # the standard tier would have waited its whole 4 s for a slot
