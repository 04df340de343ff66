"""A loopback OTLP/HTTP trace sink for benchmarks: answers every POST /v1/traces with 200 and counts
the exports, their bytes and, with --decode (needs opentelemetry-proto), their spans; GET /stats says
so. Without --decode it does next to nothing, so that it takes no CPU from what is measured.

    python bench/otlp_sink.py --port 4318 [--decode]
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import httptools
import orjson

try:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
except ImportError:  # counts exports and bytes only
    ExportTraceServiceRequest = None

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"


class Stats:
    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        self.spans = 0


class SinkProtocol(asyncio.Protocol):
    def __init__(self, stats: Stats, decode: bool) -> None:
        self.stats = stats
        self.decode = decode
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.parser.get_method() == b"GET":
            body = orjson.dumps(vars(self.stats))
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                                 % (len(body), body))
            return
        payload = b"".join(self.body)
        self.stats.exports += 1
        self.stats.bytes += len(payload)
        if self.decode and ExportTraceServiceRequest is not None:
            request = ExportTraceServiceRequest.FromString(payload)
            self.stats.spans += sum(len(scope.spans) for resource in request.resource_spans
                                    for scope in resource.scope_spans)
        self.transport.write(_OK)


async def serve(port: int, decode: bool) -> None:
    loop = asyncio.get_running_loop()
    stats = Stats()
    server = await loop.create_server(lambda: SinkProtocol(stats, decode), "127.0.0.1", port)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--decode", action="store_true", help="count spans (decodes every export)")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.decode))


if __name__ == "__main__":
    main()
