"""The breaker state machine, driven with explicit times: no event loop, no clock."""

from __future__ import annotations

import random

import pytest

from tidegate.policy.health import CLOSED_BREAKER, BreakerPolicy, BreakerState, EjectionReason, is_routable, median
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


def _run_outcomes(breaker, policy, failure_share, outcomes, seed, pool_failure_ratio=0.0):
    rng = random.Random(seed)
    for _ in range(outcomes):
        if rng.random() < failure_share:
            breaker = breaker.on_failure(0.0, 0.0, policy, pool_failure_ratio=pool_failure_ratio)
        else:
            breaker = breaker.on_success(0.0, 0.0, policy)
        if breaker.state is not BreakerState.CLOSED:
            break
    return breaker


def test_a_fleet_failing_alike_is_not_ejected_by_ratio() -> None:
    # every replica fails 30 % (an overloaded fleet, a bad request pattern): the pool's median fails
    # as much, so none is an outlier, and ejecting one would only take capacity away. Against healthy
    # peers the same replica is ejected within 100 outcomes in every run; beside peers failing
    # alike only a run of bad luck does it (the moving ratio of ~16 outcomes is noisy)
    policy = BreakerPolicy(failure_threshold=1_000)
    alone = [_run_outcomes(CLOSED_BREAKER, policy, 0.3, 100, seed=seed) for seed in range(40)]
    alike = [_run_outcomes(CLOSED_BREAKER, policy, 0.3, 100, seed=seed, pool_failure_ratio=0.3)
             for seed in range(40)]
    assert sum(b.state is BreakerState.OPEN for b in alone) == 40
    assert sum(b.state is BreakerState.OPEN for b in alike) <= 10


def test_ratio_ejection_names_success_rate_as_its_reason() -> None:
    policy = BreakerPolicy(failure_threshold=1_000)
    breaker = _run_outcomes(CLOSED_BREAKER, policy, 0.3, 200, seed=7)
    assert breaker.state is BreakerState.OPEN and breaker.reason is EjectionReason.SUCCESS_RATE


def test_consecutive_failures_name_consecutive_as_the_reason() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=4.0)
    assert breaker.reason is EjectionReason.CONSECUTIVE and breaker.ejected_s == 4.0


def test_a_failed_probe_keeps_the_reason_and_moves_the_ejection_time() -> None:
    policy = BreakerPolicy(failure_threshold=1_000, cooldown_s=5.0)
    breaker = _run_outcomes(CLOSED_BREAKER, policy, 0.3, 200, seed=7)
    probe_s = breaker.reopen_at_s
    again = _probe(breaker, probe_s).on_failure(probe_s, probe_s, policy)
    assert again.reason is EjectionReason.SUCCESS_RATE and again.ejected_s == probe_s > breaker.ejected_s


def test_a_slow_replica_is_ejected_for_latency_and_a_probe_returns_it() -> None:
    breaker = CLOSED_BREAKER.on_slow(2.0, POLICY)
    assert breaker.state is BreakerState.OPEN and breaker.reason is EjectionReason.LATENCY
    probe_s = breaker.reopen_at_s
    closed = _probe(breaker, probe_s).on_success(probe_s + 0.1, probe_s, POLICY)
    assert closed.state is BreakerState.CLOSED and closed.ejected_s == 2.0  # the last ejection is remembered


def test_an_ejected_replica_is_not_ejected_again_for_latency() -> None:
    breaker = _fail(CLOSED_BREAKER, 3, now_s=1.0)
    assert breaker.on_slow(2.0, POLICY) is breaker


def test_median_of_an_odd_an_even_and_no_count() -> None:
    assert median([0.5, 0.0, 0.1]) == 0.1
    assert median([0.4, 0.0, 0.2, 0.1]) == pytest.approx(0.15)
    assert median([]) == 0.0


def _fleet_trial(policy, shares, outcomes_each, seed):
    """Replicas given outcomes in turn, each failure judged against the median of the others' ratios
    under the pool's ejection cap, as the pool controller does: the reason each was first ejected for."""
    rng = random.Random(seed)
    breakers, reasons = [CLOSED_BREAKER] * len(shares), [None] * len(shares)
    cap = max(1, int(len(shares) * policy.max_ejected_fraction))
    for _ in range(outcomes_each):
        for index, share in enumerate(shares):
            breaker = breakers[index]
            if breaker.state is not BreakerState.CLOSED:
                continue
            if rng.random() < share:
                ejected = sum(1 for other in breakers if other.state is not BreakerState.CLOSED)
                pool = median([other.failure_ratio for j, other in enumerate(breakers) if j != index])
                breaker = breaker.on_failure(0.0, 0.0, policy, ejected < cap, pool)
                if breaker.state is BreakerState.OPEN and reasons[index] is None:
                    reasons[index] = breaker.reason
            else:
                breaker = breaker.on_success(0.0, 0.0, policy)
            breakers[index] = breaker
    return reasons


def _trials_with_an_ejection(policy, shares, seeds=40, outcomes_each=200):
    return sum(any(_fleet_trial(policy, shares, outcomes_each, seed)) for seed in range(seeds))


def test_a_fleet_failing_alike_is_seldom_ejected_by_ratio() -> None:
    # five replicas failing 30 % alike, 200 outcomes each: the ratio of ~16 outcomes wanders 0.2 above
    # the median by chance in every run; the confidence margin (3.5 standard errors) keeps most runs whole
    ratio_only = BreakerPolicy(failure_threshold=10**9)
    without_confidence = BreakerPolicy(failure_threshold=10**9, ratio_confidence=0.0)
    assert _trials_with_an_ejection(without_confidence, (0.3,) * 5) == 40
    assert _trials_with_an_ejection(ratio_only, (0.3,) * 5) <= 10


def test_one_replica_failing_among_healthy_ones_is_still_ejected() -> None:
    runs = [_fleet_trial(BreakerPolicy(), (0.3, 0.0, 0.0, 0.0, 0.0), 200, seed) for seed in range(40)]
    assert all(reasons[0] is not None for reasons in runs)
    assert not any(any(reasons[1:]) for reasons in runs)


def test_an_outlier_in_a_failing_fleet_is_still_ejected_by_ratio() -> None:
    runs = [_fleet_trial(BreakerPolicy(failure_threshold=10**9), (0.6, 0.3, 0.3, 0.3, 0.3), 200, seed)
            for seed in range(40)]
    assert sum(reasons[0] is EjectionReason.SUCCESS_RATE for reasons in runs) >= 38


def test_the_ratio_margin_is_failure_ratio_beside_a_healthy_pool_and_grows_with_its_errors() -> None:
    policy = BreakerPolicy()
    assert policy.ratio_margin(0.0) == policy.failure_ratio == policy.ratio_margin(0.02)
    assert policy.ratio_margin(0.3) == pytest.approx(3.5 * (0.3 * 0.7 / 16) ** 0.5)


def test_a_fleet_failing_alike_is_seldom_ejected_for_consecutive_failures() -> None:
    # three failures in a row come every ~50 requests at 30 %: before, every run lost replicas
    before = BreakerPolicy(ratio_confidence=0.0, run_chance=1.0)
    assert _trials_with_an_ejection(before, (0.3,) * 5) == 40
    assert _trials_with_an_ejection(BreakerPolicy(), (0.3,) * 5) <= 24


def test_failures_in_a_row_that_eject_grow_with_the_pools_failure_ratio() -> None:
    policy = BreakerPolicy()
    assert [policy.consecutive_threshold(p) for p in (0.0, 0.02, 0.1, 0.3)] == [3, 3, 4, 8]
    assert policy.consecutive_threshold(1.0) == float("inf")  # a pool failing everything has no outlier


def test_a_dead_replica_in_a_fleet_failing_alike_is_ejected_after_a_longer_run() -> None:
    breaker = CLOSED_BREAKER
    for _ in range(7):
        breaker = breaker.on_failure(0.0, 0.0, BreakerPolicy(), pool_failure_ratio=0.3)
    assert breaker.state is BreakerState.CLOSED
    breaker = breaker.on_failure(0.0, 0.0, BreakerPolicy(), pool_failure_ratio=0.3)
    assert breaker.state is BreakerState.OPEN and breaker.reason is EjectionReason.CONSECUTIVE
