"""The breaker state machine, driven with explicit times: no event loop, no clock."""

from __future__ import annotations

from tidegate.policy.health import CLOSED_BREAKER, BreakerPolicy, BreakerState, is_routable
from tidegate.types import ReplicaHealth

POLICY = BreakerPolicy(failure_threshold=3, cooldown_s=5.0, max_cooldown_s=12.0)


def _fail(breaker, times, now_s=0.0):
    for _ in range(times):
        breaker = breaker.on_failure(now_s, POLICY)
    return breaker


def test_failures_below_threshold_keep_breaker_closed() -> None:
    assert _fail(CLOSED_BREAKER, 2).state is BreakerState.CLOSED


def test_threshold_failures_eject_for_cooldown() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=10.0)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.admits(14.9)
    assert breaker.admits(15.0)


def test_success_resets_failure_count() -> None:
    breaker = _fail(CLOSED_BREAKER, 2).on_success()
    assert _fail(breaker, 2).state is BreakerState.CLOSED


def test_success_on_closed_breaker_allocates_nothing() -> None:
    assert CLOSED_BREAKER.on_success() is CLOSED_BREAKER


def test_open_breaker_turns_half_open_after_cooldown() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=0.0)
    assert breaker.current(5.0).state is BreakerState.HALF_OPEN


def test_failure_when_half_open_ejects_again_for_longer() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=0.0).on_failure(6.0, POLICY)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.admits(6.0 + 9.9)
    assert breaker.admits(6.0 + 10.0)


def test_repeated_ejections_cap_the_cooldown() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=0.0)
    now = 0.0
    for _ in range(5):
        now = breaker.reopen_at_s
        breaker = breaker.on_failure(now, POLICY)
    assert breaker.reopen_at_s - now == POLICY.max_cooldown_s


def test_success_when_half_open_closes() -> None:
    breaker = _fail(CLOSED_BREAKER, 3).current(5.0).on_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.consecutive_failures == 0


def test_unhealthy_replica_is_not_routable_even_with_closed_breaker() -> None:
    assert not is_routable(ReplicaHealth.UNHEALTHY, CLOSED_BREAKER, 0.0)
    assert not is_routable(ReplicaHealth.UNKNOWN, CLOSED_BREAKER, 0.0)
    assert is_routable(ReplicaHealth.HEALTHY, CLOSED_BREAKER, 0.0)
