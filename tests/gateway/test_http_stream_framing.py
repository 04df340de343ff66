"""The edge's framing when a streamed answer fails after its head went out."""

from __future__ import annotations

from tidegate.gateway.http import HttpConnection


class _Transport:
    """Records what the connection writes; `abort` drops it."""

    def __init__(self) -> None:
        self.written = b""
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written += data

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def _connection() -> tuple[HttpConnection, _Transport]:
    conn = HttpConnection(handler=None, max_body_bytes=1024)  # type: ignore[arg-type]
    transport = _Transport()
    conn.transport = transport  # type: ignore[assignment]
    return conn, transport


def test_an_error_after_a_stream_began_cuts_the_stream_instead_of_writing_a_second_response() -> None:
    conn, transport = _connection()
    conn.start_stream(200, b"content-type: text/event-stream\r\n")
    conn.stream_chunk(b"data: {}\n\n")
    before = transport.written
    conn.respond(500, b"content-type: application/json\r\n", b'{"error": {}}')
    assert transport.written == before and transport.aborted  # no "HTTP/1.1 500" inside the chunked body


def test_a_response_after_a_finished_stream_is_written() -> None:
    conn, transport = _connection()
    conn.start_stream(200, b"")
    conn.end_stream()
    conn.respond(200, b"", b"{}")
    assert transport.written.endswith(b"\r\n\r\n{}") and not transport.aborted
