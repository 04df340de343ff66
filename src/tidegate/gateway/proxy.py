"""Request handling: route, check, dispatch to a replica, pass the answer through.

Failures map to OpenAI error bodies: a connection failure before the first byte is retried once on
another replica, then 502; silence past the timeout is 504; no replica is 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import re
import time
from collections.abc import Callable
from urllib.parse import unquote_to_bytes

import orjson

from tidegate.errors import (
    AuthenticationError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    TidegateError,
    UpstreamError,
    UpstreamTimeoutError,
    openai_error_body,
)
from tidegate.gateway.batch_api import BATCH_PATHS, BatchApi
from tidegate.gateway.dispatch import ModelPool, Replica
from tidegate.gateway.failover import SentStream, StreamFailover, error_event
from tidegate.gateway.http import HttpConnection, HttpRequest
from tidegate.cache.response import CachedAnswer
from tidegate.gateway.overload import CachedAnswerRung, OverloadRuntime, Ticket, extra_headers
from tidegate.gateway.response_cache import ResponseCache, replay
from tidegate.gateway.scaling import ScaleLoop
from tidegate.gateway.scrub import SecretScrubber, StreamScrubber, safe_content_type
from tidegate.gateway.status import StatusPage
from tidegate.gateway.tracing import PassThrough, RequestTrace, Tracing, start_trace
from tidegate.gateway.upstream import Exchange, UpstreamFailure, UpstreamConnection
from tidegate.gateway.validation import Endpoint, check_body, check_nesting
from tidegate.policy.health import is_routable
from tidegate.policy.routing import any_routable
from tidegate.policy.identity import Identity
from tidegate.telemetry.logs import AccessLog
from tidegate.telemetry.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tidegate.telemetry.metrics import GatewayMetrics, PoolMetrics

__all__ = ["ProxySettings", "Proxy"]

log = logging.getLogger("tidegate.gateway")


def _log_retry_refused(request_id: bytes, pool: str, failed_replica: str, failure: str,
                       refusal: OverloadedError) -> None:
    """A request its replica failed before any byte found no other replica in time: the client gets
    the replica's error (502), and the log says why the retry did not happen."""
    log.warning("retry refused", extra={"fields": {
        "request_id": request_id.decode("latin-1"), "pool": pool, "failed_replica": failed_replica,
        "failure": failure, "refusal": refusal.code}})


_API_ROUTES = {
    b"/v1/chat/completions": Endpoint.CHAT,
    b"/v1/completions": Endpoint.COMPLETIONS,
    b"/v1/embeddings": Endpoint.EMBEDDINGS,
}
_GET_ROUTES = frozenset((b"/health", b"/ready", b"/v1/models"))
_OBSERVING_ROUTES = frozenset((b"/metrics", b"/status", b"/status.json"))
_MODEL_PATH = b"/v1/models/"  # + a pool's name: one model object, as the SDK's models.retrieve asks
_JSON = b"content-type: application/json\r\n"
# an endpoint's path: Enum's `value` is a Python-level property, read per attempt (~1.5k instructions)
_ENDPOINT_PATHS = {endpoint: endpoint.value for endpoint in Endpoint}
_STATUS_CLIENT_CLOSED = 499  # nginx's convention for "the client left first"
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_USAGE_REACH = 256  # bytes either side of completion_tokens where its usage object's prompt_tokens is
# An event that carries generated output: non-empty text, a tool call, or a finish. Engines (vLLM,
# the embedded one, OpenAI) open a chat stream with a role-only event before any token, so the
# first event is not the first token.
_FIRST_TOKEN = re.compile(rb'"(?:content|text|reasoning_content)"\s*:\s*"(?!")|"tool_calls"\s*:\s*\[|'
                          rb'"finish_reason"\s*:\s*"')


class ProxySettings:
    __slots__ = ("max_tokens_cap", "first_byte_timeout_s", "whole_answer_timeout_s", "stream_idle_timeout_s",
                 "request_timeout_s", "api_keys", "metrics_key", "metrics_on_main_port", "status_page")

    def __init__(self, max_tokens_cap: int, first_byte_timeout_s: float, request_timeout_s: float,
                 api_keys: frozenset[bytes], metrics_key: bytes | None = None,
                 metrics_on_main_port: bool = True, *, whole_answer_timeout_s: float | None = None,
                 stream_idle_timeout_s: float | None = None, status_page: bool = True) -> None:
        self.max_tokens_cap = max_tokens_cap
        self.first_byte_timeout_s = first_byte_timeout_s  # stream: dispatch -> first event with output
        # not streamed: dispatch -> the answer's head (engines send it when the answer is complete)
        self.whole_answer_timeout_s = min(whole_answer_timeout_s or request_timeout_s, request_timeout_s)
        # stream: the longest silence of the upstream between reads, once output has begun
        self.stream_idle_timeout_s = min(stream_idle_timeout_s or request_timeout_s, request_timeout_s)
        self.request_timeout_s = request_timeout_s
        self.api_keys = api_keys  # b"Bearer <key>" values; empty: no authentication
        # b"Bearer <key>" that alone opens /metrics; None: /metrics takes the API's keys (open without)
        self.metrics_key = metrics_key
        self.metrics_on_main_port = metrics_on_main_port  # False: only the metrics listener serves it
        self.status_page = status_page  # /status and /status.json beside /metrics


class Proxy:
    def __init__(self, pools: dict[str, ModelPool], settings: ProxySettings, metrics: GatewayMetrics,
                 access_log: AccessLog, clock: Callable[[], float] = time.monotonic,
                 overload: OverloadRuntime | None = None, scaling: ScaleLoop | None = None,
                 cache: ResponseCache | None = None, tracing: Tracing | None = None) -> None:
        self.pools = pools
        self.tracing = tracing  # None: tracing off (a client's traceparent still goes upstream)
        self.cache = cache  # None: no pool has a response cache
        self.batch_api: BatchApi | None = None  # the Batch API's routes, when `batch` is on
        self.draining = False  # shutting down: /ready answers 503, requests are still served
        self.active = 0  # API requests being handled: a drain waits for them
        self.overload = overload  # None: FIFO queues, static slot limits, server.api_keys only
        self._ticket_ids = 0  # overload control's own request ids: clients may repeat x-request-id
        self.settings = settings
        self.metrics = metrics
        self.pool_metrics: dict[str, PoolMetrics] = {name: metrics.for_pool(name) for name in pools}
        self.access_log = access_log
        self.clock = clock
        self._id_prefix = os.urandom(4).hex().encode()
        self._id_counter = 0
        cards = {name: {"id": name, "object": "model", "created": 0, "owned_by": "tidegate"} for name in pools}
        self._models_body = orjson.dumps({"object": "list", "data": list(cards.values())})
        self._model_bodies = {name: orjson.dumps(card) for name, card in cards.items()}
        self.status = StatusPage(metrics.registry, pools, overload, clock, scaling) if settings.status_page else None
        observing = _OBSERVING_ROUTES if self.status is not None else frozenset((b"/metrics",))
        self._observing = observing  # served where /metrics is (the metrics listener, if any), to whom it is
        self._get_routes = _GET_ROUTES | observing if settings.metrics_on_main_port else _GET_ROUTES
        self.failover = StreamFailover(self)  # continues a stream whose replica broke mid-answer

    # -- entry point (an HttpConnection's handler)
    async def handle(self, conn: HttpConnection, request: HttpRequest, identity: Identity | None = None) -> None:
        """`identity`: a request the gateway makes itself (the batch worker), already authenticated."""
        started = self.clock()
        request_id = request.request_id
        if request_id is None:
            self._id_counter += 1
            request_id = b"%b-%x" % (self._id_prefix, self._id_counter)
        endpoint = _API_ROUTES.get(request.path)
        model: str | None = None
        status = 500
        replica_id: str | None = None
        trace = error = None
        self.active += 1
        try:
            if endpoint is None or request.method != b"POST" or request.too_large:
                if self.batch_api is not None and request.path.startswith(BATCH_PATHS) and not request.too_large:
                    status = await self.batch_api.handle(conn, request, request_id, self._authenticate(request))
                    return
                status = self._handle_other(conn, request, request_id)
                return
            if self.tracing is not None:
                trace = self.tracing.start(request, endpoint, request_id)
            elif request.traceparent is not None:  # tracing off: passed on as it came
                trace = start_trace(None, request, endpoint, request_id)
            if identity is None:
                identity = self._authenticate(request)
            try:
                body = orjson.loads(request.body)
            except orjson.JSONDecodeError:
                raise InvalidRequestError("request body is not valid JSON") from None
            check_nesting(request.body, body)
            model, stream = check_body(endpoint, body, self.settings.max_tokens_cap)
            pool = self.pools.get(model)
            if pool is None:
                raise NotFoundError(f"model {model!r} does not exist; see /v1/models", param="model")
            timeout_s = _client_timeout_s(request.request_timeout)
            cache = self.cache
            if cache is not None and model in cache.pools:
                if identity is not None and identity.preemptible:
                    # a flight runs in a task of its own and may carry other clients' identical
                    # requests: it is never cancelled for one of them (`policy.pool` rule 9)
                    identity = Identity(identity.tenant, identity.tier)
                status, replica_id = await self._forward_cached(cache, conn, request, pool, endpoint, body, stream,
                                                                request_id, started, identity, timeout_s, trace)
            else:
                # straight to the way with overload control: one coroutine less to resume a request
                forward = self._forward if identity is None or self.overload is None else self._forward_controlled
                status, replica_id = await forward(conn, pool, endpoint, body, request.body, stream,
                                                   request_id, started, identity, timeout_s, trace=trace)
        except TidegateError as refused:
            status = refused.status
            if trace is not None:
                error = refused  # for its span; dropped below (its traceback holds this frame)
            self._send_error(conn, refused, request_id)
            if model is None or model not in self.pools:
                self.metrics.unrouted.labels(str(status)).inc()
            else:
                self.pool_metrics[model].count(status)
        except asyncio.CancelledError:
            status = _STATUS_CLIENT_CLOSED
            if model in self.pools:
                self.pool_metrics[model].count(status)
            raise
        except Exception:
            log.exception("unexpected error", extra={"fields": {"request_id": request_id.decode("latin-1")}})
            status = 500
            self._send_error(conn, TidegateError("internal error"), request_id)
        finally:
            self.active -= 1
            if trace is not None:
                trace.end(model, status, replica_id, error)
                error = None
            self.access_log.record(request_id, request.method, request.path, model, status,
                                   self.clock() - started, replica_id, None if trace is None else trace.trace_id)

    def _authenticate(self, request: HttpRequest) -> Identity | None:
        overload = self.overload
        if overload is not None and overload.auth_enabled:
            return overload.authenticate(request.authorization)  # tenants' keys: tenant and tier
        keys = self.settings.api_keys
        if keys and request.authorization not in keys:
            raise AuthenticationError("missing or invalid API key (send 'Authorization: Bearer <key>')")
        return overload.anonymous if overload is not None else None  # the anonymous tenant

    def _send_error(self, conn: HttpConnection, error: TidegateError, request_id: bytes) -> None:
        headers = _JSON + b"x-request-id: " + request_id + b"\r\n" + extra_headers(error)
        if error.retry_after_s is not None:
            # rounded up: retrying a little early would only be refused again
            headers += b"retry-after: %d\r\n" % max(0, math.ceil(error.retry_after_s))
        conn.respond(error.status, headers, orjson.dumps(openai_error_body(error)))

    # -- non-API routes: probes, metrics, model list
    def _handle_other(self, conn: HttpConnection, request: HttpRequest, request_id: bytes) -> int:
        path, method = request.path, request.method
        if request.too_large:
            raise PayloadTooLargeError("request body too large")
        if path in _API_ROUTES:
            raise MethodNotAllowedError(f"{path.decode()} takes POST", allow="POST")
        if path not in self._get_routes and not path.startswith(_MODEL_PATH):
            raise NotFoundError(f"no route {method.decode('latin-1')} {path.decode('latin-1')}", code="not_found")
        if method not in (b"GET", b"HEAD"):
            raise MethodNotAllowedError(f"{path.decode('latin-1')} takes GET", allow="GET, HEAD")
        headers = _JSON + b"x-request-id: " + request_id + b"\r\n"
        if path == b"/health":
            conn.respond(200, headers, b'{"status":"ok"}')
            return 200
        if path == b"/ready":
            now_s = self.clock()
            ready = {name: pool.ready(now_s) for name, pool in self.pools.items()}
            status = 200 if all(ready.values()) and not self.draining else 503
            conn.respond(status, headers, orjson.dumps({"ready": status == 200, "draining": self.draining,
                                                        "pools": ready}))
            return status
        if path in self._observing:
            return self._serve_observing(conn, request, on_main_port=True)
        self._authenticate(request)
        if path == b"/v1/models":
            conn.respond(200, headers, self._models_body)
            return 200
        name = unquote_to_bytes(path[len(_MODEL_PATH):]).decode("utf-8", "replace")
        body = self._model_bodies.get(name)
        if body is None:
            raise NotFoundError(f"model {name!r} does not exist; see /v1/models", param="model")
        conn.respond(200, headers, body)
        return 200

    def _serve_observing(self, conn: HttpConnection, request: HttpRequest, on_main_port: bool) -> int:
        """/metrics, /status, /status.json. Their labels name replicas' host:port: with
        `metrics_api_key` only that key reads them; else, on the main port, whatever key the API
        takes (open when the API is), on their own port anyone."""
        key = self.settings.metrics_key
        if key is not None:
            if not hmac.compare_digest(request.authorization or b"", key):
                raise AuthenticationError(f"{request.path.decode('latin-1')} needs the metrics key "
                                          "(send 'Authorization: Bearer <key>')")
        elif on_main_port:
            self._authenticate(request)
        self._refresh_replica_gauges()
        if request.path == b"/metrics":
            conn.respond(200, b"content-type: " + METRICS_CONTENT_TYPE + b"\r\n", self.metrics.render())
            return 200
        assert self.status is not None
        page, snapshot = self.status.render()
        if request.path == b"/status.json":
            conn.respond(200, _JSON, orjson.dumps(snapshot))
        else:
            conn.respond(200, b"content-type: text/html; charset=utf-8\r\ncache-control: no-store\r\n", page)
        return 200

    async def handle_metrics_listener(self, conn: HttpConnection, request: HttpRequest) -> None:
        """The handler of the separate metrics listener (`server.metrics_port`): /metrics only."""
        self._id_counter += 1
        request_id = request.request_id or b"%b-%x" % (self._id_prefix, self._id_counter)
        try:
            if request.path not in self._observing:
                raise NotFoundError(f"no route {request.path.decode('latin-1')}", code="not_found")
            if request.method not in (b"GET", b"HEAD"):
                raise MethodNotAllowedError(f"{request.path.decode('latin-1')} takes GET", allow="GET, HEAD")
            self._serve_observing(conn, request, on_main_port=False)
        except TidegateError as error:
            self._send_error(conn, error, request_id)

    def _refresh_replica_gauges(self) -> None:
        now_s = self.clock()
        for name, pool in self.pools.items():
            self.pool_metrics[name].queue_depth.set(len(pool.queue))
            for replica in pool.replicas:
                routable = is_routable(replica.health, replica.breaker, now_s)
                self.metrics.replica_healthy.labels(name, replica.replica_id).set(1 if routable else 0)
                self.metrics.replica_outstanding.labels(name, replica.replica_id).set(replica.outstanding)

    # -- proxying
    async def _forward_cached(self, cache: ResponseCache, conn: HttpConnection, request: HttpRequest,
                              pool: ModelPool, endpoint: Endpoint, body: dict, stream: bool, request_id: bytes,
                              started: float, identity: Identity | None, timeout_s: float | None,
                              trace: RequestTrace | PassThrough | None) -> tuple[int, str | None]:
        """A pool with a response cache: a hit or a coalesced request is answered without a replica;
        the rest go through `_forward` (once for all identical requests in flight, under the trace of the
        request that leads the flight)."""
        overload = self.overload
        tenant = identity.tenant if identity is not None and overload is not None \
            and overload.identity.auth_enabled else None

        async def forward(target: HttpConnection, forwarded_id: bytes,
                          cached_fallback: CachedAnswer | None) -> tuple[int, str | None]:
            return await self._forward(target, pool, endpoint, body, request.body, stream, forwarded_id, started,
                                       identity, timeout_s, cached_fallback, trace=trace)

        status, replica_id, upstream = await cache.serve(conn, pool.name, endpoint.name, body, request_id, tenant,
                                                         request.authorization, request.cache_control, forward,
                                                         opt_in=request.cache_opt_in)
        if not upstream:  # answered from the cache or by another request's flight: counted here
            self.pool_metrics[pool.name].count(status)
        return status, replica_id

    async def _forward(self, conn: HttpConnection, pool: ModelPool, endpoint: Endpoint, body: dict,
                       raw_body: bytes, stream: bool, request_id: bytes, started: float,
                       identity: Identity | None = None, timeout_s: float | None = None,
                       cached_fallback: CachedAnswer | None = None, *,
                       trace: RequestTrace | PassThrough | None = None) -> tuple[int, str | None]:
        """`trace`: the request's (`Tracing.start`), passed along, not read from a context variable (a
        set and reset cost some 2k instructions a request)."""
        if self.overload is not None and identity is not None:
            return await self._forward_controlled(conn, pool, endpoint, body, raw_body, stream, request_id, started,
                                                  identity, timeout_s, cached_fallback, trace=trace)
        # Whoever holds a replica slot gives it back in the `finally` below, on every way out:
        # an exception anywhere between acquiring and releasing must not leak it (eight leaked
        # slots once disabled a pool until restart)
        held: Replica | None = None
        metrics = self.pool_metrics[pool.name]
        metrics.in_flight.inc()
        try:
            held = await self._acquire(pool, started, ())
            pool.retry_budget.on_attempt()
            try:
                status = await self._exchange_on(conn, pool, held, endpoint, body, raw_body, stream,
                                                 request_id, started, metrics, trace=trace)
            except _RetryElsewhere as retry:
                # nothing reached the client and the replica failed: one more try, on another
                # replica, if the pool's retry budget allows (retries must not amplify an outage)
                tried = held.replica_id
                self._release(held)
                held = None
                try:
                    held = await self._acquire(pool, self.clock(), (tried,))
                except OverloadedError as refusal:
                    _log_retry_refused(request_id, pool.name, tried, retry.reason, refusal)
                    raise retry.error from None
                self.metrics.upstream_retries.labels(pool.name, retry.reason).inc()
                status = await self._exchange_on(conn, pool, held, endpoint, body, raw_body, stream,
                                                 request_id, started, metrics, retried=True, trace=trace)
            metrics.count(status)
            metrics.e2e.observe(self.clock() - started)
            return status, held.replica_id
        finally:
            if held is not None:
                self._release(held)
            metrics.in_flight.dec()

    async def _forward_controlled(self, conn: HttpConnection, pool: ModelPool, endpoint: Endpoint, body: dict,
                                  raw_body: bytes, stream: bool, request_id: bytes, started: float,
                                  identity: Identity, timeout_s: float | None,
                                  cached_fallback: CachedAnswer | None = None, *,
                                  trace: RequestTrace | PassThrough | None = None) -> tuple[int, str | None]:
        """The same way through with overload control: its pool's controller decides when and where
        the request goes, and hears how it ended (`OverloadRuntime.settle`, on every way out).
        `cached_fallback`: the cache's answer to the same question, for the ladder's cached-answer rung."""
        overload = self.overload
        assert overload is not None
        # raises the answer for a refusal (429, or 503 with the preset reply) at once
        try:
            # rate limits shared by several gateways (`shared_state: redis`): decided there first
            shared = overload.shared_limits
            admission = None if shared is None else await shared.admit(identity.tenant, pool.name,
                                                                         *overload.request_cost(body))
            self._ticket_ids += 1
            # the same bytes from the same tenant: a resend of the same request (`policy.resends`)
            ticket = overload.admit(started, str(self._ticket_ids), identity, pool.name, body, timeout_s, stream,
                                    cached_answer_available=cached_fallback is not None, shared=admission,
                                    fingerprint=hash(raw_body) ^ hash(identity.tenant))
        except CachedAnswerRung as rung:
            assert cached_fallback is not None
            if trace is not None:
                trace.admitted(identity)  # answered by overload control, without a ticket
            self.pool_metrics[pool.name].count(200)
            return replay(conn, cached_fallback, request_id, rung.headers), None
        except BaseException:
            if trace is not None:
                trace.admitted(identity)  # refused: its admission span says whose request it was
            raise
        pool = self.pools[ticket.pool]  # the fallback pool when degraded to it
        metrics = self.pool_metrics[pool.name]
        metrics.in_flight.inc()
        usage = _Usage(ticket)
        if trace is not None:
            trace.admitted(identity, ticket, usage)
        try:
            try:
                # assigned at arrival (the common case): no coroutine to create and await
                replica = ticket.replica if ticket.future is None else await overload.acquire(ticket)
            except CachedAnswerRung as rung:  # shed while it waited
                assert cached_fallback is not None
                metrics.count(200)
                return replay(conn, cached_fallback, request_id, rung.headers), None
            pool = self.pools[ticket.pool]  # a request displaced while it waited may move to the fallback
            pool.retry_budget.on_attempt()
            try:
                status = await self._exchange_on(conn, pool, replica, endpoint, body, raw_body, stream,
                                                 request_id, started, metrics, usage=usage, trace=trace)
            except _RetryElsewhere as retry:
                failed_id = replica.replica_id
                try:
                    replica = await overload.retry(ticket, retry.reason)
                except OverloadedError as refusal:
                    _log_retry_refused(request_id, pool.name, failed_id, retry.reason, refusal)
                    raise retry.error from None
                self.metrics.upstream_retries.labels(pool.name, retry.reason).inc()
                status = await self._exchange_on(conn, pool, replica, endpoint, body, raw_body, stream,
                                                 request_id, started, metrics, retried=True, usage=usage,
                                                 trace=trace)
            metrics.count(status)
            metrics.e2e.observe(self.clock() - started)
            return status, replica.replica_id
        finally:
            metrics.in_flight.dec()
            overload.settle(ticket, usage.completion_tokens(), usage.prompt_tokens)

    def _release(self, replica: Replica) -> None:
        self.pools[replica.pool_name].release(replica, self.clock())

    async def _acquire(self, pool: ModelPool, now_s: float, exclude: tuple[str, ...]) -> Replica:
        replica = pool.try_acquire(now_s, exclude)
        return replica if replica is not None else await pool.acquire(now_s, exclude)

    async def _exchange_on(self, conn: HttpConnection, pool: ModelPool, replica: Replica, endpoint: Endpoint,
                           body: dict, raw_body: bytes, stream: bool, request_id: bytes, started: float,
                           metrics: PoolMetrics, retried: bool = False, usage: _Usage | None = None,
                           trace: RequestTrace | PassThrough | None = None) -> int:
        """One attempt on `replica`, whose slot the caller holds and gives back."""
        rewrites: dict = {}
        if replica.upstream_model != body["model"]:
            rewrites["model"] = replica.upstream_model
        if replica.forward_priority and usage is not None:
            # the controller's engine level (tier, and a tenant's flood) decides, not a `priority`
            # the client may have sent
            rewrites["priority"] = usage.ticket.priority
        payload = orjson.dumps({**body, **rewrites}) if rewrites else raw_body
        trace_lines = b"" if trace is None else trace.upstream_headers(replica)
        path = _ENDPOINT_PATHS[endpoint]
        data = b"".join((replica.request_head(path), trace_lines, b"x-request-id: ", request_id,
                         b"\r\ncontent-length: ", str(len(payload)).encode(), b"\r\n\r\n", payload))
        sent_s = self.clock()
        try:
            return await self._exchange(conn, replica, data, stream, request_id, started, metrics, usage, sent_s,
                                        may_retry=not retried, request=(path, body), trace=trace)
        except UpstreamFailure as failure:
            kind = "timeout" if failure.timed_out else ("connect" if failure.connect else "broken")
            self.metrics.upstream_errors.labels(pool.name, replica.replica_id, kind).inc()
            self._record(pool, replica, sent_s, usage, kind, trace)
            if failure.timed_out:
                raise UpstreamTimeoutError("the upstream did not answer in time") from None
            error = UpstreamError(f"upstream replica failed: {failure}")
            if failure.before_first_byte:
                refusal = "already_retried" if retried else self._retry_refusal(pool, replica, self.clock())
                if refusal is None:
                    raise _RetryElsewhere(error, kind) from None
                log.warning("upstream failure not retried", extra={"fields": {
                    "request_id": request_id.decode("latin-1"), "pool": pool.name,
                    "replica": replica.replica_id, "failure": kind, "refusal": refusal}})
            raise error from None

    def _record(self, pool: ModelPool, replica: Replica, sent_s: float, usage: _Usage | None,
                failure: str | None, trace: RequestTrace | PassThrough | None) -> None:
        """How the attempt ended, for the replica's breaker: the pool's, or its controller's."""
        if failure is not None and pool.on_replica_failed is not None:
            pool.on_replica_failed(replica)  # a dead worker's spare takes over before any retry
        if trace is not None:
            trace.attempt_ended(failure)
        if usage is not None:
            self.overload.ended(usage.ticket, failure)  # type: ignore[union-attr]
        elif failure is None:
            pool.record_success(replica, self.clock(), sent_s)
        else:
            pool.record_failure(replica, self.clock(), sent_s)

    @staticmethod
    def _may_retry(pool: ModelPool, failed: Replica, now_s: float) -> bool:
        """Another replica could take the request, and the pool's retry budget allows one more."""
        return Proxy._retry_refusal(pool, failed, now_s) is None

    @staticmethod
    def _retry_refusal(pool: ModelPool, failed: Replica, now_s: float) -> str | None:
        """None, with the retry's budget spent, when another replica could take the request and the
        pool's retry budget allows one more; else why not (for the log)."""
        if not any_routable(pool.replicas, now_s, (failed.replica_id,)):
            return "no_other_replica"
        return None if pool.retry_budget.try_spend(now_s) else "retry_budget"

    async def _exchange(self, conn: HttpConnection, replica: Replica, data: bytes, stream: bool,
                        request_id: bytes, started: float, metrics: PoolMetrics, usage: _Usage | None,
                        sent_s: float, may_retry: bool, request: tuple[str, dict] | None = None,
                        trace: RequestTrace | PassThrough | None = None) -> int:
        loop = asyncio.get_running_loop()
        settings = self.settings
        connection, reused = await replica.connections.connection()
        relay = _StreamRelay(self, conn, connection, request_id, started, metrics, usage,
                             replica.scrubber, trace) if stream else None
        exchange = Exchange(loop, relay)
        connection.send(data, exchange)
        timeout_s = settings.first_byte_timeout_s if stream else settings.whole_answer_timeout_s
        timer = loop.call_later(timeout_s, _time_out, connection, exchange)
        if relay is not None:
            relay.timer = timer
        try:
            try:
                await exchange.done
            except UpstreamFailure as failure:
                if not (reused and failure.before_first_byte and not failure.timed_out):
                    raise
                # the server closed this pooled connection while it sat idle: resend on a new one
                timer.cancel()
                connection, _ = await replica.connections.connection(fresh=True)
                relay = _StreamRelay(self, conn, connection, request_id, started, metrics, usage,
                                     replica.scrubber, trace) if stream else None
                exchange = Exchange(loop, relay)
                connection.send(data, exchange)
                timer = loop.call_later(timeout_s, _time_out, connection, exchange)
                if relay is not None:
                    relay.timer = timer
                await exchange.done
            if relay is not None:
                # what it held: a stream that ended with no output event, or a last line without its newline
                relay.flush(at_end=True)
            if relay is None or not relay.streaming:
                return self._answer_whole(conn, replica, exchange, request_id, usage, sent_s, may_retry, trace)
            self._record(self.pools[replica.pool_name], replica, sent_s, usage, None, trace)
            conn.end_stream()
            return 200
        except UpstreamFailure as failure:
            if relay is None or not relay.streaming:
                if relay is not None and not failure.before_first_byte and not failure.timed_out:
                    # the engine sent its head and role-only event at once, then died before any
                    # output (killed during prefill): the client got nothing, held back until the
                    # first output, so another replica may take it as after a connection failure
                    raise UpstreamFailure(str(failure), before_first_byte=True) from None
                raise
            # headers are out: continue the answer on another replica (gateway/failover.py), or say
            # what happened in the stream, then end it, so it cannot look complete
            pool = self.pools[replica.pool_name]
            kind = "timeout" if failure.timed_out else "broken"
            self._record(pool, replica, sent_s, usage, kind, trace)
            self.metrics.upstream_errors.labels(pool.name, replica.replica_id, kind).inc()
            relay.timer.cancel()  # type: ignore[union-attr]
            if request is not None:
                status = await self.failover.resume(conn, pool, replica, relay.sent, request[0], request[1],
                                                    request_id, started, usage, failure, trace)
                if status is not None:
                    return status
            conn.stream_chunk(error_event(failure))
            conn.end_stream()
            return 504 if failure.timed_out else 502
        finally:
            (relay.timer if relay is not None else timer).cancel()
            done = exchange.done
            # a cancelled task cancels the future it awaited: done, yet the upstream is still at work
            if not done.done() or done.cancelled():
                connection.close()  # client gone or timed out: stop the upstream's work

    def _answer_whole(self, conn: HttpConnection, replica: Replica, exchange: Exchange, request_id: bytes,
                      usage: _Usage | None, sent_s: float, may_retry: bool,
                      trace: RequestTrace | PassThrough | None) -> int:
        status = exchange.status
        body = exchange.body()
        pool = self.pools[replica.pool_name]
        now_s = self.clock()
        if status >= 500:
            # the replica failed: it counts towards ejection
            self._record(pool, replica, sent_s, usage, "status_5xx", trace)
            self.metrics.upstream_errors.labels(pool.name, replica.replica_id, "status_5xx").inc()
            if may_retry and self._may_retry(pool, replica, now_s):
                # nothing has reached the client yet: another replica may answer it well
                raise _RetryElsewhere(UpstreamError(f"upstream replica answered {status}"), "status_5xx")
        else:
            self._record(pool, replica, sent_s, usage, None, trace)
            if usage is not None:
                usage.answered_whole(body)  # its token counts are the trace's too (`RequestTrace.end`)
            elif trace is not None:
                trace.answered(body)
        extra = usage.ticket.response_headers if usage is not None else b""
        scrubber = replica.scrubber
        if scrubber is not None:
            body = scrubber.scrub_answer(status, body)
        content_type = safe_content_type(exchange.content_type, b"application/json", scrubber)
        conn.respond(status, b"content-type: " + content_type + b"\r\nx-request-id: " + request_id + b"\r\n"
                     + extra, body)
        return status


class _StreamRelay:
    """Passes a 200 SSE response on as it arrives, from the upstream protocol's callbacks."""

    __slots__ = ("proxy", "conn", "connection", "request_id", "started", "metrics", "timer", "streaming",
                 "pending", "exchange", "usage", "saw_token", "last_read_s", "client_paused", "scrub", "trace",
                 "sent")

    def __init__(self, proxy: Proxy, conn: HttpConnection, connection: UpstreamConnection, request_id: bytes,
                 started: float, metrics: PoolMetrics, usage: _Usage | None = None,
                 scrubber: SecretScrubber | None = None, trace: RequestTrace | PassThrough | None = None) -> None:
        self.proxy = proxy
        self.conn = conn
        self.connection = connection
        self.request_id = request_id
        self.started = started
        self.metrics = metrics
        self.timer: asyncio.TimerHandle | None = None
        self.streaming = False  # headers sent to the client: errors now go into the stream
        self.saw_token = False  # an event with generated output has passed (see _FIRST_TOKEN)
        self.pending: list[bytes] = []
        self.exchange: Exchange | None = None
        self.usage = usage  # overload control only
        self.last_read_s = started  # the upstream's last read, once streaming: its silence is timed
        self.client_paused = False  # the client reads slower than the upstream writes: not the upstream's silence
        # the replica's key kept out of the stream: body pieces go through it, whole lines come out
        self.scrub = StreamScrubber(scrubber) if scrubber is not None else None
        self.trace = trace  # the request's, for its first token
        self.sent = SentStream()  # what the client got, for a continuation should the upstream break

    def on_head(self, exchange: Exchange) -> None:
        if exchange.status == 200:
            # engines send the head (and a chat stream's role-only event) at once; the client's head
            # waits for the first event with output, so that an upstream silent past the first-byte
            # timeout is still a clean 504, not a broken stream
            self.exchange = exchange
            exchange.sink = self.pending.append if self.scrub is None else self.scrub.pieces.append
        # otherwise an error answer: the handler sends it whole, with its status

    def flush(self, at_end: bool = False) -> None:
        if self.streaming:
            self.last_read_s = self.proxy.clock()  # the upstream is not silent, whatever it sent
        pending = self.pending
        if self.scrub is not None:
            self.scrub.drain(pending, at_end)
        if not pending:
            return
        conn = self.conn
        if not self.saw_token and any(_FIRST_TOKEN.search(piece) for piece in pending):
            self._first_token()
        if not self.streaming:
            if not self.saw_token and not at_end:
                return  # only a role-only opening event so far: held, so silence past the timeout is a clean 504
            self._start(conn)
        held = None
        if pending[-1][-1:] != b"\n" and not at_end:
            # half an event stays here until its end comes: a client never holds a part of one that
            # a failed upstream will not finish (a continuation then splices in at an event's end)
            data = b"".join(pending)
            cut = data.rfind(b"\n") + 1
            held = data[cut:]
            pending[:] = [data[:cut]] if cut else []
            if not pending:
                pending.append(held)
                return
        if self.usage is not None:
            self.usage.stream_pieces(pending)
        conn.stream_chunks(pending)
        sent = self.sent  # kept for a continuation (gateway/failover.py): SentStream.add, inline
        if sent.kept:
            sent += pending
            if len(sent) >= sent.check_at:
                sent.measure()
        pending.clear()
        if held is not None:
            pending.append(held)

    def _first_token(self) -> None:
        """TTFT for the gateway's histogram and the replica's slot limit: the first event with output."""
        self.saw_token = True
        proxy = self.proxy
        now_s = proxy.clock()
        self.metrics.ttft.observe(now_s - self.started)
        if self.trace is not None:
            self.trace.first_token()
        if self.usage is not None:
            proxy.overload.first_token(self.usage.ticket)  # type: ignore[union-attr]

    def _start(self, conn: HttpConnection) -> None:
        self.streaming = True
        proxy = self.proxy
        now_s = proxy.clock()
        exchange = self.exchange
        usage = self.usage
        extra = b""
        if usage is not None:
            extra = usage.ticket.response_headers
        scrubber = self.scrub.scrubber if self.scrub is not None else None
        content_type = safe_content_type(exchange.content_type, b"text/event-stream", scrubber)
        conn.start_stream(200, b"content-type: " + content_type
                          + b"\r\ncache-control: no-cache\r\nx-request-id: " + self.request_id + b"\r\n" + extra)
        conn.on_pause_writing = self._client_paused
        conn.on_resume_writing = self._client_resumed
        # the first-byte timeout is over; from now on the upstream may be silent at most
        # `stream_idle_timeout_s` at a time, within what is left of the request's time
        if self.timer is not None:
            self.timer.cancel()
        self.last_read_s = now_s
        self._arm_silence_timer(now_s)

    def _arm_silence_timer(self, now_s: float) -> None:
        """One timer at a time, re-armed when it fires, not at every read: reads only note their time."""
        settings = self.proxy.settings
        due_s = min(self.started + settings.request_timeout_s, self.last_read_s + settings.stream_idle_timeout_s)
        self.timer = asyncio.get_running_loop().call_later(max(0.0, due_s - now_s), self._check_silence)

    def _check_silence(self) -> None:
        now_s = self.proxy.clock()
        settings = self.proxy.settings
        if self.client_paused:
            self.last_read_s = now_s  # the client's write timeout answers for a client that stopped reading
        over = now_s >= self.started + settings.request_timeout_s
        if over or now_s - self.last_read_s >= settings.stream_idle_timeout_s:
            _time_out(self.connection, self.exchange)
            return
        self._arm_silence_timer(now_s)

    def _client_paused(self) -> None:
        self.client_paused = True
        self.connection.pause_reading()

    def _client_resumed(self) -> None:
        self.client_paused = False
        self.last_read_s = self.proxy.clock()
        self.connection.resume_reading()


class _Usage:
    """Overload control's view of one exchange: the completion tokens to settle, and the prompt's
    tokens (the prefix index's characters a token, `PoolController.on_prompt_usage`)."""

    __slots__ = ("ticket", "events", "reported", "prompt_tokens")

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self.events = 0  # SSE events passed on
        self.reported: int | None = None  # completion_tokens of the upstream's usage, when it sent one
        self.prompt_tokens: int | None = None  # prompt_tokens of the upstream's usage, when it sent one

    def stream_pieces(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            self.events += piece.count(b"data:")
            # find(), not `in`: bytes' `in` first tries its needle as an integer, raising and clearing
            # a TypeError on every streamed piece (twice find's cost, measured on Python 3.11)
            if piece.find(b'"usage"') >= 0:
                self._read_usage(piece)

    def _read_usage(self, text: bytes) -> None:
        found = _COMPLETION_TOKENS.search(text)
        if found is not None:
            self.reported = int(found.group(1))
            # its neighbour in the same usage object (engines order the two either way): not the whole
            # answer scanned again (a start before the text's is its start, as `re` takes it)
            prompt = _PROMPT_TOKENS.search(text, found.start() - _USAGE_REACH, found.end() + _USAGE_REACH)
            if prompt is not None:
                self.prompt_tokens = int(prompt.group(1))

    answered_whole = _read_usage  # a whole answer: its usage read at once (no frame around the call)

    def completion_tokens(self) -> int:
        if self.reported is not None:
            return self.reported
        # one event a token, less the closing `[DONE]`: an estimate when the upstream sent no usage
        return max(0, self.events - 1)


class _RetryElsewhere(Exception):
    """Nothing reached the client and the replica failed (no answer, or a 5xx): another replica may
    take it. `reason` labels the retry metric."""

    def __init__(self, error: UpstreamError, reason: str) -> None:
        self.error = error
        self.reason = reason


def _time_out(connection: UpstreamConnection, exchange: Exchange) -> None:
    exchange.fail(UpstreamFailure("timed out", before_first_byte=not exchange.got_bytes, timed_out=True))
    connection.close()


def _client_timeout_s(header: bytes | None) -> float | None:
    """The client's `x-request-timeout` (seconds): a deadline for its wait in the queue."""
    if header is None:
        return None
    try:
        timeout_s = float(header)
    except ValueError:
        raise InvalidRequestError("x-request-timeout must be a number of seconds", param="x-request-timeout") from None
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise InvalidRequestError("x-request-timeout must be a positive number of seconds", param="x-request-timeout")
    return timeout_s
