"""A retry budget (Finagle, Google SRE "Handling Overload"): retries may add at most a fraction of
the traffic, so that a failing fleet is not hit with amplified load. Time is an argument.

A token bucket: every first attempt deposits `ratio` of a retry, time deposits `min_per_s` (a
floor, so a quiet pool can still retry its rare failure), and a retry spends one. The bucket holds
at most `burst` retries, so a long healthy spell cannot save up for a storm.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RetryBudgetPolicy", "RetryBudget"]


@dataclass(frozen=True, slots=True)
class RetryBudgetPolicy:
    ratio: float = 0.2  # retries per first attempt, at most
    min_per_s: float = 5.0  # retries per second always allowed
    burst: float = 20.0  # retries the bucket can hold


class RetryBudget:
    def __init__(self, policy: RetryBudgetPolicy = RetryBudgetPolicy(), now_s: float = 0.0) -> None:
        self.policy = policy
        self._tokens = policy.burst
        self._refilled_s = now_s

    def on_attempt(self) -> None:
        """A first attempt was sent: it earns `ratio` of a retry."""
        tokens = self._tokens + self.policy.ratio
        self._tokens = tokens if tokens < self.policy.burst else self.policy.burst

    def try_spend(self, now_s: float) -> bool:
        """Takes one retry from the budget if there is one; False: do not retry."""
        policy = self.policy
        if now_s > self._refilled_s:
            self._tokens = min(policy.burst, self._tokens + (now_s - self._refilled_s) * policy.min_per_s)
            self._refilled_s = now_s
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
