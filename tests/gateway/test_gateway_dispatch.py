"""Late binding in ModelPool: requests wait gateway-side and leave only when a replica has a free slot."""

from __future__ import annotations

import asyncio

import pytest

from tidegate.errors import OverloadedError
from tidegate.gateway.dispatch import ModelPool, Replica
from tidegate.gateway.upstream import ConnectionPool, Endpoint
from tidegate.policy.health import BreakerPolicy
from tidegate.types import ReplicaHealth

_ENDPOINT = Endpoint("127.0.0.1", 9, False, b"/v1", b"127.0.0.1:9")


def _replica(name: str, slots: int = 1, health: ReplicaHealth = ReplicaHealth.HEALTHY) -> Replica:
    replica = Replica(name, "pool", ConnectionPool(_ENDPOINT, 1.0), slots, "m", None, health_url=None)
    replica.health = health
    return replica


def _pool(*replicas: Replica, max_queued: int = 10, queue_timeout_s: float = 5.0) -> ModelPool:
    return ModelPool("pool", list(replicas), BreakerPolicy(), max_queued, queue_timeout_s, retry_after_s=2)


async def test_free_slot_is_taken_at_once() -> None:
    pool = _pool(_replica("a"))
    replica = await pool.acquire(0.0)
    assert replica.replica_id == "a" and replica.outstanding == 1


async def test_full_pool_makes_request_wait_until_release() -> None:
    pool = _pool(_replica("a"))
    first = await pool.acquire(0.0)
    waiting = asyncio.ensure_future(pool.acquire(0.0))
    await asyncio.sleep(0)
    assert not waiting.done() and len(pool.queue) == 1
    pool.release(first, 0.0)
    assert (await waiting) is first
    assert first.outstanding == 1


async def test_waiting_requests_go_before_new_ones() -> None:
    pool = _pool(_replica("a"))
    first = await pool.acquire(0.0)
    waiting = asyncio.ensure_future(pool.acquire(0.0))
    await asyncio.sleep(0)
    first.outstanding -= 1  # a slot frees without a release call: a newcomer must still queue
    assert pool.try_acquire(0.0) is None
    waiting.cancel()


async def test_queue_timeout_is_503() -> None:
    pool = _pool(_replica("a"), queue_timeout_s=0.01)
    await pool.acquire(0.0)
    with pytest.raises(OverloadedError) as caught:
        await pool.acquire(0.0)
    assert caught.value.code == "queue_timeout" and caught.value.retry_after_s == 2
    assert len(pool.queue) == 0


async def test_no_routable_replica_fails_at_once() -> None:
    pool = _pool(_replica("a", health=ReplicaHealth.UNHEALTHY))
    with pytest.raises(OverloadedError) as caught:
        await pool.acquire(0.0)
    assert caught.value.code == "no_replica"


async def test_full_queue_rejects() -> None:
    pool = _pool(_replica("a"), max_queued=0)
    await pool.acquire(0.0)
    with pytest.raises(OverloadedError) as caught:
        await pool.acquire(0.0)
    assert caught.value.code == "queue_full"


async def test_cancelled_waiter_leaves_the_queue() -> None:
    pool = _pool(_replica("a"))
    await pool.acquire(0.0)
    waiting = asyncio.ensure_future(pool.acquire(0.0))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.sleep(0)
    assert len(pool.queue) == 0


async def test_waiter_is_failed_when_last_replica_goes_down() -> None:
    replica = _replica("a")
    pool = _pool(replica)
    await pool.acquire(0.0)
    waiting = asyncio.ensure_future(pool.acquire(0.0))
    await asyncio.sleep(0)
    replica.health = ReplicaHealth.UNHEALTHY
    pool.dispatch_waiting(0.0)
    with pytest.raises(OverloadedError):
        await waiting


async def test_slot_on_second_replica_goes_to_waiter_when_it_turns_healthy() -> None:
    busy, starting = _replica("busy"), _replica("starting", health=ReplicaHealth.UNKNOWN)
    pool = _pool(busy, starting)
    await pool.acquire(0.0)
    waiting = asyncio.ensure_future(pool.acquire(0.0))
    await asyncio.sleep(0)
    starting.health = ReplicaHealth.HEALTHY
    pool.dispatch_waiting(0.0)
    assert (await waiting) is starting


async def test_least_outstanding_replica_is_chosen() -> None:
    pool = _pool(_replica("a", slots=4), _replica("b", slots=4))
    first = await pool.acquire(0.0)
    second = await pool.acquire(0.0)
    assert {first.replica_id, second.replica_id} == {"a", "b"}
