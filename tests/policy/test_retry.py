"""The retry budget: retries add at most a fraction of the traffic, plus a floor; time passed in."""

from __future__ import annotations

from tidegate.policy.retry import RetryBudget, RetryBudgetPolicy


def test_a_failing_fleet_gets_only_the_budgeted_retries() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.2, min_per_s=0.0, burst=5.0), now_s=0.0)
    while budget.try_spend(0.0):  # the burst goes first
        pass
    retried = 0
    for _ in range(1000):  # every request fails: retries stay near 20 % of them
        budget.on_attempt()
        retried += budget.try_spend(0.0)
    assert 195 <= retried <= 200


def test_the_floor_refills_with_time() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.0, min_per_s=5.0, burst=20.0), now_s=0.0)
    for _ in range(20):
        assert budget.try_spend(0.0)
    assert not budget.try_spend(0.0)
    assert [budget.try_spend(1.0) for _ in range(6)] == [True] * 5 + [False]  # 5 a second


def test_a_healthy_spell_saves_up_no_more_than_the_burst() -> None:
    budget = RetryBudget(RetryBudgetPolicy(ratio=0.2, min_per_s=5.0, burst=3.0), now_s=0.0)
    for _ in range(10_000):
        budget.on_attempt()
    assert sum(budget.try_spend(3600.0) for _ in range(10)) == 3
