"""A small pipelined RESP2 client for Redis on the event loop, for the shared rate limits' hot path.

Why not redis-py: on loopback, with 16 commands in flight, an EVALSHA through redis-py's asyncio
client cost ~35 us of gateway CPU against ~8 us here (bench/shared_limits.py; the gateway's CPU is
what runs out first). It speaks only what `gateway.shared_limits` needs: commands as arrays of bulk
strings, replies of the five RESP2 kinds, AUTH/SELECT from the URL, TLS with `rediss://`, and
EVALSHA falling back to EVAL once when Redis has lost a script registered in `SCRIPTS`.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["SCRIPTS", "register_script", "encode_command", "bulk", "RespError", "RespConnection"]

SCRIPTS: dict[bytes, bytes] = {}  # SHA-1 hex -> Lua source, of the scripts EVALSHA may name
_EVALSHA_HEAD = b"$7\r\nEVALSHA\r\n$40\r\n"


def register_script(text: str) -> bytes:
    """Registers a Lua script (for the EVAL fallback); its SHA-1 for EVALSHA."""
    sha = hashlib.sha1(text.encode()).hexdigest().encode()
    SCRIPTS[sha] = text.encode()
    return sha


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


def encode_command(*parts: bytes) -> bytes:
    """A command in RESP2: an array of bulk strings."""
    return b"*%d\r\n" % len(parts) + b"".join(bulk(part) for part in parts)


def _as_eval(command: bytes) -> bytes | None:
    """The EVAL form of an EVALSHA command of a registered script (after NOSCRIPT: Redis lost its
    script cache)."""
    head_end = command.find(b"\r\n") + 2
    if command[head_end:head_end + len(_EVALSHA_HEAD)] != _EVALSHA_HEAD:
        return None
    sha_at = head_end + len(_EVALSHA_HEAD)
    script = SCRIPTS.get(command[sha_at:sha_at + 40])
    if script is None:
        return None
    return command[:head_end] + b"$4\r\nEVAL\r\n" + bulk(script) + command[sha_at + 42:]


class RespError(Exception):
    """An error reply from Redis (`-ERR ...`, `-NOSCRIPT ...`, `-BUSY ...`)."""


class _Incomplete(Exception):
    pass


def _parse(buffer: bytearray, at: int) -> tuple[Any, int]:
    """One RESP2 reply from `buffer[at:]`: (value, end); raises _Incomplete when it has not all come."""
    line_end = buffer.find(b"\r\n", at)
    if line_end < 0:
        raise _Incomplete
    kind = buffer[at]
    if kind == 36:  # $ bulk string
        length = int(buffer[at + 1:line_end])
        if length < 0:
            return None, line_end + 2
        end = line_end + 2 + length
        if len(buffer) < end + 2:
            raise _Incomplete
        return bytes(buffer[line_end + 2:end]), end + 2
    if kind == 43:  # + simple string
        return bytes(buffer[at + 1:line_end]), line_end + 2
    if kind == 58:  # : integer
        return int(buffer[at + 1:line_end]), line_end + 2
    if kind == 45:  # - error
        return RespError(buffer[at + 1:line_end].decode("utf-8", "replace")), line_end + 2
    if kind == 42:  # * array
        count = int(buffer[at + 1:line_end])
        at = line_end + 2
        if count < 0:
            return None, at
        items = []
        for _ in range(count):
            item, at = _parse(buffer, at)
            items.append(item)
        return items, at
    raise ValueError(f"not a RESP2 reply: {bytes(buffer[at:at + 16])!r}")


class RespConnection(asyncio.Protocol):
    """One pipelined connection to Redis speaking RESP2, on the event loop.

    `call` writes a command and returns a future of its reply; `send` writes one whose reply is only
    checked for an error, `linger_s` later at most: with the next `call`'s write when one comes
    sooner, so that its reply comes in the same read (a wake-up of the gateway costs more CPU than
    the command). Commands written in one event-loop turn go in one write; replies come in order.
    A reply later than `timeout_s` breaks the connection: every pending call fails with TimeoutError
    (the replies behind it could only be later still). An EVALSHA of ours answered NOSCRIPT is sent
    again, once, as EVAL.
    """

    def __init__(self, timeout_s: float, on_lost: Callable[[RespConnection, BaseException], None] | None = None,
                 on_unclaimed: Callable[[Any, Any], None] | None = None, linger_s: float = 0.01) -> None:
        self._timeout_s = timeout_s
        self._linger_s = linger_s
        self._on_lost = on_lost  # the connection broke (or timed out): called once
        # a reply nobody awaits any more (its caller was cancelled, or it was `send`): (context, reply)
        self._on_unclaimed = on_unclaimed
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        # (future or None, sent at (loop time), command, context) in the order Redis answers
        self._pending: deque[tuple[asyncio.Future | None, float, bytes, Any]] = deque()
        self._out: list[bytes] = []
        self._flush_soon = False  # a flush is due in this event-loop turn
        self._flush_later: asyncio.TimerHandle | None = None  # ... or at the end of a linger
        self._watchdog: asyncio.TimerHandle | None = None
        self._broken: BaseException | None = None

    @classmethod
    async def open(cls, url: str, timeout_s: float, connect_timeout_s: float = 2.0,
                   on_lost: Callable[[RespConnection, BaseException], None] | None = None,
                   on_unclaimed: Callable[[Any, Any], None] | None = None, linger_s: float = 0.01) -> RespConnection:
        """Connects to `redis://[user:password@]host:port/db` (`rediss://` with TLS), authenticates
        and selects the database."""
        parts = urlsplit(url)
        loop = asyncio.get_running_loop()
        tls = ssl.create_default_context() if parts.scheme == "rediss" else None
        _, connection = await asyncio.wait_for(loop.create_connection(
            lambda: cls(timeout_s, on_lost, on_unclaimed, linger_s), parts.hostname or "127.0.0.1", parts.port or 6379,
            ssl=tls), connect_timeout_s)
        try:
            if parts.password is not None:
                credentials = ((unquote(parts.username).encode(),) if parts.username else ()) + \
                    (unquote(parts.password).encode(),)
                await asyncio.wait_for(connection.call(encode_command(b"AUTH", *credentials)), connect_timeout_s)
            database = parts.path.strip("/")
            if database and database != "0":
                await asyncio.wait_for(connection.call(encode_command(b"SELECT", database.encode())),
                                       connect_timeout_s)
        except BaseException:
            connection.close()
            raise
        return connection

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        at = 0
        pending = self._pending
        try:
            while at < len(buffer) and pending:
                value, at = _parse(buffer, at)
                future, _, command, context = pending.popleft()
                if isinstance(value, RespError) and str(value).startswith("NOSCRIPT"):
                    retry = _as_eval(command)
                    if retry is not None:  # the script cache was flushed (or Redis restarted): once, whole
                        self._write(retry, future, context)
                        continue
                if future is not None and not future.done():
                    if isinstance(value, RespError):
                        future.set_exception(value)
                    else:
                        future.set_result(value)
                elif self._on_unclaimed is not None:
                    self._on_unclaimed(context, value)
        except _Incomplete:
            pass
        except ValueError as error:  # not RESP: nothing after it can be trusted
            del buffer[:at]
            self._break(error)
            return
        del buffer[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        self._break(exc or ConnectionError("Redis closed the connection"))

    # -- commands
    def call(self, command: bytes, context: Any = None) -> asyncio.Future:
        """Writes `command`; its reply comes as the future's result (an error reply: RespError)."""
        future = self._loop.create_future()
        if self._broken is not None:
            future.set_exception(ConnectionError(f"Redis connection broken: {self._broken!r}"))
            return future
        self._write(command, future, context)
        return future

    def send(self, command: bytes, context: Any = None) -> bool:
        """Writes `command` within `linger_s`, without waiting for its reply; False when the
        connection is broken."""
        if self._broken is not None:
            return False
        self._write(command, None, context, linger=True)
        return True

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def close(self) -> None:
        """Writes what is queued, then closes; replies not in yet are not awaited."""
        if self._broken is not None:
            return
        self._flush()
        transport, self._transport = self._transport, None
        self._break(ConnectionError("closed"), notify=False)
        if transport is not None:
            transport.close()

    def _write(self, command: bytes, future: asyncio.Future | None, context: Any, linger: bool = False) -> None:
        loop = self._loop
        now = loop.time()
        self._pending.append((future, now, command, context))
        self._out.append(command)
        if not linger:
            if not self._flush_soon:
                self._flush_soon = True
                loop.call_soon(self._flush)
        elif self._flush_later is None and not self._flush_soon:
            self._flush_later = loop.call_at(now + self._linger_s, self._flush)
        if self._watchdog is None:
            self._watchdog = loop.call_at(now + self._timeout_s, self._check_overdue)

    def _flush(self) -> None:
        self._flush_soon = False
        if self._flush_later is not None:
            self._flush_later.cancel()
            self._flush_later = None
        if self._out and self._transport is not None and self._broken is None:
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def _check_overdue(self) -> None:
        self._watchdog = None
        if not self._pending or self._broken is not None:
            return
        due = self._pending[0][1] + self._timeout_s
        if self._loop.time() >= due:
            self._break(TimeoutError(f"no reply from Redis in {self._timeout_s} s"))
        else:
            self._watchdog = self._loop.call_at(due, self._check_overdue)

    def _break(self, error: BaseException, notify: bool = True) -> None:
        if self._broken is not None:
            return
        self._broken = error
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._flush_later is not None:
            self._flush_later.cancel()
            self._flush_later = None
        self._out.clear()
        pending, self._pending = self._pending, deque()
        for future, _, _, _ in pending:
            if future is not None and not future.done():
                future.set_exception(error if isinstance(error, (TimeoutError, ConnectionError, OSError))
                                     else ConnectionError(repr(error)))
        if self._transport is not None:
            self._transport.abort()
        if notify and self._on_lost is not None:
            self._on_lost(self, error)
