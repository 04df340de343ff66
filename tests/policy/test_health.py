"""The breaker state machine, driven with explicit times: no event loop, no clock."""

from __future__ import annotations

import random

from tidegate.policy.health import CLOSED_BREAKER, BreakerPolicy, BreakerState, is_routable
from tidegate.types import ReplicaHealth

POLICY = BreakerPolicy(failure_threshold=3, cooldown_s=5.0, max_cooldown_s=12.0)


def _fail(breaker, times, now_s=0.0):
    for _ in range(times):
        breaker = breaker.on_failure(now_s, now_s, POLICY)
    return breaker


def _probe(breaker, now_s):
    """Route the next request at now_s (the probe, past the cool-down)."""
    return breaker.on_dispatch(now_s)


def test_failures_below_threshold_keep_breaker_closed() -> None:
    assert _fail(CLOSED_BREAKER, 2).state is BreakerState.CLOSED


def test_threshold_failures_eject_for_cooldown() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=10.0)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.admits(14.9)
    assert breaker.admits(15.0)


def test_success_resets_failure_count() -> None:
    policy = BreakerPolicy(failure_threshold=3, failure_ratio=1.0)  # the consecutive count alone
    breaker = CLOSED_BREAKER.on_failure(0.0, 0.0, policy).on_failure(0.0, 0.0, policy).on_success(0.0, 0.0, policy)
    breaker = breaker.on_failure(0.0, 0.0, policy).on_failure(0.0, 0.0, policy)
    assert breaker.state is BreakerState.CLOSED


def test_success_on_closed_breaker_allocates_nothing() -> None:
    assert CLOSED_BREAKER.on_success(0.0, 0.0, POLICY) is CLOSED_BREAKER


def test_open_breaker_turns_half_open_after_cooldown() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=0.0)
    assert breaker.current(5.0).state is BreakerState.HALF_OPEN


def test_stale_success_does_not_close_an_open_breaker() -> None:
    # a request sent before the ejection answers well while the replica is out: it stays out
    breaker = _fail(CLOSED_BREAKER, 3, now_s=10.0)
    after = breaker.on_success(11.0, 9.0, POLICY)
    assert after.state is BreakerState.OPEN
    assert not after.admits(12.0)
    # nor after the cool-down: only the probe's answer counts
    assert breaker.on_success(16.0, 9.0, POLICY).current(16.0).state is BreakerState.HALF_OPEN


def test_half_open_lets_one_probe_through() -> None:
    breaker = _probe(_fail(CLOSED_BREAKER, 3, now_s=0.0), 5.0)
    assert breaker.state is BreakerState.PROBING
    assert not breaker.admits(5.1)  # nothing else while the probe is out


def test_probe_success_closes() -> None:
    breaker = _probe(_fail(CLOSED_BREAKER, 3, now_s=0.0), 5.0).on_success(5.2, 5.0, POLICY)
    assert breaker.state is BreakerState.CLOSED
    assert breaker.consecutive_failures == 0
    assert breaker.admits(5.3)


def test_success_sent_before_the_probe_does_not_close() -> None:
    breaker = _probe(_fail(CLOSED_BREAKER, 3, now_s=0.0), 5.0).on_success(5.2, 4.0, POLICY)
    assert breaker.state is BreakerState.PROBING


def test_probe_failure_ejects_again_for_longer() -> None:
    breaker = _probe(_fail(CLOSED_BREAKER, 3, now_s=0.0), 6.0).on_failure(6.0, 6.0, POLICY)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.admits(6.0 + 9.9)
    assert breaker.admits(6.0 + 10.0)


def test_unanswered_probe_lets_another_through_after_a_cooldown() -> None:
    breaker = _probe(_fail(CLOSED_BREAKER, 3, now_s=0.0), 5.0)
    assert not breaker.admits(9.9)
    assert breaker.admits(10.0)
    assert breaker.on_dispatch(10.0).probe_sent_s == 10.0


def test_repeated_ejections_cap_the_cooldown() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=0.0)
    now = 0.0
    for _ in range(5):
        now = breaker.reopen_at_s
        breaker = _probe(breaker, now).on_failure(now, now, POLICY)
    assert breaker.reopen_at_s - now == POLICY.max_cooldown_s


def test_replica_failing_a_third_is_ejected_by_ratio() -> None:
    # 30 % failures at random seldom come three in a row; the failure ratio catches them
    rng = random.Random(7)
    policy = BreakerPolicy(failure_threshold=1_000)  # the ratio alone
    breaker, outcomes = CLOSED_BREAKER, 0
    while breaker.state is BreakerState.CLOSED and outcomes < 200:
        outcomes += 1
        breaker = (breaker.on_failure(0.0, 0.0, policy) if rng.random() < 0.3
                   else breaker.on_success(0.0, 0.0, policy))
    assert breaker.state is BreakerState.OPEN
    assert outcomes <= 60


def test_rare_failures_do_not_eject() -> None:
    rng = random.Random(3)
    breaker = CLOSED_BREAKER
    for _ in range(2_000):
        breaker = (breaker.on_failure(0.0, 0.0, POLICY) if rng.random() < 0.01
                   else breaker.on_success(0.0, 0.0, POLICY))
        assert breaker.state is BreakerState.CLOSED


def test_flaky_replica_is_ejected_again_for_longer() -> None:
    policy = BreakerPolicy(failure_threshold=1_000, cooldown_s=5.0, max_cooldown_s=60.0)
    breaker = CLOSED_BREAKER
    for index in range(20):  # 30 % failures until ejected
        breaker = (breaker.on_failure(0.0, 0.0, policy) if index % 3 == 0
                   else breaker.on_success(0.0, 0.0, policy))
    assert breaker.state is BreakerState.OPEN
    first_cooldown = breaker.cooldown_s
    # the probe succeeds, but the next failure soon after ejects it again, for twice as long
    breaker = _probe(breaker, 5.0).on_success(5.1, 5.0, policy)
    assert breaker.state is BreakerState.CLOSED
    breaker = breaker.on_failure(5.2, 5.2, policy)
    assert breaker.state is BreakerState.OPEN
    assert breaker.cooldown_s == 2 * first_cooldown


def test_pool_guard_keeps_a_failing_replica_in() -> None:
    breaker = CLOSED_BREAKER
    for _ in range(5):
        breaker = breaker.on_failure(0.0, 0.0, POLICY, may_eject=False)
    assert breaker.state is BreakerState.CLOSED


def test_unhealthy_replica_is_not_routable_even_with_closed_breaker() -> None:
    assert not is_routable(ReplicaHealth.UNHEALTHY, CLOSED_BREAKER, 0.0)
    assert not is_routable(ReplicaHealth.UNKNOWN, CLOSED_BREAKER, 0.0)
    assert is_routable(ReplicaHealth.HEALTHY, CLOSED_BREAKER, 0.0)
