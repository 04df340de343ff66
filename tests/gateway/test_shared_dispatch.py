"""Active-active dispatch through a real `redis-server`: gateways split each replica's slots
(`gateway.shared_dispatch`), driven heartbeat by heartbeat with real pool controllers."""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import start_redis  # noqa: E402

from tidegate.gateway.shared_dispatch import SharedDispatch, SharedDispatchSettings  # noqa: E402
from tidegate.policy.pool import PoolController, PoolReplica  # noqa: E402
from tidegate.policy.tiers import default_tiers  # noqa: E402
from tidegate.types import PoolRequest, ReplicaLoad  # noqa: E402

SLOTS = 8


@pytest.fixture(scope="module")
def redis_server() -> Iterator[tuple[object, str]]:
    process, url = start_redis()
    try:
        yield process, url
    finally:
        process.stop()


class _Replica:
    def __init__(self, replica_id: str, slot_limit: int) -> None:
        self.replica_id = replica_id
        self.slot_limit = slot_limit
        self.load = ReplicaLoad()


class _Pool:
    def __init__(self, replicas: list[_Replica]) -> None:
        self.replicas = replicas


class _Body:
    """A pool as `SharedDispatch` sees it: the live body's controller, replicas and `wake`."""

    def __init__(self, replica_ids: tuple[str, ...] = ("r0", "r1")) -> None:
        self.pool = _Pool([_Replica(rid, SLOTS) for rid in replica_ids])
        self.controller = PoolController([PoolReplica(rid, max_requests=SLOTS) for rid in replica_ids],
                                         default_tiers())
        self.woken = 0
        self._ids = itertools.count()

    def wake(self, now_s: float) -> None:
        self.woken += 1

    def queue(self, count: int) -> None:
        for _ in range(count):
            self.controller.on_arrival(0.0, PoolRequest(f"q{next(self._ids)}", 0.0, "t", "standard", 10, 10))


_prefixes = itertools.count()


def gateway(url: str, name: str, prefix: str, body: _Body | None = None, *, gateway_count: int = 1,
            clock: list[float] | None = None, member_ttl_s: float = 0.6) -> tuple[SharedDispatch, _Body]:
    body = body or _Body()
    settings = SharedDispatchSettings(url, gateway_id=name, heartbeat_s=0.1, member_ttl_s=member_ttl_s,
                                      gateway_count=gateway_count, key_prefix=prefix)
    now = clock if clock is not None else None
    dispatch = SharedDispatch(settings, {"m": body}, CollectorRegistry(),
                              **({"clock": lambda: now[0]} if now is not None else {}))
    return dispatch, body


def fresh_prefix() -> str:
    return f"test{next(_prefixes)}:"


async def rounds(*gateways: SharedDispatch, count: int = 3) -> None:
    """Heartbeats in turn: a share computed in one round is granted in the next, once the others
    have given the slots back in theirs."""
    for _ in range(count):
        for one in gateways:
            await one.heartbeat()


async def two_busy_gateways(url: str) -> tuple[tuple[SharedDispatch, _Body], tuple[SharedDispatch, _Body]]:
    """Two gateways that joined, then each got 30 requests to send: settled after a few rounds."""
    prefix = fresh_prefix()
    (a, body_a), (b, body_b) = gateway(url, "a", prefix), gateway(url, "b", prefix)
    await rounds(a, b)
    body_a.queue(30)
    body_b.queue(30)
    await rounds(a, b)
    return (a, body_a), (b, body_b)


def grants(body: _Body) -> tuple[int, int]:
    return body.controller.slot_grant("r0"), body.controller.slot_grant("r1")


def test_a_gateway_alone_keeps_every_slot(redis_server: tuple[object, str]) -> None:
    async def scenario() -> None:
        one, body = gateway(redis_server[1], "a", fresh_prefix())
        body.queue(30)
        await one.heartbeat()
        assert grants(body) == (SLOTS, SLOTS) and one.members == 1
        await one.close()

    asyncio.run(scenario())


def test_gateways_with_queues_split_each_replica_equally(redis_server: tuple[object, str]) -> None:
    async def scenario() -> None:
        prefix = fresh_prefix()
        (a, body_a), (b, body_b) = gateway(redis_server[1], "a", prefix), gateway(redis_server[1], "b", prefix)
        await rounds(a, b)  # both start: `a` first took every slot, then gave half back
        assert grants(body_a) == grants(body_b) == (SLOTS // 2, SLOTS // 2)
        body_a.queue(30)
        body_b.queue(30)
        await rounds(a, b)
        assert grants(body_a) == grants(body_b) == (SLOTS // 2, SLOTS // 2)
        assert a.members == b.members == 2
        # what each controller sent: its grant, not the replica's whole batch
        assert body_a.controller.held("r0") == body_b.controller.held("r0") == SLOTS // 2
        assert not body_a.controller.on_capacity(0.1).assignments
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_a_gateway_asking_little_leaves_the_rest_to_the_busy_one(redis_server: tuple[object, str]) -> None:
    async def scenario() -> None:
        prefix = fresh_prefix()
        (a, body_a), (b, body_b) = gateway(redis_server[1], "a", prefix), gateway(redis_server[1], "b", prefix)
        await rounds(a, b)
        body_a.queue(40)
        body_b.queue(2)  # one request at each replica, nothing queued
        await rounds(a, b)
        assert grants(body_b) == (1, 1)
        assert grants(body_a) == (SLOTS - 1, SLOTS - 1)
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_a_dead_gateways_share_returns_after_the_member_ttl(redis_server: tuple[object, str]) -> None:
    # the ttl is Redis's clock (its TIME), real time: 2 s leaves a loaded machine 1.7 s of slack between
    # "b still counts" (0.3 s after its last beat) and the ttl (a 0.6 s ttl once failed there under load)
    ttl_s = 2.0

    async def scenario() -> None:
        prefix = fresh_prefix()
        (a, body_a), (b, body_b) = (gateway(redis_server[1], "a", prefix, member_ttl_s=ttl_s),
                                    gateway(redis_server[1], "b", prefix, member_ttl_s=ttl_s))
        await rounds(a, b)
        body_a.queue(30)
        body_b.queue(30)
        await a.heartbeat()
        assert grants(body_a) == (SLOTS // 2, SLOTS // 2)
        await b.close()  # b stops beating, as a killed gateway does
        await asyncio.sleep(0.3)
        await a.heartbeat()
        assert grants(body_a) == (SLOTS // 2, SLOTS // 2)  # within the ttl b still counts
        await asyncio.sleep(ttl_s - 0.15)
        await rounds(a, count=2)  # b forgotten: `a` wants the whole replica, then is granted it
        assert grants(body_a) == (SLOTS, SLOTS) and a.members == 1
        assert body_a.woken >= 1  # the larger grant woke the pool: what waits may go
        await a.close()

    asyncio.run(scenario())


def test_redis_gone_keeps_the_last_grants_for_the_ttl_then_an_equal_part(redis_server: tuple[object, str]) -> None:
    async def scenario() -> None:
        prefix = fresh_prefix()
        clock = [0.0]
        a, body_a = gateway(redis_server[1], "a", prefix, gateway_count=3, clock=clock)
        b, body_b = gateway(redis_server[1], "b", prefix, gateway_count=3)
        await rounds(a, b)
        body_a.queue(30)
        body_b.queue(30)
        await rounds(a, b, count=1)
        before = grants(body_a)
        assert before == (SLOTS // 2, SLOTS // 2)
        a.settings.redis_url = "redis://127.0.0.1:1/0"  # nothing listens there: Redis is gone for `a`
        await a.close()
        clock[0] = 0.5
        await a.heartbeat()
        assert grants(body_a) == before  # within member_ttl_s: the last grants hold
        clock[0] = 0.7
        await a.heartbeat()
        assert grants(body_a) == (SLOTS // 3, SLOTS // 3)  # slot_limit // gateway_count
        errors = a.metrics.heartbeat_errors._value.get()
        assert errors == 2
        a.settings.redis_url = redis_server[1]  # Redis is back: split again
        await b.heartbeat()
        await a.heartbeat()
        assert grants(body_a) == (SLOTS // 2, SLOTS // 2)
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_the_config_splits_by_default_and_checks_the_member_ttl() -> None:
    from tidegate.config import ConfigError, parse_config

    base = ("pools:\n  - name: m\n    backends:\n      - {type: upstream, url: 'http://127.0.0.1:9/v1'}\n"
            "shared_state:\n  backend: redis\n  redis_url: redis://r:6379/0\n")
    config = parse_config(base, environ={})
    assert config.shared_state.dispatch == "split"
    assert (config.shared_state.heartbeat_s, config.shared_state.member_ttl_s) == (0.25, 3.0)
    assert parse_config(base + "  dispatch: per_gateway\n", environ={}).shared_state.dispatch == "per_gateway"
    with pytest.raises(ConfigError, match="member_ttl_s"):
        parse_config(base + "  heartbeat_s: 2\n  member_ttl_s: 1\n", environ={})


def test_load_from_outside_the_gateways_leaves_fewer_slots_to_split(redis_server: tuple[object, str]) -> None:
    async def scenario() -> None:
        (a, body_a), (b, body_b) = await two_busy_gateways(redis_server[1])
        assert grants(body_a) == grants(body_b) == (SLOTS // 2, SLOTS // 2)
        # r0's engine runs 3 sequences past the gateways' 8 (a client of the engine itself), two scrapes running
        for _ in range(2):
            for dispatch, body in ((a, body_a), (b, body_b)):
                replica = body.pool.replicas[0]
                replica.load = ReplicaLoad(running_sequences=SLOTS, waiting_sequences=3)
                dispatch.observe_engine(replica)
        assert a.outside("m", "r0") == b.outside("m", "r0") == 3
        assert a.outside("m", "r1") == 0
        await rounds(a, b, count=2)
        # each is granted what the outside load and the other's held requests leave, until those end
        assert grants(body_a)[0] == grants(body_b)[0] == SLOTS - 3 - SLOTS // 2
        for body in (body_a, body_b):
            for request_id in [f"q{n}" for n in range(200)]:
                if body.controller.held("r0") > body.controller.slot_grant("r0"):
                    body.controller.on_finish(0.1, request_id)
        await rounds(a, b, count=3)
        assert grants(body_a)[0] + grants(body_b)[0] == SLOTS - 3 and grants(body_a)[1] == SLOTS // 2
        # the outside client leaves: the engine runs what the gateways hold, and the slots return
        for dispatch, body in ((a, body_a), (b, body_b)):
            replica = body.pool.replicas[0]
            replica.load = ReplicaLoad(running_sequences=body_a.controller.held("r0") + body_b.controller.held("r0"))
            dispatch.observe_engine(replica)
        await rounds(a, b, count=4)
        assert grants(body_a)[0] + grants(body_b)[0] == SLOTS
        await a.close()
        await b.close()

    asyncio.run(scenario())
