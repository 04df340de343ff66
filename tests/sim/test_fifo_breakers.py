"""The simulator's FIFO baseline ejects as the live FIFO gateway does (`gateway/dispatch.py`'s
`record_failure`): its breakers weigh a replica's failures against the pool's failure ratio."""

from __future__ import annotations

from tidegate.policy.health import BreakerState
from tidegate.policy.tiers import default_tiers
from tidegate.sim.fifo import FifoDispatcher
from tidegate.types import PoolRequest

REPLICAS = ("r0", "r1", "r2")


def _round(fifo: FifoDispatcher, first_id: int, now_s: float, failing: set[str]) -> None:
    """One request to each replica; those on `failing` replicas fail, the others succeed."""
    for offset in range(len(REPLICAS)):
        fifo.on_arrival(now_s, PoolRequest(first_id + offset, now_s, "t", "standard", 32, 16))
    for assignment in fifo.on_capacity(now_s, {}).assignments:
        if assignment.replica_id in failing:
            fifo.on_failure(now_s + 0.01, assignment.request_id, "http_500")
        else:
            fifo.on_finish(now_s + 0.01, assignment.request_id)


def test_a_fleet_failing_alike_keeps_its_replicas() -> None:
    # every replica fails 30 % of its requests, in runs of three (an overloaded fleet): three in a
    # row is no sign of one replica going wrong when the pool's others fail that often, so nothing
    # is ejected (with the pool's ratio left out, each replica's first run of three ejected it)
    fifo = FifoDispatcher(list(REPLICAS), default_tiers(), slot_limit=1)
    for index in range(60):
        now_s = float(index)
        failing = {replica for number, replica in enumerate(REPLICAS) if (index + number) % 10 < 3}
        _round(fifo, 10 * index, now_s, failing)
        assert all(fifo.breaker(replica).state is BreakerState.CLOSED for replica in REPLICAS), index


def test_one_replica_failing_beside_healthy_ones_is_still_ejected() -> None:
    fifo = FifoDispatcher(list(REPLICAS), default_tiers(), slot_limit=1)
    for index in range(3):
        _round(fifo, 10 * index, float(index), {"r0"})
    assert fifo.breaker("r0").state is BreakerState.OPEN
    assert fifo.breaker("r1").state is BreakerState.CLOSED and fifo.breaker("r2").state is BreakerState.CLOSED
