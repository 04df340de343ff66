"""Single-flight coalescing: one upstream request, its answer written to every identical request
that joins while it runs (streams fanned out event by event), each with its own request id."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tidegate.cache.response import CachedAnswer
from tidegate.gateway.http import HttpConnection

__all__ = ["CACHE_HEADER", "Flight", "Member", "Marked"]

CACHE_HEADER = b"x-tidegate-cache"


def _rewrite_head(headers: bytes, leader_id: bytes, request_id: bytes, cache_value: bytes) -> bytes:
    if request_id != leader_id:
        headers = headers.replace(b"x-request-id: " + leader_id + b"\r\n", b"x-request-id: " + request_id + b"\r\n")
    return headers + CACHE_HEADER + b": " + cache_value + b"\r\n"


class Member:
    __slots__ = ("conn", "request_id", "cache_value")

    def __init__(self, conn: HttpConnection, request_id: bytes, cache_value: bytes) -> None:
        self.conn = conn
        self.request_id = request_id
        self.cache_value = cache_value


class Flight:
    """One upstream request and everyone waiting for its answer. To the proxy it is the client
    connection (`respond`, `start_stream`, `stream_chunks`, `end_stream`): it records what is
    written and writes it to each member, each with its own request id."""

    def __init__(self, leader_id: bytes) -> None:
        self.leader_id = leader_id
        self.members: list[Member] = []
        self.task: asyncio.Task[tuple[int, str | None]] | None = None
        self.abandoned = False
        self.status: int | None = None
        self.head = b""
        self.streamed = False
        self.stream_ended = False
        self.pieces: list[bytes] = []
        self.content_type = b"application/json"
        self.closed = False  # the proxy's connection interface
        self.on_pause_writing: Callable[[], None] | None = None  # ignored: members read at their own pace
        self.on_resume_writing: Callable[[], None] | None = None

    # -- membership
    def join(self, member: Member) -> None:
        """Adds a member and writes it what the flight has sent so far."""
        self.members.append(member)
        if self.status is None:
            return
        head = _rewrite_head(self.head, self.leader_id, member.request_id, member.cache_value)
        if not self.streamed:
            member.conn.respond(self.status, head, self.pieces[0])
            return
        member.conn.start_stream(self.status, head)
        member.conn.stream_chunks(self.pieces)
        if self.stream_ended:
            member.conn.end_stream()

    def leave(self, member: Member) -> None:
        """A member's client went away: the last one out stops the upstream request."""
        self.members.remove(member)
        if not self.members and self.task is not None and not self.task.done():
            self.abandoned = True  # cancelling takes a turn of the loop: nobody may join it meanwhile
            self.task.cancel()

    # -- the proxy's connection interface
    def respond(self, status: int, headers: bytes, body: bytes) -> None:
        if self.streamed:  # an error after the head: members' streams are cut, as a client's would be
            for member in self.members:
                member.conn.respond(status, headers, body)
            return
        self.status, self.head = status, headers
        self.pieces = [body]
        self.content_type = _content_type(headers)
        for member in self.members:
            member.conn.respond(status, _rewrite_head(headers, self.leader_id, member.request_id, member.cache_value),
                                body)

    def start_stream(self, status: int, headers: bytes) -> None:
        self.status, self.head, self.streamed = status, headers, True
        self.content_type = _content_type(headers)
        for member in self.members:
            member.conn.start_stream(status, _rewrite_head(headers, self.leader_id, member.request_id,
                                                           member.cache_value))

    def stream_chunk(self, data: bytes) -> None:
        if data:
            self.stream_chunks([data])

    def stream_chunks(self, pieces: list[bytes]) -> None:
        pieces = [piece for piece in pieces if piece]
        self.pieces.extend(pieces)
        for member in self.members:
            member.conn.stream_chunks(pieces)

    def end_stream(self) -> None:
        self.stream_ended = True
        for member in self.members:
            member.conn.end_stream()

    def abort(self) -> None:
        for member in self.members:
            member.conn.abort()

    def answer(self) -> CachedAnswer:
        return CachedAnswer(self.content_type, self.streamed, tuple(self.pieces))


def _content_type(headers: bytes) -> bytes:
    at = headers.find(b"content-type: ")
    if at < 0:
        return b"application/json"
    end = headers.find(b"\r\n", at)
    return headers[at + len(b"content-type: "):end]


class Marked:
    """The client connection with `x-tidegate-cache: <value>` added to its answer's head."""

    __slots__ = ("conn", "line")

    def __init__(self, conn: HttpConnection, value: bytes) -> None:
        self.conn = conn
        self.line = CACHE_HEADER + b": " + value + b"\r\n"

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def respond(self, status: int, headers: bytes, body: bytes) -> None:
        self.conn.respond(status, headers + self.line, body)

    def start_stream(self, status: int, headers: bytes) -> None:
        self.conn.start_stream(status, headers + self.line)

    def stream_chunk(self, data: bytes) -> None:
        self.conn.stream_chunk(data)

    def stream_chunks(self, pieces: list[bytes]) -> None:
        self.conn.stream_chunks(pieces)

    def end_stream(self) -> None:
        self.conn.end_stream()

    def abort(self) -> None:
        self.conn.abort()

    @property
    def on_pause_writing(self) -> Callable[[], None] | None:
        return self.conn.on_pause_writing

    @on_pause_writing.setter
    def on_pause_writing(self, callback: Callable[[], None] | None) -> None:
        self.conn.on_pause_writing = callback

    @property
    def on_resume_writing(self) -> Callable[[], None] | None:
        return self.conn.on_resume_writing

    @on_resume_writing.setter
    def on_resume_writing(self, callback: Callable[[], None] | None) -> None:
        self.conn.on_resume_writing = callback
