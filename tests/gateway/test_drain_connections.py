"""Draining the client connections at shutdown, over real loopback sockets: a keep-alive request
that reached the socket as the drain began is answered (with `connection: close`), never reset; an
idle connection is closed once idle `DRAIN_IDLE_S`."""

from __future__ import annotations

import asyncio

from tidegate.gateway.connections import DRAIN_IDLE_S, ConnectionLimits, ConnectionRegistry
from tidegate.gateway.http import HttpConnection

REQUEST = b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n"


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


async def _server(registry: ConnectionRegistry) -> tuple[asyncio.AbstractServer, int]:
    async def handler(conn: HttpConnection, request: object) -> None:
        conn.respond(200, b"content-type: text/plain\r\n", b"ok")

    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HttpConnection(handler, 1024, registry), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _response(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def test_a_request_sent_as_the_drain_begins_is_answered() -> None:
    registry = ConnectionRegistry(ConnectionLimits(5.0, 5.0, 5.0, 100), clock=_Clock())
    server, port = await _server(registry)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(REQUEST)
        assert (await _response(reader)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.05)  # the first request is done: the connection is idle
        writer.write(REQUEST)  # into the socket now; the server reads it on its next loop turn ...
        registry.drain()  # ... after the drain began, in this very turn
        answer = await _response(reader)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # then closed, cleanly
    finally:
        writer.close()
        server.close()


async def test_draining_closes_an_idle_connection_once_idle_its_grace() -> None:
    clock = _Clock()
    registry = ConnectionRegistry(ConnectionLimits(60.0, 60.0, 60.0, 100), clock=clock)
    server, port = await _server(registry)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(REQUEST)
        await _response(reader)
        await asyncio.sleep(0.05)
        registry.drain()
        clock.now_s += DRAIN_IDLE_S * 0.9
        registry.sweep()
        assert len(registry) == 1  # still within its grace
        clock.now_s += DRAIN_IDLE_S * 0.2
        registry.sweep()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.sleep(0.05)
        assert len(registry) == 0
    finally:
        writer.close()
        server.close()
