"""The upstream client: keep-alive HTTP/1.1 connections per replica, httptools response parsing.

An `Exchange` is one request/response on one connection; the caller awaits `done`. A streaming caller
installs a `BodyRelay`: when the head arrives (in the protocol callback, without waiting for a task
to wake) the relay may take the body, then receives each piece as it arrives and a `flush` at the end
of every socket read, so that SSE events pass through as they come instead of being buffered.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httptools

__all__ = ["Endpoint", "UpstreamFailure", "BodyRelay", "Exchange", "UpstreamConnection", "ConnectionPool"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    use_tls: bool
    base_path: bytes  # e.g. b"/v1"; request paths are appended
    host_header: bytes


class UpstreamFailure(Exception):
    """The exchange broke. `before_first_byte`: nothing came back, so another replica may retry it."""

    def __init__(self, message: str, *, before_first_byte: bool, timed_out: bool = False, connect: bool = False) -> None:
        super().__init__(message)
        self.before_first_byte = before_first_byte
        self.timed_out = timed_out
        self.connect = connect


class BodyRelay(Protocol):
    """Passes a streaming response on as it arrives; installed on an Exchange before sending."""

    def on_head(self, exchange: Exchange) -> None: ...  # may set exchange.sink to take the body
    def flush(self) -> None: ...  # end of one read from the socket: write out what arrived


class Exchange:
    """One request/response on one upstream connection; `done` resolves when the response is complete."""

    __slots__ = ("done", "status", "content_type", "body_parts", "relay", "sink", "got_bytes", "keep_alive")

    def __init__(self, loop: asyncio.AbstractEventLoop, relay: BodyRelay | None = None) -> None:
        self.done: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.content_type = b"application/json"
        self.body_parts: list[bytes] = []
        self.relay = relay
        self.sink: Callable[[bytes], None] | None = None  # set by the relay: body pieces go there
        self.got_bytes = False
        self.keep_alive = True

    def body(self) -> bytes:
        parts = self.body_parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def fail(self, failure: UpstreamFailure) -> None:
        if not self.done.done():
            self.done.set_exception(failure)


class UpstreamConnection(asyncio.Protocol):
    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            self.close()  # bytes on an idle connection: the server is confused; drop it
            return
        exchange.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self.close()
            exchange.fail(UpstreamFailure(f"malformed upstream response: {error}", before_first_byte=False))
        if exchange.sink is not None:
            exchange.relay.flush()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.fail(UpstreamFailure("upstream closed the connection", before_first_byte=not exchange.got_bytes))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type" and self.exchange is not None:
            self.exchange.content_type = value

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange.status = self._parser.get_status_code()
            if exchange.relay is not None:
                exchange.relay.on_head(exchange)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is not None:
            if exchange.sink is not None:
                exchange.sink(body)
            else:
                exchange.body_parts.append(body)

    def on_message_complete(self) -> None:
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        exchange.keep_alive = self._parser.should_keep_alive()
        if exchange.keep_alive:
            self._pool.put_back(self)
        else:
            self.close()
        if not exchange.done.done():
            exchange.done.set_result(None)

    def send(self, data: bytes, exchange: Exchange) -> None:
        self.exchange = exchange
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()


class ConnectionPool:
    """Idle keep-alive connections to one replica; newest first, so few stay warm."""

    def __init__(self, endpoint: Endpoint, connect_timeout_s: float, max_idle: int = 256) -> None:
        self.endpoint = endpoint
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle
        self._idle: list[UpstreamConnection] = []
        self._ssl = ssl_module.create_default_context() if endpoint.use_tls else None

    async def connection(self, fresh: bool = False) -> tuple[UpstreamConnection, bool]:
        """(connection, reused): a reused one may turn out closed by the server (retry it fresh)."""
        idle = self._idle
        while idle and not fresh:
            connection = idle.pop()
            if not connection.lost and connection.transport is not None and not connection.transport.is_closing():
                return connection, True
        loop = asyncio.get_running_loop()
        try:
            _transport, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: UpstreamConnection(self), self.endpoint.host, self.endpoint.port, ssl=self._ssl
                ),
                self._connect_timeout_s,
            )
        except asyncio.TimeoutError:
            raise UpstreamFailure("connect timed out", before_first_byte=True, timed_out=True, connect=True) from None
        except OSError as error:
            raise UpstreamFailure(f"connect failed: {error.strerror or error}", before_first_byte=True, connect=True) from None
        return connection, False

    def put_back(self, connection: UpstreamConnection) -> None:
        if len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
