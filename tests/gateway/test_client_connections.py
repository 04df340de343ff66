"""Client connection limits through a real gateway, over raw sockets: idle, head and body timeouts,
the connection cap, running out of descriptors, and the metrics and log lines that show them."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request
from contextlib import ExitStack

import pytest
import yaml
from support import free_port, start_process, tidegate_argv

from gateway_harness import Gateway, upstream_pool

TIMEOUT_S = 1.0  # every timeout of the timeouts gateway; its sweep runs every 0.25 s
HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.fixture(scope="module")
def timeouts_gateway(start_mock, start_gateway) -> Gateway:
    return start_gateway([upstream_pool("m", start_mock("--itl-ms", "100", tokens=30))], server={
        "keepalive_timeout_s": TIMEOUT_S, "head_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S})


def _connect(gateway: Gateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.port), timeout=10)


def _read_until_closed(sock: socket.socket, limit_s: float = 8.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took; fails past limit_s."""
    started = time.monotonic()
    received = b""
    while True:
        sock.settimeout(max(0.01, started + limit_s - time.monotonic()))
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            pytest.fail(f"the gateway did not close the connection within {limit_s} s; got {received!r}")
        if not data:
            break
        received += data
    return received, time.monotonic() - started


def _read_response(sock: socket.socket) -> bytes:
    """One complete response with a content-length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return head + b"\r\n\r\n" + body


def _error_code(response: bytes) -> str:
    return json.loads(response.partition(b"\r\n\r\n")[2])["error"]["code"]


def _metrics(gateway: Gateway) -> dict[str, float]:
    with urllib.request.urlopen(f"{gateway.base}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("tidegate_client_connections")}


def test_idle_keepalive_connection_is_closed_silently(timeouts_gateway: Gateway) -> None:
    with _connect(timeouts_gateway) as sock:
        sock.sendall(HEALTH)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        rest, waited_s = _read_until_closed(sock)
    assert rest == b""  # nothing to answer: just closed
    assert waited_s >= TIMEOUT_S * 0.9


def test_new_connection_that_sends_nothing_is_closed(timeouts_gateway: Gateway) -> None:
    with _connect(timeouts_gateway) as sock:
        rest, _ = _read_until_closed(sock)
    assert rest == b""


def test_trickled_head_gets_408_at_the_head_timeout(timeouts_gateway: Gateway) -> None:
    """Slowloris: a header line every 0.2 s; activity must not extend the head's time."""
    with _connect(timeouts_gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        started = time.monotonic()
        sock.settimeout(0.2)
        received = b""
        for index in range(40):  # 8 s at most
            try:
                sock.sendall(b"x-trickle-%d: y\r\n" % index)
                data = sock.recv(65536)
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not data:
                break
            received += data
        elapsed_s = time.monotonic() - started
    assert received.startswith(b"HTTP/1.1 408"), received
    assert b"connection: close" in received
    assert _error_code(received) == "request_timeout"
    assert TIMEOUT_S * 0.9 <= elapsed_s < 6


def test_half_sent_head_gets_408_and_close(timeouts_gateway: Gateway) -> None:
    with _connect(timeouts_gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        received, _ = _read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 408")
    assert _error_code(received) == "request_timeout"


def test_body_shorter_than_content_length_gets_408(timeouts_gateway: Gateway) -> None:
    with _connect(timeouts_gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"model\": \"m\"")
        received, waited_s = _read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 408"), received
    assert b"connection: close" in received
    assert _error_code(received) == "request_timeout"
    assert waited_s >= TIMEOUT_S * 0.9


def test_stream_longer_than_every_timeout_is_not_cut(timeouts_gateway: Gateway) -> None:
    """A request being handled is no business of these timeouts: 30 tokens at 100 ms is 3 s."""
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with _connect(timeouts_gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(body), body))
        received = b""
        deadline = time.monotonic() + 15
        while not received.endswith(b"0\r\n\r\n") and time.monotonic() < deadline:
            data = sock.recv(65536)
            assert data, f"closed mid-stream after {received[-200:]!r}"
            received += data
    assert received.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" in received


def test_timeouts_are_counted_and_logged(timeouts_gateway: Gateway) -> None:
    for head in (b"GET /health HTTP/1.1\r\n", b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 9\r\n\r\n{"):
        with _connect(timeouts_gateway) as sock:
            sock.sendall(head)
            _read_until_closed(sock)
    with _connect(timeouts_gateway) as sock:
        _read_until_closed(sock)
    metrics = _metrics(timeouts_gateway)
    for reason in ("idle_timeout", "head_timeout", "body_timeout"):
        assert metrics[f'tidegate_client_connections_closed_total{{reason="{reason}"}}'] >= 1, metrics
    assert metrics["tidegate_client_connections_open"] >= 1  # the /metrics request's own
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        log = timeouts_gateway.process.log()
        if all(f'"reason":"{reason}"' in log for reason in ("idle_timeout", "head_timeout", "body_timeout")):
            break
        time.sleep(0.2)
    lines = [line for line in log.splitlines() if "client connections closed" in line]
    for reason in ("idle_timeout", "head_timeout", "body_timeout"):
        assert any(f'"reason":"{reason}"' in line for line in lines), lines
    # rate-limited: a line per reason per 10 s, not one per connection (this module runs for ~20 s)
    for reason in ("idle_timeout", "head_timeout", "body_timeout"):
        assert sum(f'"reason":"{reason}"' in line for line in lines) <= 3, lines


CAP = 4


@pytest.fixture(scope="module")
def capped_gateway(start_mock, start_gateway) -> Gateway:
    return start_gateway([upstream_pool("m", start_mock())], server={"max_connections": CAP, "head_timeout_s": 30})


def test_over_the_cap_new_connection_gets_503_and_busy_ones_keep_working(capped_gateway: Gateway) -> None:
    with ExitStack() as stack:
        # the cap filled with connections mid-head: none of them is idle, so none can make room
        stalled = [stack.enter_context(_connect(capped_gateway)) for _ in range(CAP - 1)]
        for sock in stalled:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        existing = stack.enter_context(_connect(capped_gateway))
        existing.sendall(b"GET /hea")
        time.sleep(0.3)  # every one of them accepted before the next

        with _connect(capped_gateway) as refused:
            answer, _ = _read_until_closed(refused)  # answered before it sends anything
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"connection: close" in answer
        assert _error_code(answer) == "too_many_connections"

        with _connect(capped_gateway) as refused:  # a client that sends its request first still reads the 503
            refused.sendall(HEALTH)
            answer, _ = _read_until_closed(refused)
        assert answer.startswith(b"HTTP/1.1 503"), answer

        existing.sendall(b"lth HTTP/1.1\r\nhost: x\r\n\r\n")  # the existing connection still works
        assert _read_response(existing).startswith(b"HTTP/1.1 200")

        # now idle, it is the one closed to make room for a newcomer, which gets /health (the gateway
        # looks for idle connections at most every 0.1 s)
        time.sleep(0.3)
        with _connect(capped_gateway) as newcomer:
            newcomer.sendall(HEALTH)
            assert _read_response(newcomer).startswith(b"HTTP/1.1 200")
        existing.settimeout(5)
        assert existing.recv(100) == b""
    time.sleep(0.3)  # the stalled ones closed on our side: the gateway sees them go
    metrics = _metrics(capped_gateway)
    assert metrics['tidegate_client_connections_closed_total{reason="over_capacity"}'] >= 2
    assert metrics['tidegate_client_connections_closed_total{reason="idle_evicted"}'] >= 1
    assert metrics["tidegate_client_connections_open"] == 1  # the /metrics request's own


def test_out_of_descriptors_the_gateway_keeps_serving(start_mock, processes, tmp_path) -> None:
    """Under a hard limit barely above what the process holds at start, a flood of connections runs
    it out of descriptors (accept fails with EMFILE); once the flood goes, it serves again."""
    mock = start_mock()
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": port, "access_log": False},
                                      "pools": [upstream_pool("m", mock)]}))
    limit = 24  # the process holds about 16 at start: the cap (16 at least) is more than fits
    set_limit = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
                 "os.execv(sys.executable, sys.argv[1:])")
    process = start_process([sys.executable, "-c", set_limit, *tidegate_argv("serve", "--config", str(config))],
                            ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=30)
    processes.append(process)
    gateway = Gateway(process, port)
    with ExitStack() as stack:
        for _ in range(100):
            stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        if os.path.isdir(f"/proc/{process.pid}/fd"):
            assert len(os.listdir(f"/proc/{process.pid}/fd")) >= limit - 2  # it did run out
    time.sleep(0.5)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(f"{gateway.api}/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{gateway.base}/health", timeout=5) as response:
        assert response.status == 200
