"""Each fault of the proxy, between a real `tidegate mock-upstream` process and a real HTTP client.

Times are compared with a run without the fault in the same test, or with what the proxy itself
measured, never with an absolute bound: the machine may be busy.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import orjson
import pytest

from tidegate.chaos.fault_proxy import FaultProxy
from tidegate.chaos.faults import PASS, FaultSet, parse_fault_set
from tidegate.chaos.proxy_admin import AdminClient, start_admin

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hello"}]}
STREAM = {**CHAT, "stream": True}


@asynccontextmanager
async def _proxy(port: int, faults: FaultSet = PASS, **options) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy("127.0.0.1", 0, "127.0.0.1", port, faults, seed=7, **options)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


def _url(proxy: FaultProxy) -> str:
    return f"http://127.0.0.1:{proxy.port}/v1/chat/completions"


def _raw_request(body: dict) -> bytes:
    data = orjson.dumps(body)
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


async def _api_requests(mock) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{mock.base}/metrics") as response:
        text = await response.text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("mock_api_requests_total")))


async def _durations(session: aiohttp.ClientSession, url: str, body: dict, count: int) -> list[float]:
    durations = []
    for _ in range(count):
        started = time.perf_counter()
        async with session.post(url, json=body) as response:
            assert response.status == 200
            await response.read()
        durations.append(time.perf_counter() - started)
    return durations


async def test_request_latency_adds_the_configured_delay(start_mock) -> None:
    mock = start_mock()
    async with _proxy(mock.port) as proxy, aiohttp.ClientSession() as session:
        baseline = statistics.median(await _durations(session, _url(proxy), CHAT, 8))
        proxy.set_faults(parse_fault_set({"latency": {"ms": 150, "jitter_ms": 30, "per": ["request"]}}))
        faulted = statistics.median(await _durations(session, _url(proxy), CHAT, 8))
    assert proxy.counters.delays == 8
    assert 0.8 <= (faulted - baseline) / 0.150 <= 1.5


async def test_chunk_latency_delays_every_chunk_of_the_response(start_mock) -> None:
    mock = start_mock(tokens=6)
    async with _proxy(mock.port) as proxy, aiohttp.ClientSession() as session:
        baseline = sum(await _durations(session, _url(proxy), STREAM, 3))
        proxy.set_faults(parse_fault_set({"latency": {"ms": 40, "per": ["chunk"]}}))
        faulted = sum(await _durations(session, _url(proxy), STREAM, 3))
    assert proxy.counters.delays >= 3  # at least one chunk per response
    assert 0.85 <= (faulted - baseline) / proxy.counters.delay_s_total <= 1.5


async def test_reset_mid_stream_is_seen_as_a_broken_stream(start_mock) -> None:
    mock = start_mock(tokens=64)
    async with _proxy(mock.port) as proxy, aiohttp.ClientSession() as session:
        async with session.post(_url(proxy), json=STREAM) as response:
            whole = len(await response.read())
        proxy.set_faults(parse_fault_set({"reset": {"after_bytes": 1000}}))
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(_url(proxy), json=STREAM) as response:
                assert response.status == 200
                async for chunk in response.content.iter_any():
                    received += chunk
        assert 0 < len(received) < whole
        # at the socket: exactly the bytes before the cut sent, then an RST (an error at the client), not a
        # clean close (EOF). The client may read fewer of them: a kernel that takes an RST drops what its
        # reader had not read yet (648 of 1,000 once, on a loaded machine), so the count is the proxy's
        sent_before = proxy.counters.bytes_to_client
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(_raw_request(STREAM))
        raw = b""
        with pytest.raises(ConnectionResetError):
            while chunk := await asyncio.wait_for(reader.read(65536), 5):
                raw += chunk
        writer.close()
    assert proxy.counters.bytes_to_client - sent_before == 1000
    assert len(raw) <= 1000 and raw[:12] == b"HTTP/1.1 200"[:len(raw)]
    assert proxy.counters.resets == 2


async def test_blackhole_is_seen_as_a_timeout_and_reaches_no_upstream(start_mock) -> None:
    mock = start_mock()
    before = await _api_requests(mock)
    async with _proxy(mock.port, parse_fault_set({"blackhole": True})) as proxy:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(_url(proxy), json=CHAT) as response:
                    await response.read()
    assert proxy.counters.blackholed_connections == 1
    assert proxy.counters.bytes_to_client == 0
    assert await _api_requests(mock) == before


async def test_stall_after_n_bytes_leaves_the_connection_open(start_mock) -> None:
    mock = start_mock(tokens=64)
    async with _proxy(mock.port, parse_fault_set({"stall": {"after_bytes": 700}})) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(_raw_request(STREAM))
        received = b""
        while True:  # until nothing more comes for half a second
            try:
                chunk = await asyncio.wait_for(reader.read(65536), 0.5)
            except asyncio.TimeoutError:
                break
            assert chunk, "the proxy closed a stalled connection"
            received += chunk
        assert not reader.at_eof()
        assert proxy.counters.connections_open == 1
        writer.close()
    assert received.startswith(b"HTTP/1.1 200")
    assert len(received) == 700
    assert proxy.counters.stalls == 1


async def test_error_injection_rate_is_within_binomial_tolerance_on_one_keep_alive_connection(start_mock) -> None:
    mock = start_mock(tokens=2)
    count, probability = 300, 0.3
    async with _proxy(mock.port) as proxy, aiohttp.ClientSession() as session:
        async with session.post(_url(proxy), json=CHAT) as response:
            assert response.status == 200
        before = await _api_requests(mock)
        # switched while the connection is open: the next request on it already draws its fate
        proxy.set_faults(parse_fault_set({"error": {"status": 503, "probability": probability, "retry_after_s": 2}}))
        statuses, error_body, retry_after = [], None, None
        for _ in range(count):
            async with session.post(_url(proxy), json=CHAT) as response:
                statuses.append(response.status)
                if response.status == 503:
                    error_body, retry_after = await response.json(), response.headers.get("retry-after")
                else:
                    await response.read()
    injected = statuses.count(503)
    sigma = math.sqrt(count * probability * (1 - probability))
    assert abs(injected - count * probability) <= 4 * sigma
    assert statuses.count(200) == count - injected
    assert error_body["error"]["type"] == "server_error" and error_body["error"]["code"] == "503"
    assert retry_after == "2"
    assert proxy.counters.errors_injected == injected
    assert await _api_requests(mock) - before == count - injected  # injected requests never went upstream
    assert proxy.counters.connections_accepted == 1


async def test_bandwidth_limit_paces_the_response(start_mock) -> None:
    mock = start_mock(tokens=256)
    limit = 40_000.0
    async with _proxy(mock.port) as proxy, aiohttp.ClientSession() as session:
        started = time.perf_counter()
        async with session.post(_url(proxy), json=STREAM) as response:
            size = len(await response.read())
        baseline = time.perf_counter() - started
        proxy.set_faults(parse_fault_set({"bandwidth": {"bytes_per_s": limit}}))
        started = time.perf_counter()
        async with session.post(_url(proxy), json=STREAM) as response:
            assert len(await response.read()) == size
        elapsed = time.perf_counter() - started
    assert size > 3 * limit * 0.05  # several pacing slices, so the limit is what sets the time
    assert 0.6 <= size / (elapsed - baseline) / limit <= 1.15


async def test_admin_endpoint_switches_faults_and_names_bad_keys(start_mock) -> None:
    mock = start_mock()
    async with _proxy(mock.port) as proxy:
        admin = await start_admin(proxy, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{admin.addresses[0][1]}"
        try:
            client = AdminClient(base)
            assert await client.set_faults(parse_fault_set({"error": {"status": 500, "probability": 0.3}})) \
                == "error 500 p=0.3"
            assert proxy.faults.error is not None and proxy.faults.error.probability == 0.3
            document = await client.faults()
            assert document["listen"] == f"127.0.0.1:{proxy.port}"
            async with aiohttp.ClientSession() as session:
                async with session.put(f"{base}/faults", data=b'{"error": {"status": 700}, "typo": 1}') as response:
                    assert response.status == 400
                    message = (await response.json())["error"]["message"]
                async with session.delete(f"{base}/faults") as response:
                    assert (await response.json())["summary"] == "pass"
            assert "error.status" in message and "typo: unknown key" in message
            assert proxy.faults.is_pass()
            assert set(await client.counters()) >= {"errors_injected", "resets", "stalls", "requests_seen"}
            await client.close()
        finally:
            await admin.cleanup()


def test_raw_tcp_proxy_refuses_faults_that_need_request_boundaries() -> None:
    proxy = FaultProxy("127.0.0.1", 0, "127.0.0.1", 9, http=False)
    with pytest.raises(ValueError, match="need HTTP mode"):
        proxy.set_faults(parse_fault_set({"error": {"status": 500}}))
    proxy.set_faults(parse_fault_set({"reset": {"after_bytes": 10}}))  # byte-counted faults still work
