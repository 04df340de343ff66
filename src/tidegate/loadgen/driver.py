"""The I/O body of the load generator: sends a plan on schedule (open loop) or at a fixed
concurrency (closed loop), and optionally scrapes the target's /metrics on the same timeline.

Open loop is never silently turned into closed loop: there is no cap on requests in flight
unless `max_inflight` is set, and then every request over it is dropped and counted.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import orjson

from tidegate.loadgen.http_client import Endpoint, HttpClient, HttpResponse, InFlight
from tidegate.loadgen.mix import synthetic_prompt
from tidegate.loadgen.plan import PlannedRequest
from tidegate.loadgen.records import ApiKind, RequestRecord, measure

__all__ = ["RunConfig", "RunResult", "MetricSample", "Driver", "API_PATHS", "parse_prometheus"]

API_PATHS = {
    ApiKind.CHAT: "/v1/chat/completions",
    ApiKind.COMPLETIONS: "/v1/completions",
    ApiKind.EMBEDDINGS: "/v1/embeddings",
}
_TIMER_TICK_S = 0.002
DEFAULT_METRIC_PATTERNS = ("queue", "replica", "kv", "inflight", "in_flight", "running", "waiting", "utili")


@dataclass(frozen=True)
class RunConfig:
    targets: tuple[Endpoint, ...]  # two with --compare; request i goes to target i % len(targets)
    model: str = "default"
    kind: ApiKind = ApiKind.CHAT
    stream: bool = True
    ignore_eos: bool = False  # vLLM's field (also the embedded engine's): every answer runs to max_tokens
    timeout_s: float = 60.0
    concurrency: int | None = None  # closed loop when set
    duration_s: float | None = None  # hard stop for the closed loop
    max_inflight: int | None = None  # open loop: drop (and count) beyond this
    scrape_metrics: bool = False
    metric_patterns: tuple[str, ...] = DEFAULT_METRIC_PATTERNS


@dataclass(frozen=True, slots=True)
class MetricSample:
    t_s: float  # offset from the run's start
    target: int
    series: str  # metric name with its labels, as exposed
    value: float


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    metrics: list[MetricSample]
    started_at_unix: float
    elapsed_s: float  # first send to last completion
    connections_opened: int
    peak_in_flight: int


def parse_prometheus(text: str, patterns: Sequence[str]) -> list[tuple[str, float]]:
    """(series, value) for every sample whose metric name contains one of `patterns`."""
    wanted = [p.lower() for p in patterns]
    samples: list[tuple[str, float]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:  # labels may contain spaces: split after the closing brace
            close = line.rindex("}")
            series, rest = line[: close + 1], line[close + 1:]
        else:
            series, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields or not any(p in series.split("{", 1)[0].lower() for p in wanted):
            continue
        try:
            samples.append((series, float(fields[0])))
        except ValueError:
            continue
    return samples


@dataclass
class Driver:
    config: RunConfig
    plan: Sequence[PlannedRequest]
    on_progress: Callable[["Driver"], None] | None = None
    records: list[RequestRecord] = field(default_factory=list)
    metrics: list[MetricSample] = field(default_factory=list)
    sent: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0

    def __post_init__(self) -> None:
        self._clients = [HttpClient(t, self.config.timeout_s) for t in self.config.targets]
        self._path = API_PATHS[self.config.kind]
        self._start = 0.0
        self._auth_cache: dict[str, bytes] = {}

    def _render(self, request: PlannedRequest, client: HttpClient) -> bytes:
        prompt = synthetic_prompt(request.prompt_tokens, request.index)
        body: dict = {"model": self.config.model}
        if self.config.kind is ApiKind.CHAT:
            body["messages"] = [{"role": "user", "content": prompt}]
        elif self.config.kind is ApiKind.COMPLETIONS:
            body["prompt"] = prompt
        else:
            body["input"] = prompt
        if self.config.kind is not ApiKind.EMBEDDINGS:
            body["max_tokens"] = request.max_tokens
            if self.config.ignore_eos:
                body["ignore_eos"] = True
            body["stream"] = self.config.stream
            if self.config.stream:
                body["stream_options"] = {"include_usage": True}
        key = request.tenant.api_key
        auth = self._auth_cache.get(key)
        if auth is None:
            auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
            self._auth_cache[key] = auth
        return client.render("POST", self._path, orjson.dumps(body), auth)

    def _count_send(self) -> None:
        # counted by whoever sends, at once: the in-flight cap must see sends of this loop turn
        self.sent += 1
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight = self.in_flight

    async def _one(self, request: PlannedRequest, data: bytes | None = None, sent_at: float | None = None,
                   in_flight: InFlight | None = None) -> None:
        """One request, from sending (unless the open loop already wrote it) to its record.
        The caller has counted it with `_count_send`."""
        target = request.index % len(self._clients)
        client = self._clients[target]
        if data is None:
            data = self._render(request, client)
        if sent_at is None:
            sent_at = time.perf_counter()
        try:
            response = await (client.response(in_flight) if in_flight is not None else client.request(data))
        except Exception as error:  # a generator bug must cost one record, never the run
            response = HttpResponse(error=f"client_error:{type(error).__name__}")
        finally:
            self.in_flight -= 1
        self.records.append(measure(
            response, index=request.index, target=target, tenant=request.tenant.name,
            tier=request.tenant.tier, sent_at=sent_at,
            # a closed loop sends when a slot frees, not on a schedule: no lag to report
            scheduled_s=request.send_at_s if self.config.concurrency is None else sent_at - self._start,
            run_start=self._start, stream=self.config.stream, kind=self.config.kind,
            target_prompt_tokens=request.prompt_tokens, max_tokens=request.max_tokens,
        ))

    def _drop(self, request: PlannedRequest) -> None:
        now = time.perf_counter()
        self.records.append(RequestRecord(
            index=request.index, target=request.index % len(self._clients), tenant=request.tenant.name,
            tier=request.tenant.tier, scheduled_s=request.send_at_s, sent_s=now - self._start, status=0,
            reason="dropped_inflight_cap", ttft_s=None, itl_s=(), e2e_s=None,
            target_prompt_tokens=request.prompt_tokens, max_tokens=request.max_tokens,
            prompt_tokens=None, completion_tokens=None, headers={},
        ))

    async def _open_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        cap = self.config.max_inflight
        for request in self.plan:
            client = self._clients[request.index % len(self._clients)]
            data = self._render(request, client)  # before the wait, so it costs no lag
            due = self._start + request.send_at_s
            while (wait := due - time.perf_counter()) > 0:
                # Event-loop timers tick in milliseconds: sleep to within a tick, then yield
                # (sleep(0) still serves responses) until due, so sends land within tens of us.
                await asyncio.sleep(wait - _TIMER_TICK_S if wait > _TIMER_TICK_S else 0)
            if cap is not None and self.in_flight >= cap:
                self._drop(request)
                continue
            sent_at = time.perf_counter()
            in_flight = client.send_now(data)
            self._count_send()
            task = loop.create_task(self._one(request, data, sent_at, in_flight))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))

    async def _closed_loop(self) -> None:
        assert self.config.concurrency is not None
        pending = iter(self.plan)
        deadline = self._start + self.config.duration_s if self.config.duration_s else None

        async def worker() -> None:
            for request in pending:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                self._count_send()
                await self._one(request)

        await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))

    async def _scrape(self, stop: asyncio.Event) -> None:
        scrapers = [HttpClient(t, timeout_s=2.0) for t in self.config.targets]
        # a gateway with API keys opens /metrics to them: the first planned tenant's, as for /v1/models
        key = self.plan[0].tenant.api_key if self.plan else ""
        auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
        try:
            while not stop.is_set():
                tick = time.perf_counter()
                for target, client in enumerate(scrapers):
                    response = await client.request(client.render("GET", "/metrics", headers=auth,
                                                                  under_base=False))
                    if response.status == 200:
                        t_s = tick - self._start
                        for series, value in parse_prometheus(response.body().decode("utf-8", "replace"),
                                                              self.config.metric_patterns):
                            self.metrics.append(MetricSample(t_s, target, series, value))
                try:
                    await asyncio.wait_for(stop.wait(), timeout=max(0.0, 1.0 - (time.perf_counter() - tick)))
                except asyncio.TimeoutError:
                    pass
        finally:
            for client in scrapers:
                await client.close()

    async def _report_progress(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.on_progress is not None:
                self.on_progress(self)
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    async def run(self) -> RunResult:
        started_at_unix = time.time()
        stop = asyncio.Event()
        # The plan and everything loaded before the run leave the collector's view, so a full
        # collection mid-run does not walk them and stall sends by milliseconds.
        gc.collect()
        gc.freeze()
        helpers = [asyncio.create_task(self._report_progress(stop))]
        self._start = time.perf_counter()
        if self.config.scrape_metrics:
            helpers.append(asyncio.create_task(self._scrape(stop)))
        try:
            if self.config.concurrency:
                await self._closed_loop()
            else:
                await self._open_loop()
        finally:
            elapsed_s = time.perf_counter() - self._start
            stop.set()
            await asyncio.gather(*helpers, return_exceptions=True)
            if self.on_progress is not None:
                self.on_progress(self)
            for client in self._clients:
                await client.close()
            gc.unfreeze()
        self.records.sort(key=lambda r: r.index)
        return RunResult(
            records=self.records, metrics=self.metrics, started_at_unix=started_at_unix,
            elapsed_s=elapsed_s, connections_opened=sum(c.connections_opened for c in self._clients),
            peak_in_flight=self.peak_in_flight,
        )

    @property
    def completed(self) -> int:
        return len(self.records)
