"""Outlier detection in the pool controller: success-rate and latency outliers against the pool's
median, each ejection with its reason, never past the pool's ejection cap. Hand-made events."""

from __future__ import annotations

from tidegate.policy.health import BreakerPolicy, BreakerState, EjectionReason
from tidegate.policy.pool import PoolController, PoolReplica, PoolSettings
from tidegate.policy.tiers import default_tiers
from tidegate.types import PoolRequest

TIERS = default_tiers()


def _controller(count: int, **breaker: object) -> PoolController:
    settings = PoolSettings(breaker=BreakerPolicy(**breaker))  # type: ignore[arg-type]
    return PoolController([PoolReplica(f"r{i}", max_requests=1) for i in range(count)], TIERS, settings)


def _round(ctl: PoolController, first_id: int, now_s: float, count: int) -> dict[str, int]:
    """One request per replica (each holds one at most): replica id -> request id."""
    sent: dict[str, int] = {}
    for offset in range(count):
        decision = ctl.on_arrival(now_s, PoolRequest(first_id + offset, now_s, "t", "standard", 100, 10))
        if decision.assignment is not None:
            sent[decision.assignment.replica_id] = first_id + offset
    for assignment in ctl.on_capacity(now_s).assignments:
        sent[assignment.replica_id] = int(assignment.request_id)
    return sent


def _serve_rounds(ctl: PoolController, rounds: int, engine_s: dict[str, float],
                  fails: dict[str, tuple[bool, ...]] = {}, start_s: float = 0.0) -> None:
    """Rounds of one request per replica; a replica's first token after its engine_s; `fails`: which
    rounds a replica fails."""
    count = len(engine_s)
    for index in range(rounds):
        now_s = start_s + index * 10.0
        for replica_id, request_id in _round(ctl, int(now_s) * count, now_s, count).items():
            pattern = fails.get(replica_id, ())
            if pattern and pattern[index % len(pattern)]:
                ctl.on_failure(now_s + 0.01, request_id, "http_500")
                continue
            ctl.on_first_token(now_s + engine_s[replica_id], request_id)
            ctl.on_finish(now_s + engine_s[replica_id] + 0.1, request_id)


def test_a_replica_failing_far_more_than_the_pool_is_ejected_for_its_success_rate() -> None:
    ctl = _controller(3, failure_threshold=1_000)
    engine_s = {"r0": 0.05, "r1": 0.05, "r2": 0.05}
    _serve_rounds(ctl, 30, engine_s, fails={"r0": (True, False, False)})  # a third fail, never twice in a row
    breaker = ctl.breaker(300.0, "r0")
    assert breaker.reason is EjectionReason.SUCCESS_RATE
    assert ctl.breaker(300.0, "r1").reason is None and ctl.breaker(300.0, "r2").reason is None


def test_a_pool_failing_alike_keeps_every_replica() -> None:
    # one failure in three on every replica: none is an outlier of a pool whose median fails as much
    ctl = _controller(3, failure_threshold=1_000)
    engine_s = {"r0": 0.05, "r1": 0.05, "r2": 0.05}
    third = (False, False, True)
    _serve_rounds(ctl, 30, engine_s, fails={"r0": third, "r1": third, "r2": third})
    assert all(ctl.breaker(300.0, f"r{i}").reason is None for i in range(3))


def test_a_replica_far_slower_than_the_pool_is_ejected_for_latency() -> None:
    ctl = _controller(3, latency_factor=3.0, cooldown_s=1_000.0)
    _serve_rounds(ctl, 8, {"r0": 0.05, "r1": 0.05, "r2": 0.5})
    breaker = ctl.breaker(80.0, "r2")
    assert breaker.state is BreakerState.OPEN and breaker.reason is EjectionReason.LATENCY
    assert [r.routable for r in ctl.snapshot(80.0).replicas] == [True, True, False]


def test_latency_ejection_is_off_by_default() -> None:
    ctl = _controller(3)
    _serve_rounds(ctl, 8, {"r0": 0.05, "r1": 0.05, "r2": 0.5})
    assert ctl.breaker(80.0, "r2").state is BreakerState.CLOSED


def test_a_replica_somewhat_slower_than_the_factor_stays() -> None:
    ctl = _controller(3, latency_factor=3.0)
    _serve_rounds(ctl, 8, {"r0": 0.05, "r1": 0.05, "r2": 0.12})
    assert ctl.breaker(80.0, "r2").state is BreakerState.CLOSED


def _slow_survivor(max_ejected_fraction: float) -> PoolController:
    """r0 and r1 learn their (equal) speeds; r0 then fails twice in a row (ejected); r1 turns 10x slower."""
    ctl = _controller(2, latency_factor=3.0, cooldown_s=1_000.0, failure_threshold=2,
                      max_ejected_fraction=max_ejected_fraction)
    _serve_rounds(ctl, 6, {"r0": 0.05, "r1": 0.05})
    _serve_rounds(ctl, 2, {"r0": 0.05, "r1": 0.05}, fails={"r0": (True,)}, start_s=100.0)
    assert ctl.breaker(200.0, "r0").reason is EjectionReason.CONSECUTIVE
    _serve_rounds(ctl, 12, {"r0": 0.05, "r1": 0.5}, start_s=200.0)
    return ctl


def test_latency_ejection_never_passes_the_pools_ejection_cap() -> None:
    # two of two replicas cannot both go: the cap (half, at least one) keeps the second
    assert _slow_survivor(max_ejected_fraction=0.5).breaker(400.0, "r1").state is BreakerState.CLOSED
    # the same replica is a latency outlier where the cap allows both to go
    assert _slow_survivor(max_ejected_fraction=1.0).breaker(400.0, "r1").reason is EjectionReason.LATENCY
