"""The built-in span exporter: OTLP/HTTP with protobuf bodies (POST {endpoint}/v1/traces), in batches
from a background task. An ended request's spans are encoded as it ends (gateway/trace_spans.py) and
queued as bytes; a batch's export costs the event loop one POST, sent on the gateway's own keep-alive
upstream client (a prebuilt head, httptools parsing: 0.06 ms of CPU an export of 512 spans here,
against 0.14 ms with aiohttp's client); a bounded queue drops spans, counted, when the collector cannot
keep up or is away, rather than growing or slowing requests.
"""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_right
from collections.abc import Mapping
from itertools import accumulate, islice
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter

from tidegate.gateway.upstream import ConnectionPool, Endpoint, Exchange, UpstreamFailure
from tidegate.gateway.trace_spans import TraceEncoder
from tidegate.telemetry.otlp import AttributeValue, export_request_head, traces_url

if TYPE_CHECKING:
    from tidegate.gateway.tracing import RequestTrace

__all__ = ["OtlpHttpExporter", "SCOPE_NAME"]

log = logging.getLogger("tidegate.tracing")

SCOPE_NAME = "tidegate"


class OtlpHttpExporter:
    """A `SpanSink`: `submit_trace` encodes and queues; `start` runs the export loop, `stop` flushes."""

    def __init__(self, endpoint: str, resource: Mapping[str, AttributeValue], *, scope_version: str,
                 headers: Mapping[str, str] | None = None, max_queue_spans: int = 8192, max_batch_spans: int = 512,
                 interval_s: float = 1.0, timeout_s: float = 10.0, registry: CollectorRegistry | None = None) -> None:
        self.url = traces_url(endpoint)
        parts = urlsplit(self.url)
        tls = parts.scheme == "https"
        host, port = parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80)
        self._connections = ConnectionPool(Endpoint(host, port, tls, b"", f"{host}:{port}".encode()),
                                           connect_timeout_s=timeout_s, max_idle=2)
        extra = b"".join(f"{name}: {value}\r\n".encode() for name, value in (headers or {}).items())
        self._head = (b"POST " + (parts.path or "/").encode() + b" HTTP/1.1\r\nhost: " + f"{host}:{port}".encode()
                      + b"\r\ncontent-type: application/x-protobuf\r\n" + extra)
        self._resource = dict(resource)
        self._scope_version = scope_version
        self._max_queue_spans = max_queue_spans
        self._max_batch_spans = max_batch_spans
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        # ended requests' spans, encoded, not yet exported, a request an item: their bytes, and beside them
        # their count (two lists: a batch's cut is found by C-level sums, not a Python loop a request)
        self._pending: list[bytes] = []
        self._pending_counts: list[int] = []
        self._pending_spans = 0  # their spans
        self._encoder = TraceEncoder()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False  # logged once per outage
        self.spans = Counter("tidegate_tracing_spans", "Spans by what became of them: exported, dropped "
                             "(queue full), failed (the collector refused or was unreachable)", ["outcome"],
                             registry=registry)
        self._exported = self.spans.labels("exported")
        self._dropped = self.spans.labels("dropped")
        self._failed = self.spans.labels("failed")

    # -- the request's end
    def submit_trace(self, trace: RequestTrace) -> None:
        count = trace.span_count
        queued = self._pending_spans + count
        if queued > self._max_queue_spans:
            self._dropped.inc(count)
            return
        try:
            spans = self._encoder.encode_trace(trace)
        except Exception:  # a tracing fault: those spans are lost, counted, and requests go on
            log.exception("span encoding failed")
            self._failed.inc(count)
            return
        self._pending.append(spans)
        self._pending_counts.append(count)
        self._pending_spans = queued
        if queued >= self._max_batch_spans and self._wake is not None:
            self._wake.set()

    # -- the export loop
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
                due = False  # a full batch is waiting
            except asyncio.TimeoutError:
                due = True  # the interval passed: whatever waits goes
            self._wake.clear()
            await self.flush(partial=due)

    async def flush(self, partial: bool = True) -> None:
        """Exports what is queued, a batch at a time; `partial`: the last, smaller batch too (else it
        waits for more: small exports cost the loop more per span)."""
        while self._pending_spans >= (1 if partial else self._max_batch_spans):
            batch, count = self._take_batch()
            await self._export(batch, count)

    def _take_batch(self) -> tuple[list[bytes], int]:
        """The next batch off the queue: whole requests, up to max_batch_spans spans (or one request's,
        should it have more); (their encoded spans, a request a piece; their count)."""
        pending, counts, limit = self._pending, self._pending_counts, self._max_batch_spans
        # running span totals of the first requests (a request has a span at least: `limit` of them reach it)
        totals = list(accumulate(islice(counts, limit)))
        taken = bisect_right(totals, limit) or 1
        count = totals[taken - 1]
        batch = pending[:taken]
        del pending[:taken], counts[:taken]
        self._pending_spans -= count
        return batch, count

    async def _post(self, body: list[bytes]) -> int:
        """POSTs one export, its body in pieces (joined once, with the head); its HTTP status. A pooled
        connection the collector closed while idle is replaced and the export sent again, as the
        proxy does."""
        size = sum(map(len, body))
        data = b"".join([self._head, b"content-length: %d\r\n\r\n" % size, *body])
        loop = asyncio.get_running_loop()
        for fresh in (False, True):
            connection, reused = await self._connections.connection(fresh=fresh)
            exchange = Exchange(loop)
            connection.send(data, exchange)
            try:
                await asyncio.wait_for(exchange.done, self._timeout_s)
            except UpstreamFailure as failure:
                if reused and failure.before_first_byte and not fresh:
                    continue
                raise
            except asyncio.TimeoutError:
                connection.close()
                raise
            return exchange.status
        raise AssertionError("unreachable")

    async def _export(self, spans: list[bytes], count: int) -> None:
        body = export_request_head(self._resource, SCOPE_NAME, self._scope_version, sum(map(len, spans))) + spans
        try:
            status = await self._post(body)
            ok, problem = status == 200, f"status {status}"
        except (UpstreamFailure, asyncio.TimeoutError, OSError) as error:
            ok, problem = False, repr(error)
        if ok:
            self._exported.inc(count)
            if self._failing:
                log.info("span export recovered", extra={"fields": {"url": self.url}})
            self._failing = False
            return
        self._failed.inc(count)
        if not self._failing:
            log.warning("span export failed; spans are dropped until it works",
                        extra={"fields": {"url": self.url, "error": problem}})
        self._failing = True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._wake is not None:  # started: what waits goes out, within the export timeout
            try:
                await asyncio.wait_for(self.flush(), self._timeout_s)
            except asyncio.TimeoutError:
                pass
        self._connections.close()
