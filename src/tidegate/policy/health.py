"""Passive ejection of a failing replica: a pure circuit-breaker state machine, time passed in.

A replica that fails `failure_threshold` times in a row is ejected (OPEN) for a cool-down; after it,
the breaker lets traffic through again (HALF_OPEN): the next success closes it, the next failure
ejects it again for a longer cool-down (doubling, capped). Active health checks are a separate
signal (`ReplicaHealth`), combined by `is_routable`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from tidegate.types import ReplicaHealth

__all__ = ["BreakerState", "BreakerPolicy", "Breaker", "CLOSED_BREAKER", "is_routable"]


class BreakerState(Enum):
    CLOSED = "closed"  # traffic flows
    OPEN = "open"  # ejected until `reopen_at_s`
    HALF_OPEN = "half_open"  # cool-down over: traffic flows, one failure ejects again


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failure_threshold: int = 3  # consecutive failures that eject a closed replica
    cooldown_s: float = 5.0  # first ejection's length
    max_cooldown_s: float = 60.0  # repeated ejections double the cool-down up to this


@dataclass(frozen=True, slots=True)
class Breaker:
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    reopen_at_s: float = 0.0  # when an OPEN breaker lets traffic through again
    cooldown_s: float = 0.0  # length of the current/last ejection; 0 before the first

    def on_success(self) -> Breaker:
        if self.state is BreakerState.CLOSED and self.consecutive_failures == 0:
            return self  # the hot path: no allocation
        return CLOSED_BREAKER

    def on_failure(self, now_s: float, policy: BreakerPolicy) -> Breaker:
        current = self.current(now_s)
        failures = current.consecutive_failures + 1
        if current.state is BreakerState.HALF_OPEN:
            cooldown = min(max(current.cooldown_s, policy.cooldown_s) * 2.0, policy.max_cooldown_s)
            return Breaker(BreakerState.OPEN, failures, now_s + cooldown, cooldown)
        if current.state is BreakerState.OPEN:
            return replace(current, consecutive_failures=failures)
        if failures >= policy.failure_threshold:
            return Breaker(BreakerState.OPEN, failures, now_s + policy.cooldown_s, policy.cooldown_s)
        return replace(current, consecutive_failures=failures)

    def current(self, now_s: float) -> Breaker:
        """The breaker as it stands at now_s: an OPEN breaker past its cool-down is HALF_OPEN."""
        if self.state is BreakerState.OPEN and now_s >= self.reopen_at_s:
            return replace(self, state=BreakerState.HALF_OPEN)
        return self

    def admits(self, now_s: float) -> bool:
        return self.state is not BreakerState.OPEN or now_s >= self.reopen_at_s


CLOSED_BREAKER = Breaker()


def is_routable(health: ReplicaHealth, breaker: Breaker, now_s: float) -> bool:
    """UNKNOWN counts as not yet routable: a replica is trusted after its first good health check."""
    return health is ReplicaHealth.HEALTHY and breaker.admits(now_s)
