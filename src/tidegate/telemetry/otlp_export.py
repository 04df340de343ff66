"""The built-in span exporter: OTLP/HTTP with protobuf bodies (POST {endpoint}/v1/traces), in batches
from a background task. Spans are encoded when handed over (`telemetry.otlp`), so that a batch's
export costs the event loop one POST; a bounded queue drops spans, counted, when the collector
cannot keep up or is away, rather than growing or slowing requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from tidegate.telemetry.otlp import AttributeValue, SpanRecord, encode_export_request, encode_span

__all__ = ["OtlpHttpExporter", "traces_url", "SCOPE_NAME"]

log = logging.getLogger("tidegate.tracing")

SCOPE_NAME = "tidegate"


def traces_url(endpoint: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT's rule: a base URL gets `/v1/traces`; one that names it is kept."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class OtlpHttpExporter:
    """A `SpanSink`: `submit` encodes and queues; `start` runs the export loop, `stop` flushes."""

    def __init__(self, endpoint: str, resource: Mapping[str, AttributeValue], *, scope_version: str,
                 headers: Mapping[str, str] | None = None, max_queue_spans: int = 8192, max_batch_spans: int = 512,
                 interval_s: float = 1.0, timeout_s: float = 10.0, registry: CollectorRegistry | None = None) -> None:
        self.url = traces_url(endpoint)
        self._resource = dict(resource)
        self._scope_version = scope_version
        self._headers = {"content-type": "application/x-protobuf", **(headers or {})}
        self._max_queue_spans = max_queue_spans
        self._max_batch_spans = max_batch_spans
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._pending: list[bytes] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._failing = False  # logged once per outage
        self.spans = Counter("tidegate_tracing_spans", "Spans by what became of them: exported, dropped "
                             "(queue full), failed (the collector refused or was unreachable)", ["outcome"],
                             registry=registry)
        self._exported = self.spans.labels("exported")
        self._dropped = self.spans.labels("dropped")
        self._failed = self.spans.labels("failed")

    # -- the request's end
    def submit(self, spans: list[SpanRecord]) -> None:
        pending = self._pending
        if len(pending) + len(spans) > self._max_queue_spans:
            self._dropped.inc(len(spans))
            return
        pending += [encode_span(span) for span in spans]
        if len(pending) >= self._max_batch_spans and self._wake is not None:
            self._wake.set()

    # -- the export loop
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout_s))
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
        while len(self._pending) >= (1 if partial else self._max_batch_spans):
            batch = self._pending[:self._max_batch_spans]
            del self._pending[:self._max_batch_spans]
            await self._export(batch)

    async def _export(self, batch: list[bytes]) -> None:
        assert self._session is not None
        body = encode_export_request(self._resource, SCOPE_NAME, self._scope_version, batch)
        try:
            async with self._session.post(self.url, data=body, headers=self._headers) as response:
                await response.read()
                ok = response.status == 200
                problem = f"status {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
            ok, problem = False, repr(error)
        if ok:
            self._exported.inc(len(batch))
            if self._failing:
                log.info("span export recovered", extra={"fields": {"url": self.url}})
            self._failing = False
            return
        self._failed.inc(len(batch))
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
        if self._session is not None:
            try:
                await asyncio.wait_for(self.flush(), self._timeout_s)
            except asyncio.TimeoutError:
                pass
            await self._session.close()
