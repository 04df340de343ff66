"""Active health checks: GET each replica's health URL every interval; read engine load gauges.

Replicas not yet seen healthy are polled faster, so a starting pool turns ready quickly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import aiohttp

from tidegate.types import ReplicaHealth, ReplicaLoad

__all__ = ["CheckedReplica", "HealthChecker", "parse_engine_load"]

log = logging.getLogger("tidegate.health")

_STARTUP_INTERVAL_S = 0.25


class CheckedReplica(Protocol):
    replica_id: str
    health: ReplicaHealth
    load: ReplicaLoad
    health_url: str | None
    scrape_url: str | None


def parse_engine_load(text: str) -> ReplicaLoad:
    """The engine's Prometheus gauges -> ReplicaLoad; absent gauges read as zero."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tidegate_engine_"):
            name, _, value = line.partition(" ")
            try:
                values[name.split("{", 1)[0]] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return ReplicaLoad(
        running_sequences=int(values.get("tidegate_engine_running_sequences", 0)),
        waiting_sequences=int(values.get("tidegate_engine_waiting_sequences", 0)),
        kv_cache_usage=values.get("tidegate_engine_kv_cache_usage", 0.0),
    )


class HealthChecker:
    def __init__(self, replicas: list[CheckedReplica], interval_s: float, timeout_s: float,
                 on_change: Callable[[], None]) -> None:
        self._replicas = [r for r in replicas if r.health_url]
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._on_change = on_change  # called when a replica's health changed (wake queued requests)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch(replica)) for replica in self._replicas]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def check_once(self, replica: CheckedReplica) -> None:
        assert self._session is not None and replica.health_url
        healthy = False
        try:
            async with self._session.get(replica.health_url) as response:
                healthy = response.status == 200
            if healthy and replica.scrape_url:
                async with self._session.get(replica.scrape_url) as response:
                    if response.status == 200:
                        replica.load = parse_engine_load(await response.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        new_health = ReplicaHealth.HEALTHY if healthy else ReplicaHealth.UNHEALTHY
        if new_health is not replica.health:
            if replica.health is not ReplicaHealth.UNKNOWN or healthy:
                log.info("replica health changed", extra={"fields": {
                    "replica": replica.replica_id, "from": replica.health.value, "to": new_health.value}})
            if not (replica.health is ReplicaHealth.UNKNOWN and not healthy):
                replica.health = new_health  # a starting replica stays UNKNOWN until its first success
                self._on_change()

    async def _watch(self, replica: CheckedReplica) -> None:
        while True:
            await self.check_once(replica)
            starting = replica.health is ReplicaHealth.UNKNOWN
            await asyncio.sleep(min(_STARTUP_INTERVAL_S, self._interval_s) if starting else self._interval_s)
