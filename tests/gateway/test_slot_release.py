"""Every way out of a request gives its replica slot (and its overload ticket) back.

An in-process gateway over a real mock upstream; a failure is injected at each step between
acquiring a slot and releasing it, then the pool must be whole again: no slot held, nothing
queued or reserved, and the next request served.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from tidegate.config import parse_config
from tidegate.gateway import proxy as proxy_module
from tidegate.gateway.app import Gateway
from tidegate.gateway.dispatch import Replica
from tidegate.gateway.overload import OverloadRuntime
from tidegate.gateway.upstream import ConnectionPool, UpstreamConnection
from tidegate.gateway.validation import MAX_JSON_DEPTH

from support import free_port, start_process, tidegate_argv

_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Injected(RuntimeError):
    pass


def _boom(*_args, **_kwargs):
    raise Injected("injected failure")


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    port = free_port()
    process = start_process(tidegate_argv("mock-upstream", "--port", str(port), "--tokens", "4"),
                            ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30)
    yield f"http://127.0.0.1:{port}/v1"
    process.stop()


def _config(mock_url: str, mode: str, replicas: int = 2, model: str | None = None) -> str:
    backend = f"{{type: upstream, url: '{mock_url}', health_path: null, slot_limit: 2"
    backend += f", model: {model}}}" if model else "}"
    lines = ["server: {port: 0, access_log: false}", "pools:", "  - name: m", "    backends:"]
    lines += [f"      - {backend}"] * replicas
    if mode == "fifo":
        lines.append("overload_control: false")
    elif mode == "policy":  # a (generous) rate limit sends every request through the full policy path
        lines.append("limits: {default: {requests_per_minute: 1000000}}")
    return "\n".join(lines) + "\n"


class _Client:
    """A small aiohttp client that answers (status, JSON body or None)."""

    def __init__(self, port: int) -> None:
        self._base = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def post(self, path: str, body: dict | bytes) -> tuple[int, dict | None]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self._session.post(self._base + path, data=data,
                                      headers={"content-type": "application/json"}) as response:
            try:
                text = await response.text()
            except aiohttp.ClientPayloadError:  # a stream the gateway cut after its head went out
                return response.status, None
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, None

    async def get(self, path: str) -> int:
        async with self._session.get(self._base + path) as response:
            await response.read()
            return response.status

    async def close(self) -> None:
        await self._session.close()


async def _started(config_text: str) -> Gateway:
    gateway = Gateway(parse_config(config_text))
    await gateway.start()
    assert await gateway.wait_ready(5.0)
    return gateway


def _assert_whole(gateway: Gateway) -> None:
    for pool in gateway.pools.values():
        assert [r.outstanding for r in pool.replicas] == [0] * len(pool.replicas)
        assert len(pool.queue) == 0
    overload: OverloadRuntime | None = gateway.overload
    if overload is not None:
        assert overload.control.open_requests == 0
        for body in overload.bodies.values():
            assert not body.waiting
            snapshot = body.controller.snapshot(overload.clock())
            assert snapshot.queued == snapshot.retries_waiting == 0
            assert all(r.requests == 0 and not any(r.prefill_tokens) for r in snapshot.replicas)


# step name -> (class or module, attribute) that raises when the step is reached
_STEPS = {
    "request_head": (Replica, "request_head"),
    "connect": (ConnectionPool, "connection"),
    "send": (UpstreamConnection, "send"),
    "answer": (proxy_module.Proxy, "_answer_whole"),
    "stream_start": (proxy_module._StreamRelay, "_start"),
    "first_token": (OverloadRuntime, "first_token"),
    "acquire": (OverloadRuntime, "acquire"),
    "stream_pieces": (proxy_module._Usage, "stream_pieces"),
}


@pytest.mark.parametrize("mode", ["fifo", "fast_path", "policy"])
@pytest.mark.parametrize("step", sorted(_STEPS))
async def test_failure_at_any_step_releases_the_slot(mock_url: str, mode: str, step: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = await _started(_config(mock_url, mode))
    try:
        owner, name = _STEPS[step]
        client = _Client(gateway.port)
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, _boom)
            # more requests than slots: a leak would leave later ones nothing to take
            for stream in (False, True) * 4:
                status, _ = await client.post("/v1/chat/completions", {**_CHAT, "stream": stream})
                assert status in (200, 500, 502)
        await asyncio.sleep(0)
        _assert_whole(gateway)
        status, _ = await client.post("/v1/chat/completions", _CHAT)
        assert status == 200
        _assert_whole(gateway)
        await client.close()
    finally:
        await gateway.stop()


def _with_nested(depth: int) -> bytes:
    """The chat body with a value `depth` levels deep (the body itself is the first level)."""
    inner = depth - 2  # the body object and `metadata`
    return (json.dumps(_CHAT)[:-1] + ', "metadata": {"deep": ' + "[" * inner + '"x"'
            + "]" * inner + "}}").encode()


async def test_over_deep_body_is_400_and_holds_no_slot(mock_url: str) -> None:
    # a renamed model re-encodes the body for the replica: 254+ levels once failed there, after a slot was taken
    gateway = await _started(_config(mock_url, "policy", model="mock-model"))
    try:
        client = _Client(gateway.port)
        for depth in (MAX_JSON_DEPTH + 1, 300, 1000):
            status, error = await client.post("/v1/chat/completions", _with_nested(depth))
            assert status == 400, depth
            assert "nested deeper" in error["error"]["message"]
        _assert_whole(gateway)
        assert (await client.post("/v1/chat/completions", _with_nested(MAX_JSON_DEPTH)))[0] == 200
        _assert_whole(gateway)
        await client.close()
    finally:
        await gateway.stop()


async def test_ready_is_503_while_waiting_requests_get_no_slot(mock_url: str) -> None:
    text = _config(mock_url, "fifo", replicas=1).replace("access_log: false", "access_log: false, queue_timeout_s: 3")
    gateway = await _started(text)
    try:
        pool = gateway.pools["m"]
        replica = pool.replicas[0]
        replica.outstanding = replica.slot_limit  # every slot held, and never given back
        client = _Client(gateway.port)
        waiting = asyncio.ensure_future(client.post("/v1/chat/completions", _CHAT))
        await asyncio.sleep(0.2)
        assert await client.get("/ready") == 200  # waiting, but not for long yet
        pool._released_s -= 10.0  # as if the last slot had been given back long ago
        assert await client.get("/ready") == 503
        assert (await waiting)[0] == 503
        await client.close()
    finally:
        pool.replicas[0].outstanding = 0
        await gateway.stop()
