"""The exact response cache and single-flight coalescing, live: memory tier -> Redis tier -> upstream.

Per request of a pool with `response_cache` (config): `cache_mode` says whether it may be cached
(deterministic, or sampled and opted in by the pool, the tenant or the client's `x-tidegate-cache:
use`; `Cache-Control: no-store` / `no-cache`; a tenant's opt-out). A cacheable request is answered
from the in-process tier, else from Redis (shared by every gateway), else it joins the identical
request already in flight, else it leads a new flight: one upstream request whose answer every
member receives as it arrives (streams fanned out event by event), and which is stored when it ends
complete. `x-tidegate-cache` says which: hit, miss, coalesced, bypass.

A flight runs in a task of its own, not in its leader's handler, so that the leader's disconnect
does not fail the followers; it is cancelled (closing the upstream request) only when every member
has gone. Cache hits and coalesced followers take no replica and no rate-limit budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from tidegate.cache.response import (CacheKeys, CachedAnswer, CacheMode, MemoryTier, SemanticQuestion, cache_mode,
                                     request_keys, semantic_question)
from tidegate.cache.semantic import SemanticHit
from tidegate.gateway.cache_tiers import CacheMetrics, CacheSettings, PoolCacheSettings, RedisTier
from tidegate.gateway.http import HttpConnection
from tidegate.gateway.overload import DegradedReplyError
from tidegate.gateway.semantic_cache import SemanticCache, decode_entry, encode_entry
from tidegate.gateway.single_flight import CACHE_HEADER, Flight, Marked, Member
from tidegate.policy.degradation import DEGRADATION_HEADER, Rung

__all__ = ["CacheSettings", "PoolCacheSettings", "ResponseCache", "replay", "CACHE_HEADER"]

log = logging.getLogger("tidegate.cache")

DEGRADATION_HEADER_LINE = DEGRADATION_HEADER.encode() + b": "
_LOOSE = "loose:"  # semantic entries indexed in their loose scope, for the cached-answer rung

# (conn, request_id, cached_fallback) -> (status, replica_id): the proxy's way to the upstream
Forward = Callable[[Any, bytes, "CachedAnswer | None"], Awaitable[tuple[int, "str | None"]]]


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
                 opted_out_tenants: frozenset[str] = frozenset(), clock: Callable[[], float] = time.monotonic,
                 sampled_tenants: frozenset[str] = frozenset(),
                 semantic: dict[str, SemanticCache] | None = None) -> None:
        self.settings = settings
        self.pools = pools
        self.semantic = semantic or {}  # pools with a semantic layer
        self.metrics = CacheMetrics(registry)
        self.memory = MemoryTier(settings.memory_bytes)
        self.redis = RedisTier(settings, self.metrics, clock) if settings.redis_url else None
        self._opted_out = opted_out_tenants
        self._sampled_tenants = sampled_tenants  # their sampled requests are cached too (`response_cache: sampled`)
        self._flights: dict[str, Flight] = {}
        self._writes: set[asyncio.Task[None]] = set()  # Redis stores in the background
        self._evictions_seen = 0
        results = ("hit_memory", "hit_redis", "hit_semantic", "miss", "coalesced", "bypass")
        self._results = {pool: {result: self.metrics.requests.labels(pool, result) for result in results}
                         for pool in pools}

    def scope(self, tenant: str | None, authorization: bytes | None) -> str:
        """Whose answers a request may see: its tenant, or (no tenants configured) its API key."""
        if tenant is not None:
            return "tenant:" + tenant
        return "key:" + hashlib.sha256(authorization or b"").hexdigest()[:32]

    async def serve(self, conn: HttpConnection, pool: str, endpoint: str, body: dict[str, Any], request_id: bytes,
                    tenant: str | None, authorization: bytes | None, cache_control: bytes | None,
                    forward: Forward, opt_in: bool = False) -> tuple[int, str | None, bool]:
        """Answers one request: (status, replica, whether this request's own upstream call answered it).
        `opt_in`: the client sent `x-tidegate-cache: use`, so its sampled request is cached too."""
        settings = self.pools[pool]
        results = self._results[pool]
        allowed = tenant is None or tenant not in self._opted_out
        sampled = settings.cache_sampled or opt_in or (tenant is not None and tenant in self._sampled_tenants)
        mode = cache_mode(body, cache_control, cache_sampled=sampled, tenant_allows=allowed)
        scope = self.scope(tenant, authorization)
        keys = request_keys(scope, endpoint, body)
        semantic = self.semantic.get(pool)
        asked = _Asked(semantic, semantic_question(scope, endpoint, body)) if semantic is not None else None
        try:
            if mode is CacheMode.BYPASS:
                results["bypass"].inc()
                # a sampled request still gets a cached answer from the ladder when overload sheds it
                status, replica_id = await forward(Marked(conn, b"bypass"), request_id,
                                                   self.memory.peek_loose(keys.loose))
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
                status, _ = await self._follow(flight, Member(conn, request_id, b"coalesced"))
                return status, None, False
            if asked is not None and mode is CacheMode.USE:
                served = await self._semantic_hit(asked, conn, request_id, rung=False)
                if served:
                    results["hit_semantic"].inc()
                    return 200, None, False
            results["miss"].inc()
            status, replica_id = await self._lead(pool, keys, conn, request_id, forward, settings.coalesce, asked)
            return status, replica_id, True
        except DegradedReplyError as refusal:
            # the last rung before the preset reply: a cached answer to a question like it
            if asked is not None and await self._semantic_hit(asked, conn, request_id, rung=True,
                                                              degraded=refusal.headers):
                return 200, None, False
            raise

    async def _semantic_hit(self, asked: _Asked, conn: HttpConnection, request_id: bytes, *, rung: bool,
                            degraded: bytes = b"") -> bool:
        """Answers from the answer of the most similar question cached, if one is close enough."""
        semantic = asked.cache
        if asked.question is None or (rung and semantic.settings.rung_threshold is None):
            return False
        vector = await asked.vector()
        if vector is None:
            return False
        asked_question = asked.question
        if rung:  # any answer to a question like it, whatever its sampling parameters
            hit = semantic.lookup(asked_question.loose_scope, vector, asked_question.text, rung=True)
            if hit is not None:
                hit = SemanticHit(hit.entry_key.removeprefix(_LOOSE), hit.similarity)
        else:
            hit = semantic.lookup(asked_question.scope, vector, asked_question.text)
        entry = None
        if hit is not None:
            entry = self.memory.touch(hit.entry_key)
            if entry is None and self.redis is not None:
                entry = await self.redis.get(hit.entry_key)
        if hit is None or entry is None:
            if not rung:
                semantic.missed()
            return False
        semantic.served(hit, rung=rung)
        # the threshold it passed beside its similarity, so a client can tell how close a hit had to be
        threshold = semantic.settings.rung_threshold if rung else semantic.settings.threshold
        assert threshold is not None  # a rung lookup without one returned above
        similarity = b"x-tidegate-cache-similarity: %.3f\r\nx-tidegate-cache-threshold: %.3f\r\n" % (
            hit.similarity, threshold)
        if rung:
            head = degraded.replace(DEGRADATION_HEADER_LINE + Rung.PRESET_REPLY.value.encode(),
                                    DEGRADATION_HEADER_LINE + Rung.CACHED_ANSWER.value.encode())
        else:
            head = CACHE_HEADER + b": hit\r\n"
        replay(conn, entry, request_id, head + similarity)
        return True

    async def _lead(self, pool: str, keys: CacheKeys, conn: HttpConnection, request_id: bytes, forward: Forward,
                    shared: bool, asked: _Asked | None) -> tuple[int, str | None]:
        flight = Flight(request_id)
        if shared:
            self._flights[keys.exact] = flight
        flight.task = asyncio.get_running_loop().create_task(self._fly(pool, keys, flight, forward, asked))
        return await self._follow(flight, Member(conn, request_id, b"miss"))

    async def _fly(self, pool: str, keys: CacheKeys, flight: Flight, forward: Forward,
                   asked: _Asked | None) -> tuple[int, str | None]:
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
            if asked is not None and asked.question is not None and asked.embedded is not None:
                self._index_question(pool, asked, keys.exact)
        return status, replica_id

    def _index_question(self, pool: str, asked: _Asked, entry_key: str) -> None:
        """Indexes a stored answer's question twice: in its exact scope, and in its loose scope
        (no sampling parameters) for the cached-answer rung."""
        assert asked.question is not None and asked.embedded is not None
        question = asked.question
        for scope, key in ((question.scope, entry_key), (question.loose_scope, _LOOSE + entry_key)):
            entry = asked.cache.add(scope, asked.embedded, question.text, key)
            if entry is not None and self.redis is not None:
                self._background(self.redis.put_raw(f"sem:{pool}:{key}", encode_entry(entry)))

    async def load_semantic(self) -> None:
        """Loads the semantic entries other gateways (or this one before a restart) kept in Redis."""
        if self.redis is None:
            return
        for pool, semantic in self.semantic.items():
            raws = await self.redis.scan_values(f"sem:{pool}:", semantic.settings.max_entries)
            entries = [entry for entry in map(decode_entry, raws) if entry is not None]
            if entries:
                semantic.restore(entries)
                log.info("semantic cache: %d entries of pool %s loaded from Redis", len(entries), pool)

    async def _follow(self, flight: Flight, member: Member) -> tuple[int, str | None]:
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
            self._background(self.redis.put(keys, entry))

    def _background(self, write: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(write)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def close(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        for semantic in self.semantic.values():
            await semantic.close()
        if self.redis is not None:
            await self.redis.close()


class _Asked:
    """A request's question for the semantic cache, embedded at most once, when first needed."""

    __slots__ = ("cache", "question", "embedded", "_tried")

    def __init__(self, cache: SemanticCache, question: SemanticQuestion | None) -> None:
        self.cache = cache
        self.question = question  # None: not a chat question
        self.embedded: np.ndarray | None = None
        self._tried = False

    async def vector(self) -> np.ndarray | None:
        if not self._tried and self.question is not None:
            self._tried = True
            self.embedded = await self.cache.embed(self.question.text)
        return self.embedded
