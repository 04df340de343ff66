"""The local actuator carries out `policy.fleet.fleet_actions` on an embedded pool: the same
decision the simulator carries out (`sim.scaling`). A fake supervisor at the process edge records
the workers it is asked to start and stop; the replicas are the pool's health states."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from tidegate.gateway.scaling import LocalActuator
from tidegate.policy.fleet import FleetCounts, fleet_actions
from tidegate.types import ReplicaHealth as H


@dataclass
class FakeReplica:
    replica_id: str
    health: H
    outstanding: int = 0


@dataclass
class FakePool:
    replicas: list[FakeReplica]


class FakeSupervisor:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.restored: list[str] = []  # workers given the gateway's CPU priority back

    async def start_worker(self, name: str) -> None:
        self.started.append(name)

    async def stop_worker(self, name: str) -> None:
        self.stopped.append(name)

    def restore_priority(self, name: str) -> None:
        self.restored.append(name)


def _actuator(*states: H, standby: int = 0) -> tuple[LocalActuator, FakePool, FakeSupervisor, list[int]]:
    pool = FakePool([FakeReplica(f"w{i}", state) for i, state in enumerate(states)])
    supervisor, wakes = FakeSupervisor(), []
    return LocalActuator(pool, supervisor, lambda: wakes.append(1), standby=standby), pool, supervisor, wakes


def _healths(pool: FakePool) -> list[H]:
    return [r.health for r in pool.replicas]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.06)  # a drain polls every 50 ms


async def test_a_scale_out_promotes_the_standby_first_then_starts_and_refills() -> None:
    actuator, pool, supervisor, wakes = _actuator(H.HEALTHY, H.STANDBY, H.STOPPED, H.STOPPED, standby=1)
    actions = actuator.apply(3)
    assert (actions.promote, actions.start, actions.warm) == (1, 1, 1)
    assert _healths(pool) == [H.HEALTHY, H.HEALTHY, H.UNKNOWN, H.WARMING]  # w2 to serve, w3 the new standby
    await _settle()
    assert supervisor.started == ["w2", "w3"] and wakes  # the pool learns of the promoted standby
    assert supervisor.restored == ["w1"]  # the standby loaded at a lower CPU priority: it serves at full



async def test_a_scale_in_drains_the_newest_and_keeps_one_as_the_missing_standby() -> None:
    actuator, pool, supervisor, _ = _actuator(H.HEALTHY, H.HEALTHY, H.HEALTHY, standby=1)
    pool.replicas[2].outstanding = 1  # w2 holds a request: drained, not aborted
    actions = actuator.apply(1)
    assert (actions.drain, actions.keep_drained, actions.warm) == (2, 1, 0)
    assert _healths(pool) == [H.HEALTHY, H.DRAINING, H.DRAINING]
    assert actuator.counts().warming == 1  # the kept one counts as the standby to be: not refilled again
    assert actuator.apply(1).warm == 0
    await _settle()
    assert supervisor.stopped == ["w1"] and pool.replicas[2].health is H.DRAINING  # still holds its request
    pool.replicas[2].outstanding = 0
    await _settle()
    assert _healths(pool) == [H.HEALTHY, H.STOPPED, H.STANDBY] and supervisor.stopped == ["w1"]


async def test_the_last_serving_replica_is_never_drained() -> None:
    actuator, pool, _, _ = _actuator(H.HEALTHY, H.STOPPED)
    assert actuator.apply(0).drain == 0
    assert _healths(pool) == [H.HEALTHY, H.STOPPED]
    # nor the last one answering its health checks, when an unhealthy one would be left
    actuator, pool, _, _ = _actuator(H.UNHEALTHY, H.HEALTHY)
    actuator.apply(1)
    assert _healths(pool) == [H.UNHEALTHY, H.HEALTHY]
    await _settle()


@pytest.mark.parametrize("states,standby,desired", [
    ((H.HEALTHY, H.STOPPED, H.STOPPED, H.STOPPED), 0, 3),
    ((H.HEALTHY, H.STANDBY, H.STANDBY, H.STOPPED), 2, 2),
    ((H.HEALTHY, H.HEALTHY, H.UNKNOWN, H.WARMING, H.STOPPED), 2, 1),
    ((H.HEALTHY, H.HEALTHY, H.HEALTHY, H.HEALTHY), 0, 2),
])
async def test_it_does_what_fleet_actions_decides(states: tuple[H, ...], standby: int, desired: int) -> None:
    actuator, pool, _, _ = _actuator(*states, standby=standby)
    counts = actuator.counts()
    expected = fleet_actions(desired, counts)
    before = _healths(pool)
    assert actuator.apply(desired) == expected
    after = _healths(pool)
    changed = [(b, a) for b, a in zip(before, after) if a is not b]
    assert changed.count((H.STANDBY, H.HEALTHY)) == expected.promote
    assert changed.count((H.STOPPED, H.UNKNOWN)) == expected.start
    assert changed.count((H.STOPPED, H.WARMING)) == expected.warm
    assert sum(1 for _, a in changed if a is H.DRAINING) == expected.drain
    assert counts == FleetCounts(sum(s in (H.HEALTHY, H.UNHEALTHY) for s in states), states.count(H.UNKNOWN),
                                 states.count(H.STANDBY), states.count(H.WARMING), standby)
    await _settle()
