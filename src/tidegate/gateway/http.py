"""The gateway's HTTP/1.1 server edge: an asyncio.Protocol with httptools (llhttp) parsing.

Chosen by measurement (see bench/gateway_overhead.py): a raw protocol writes pre-built header bytes
and skips the per-request objects of a framework, which is most of a proxy's CPU. One request per
connection is handled at a time; pipelined requests wait their turn in arrival order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING

import httptools

from tidegate.gateway.connections import IDLE, READING_BODY, READING_HEAD

if TYPE_CHECKING:
    from tidegate.gateway.connections import ConnectionRegistry

__all__ = ["HttpRequest", "HttpConnection", "RequestHandler", "MAX_HEAD_BYTES", "status_line"]

_STATUS_LINES = {
    int(status): f"HTTP/1.1 {int(status)} {status.phrase}\r\n".encode() for status in HTTPStatus
}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Unknown\r\n".encode()


class HttpRequest:
    """One parsed request: only the headers the gateway reads are kept."""

    __slots__ = ("method", "path", "query", "body", "authorization", "request_id", "request_timeout", "cache_control",
                 "cache_opt_in", "traceparent", "tracestate", "keep_alive", "too_large", "takes_chunked")

    def __init__(self) -> None:
        self.method = b""
        self.path = b""
        self.query = b""  # after the `?`, for the few routes that read one (GET /v1/batches)
        self.body = b""
        self.authorization: bytes | None = None
        self.request_id: bytes | None = None
        self.request_timeout: bytes | None = None  # the client's `x-request-timeout`, seconds, unparsed
        self.cache_control: bytes | None = None  # `Cache-Control` (no-cache, no-store) for the response cache
        self.cache_opt_in = False  # `x-tidegate-cache: use`: cache this request even if sampled
        self.traceparent: bytes | None = None  # W3C trace context, unparsed (gateway/tracing.py)
        self.tracestate: bytes | None = None
        self.keep_alive = True
        self.too_large = False  # the body passed the size cap and was discarded: answer 413
        self.takes_chunked = True  # False for HTTP/1.0, which has no chunked transfer encoding


RequestHandler = Callable[["HttpConnection", HttpRequest], Awaitable[None]]

# request line + headers; the parser would otherwise buffer a header of any length
MAX_HEAD_BYTES = 64 * 1024


class _HeadTooLarge(Exception):
    pass


def _error_answer(status: int, message: bytes, code: bytes = b"null", error_type: bytes = b"invalid_request_error",
                  headers: bytes = b"") -> bytes:
    """A whole answer with an OpenAI error body, after which the connection closes."""
    body = (b'{"error":{"message":"' + message + b'","type":"' + error_type + b'","param":null,"code":' + code
            + b"}}")
    return (status_line(status) + b"content-type: application/json\r\nconnection: close\r\n" + headers
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_OVER_CAPACITY = _error_answer(503, b"too many open connections to the gateway; retry later",
                               b'"too_many_connections"', b"server_error", b"retry-after: 1\r\n")
_TIMED_OUT = {
    READING_HEAD: _error_answer(408, b"request line and headers not received in time", b'"request_timeout"'),
    READING_BODY: _error_answer(408, b"request body not received in time", b'"request_timeout"'),
}


class _DiscardInput:
    """Stands in for the parser on a refused connection: what the client still sends is dropped."""

    @staticmethod
    def feed_data(data: bytes) -> None:
        pass


class HttpConnection(asyncio.Protocol):
    """One client connection. The handler answers through `respond` or `start_stream`/`stream_chunk`/`end_stream`."""

    def __init__(self, handler: RequestHandler, max_body_bytes: int,
                 registry: ConnectionRegistry | None = None, write_timeout_s: float | None = None) -> None:
        self._handler = handler
        self._registry = registry  # None: no timeouts and no cap
        # what the connection waits for while no request of it is handled, and since when: 0.0 until
        # the registry's sweep stamps it, so that the request path reads no clock
        self.phase = IDLE
        self.phase_since = 0.0
        # a client that reads nothing of its answer for this long is dropped, which cancels its
        # request upstream and frees the replica slot (stalled readers once held slots for 600 s)
        self._write_timeout_s = write_timeout_s
        self._write_timer: asyncio.TimerHandle | None = None
        self._max_body_bytes = max_body_bytes
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._url = b""
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._too_large = False
        self._expect_continue = False
        self._head_done = False
        self._head_bytes = 0  # url and header lines parsed, exactly
        self._head_read_bytes = 0  # bytes of the reads that ended inside the head
        self._completed_in_read = False  # a request ended in the read being parsed
        self._current: HttpRequest | None = None
        self._pending: deque[HttpRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._keep_alive = True
        self._answering_head = False  # a HEAD request: its answer has headers only
        self._stream_chunked = True  # False: an HTTP/1.0 client's stream ends where the connection closes
        self._stream_open = False  # a streamed answer's head is out and its end is not
        self.closed = False
        # set by a streaming handler so that a slow client pauses the upstream instead of buffering
        self.on_pause_writing: Callable[[], None] | None = None
        self.on_resume_writing: Callable[[], None] | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._registry is not None:
            self._registry.admit(self)  # past the cap: refused with 503

    def data_received(self, data: bytes) -> None:
        if not self._head_done and self._head_read_bytes > MAX_HEAD_BYTES:
            # earlier reads held only head, and it is still incomplete: a head dribbled in forever
            self._reject(431, b"request line and headers too large")
            return
        self._completed_in_read = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, b"upgrades are not supported")
            return
        except httptools.HttpParserError:
            if self._head_bytes > MAX_HEAD_BYTES:  # raised from on_url / on_header
                self._reject(431, b"request line and headers too large")
            else:
                self._reject(400, b"malformed HTTP request")
            return
        if not self._head_done and not self._completed_in_read:
            # counted after parsing, and only for reads that hold nothing but head, so that a body
            # sharing a read with a head is not taken for head (a 100 KB body was answered 431)
            self._head_read_bytes += len(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._registry is not None:
            self._registry.forget(self)
        self._pending.clear()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._task is not None and not self._task.done():
            # the client went away: cancelling the handler closes its upstream connection
            self._task.cancel()

    def pause_writing(self) -> None:
        if self._write_timeout_s is not None and self._write_timer is None:
            self._write_timer = asyncio.get_running_loop().call_later(self._write_timeout_s, self._write_timed_out)
        if self.on_pause_writing is not None:
            self.on_pause_writing()

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self.on_resume_writing is not None:
            self.on_resume_writing()

    def _write_timed_out(self) -> None:
        """The client has read nothing for the write timeout: drop it (its handler is cancelled)."""
        self._write_timer = None
        if self._registry is not None:
            self._registry.record_close("write_timeout")
        self.abort()

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.phase = READING_HEAD
        self.phase_since = 0.0
        self._current = HttpRequest()
        self._url = b""
        self._body_parts = []
        self._body_size = 0
        self._too_large = False
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge  # stops the parser; data_received answers 431

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        request = self._current
        if request is None:
            return
        lowered = name.lower()
        if lowered == b"authorization":
            request.authorization = value
        elif lowered == b"x-request-id":
            request.request_id = value[:128]
        elif lowered == b"x-request-timeout":
            request.request_timeout = value[:32]
        elif lowered == b"cache-control":
            request.cache_control = value[:128]
        elif lowered == b"x-tidegate-cache":
            request.cache_opt_in = value.strip().lower() == b"use"
        elif lowered == b"traceparent":
            request.traceparent = value[:128]
        elif lowered == b"tracestate":
            request.tracestate = value[:1024]
        elif lowered == b"content-length":
            if value.isdigit() and int(value) > self._max_body_bytes:
                self._too_large = True
        elif lowered == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True

    def on_headers_complete(self) -> None:
        self.phase = READING_BODY
        self.phase_since = 0.0
        self._head_done = True
        self._head_bytes = self._head_read_bytes = 0
        # curl and others wait for this before sending a body over 1 KiB; a body we will refuse is
        # not invited (the client sends it after its own timeout, then gets 413)
        if self._expect_continue and not self._too_large and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._body_size += len(body)
        if self._body_size > self._max_body_bytes:
            self._too_large = True
            self._body_parts = []
            return
        self._body_parts.append(body)

    def on_message_complete(self) -> None:
        self.phase = IDLE  # its clock starts when the answer is done (see _run)
        self._head_done = False
        self._completed_in_read = True
        request = self._current
        self._current = None
        if request is None:
            return
        request.method = self._parser.get_method()
        query_at = self._url.find(b"?")
        if query_at < 0:
            request.path = self._url
        else:
            request.path, request.query = self._url[:query_at], self._url[query_at + 1:]
        request.keep_alive = self._parser.should_keep_alive()
        request.takes_chunked = self._parser.get_http_version() != "1.0"
        if self._too_large:
            request.too_large = True
        else:
            parts = self._body_parts
            request.body = parts[0] if len(parts) == 1 else b"".join(parts)
        if self._task is None:
            self._start(request)
        else:
            self._pending.append(request)

    # -- request lifecycle
    @property
    def handling(self) -> bool:
        """A request of this connection is being handled: no timeout of the registry applies."""
        return self._task is not None

    def close_after_answer(self) -> None:
        """The gateway is draining: this connection closes once its answer is out."""
        self._keep_alive = False

    def _start(self, request: HttpRequest) -> None:
        self._keep_alive = request.keep_alive and not (self._registry is not None and self._registry.draining)
        self._answering_head = request.method == b"HEAD"
        self._stream_chunked = request.takes_chunked
        self._stream_open = False
        self._task = asyncio.get_running_loop().create_task(self._run(request))

    async def _run(self, request: HttpRequest) -> None:
        try:
            await self._handler(self, request)
        finally:
            self._task = None
            self.phase_since = 0.0  # idle, or a next head already begun: timed from the end of this answer
            self.on_pause_writing = self.on_resume_writing = None
            if not self._keep_alive and self.transport is not None:
                self.transport.close()
            elif self._pending and not self.closed:
                self._start(self._pending.popleft())

    def _reject(self, status: int, message: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(_error_answer(status, message))
            self.transport.close()

    # -- limits (called by the ConnectionRegistry)
    def time_out(self, answer: bool, linger: bool) -> bool:
        """Closes the connection: its phase outlasted its limit. answer: 408 first (a head or body that
        came too slowly; nothing of that request was answered). False when it was closing already, its
        last answer stuck unread: dropped, and not counted as a timeout."""
        transport = self.transport
        if transport is None or self.closed:
            return False
        if transport.is_closing():
            transport.abort()
            return False
        if answer:
            self._answer_and_close(_TIMED_OUT[self.phase], linger)
        elif transport.get_write_buffer_size():
            transport.abort()  # the client reads nothing: waiting to flush would keep the descriptor
        else:
            transport.close()
        return True

    def refuse(self, linger: bool) -> None:
        """Past the connection cap: 503 at once, before any request arrives."""
        self._answer_and_close(_OVER_CAPACITY, linger)

    def _answer_and_close(self, answer: bytes, linger: bool) -> None:
        """Lingering, the connection is half-closed and what the client still sends is dropped until it
        closes (the registry aborts it after a while): closing with input unread sends a reset, which
        can destroy the answer before the client reads it."""
        transport = self.transport
        if transport is None:
            return
        transport.write(answer)
        if transport.get_write_buffer_size():
            transport.abort()  # the client reads nothing
        elif linger and transport.can_write_eof():
            self._parser = _DiscardInput  # type: ignore[assignment]
            self._head_done = True  # no head-size check on discarded input
            transport.write_eof()
        else:
            transport.close()

    # -- writing answers
    def respond(self, status: int, headers: bytes, body: bytes) -> None:
        """headers: pre-built `name: value\\r\\n` lines, without content-length."""
        if self.closed or self.transport is None:
            return
        if self._stream_open:
            # an error after a stream's head went out cannot be a response of its own: written into
            # the stream it would corrupt the framing; cut the stream so it cannot look complete
            self.abort()
            return
        connection = b"" if self._keep_alive else b"connection: close\r\n"
        self.transport.write(
            b"".join((status_line(status), headers, connection, b"content-length: ", str(len(body)).encode(),
                      b"\r\n\r\n", b"" if self._answering_head else body))
        )

    def start_stream(self, status: int, headers: bytes) -> None:
        if self.closed or self.transport is None:
            return
        if self._stream_chunked:
            framing = (b"" if self._keep_alive else b"connection: close\r\n") + b"transfer-encoding: chunked\r\n"
        else:
            # HTTP/1.0 has no chunked encoding: the body runs until the connection closes, which
            # `_run` does once the handler is done
            self._keep_alive = False
            framing = b"connection: close\r\n"
        self._stream_open = True
        self.transport.write(status_line(status) + headers + framing + b"\r\n")

    def stream_chunk(self, data: bytes) -> None:
        if data and not self.closed and self.transport is not None:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._stream_chunked else data)

    def stream_chunks(self, pieces: list[bytes]) -> None:
        """Everything one upstream read brought, in one write: one syscall instead of one a piece."""
        if not self.closed and self.transport is not None:
            if self._stream_chunked:
                self.transport.write(b"".join([b"%x\r\n%b\r\n" % (len(data), data) for data in pieces if data]))
            else:
                self.transport.write(b"".join(pieces))

    def end_stream(self) -> None:
        self._stream_open = False
        if self._stream_chunked and not self.closed and self.transport is not None:
            self.transport.write(b"0\r\n\r\n")

    def abort(self) -> None:
        """Drop the connection: a stream broken mid-way must not look complete to the client."""
        if self.transport is not None:
            self._keep_alive = False
            self.transport.abort()
