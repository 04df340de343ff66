"""A TCP proxy in front of one upstream whose faults switch at run time (`FaultSet`, see faults.py).

Each client connection gets its own upstream connection and two pumps: requests (client → upstream)
and responses (upstream → client). In HTTP mode the request side is parsed with httptools, only to
know where each request starts and ends on a keep-alive connection: that is where a request's fate
is drawn (error answer instead of forwarding, reset or stall of its response, added latency). The
faults are read again for every chunk, so switching them also changes connections already open.

Used from tests and the experiment runner as a Python object (`await proxy.start()`,
`proxy.set_faults(...)`, `proxy.counters`), and from `tidegate chaos proxy` with its admin endpoint.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from dataclasses import asdict, dataclass
from http import HTTPStatus

import httptools
import orjson

from tidegate.chaos.faults import PASS, ErrorFault, FaultSet, LatencyFault, LatencyScope

__all__ = ["FaultProxy", "ProxyCounters", "error_answer"]

_READ_BYTES = 65536
_PACE_SLICE_S = 0.05  # a bandwidth-limited connection is written in slices worth this long


@dataclass
class ProxyCounters:
    """What the proxy did, counted as it did it."""

    connections_accepted: int = 0
    connections_open: int = 0
    upstream_connect_failures: int = 0
    requests_seen: int = 0  # HTTP mode: requests whose head was parsed
    requests_forwarded: int = 0
    errors_injected: int = 0
    resets: int = 0
    stalls: int = 0
    blackholed_connections: int = 0
    delays: int = 0
    delay_s_total: float = 0.0
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0

    def snapshot(self) -> dict[str, int | float]:
        return asdict(self)


def error_answer(fault: ErrorFault, keep_alive: bool) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-format error body, marked `x-tidegate-chaos: injected`."""
    status = fault.status
    error_type = "server_error" if status >= 500 else "rate_limit_error" if status == 429 else "invalid_request_error"
    body = orjson.dumps({"error": {"message": f"HTTP {status} injected by the tidegate chaos fault proxy",
                                   "type": error_type, "param": None, "code": str(status)}})
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    head = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json", f"content-length: {len(body)}",
            f"connection: {'keep-alive' if keep_alive else 'close'}", "x-tidegate-chaos: injected"]
    if fault.retry_after_s is not None:
        head.append(f"retry-after: {fault.retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@dataclass
class _Fate:
    """What happens to one request and its response, drawn once when its head is parsed."""

    inject: ErrorFault | None = None
    reset_at_bytes: int | None = None
    stall_at_bytes: int | None = None
    delay_s: float = 0.0  # before the request is forwarded
    forwarded: bool = False  # its first bytes went upstream (counted once)


class FaultProxy:
    def __init__(self, listen_host: str, listen_port: int, target_host: str, target_port: int,
                 faults: FaultSet = PASS, *, http: bool = True, seed: int | None = None,
                 connect_timeout_s: float = 5.0) -> None:
        self.listen_host, self.listen_port = listen_host, listen_port
        self.target_host, self.target_port = target_host, target_port
        self.http = http
        self.connect_timeout_s = connect_timeout_s
        self.counters = ProxyCounters()
        self.rng = random.Random(seed)
        self._faults = PASS
        self.set_faults(faults)
        self._server: asyncio.AbstractServer | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task] = set()

    @property
    def faults(self) -> FaultSet:
        return self._faults

    def set_faults(self, faults: FaultSet) -> None:
        if not self.http and faults.needs_http():
            raise ValueError("error injection, per-request latency and path filters need HTTP mode "
                             "(this proxy forwards raw TCP)")
        self._faults = faults

    @property
    def port(self) -> int:
        """The port listened on (the one the OS picked when listen_port was 0)."""
        if self._server is None or not self._server.sockets:
            return self.listen_port
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port,
                                                  reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.abort()
        # aborted links end their handlers at once; a blackholed or connecting one is cancelled
        if self._handlers:
            _done, pending = await asyncio.wait(set(self._handlers), timeout=1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def sample_delay_s(self, latency: LatencyFault) -> float:
        jitter = self.rng.uniform(-latency.jitter_ms, latency.jitter_ms) if latency.jitter_ms else 0.0
        return max(0.0, latency.ms + jitter) / 1000.0

    async def delay(self, seconds: float) -> None:
        if seconds > 0:
            self.counters.delays += 1
            self.counters.delay_s_total += seconds
            await asyncio.sleep(seconds)

    def draw_fate(self, path: bytes | None) -> _Fate:
        """A request's fate under the faults now in force; path None (raw TCP): the connection's."""
        faults, rng = self._faults, self.rng
        if path is not None and not faults.matches_path(path):
            return _Fate()
        fate = _Fate()
        if faults.error is not None and rng.random() < faults.error.probability:
            fate.inject = faults.error
            return fate  # never forwarded: nothing else can happen to it
        if faults.reset is not None and rng.random() < faults.reset.probability:
            fate.reset_at_bytes = faults.reset.after_bytes
        if faults.stall is not None and rng.random() < faults.stall.probability:
            fate.stall_at_bytes = faults.stall.after_bytes
        if faults.latency is not None and LatencyScope.REQUEST in faults.latency.per and path is not None:
            fate.delay_s = self.sample_delay_s(faults.latency)
        return fate

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        counters = self.counters
        counters.connections_accepted += 1
        counters.connections_open += 1
        link: _Link | None = None
        try:
            faults = self._faults
            if faults.blackhole:
                counters.blackholed_connections += 1
                while await client_reader.read(_READ_BYTES):
                    pass  # read and drop until the client gives up
                return
            if faults.latency is not None and LatencyScope.CONNECTION in faults.latency.per:
                await self.delay(self.sample_delay_s(faults.latency))
            try:
                upstream_reader, upstream_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port), self.connect_timeout_s)
            except (OSError, asyncio.TimeoutError):
                counters.upstream_connect_failures += 1
                return  # the client sees its connection closed, as with a dead upstream behind a proxy
            link = _Link(self, client_reader, client_writer, upstream_reader, upstream_writer)
            self._links.add(link)
            await link.run()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # only `stop` cancels a handler; ending quietly spares asyncio's stream callback, which
            # logs a cancelled handler as an error (Python 3.11)
            pass
        finally:
            self._handlers.discard(handler)
            counters.connections_open -= 1
            if link is not None:
                self._links.discard(link)
                link.abort()
            else:
                client_writer.transport.abort()


class _Link:
    """One client connection and its upstream connection: the two pumps and the current response."""

    def __init__(self, proxy: FaultProxy, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter,
                 upstream_reader: asyncio.StreamReader, upstream_writer: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client_reader, self.client_writer = client_reader, client_writer
        self.upstream_reader, self.upstream_writer = upstream_reader, upstream_writer
        self.fate = _Fate() if proxy.http else proxy.draw_fate(None)
        self.response_bytes = 0  # of the current response, forwarded so far
        self.stalled = False
        self.reset_done = False
        self._pace_until = 0.0
        # HTTP mode: the parser's view of the current request
        self._parser = httptools.HttpRequestParser(self) if proxy.http else None
        self._url = b""
        self._decided = True  # False from a request's first byte until its head is parsed
        self._complete_injected: list[bool] = []  # keep-alive of each injected request completed in a feed

    # -- httptools callbacks (run inside feed_data)
    def on_message_begin(self) -> None:
        self._url = b""
        self._decided = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_headers_complete(self) -> None:
        self.proxy.counters.requests_seen += 1
        self.fate = self.proxy.draw_fate(self._url.split(b"?", 1)[0])
        self.response_bytes = 0
        self._decided = True

    def on_message_complete(self) -> None:
        if self.fate.inject is not None:
            self._complete_injected.append(self._parser.should_keep_alive())

    # -- the pumps
    async def run(self) -> None:
        responses = asyncio.ensure_future(self._pump_responses())
        requests = asyncio.ensure_future(self._pump_requests())
        try:
            # whichever side ends first ends the link, but for a client that half-closes after its
            # request: its answer still comes through
            done, _ = await asyncio.wait({responses, requests}, return_when=asyncio.FIRST_COMPLETED)
            half_closed = requests in done and requests.exception() is None and not requests.result()
            if half_closed and not self.stalled:
                await responses  # the client half-closed after its request: let the answer through
        finally:
            for task in (responses, requests):
                task.cancel()
            await asyncio.gather(responses, requests, return_exceptions=True)

    async def _pump_requests(self) -> bool:
        """Forwards requests; True when the link must end now (reset, injected answer with close)."""
        held = bytearray()  # a request's bytes until its head is parsed and its fate known
        proxy, counters = self.proxy, self.proxy.counters
        while True:
            data = await self.client_reader.read(_READ_BYTES)
            if not data:
                if self.upstream_writer.can_write_eof():
                    self.upstream_writer.write_eof()
                return False
            if proxy.faults.blackhole:
                continue
            if self._parser is not None:
                try:
                    self._parser.feed_data(data)
                except httptools.HttpParserError:
                    self._decided = True  # not HTTP we can read: forward it as it is
                if not self._decided:
                    held += data
                    continue
                data, held = bytes(held) + data, bytearray()
            fate = self.fate
            if fate.inject is not None:
                answers, self._complete_injected = self._complete_injected, []
                for keep_alive in answers:
                    counters.errors_injected += 1
                    self.client_writer.write(error_answer(fate.inject, keep_alive))
                    await self.client_writer.drain()
                    if not keep_alive:
                        return True
                continue
            if fate.reset_at_bytes == 0:
                self.reset()
                return True
            if fate.delay_s:
                await proxy.delay(fate.delay_s)
                fate.delay_s = 0.0  # once per request, not per chunk of its body
            if self._parser is not None and not fate.forwarded:
                fate.forwarded = True
                counters.requests_forwarded += 1
            self.upstream_writer.write(data)
            counters.bytes_to_upstream += len(data)
            await self.upstream_writer.drain()

    async def _pump_responses(self) -> None:
        proxy, counters = self.proxy, self.proxy.counters
        while True:
            data = await self.upstream_reader.read(_READ_BYTES)
            if not data:
                return
            faults = proxy.faults
            if faults.blackhole or self.stalled:
                continue  # dropped; the client's connection stays open, waiting
            fate = self.fate
            cut_at, cut_is_reset = None, False
            if fate.reset_at_bytes is not None:
                cut_at, cut_is_reset = fate.reset_at_bytes, True
            if fate.stall_at_bytes is not None and (cut_at is None or fate.stall_at_bytes < cut_at):
                cut_at, cut_is_reset = fate.stall_at_bytes, False
            if cut_at is not None and self.response_bytes + len(data) >= cut_at:
                await self._forward(data[:cut_at - self.response_bytes], faults)
                if cut_is_reset:
                    await self._flush()
                    self.reset()
                    return
                counters.stalls += 1
                self.stalled = True
                continue
            await self._forward(data, faults)

    async def _forward(self, data: bytes, faults: FaultSet) -> None:
        if not data:
            return
        if faults.latency is not None and LatencyScope.CHUNK in faults.latency.per:
            await self.proxy.delay(self.proxy.sample_delay_s(faults.latency))
        if faults.bandwidth is None:
            await self._write_client(data)
            return
        rate = faults.bandwidth.bytes_per_s
        step = max(1, int(rate * _PACE_SLICE_S))
        loop = asyncio.get_running_loop()
        for start in range(0, len(data), step):
            piece = data[start:start + step]
            now = loop.time()
            if self._pace_until > now:
                await asyncio.sleep(self._pace_until - now)
            self._pace_until = max(now, self._pace_until) + len(piece) / rate
            await self._write_client(piece)

    async def _write_client(self, data: bytes) -> None:
        self.client_writer.write(data)
        self.response_bytes += len(data)
        self.proxy.counters.bytes_to_client += len(data)
        await self.client_writer.drain()

    async def _flush(self) -> None:
        """Waits until what was written left our buffer, so a reset lands after those bytes."""
        transport = self.client_writer.transport
        while transport.get_write_buffer_size() and not transport.is_closing():
            await asyncio.sleep(0.001)

    def reset(self) -> None:
        """Closes the client's connection with a TCP RST (SO_LINGER 0), as a crashed peer would."""
        if self.reset_done:
            return
        self.reset_done = True
        self.proxy.counters.resets += 1
        sock = self.client_writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.abort()

    def abort(self) -> None:
        self.client_writer.transport.abort()
        self.upstream_writer.transport.abort()
