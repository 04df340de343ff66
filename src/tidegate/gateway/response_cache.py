"""The exact response cache and single-flight coalescing, live: memory tier -> Redis tier -> upstream.

Per request of a pool with `response_cache` (config): `cache_mode` says whether it may be cached
(deterministic, or the pool caches samples too; `Cache-Control: no-store` / `no-cache`; a tenant's
opt-out). A cacheable request is answered from the in-process tier, else from Redis (shared by every
gateway), else it joins the identical request already in flight, else it leads a new flight: one
upstream request whose answer every member receives as it arrives (streams fanned out event by
event), and which is stored when it ends complete. `x-tidegate-cache` says which: hit, miss,
coalesced, bypass.

A flight runs in a task of its own, not in its leader's handler, so that the leader's disconnect
does not fail the followers; it is cancelled (closing the upstream request) only when every member
has gone. Cache hits and coalesced followers take no replica and no rate-limit budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tidegate.cache.response import CacheKeys, CachedAnswer, CacheMode, MemoryTier, cache_mode, request_keys
from tidegate.gateway.http import HttpConnection
from tidegate.policy.degradation import DEGRADATION_HEADER

__all__ = ["CacheSettings", "PoolCacheSettings", "RedisTier", "ResponseCache", "replay", "CACHE_HEADER"]

log = logging.getLogger("tidegate.cache")

CACHE_HEADER = b"x-tidegate-cache"
DEGRADATION_HEADER_LINE = DEGRADATION_HEADER.encode() + b": "

# (conn, request_id, cached_fallback) -> (status, replica_id): the proxy's way to the upstream
Forward = Callable[[Any, bytes, "CachedAnswer | None"], Awaitable[tuple[int, "str | None"]]]


class CacheSettings:
    __slots__ = ("memory_bytes", "redis_url", "ttl_s", "redis_timeout_s", "redis_retry_s", "key_prefix")

    def __init__(self, memory_bytes: int = 64 << 20, redis_url: str | None = None, ttl_s: float = 3600.0,
                 redis_timeout_s: float = 0.05, redis_retry_s: float = 5.0, key_prefix: str = "tidegate:rc:") -> None:
        self.memory_bytes = memory_bytes
        self.redis_url = redis_url
        self.ttl_s = ttl_s
        # a Redis slower than this is a miss: the cache must never make a request slower than the engine
        self.redis_timeout_s = redis_timeout_s
        self.redis_retry_s = redis_retry_s  # after a Redis failure, the tier is skipped this long
        self.key_prefix = key_prefix


class PoolCacheSettings:
    __slots__ = ("cache_sampled", "coalesce")

    def __init__(self, cache_sampled: bool = False, coalesce: bool = True) -> None:
        self.cache_sampled = cache_sampled  # also cache requests that are not deterministic (opt-in)
        self.coalesce = coalesce  # identical in-flight requests share one upstream request


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("tidegate_response_cache_requests", "Requests of pools with a response cache, by "
                                "outcome: hit_memory, hit_redis, miss, coalesced, bypass", ["pool", "result"], registry=r)
        self.stores = Counter("tidegate_response_cache_stores", "Complete answers stored", ["pool"], registry=r)
        self.evictions = Counter("tidegate_response_cache_evictions", "Answers evicted from the memory tier",
                                 registry=r)
        self.memory_bytes = Gauge("tidegate_response_cache_memory_bytes", "Bytes held by the memory tier",
                                  registry=r)
        self.redis_up = Gauge("tidegate_response_cache_redis_up", "1 while the Redis tier answers; 0 while the "
                              "gateway goes on without it", registry=r)
        self.redis_errors = Counter("tidegate_response_cache_redis_errors", "Failed or slow Redis operations",
                                    ["op"], registry=r)


class RedisTier:
    """Answers shared by every gateway, with a TTL. Any failure or a reply slower than the timeout
    counts as a miss and takes the tier out for `redis_retry_s`: the gateway serves on without it."""

    def __init__(self, settings: CacheSettings, metrics: CacheMetrics, clock: Callable[[], float]) -> None:
        import redis.asyncio  # only gateways configured with Redis need the client

        self._client = redis.asyncio.Redis.from_url(settings.redis_url, socket_connect_timeout=1.0)
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._down_until_s = 0.0
        metrics.redis_up.set(1)

    async def get(self, key: str) -> CachedAnswer | None:
        if self._clock() < self._down_until_s:
            return None
        try:
            data = await asyncio.wait_for(self._client.get(self._settings.key_prefix + key),
                                          self._settings.redis_timeout_s)
        except Exception as error:  # noqa: BLE001 - any Redis trouble is a miss, never a failed request
            self._failed("get", error)
            return None
        self._recovered()
        if data is None:
            return None
        try:
            return CachedAnswer.decode(data)
        except ValueError:
            return None  # written by another version: a miss, overwritten on store

    async def put(self, keys: CacheKeys, entry: CachedAnswer) -> None:
        if self._clock() < self._down_until_s:
            return
        prefix, ttl_ms = self._settings.key_prefix, int(self._settings.ttl_s * 1000)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.set(prefix + keys.exact, entry.encode(), px=ttl_ms)
                pipe.set(prefix + "loose:" + keys.loose, keys.exact, px=ttl_ms)
                await asyncio.wait_for(pipe.execute(), max(1.0, 10 * self._settings.redis_timeout_s))
        except Exception as error:  # noqa: BLE001
            self._failed("set", error)
            return
        self._recovered()

    def _failed(self, op: str, error: BaseException) -> None:
        self._metrics.redis_errors.labels(op).inc()
        if self._clock() >= self._down_until_s:
            log.warning("response cache: Redis unavailable (%s: %r); serving without it for %.0f s",
                        op, error, self._settings.redis_retry_s)
        self._down_until_s = self._clock() + self._settings.redis_retry_s
        self._metrics.redis_up.set(0)

    def _recovered(self) -> None:
        if self._down_until_s:
            log.info("response cache: Redis answers again")
            self._down_until_s = 0.0
        self._metrics.redis_up.set(1)

    async def close(self) -> None:
        await self._client.aclose()


def _rewrite_head(headers: bytes, leader_id: bytes, request_id: bytes, cache_value: bytes) -> bytes:
    if request_id != leader_id:
        headers = headers.replace(b"x-request-id: " + leader_id + b"\r\n", b"x-request-id: " + request_id + b"\r\n")
    return headers + CACHE_HEADER + b": " + cache_value + b"\r\n"


class _Member:
    __slots__ = ("conn", "request_id", "cache_value")

    def __init__(self, conn: HttpConnection, request_id: bytes, cache_value: bytes) -> None:
        self.conn = conn
        self.request_id = request_id
        self.cache_value = cache_value


class _Flight:
    """One upstream request and everyone waiting for its answer. To the proxy it is the client
    connection (`respond`, `start_stream`, `stream_chunks`, `end_stream`): it records what is
    written and writes it to each member, each with its own request id."""

    def __init__(self, leader_id: bytes) -> None:
        self.leader_id = leader_id
        self.members: list[_Member] = []
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
    def join(self, member: _Member) -> None:
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

    def leave(self, member: _Member) -> None:
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


def replay(conn: HttpConnection, entry: CachedAnswer, request_id: bytes, extra_headers: bytes = b"") -> int:
    """Answers from a cached entry: a stream piece by piece as first sent, else the whole body."""
    head = b"content-type: " + entry.content_type + b"\r\nx-request-id: " + request_id + b"\r\n" + extra_headers
    if not entry.streamed:
        conn.respond(200, head, entry.pieces[0])
        return 200
    conn.start_stream(200, head + b"cache-control: no-cache\r\n")
    conn.stream_chunks(list(entry.pieces))
    conn.end_stream()
    return 200


class ResponseCache:
    """The cache of every pool configured with one; the proxy sends those pools' requests through
    `serve`."""

    def __init__(self, settings: CacheSettings, pools: dict[str, PoolCacheSettings], registry: CollectorRegistry,
                 opted_out_tenants: frozenset[str] = frozenset(), clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.pools = pools
        self.metrics = CacheMetrics(registry)
        self.memory = MemoryTier(settings.memory_bytes)
        self.redis = RedisTier(settings, self.metrics, clock) if settings.redis_url else None
        self._opted_out = opted_out_tenants
        self._flights: dict[str, _Flight] = {}
        self._writes: set[asyncio.Task[None]] = set()  # Redis stores in the background
        self._evictions_seen = 0
        self._results = {pool: {result: self.metrics.requests.labels(pool, result) for result in
                                ("hit_memory", "hit_redis", "miss", "coalesced", "bypass")} for pool in pools}

    def scope(self, tenant: str | None, authorization: bytes | None) -> str:
        """Whose answers a request may see: its tenant, or (no tenants configured) its API key."""
        if tenant is not None:
            return "tenant:" + tenant
        return "key:" + hashlib.sha256(authorization or b"").hexdigest()[:32]

    async def serve(self, conn: HttpConnection, pool: str, endpoint: str, body: dict[str, Any], request_id: bytes,
                    tenant: str | None, authorization: bytes | None, cache_control: bytes | None,
                    forward: Forward) -> tuple[int, str | None, bool]:
        """Answers one request: (status, replica, whether this request's own upstream call answered it)."""
        settings = self.pools[pool]
        results = self._results[pool]
        allowed = tenant is None or tenant not in self._opted_out
        mode = cache_mode(body, cache_control, cache_sampled=settings.cache_sampled, tenant_allows=allowed)
        keys = request_keys(self.scope(tenant, authorization), endpoint, body)
        if mode is CacheMode.BYPASS:
            results["bypass"].inc()
            # a sampled request still gets a cached answer from the ladder when overload sheds it
            status, replica_id = await forward(_Marked(conn, b"bypass"), request_id, self.memory.peek_loose(keys.loose))
            return status, replica_id, True
        if mode is CacheMode.USE:
            entry = self.memory.touch(keys.exact)
            if entry is not None:
                results["hit_memory"].inc()
                return replay(conn, entry, request_id, CACHE_HEADER + b": hit\r\n"), None, False
            if self.redis is not None:
                entry = await self.redis.get(keys.exact)
                if entry is not None:
                    results["hit_redis"].inc()
                    self._keep(keys, entry)
                    return replay(conn, entry, request_id, CACHE_HEADER + b": hit\r\n"), None, False
        flight = self._flights.get(keys.exact) if settings.coalesce else None
        if flight is not None and not flight.abandoned:
            results["coalesced"].inc()
            status, _ = await self._follow(flight, _Member(conn, request_id, b"coalesced"))
            return status, None, False
        results["miss"].inc()
        status, replica_id = await self._lead(pool, keys, conn, request_id, forward, settings.coalesce)
        return status, replica_id, True

    def loose_answer(self, tenant: str | None, authorization: bytes | None, endpoint: str,
                     body: dict[str, Any]) -> CachedAnswer | None:
        """An answer to the same question for the cached-answer rung (memory tier only: no wait)."""
        return self.memory.peek_loose(request_keys(self.scope(tenant, authorization), endpoint, body).loose)

    async def _lead(self, pool: str, keys: CacheKeys, conn: HttpConnection, request_id: bytes, forward: Forward,
                    shared: bool) -> tuple[int, str | None]:
        flight = _Flight(request_id)
        if shared:
            self._flights[keys.exact] = flight
        flight.task = asyncio.get_running_loop().create_task(self._fly(pool, keys, flight, forward))
        return await self._follow(flight, _Member(conn, request_id, b"miss"))

    async def _fly(self, pool: str, keys: CacheKeys, flight: _Flight, forward: Forward) -> tuple[int, str | None]:
        try:
            # under overload the ladder may answer with an earlier sample of the same question
            status, replica_id = await forward(flight, flight.leader_id, self.memory.peek_loose(keys.loose))
        finally:
            if self._flights.get(keys.exact) is flight:
                del self._flights[keys.exact]
        complete = status == 200 and flight.status == 200 and (flight.stream_ended or not flight.streamed)
        # a degraded answer (a lighter pool's, or the cache's own) is not this request's answer
        degraded = replica_id is None or DEGRADATION_HEADER_LINE in flight.head
        if complete and not degraded:
            self._keep(keys, flight.answer())
            self.metrics.stores.labels(pool).inc()
        return status, replica_id

    async def _follow(self, flight: _Flight, member: _Member) -> tuple[int, str | None]:
        flight.join(member)
        assert flight.task is not None
        try:
            return await asyncio.shield(flight.task)
        finally:
            if member in flight.members:
                flight.leave(member)

    def _keep(self, keys: CacheKeys, entry: CachedAnswer) -> None:
        """Stores an answer in memory, and in Redis in the background."""
        memory = self.memory
        memory.put(keys, entry)
        metrics = self.metrics
        if memory.evictions > self._evictions_seen:
            metrics.evictions.inc(memory.evictions - self._evictions_seen)
            self._evictions_seen = memory.evictions
        metrics.memory_bytes.set(memory.bytes)
        if self.redis is not None:
            task = asyncio.get_running_loop().create_task(self.redis.put(keys, entry))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def close(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if self.redis is not None:
            await self.redis.close()


class _Marked:
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
