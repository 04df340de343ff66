"""The response cache's settings, metrics and Redis tier (shared by every gateway, with a TTL)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from tidegate.cache.response import CacheKeys, CachedAnswer

__all__ = ["CacheSettings", "PoolCacheSettings", "CacheMetrics", "RedisTier"]

log = logging.getLogger("tidegate.cache")


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
                                "outcome: hit_memory, hit_redis, hit_semantic, miss, coalesced, bypass",
                                ["pool", "result"], registry=r)
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

    async def put_raw(self, key: str, value: bytes) -> None:
        if self._clock() < self._down_until_s:
            return
        try:
            await asyncio.wait_for(self._client.set(self._settings.key_prefix + key, value,
                                                    px=int(self._settings.ttl_s * 1000)),
                                   max(1.0, 10 * self._settings.redis_timeout_s))
        except Exception as error:  # noqa: BLE001
            self._failed("set", error)
            return
        self._recovered()

    async def scan_values(self, prefix: str, limit: int) -> list[bytes]:
        """Up to `limit` values of the keys under `prefix` (at start: no timeout but the client's)."""
        values: list[bytes] = []
        try:
            keys = []
            async for key in self._client.scan_iter(match=self._settings.key_prefix + prefix + "*", count=1000):
                keys.append(key)
                if len(keys) >= limit:
                    break
            for start in range(0, len(keys), 500):
                values += [v for v in await self._client.mget(keys[start:start + 500]) if v is not None]
        except Exception as error:  # noqa: BLE001
            self._failed("scan", error)
        return values

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
