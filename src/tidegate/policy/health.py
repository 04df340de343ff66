"""Passive ejection of a failing replica: a pure circuit-breaker state machine, time passed in.

A CLOSED replica is ejected (OPEN) for a cool-down when it fails `failure_threshold` times in a
row, or when its recent failure ratio (a moving average over about `ratio_window` outcomes)
reaches `failure_ratio`: a replica failing 30 % of requests at random rarely fails three times in
a row, and its instant errors keep its outstanding count lowest, so least-outstanding routing
would favour it (`test_replica_failing_a_third_is_ejected_by_ratio`).

After the cool-down the breaker is HALF_OPEN: the next request routed to it is its one probe
(PROBING; nothing else is routed there meanwhile). The probe's success closes the breaker; its
failure ejects the replica again for twice the cool-down (capped). Outcomes of requests sent
before the probe are stale: they change no state, so one success that was in flight when the
replica was ejected cannot bring it back (`test_stale_success_does_not_close_an_open_breaker`).
A probe that never answers (its client left) frees the way for another after one more cool-down.

The failure ratio survives the probe, so a replica that comes back still failing is ejected
again at once, for longer (`test_flaky_replica_is_ejected_again_for_longer`), and the cool-down
keeps doubling while ejections follow each other within `max_cooldown_s`.

Active health checks are a separate signal (`ReplicaHealth`), combined by `is_routable`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from tidegate.types import ReplicaHealth

__all__ = ["BreakerState", "BreakerPolicy", "Breaker", "CLOSED_BREAKER", "is_routable"]


class BreakerState(Enum):
    CLOSED = "closed"  # traffic flows
    OPEN = "open"  # ejected until `reopen_at_s`
    HALF_OPEN = "half_open"  # cool-down over: the next request routed here is the probe
    PROBING = "probing"  # the probe is in flight: nothing else until it answers (or `reopen_at_s`)


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failure_threshold: int = 3  # consecutive failures that eject a closed replica
    cooldown_s: float = 5.0  # first ejection's length
    max_cooldown_s: float = 60.0  # repeated ejections double the cool-down up to this
    # eject when the moving failure ratio reaches this; a healthy replica's 5xx are rare, and at
    # 0.2 a replica failing 30 % is ejected after ~20 of its requests
    failure_ratio: float = 0.2
    ratio_window: int = 16  # outcomes the failure ratio averages over (weight 1/window each)
    # the breakers of a pool never eject more than this share of its replicas (at least one), so
    # an error every replica gives (a bad request pattern, an overloaded fleet) cannot empty it
    max_ejected_fraction: float = 0.5

    @property
    def ratio_weight(self) -> float:
        return 1.0 / self.ratio_window


@dataclass(frozen=True, slots=True)
class Breaker:
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    failure_ratio: float = 0.0  # moving average of outcomes, a failure counting 1
    reopen_at_s: float = 0.0  # OPEN: when the cool-down ends; PROBING: when another probe may go
    cooldown_s: float = 0.0  # length of the current/last ejection; 0 before the first
    probe_sent_s: float = 0.0  # PROBING: when the probe was dispatched
    closed_at_s: float = 0.0  # when the last probe closed it: ejections soon after escalate

    def current(self, now_s: float) -> Breaker:
        """The breaker as it stands at now_s: an OPEN (or unanswered PROBING) breaker past
        `reopen_at_s` is HALF_OPEN."""
        if self.state in (BreakerState.OPEN, BreakerState.PROBING) and now_s >= self.reopen_at_s:
            return replace(self, state=BreakerState.HALF_OPEN)
        return self

    def admits(self, now_s: float) -> bool:
        return self.state is BreakerState.CLOSED or now_s >= self.reopen_at_s

    def on_dispatch(self, now_s: float) -> Breaker:
        """A request was routed to the replica: past the cool-down, it becomes the probe."""
        if self.state is BreakerState.CLOSED or now_s < self.reopen_at_s:
            return self
        return replace(self, state=BreakerState.PROBING, probe_sent_s=now_s,
                       reopen_at_s=now_s + max(self.cooldown_s, 0.0))

    def on_success(self, now_s: float, sent_s: float, policy: BreakerPolicy) -> Breaker:
        """A request sent at `sent_s` succeeded."""
        if self.state is BreakerState.CLOSED:
            if self.consecutive_failures == 0 and self.failure_ratio == 0.0:
                return self  # the hot path: no allocation
            ratio = self.failure_ratio * (1.0 - policy.ratio_weight)
            return replace(self, consecutive_failures=0, failure_ratio=ratio if ratio > 1e-3 else 0.0)
        if self.state is BreakerState.PROBING and sent_s >= self.probe_sent_s:
            return Breaker(BreakerState.CLOSED, 0, self.failure_ratio * (1.0 - policy.ratio_weight),
                           cooldown_s=self.cooldown_s, closed_at_s=now_s)
        return self  # stale: sent before the ejection or before the probe

    def on_failure(self, now_s: float, sent_s: float, policy: BreakerPolicy, may_eject: bool = True) -> Breaker:
        """A request sent at `sent_s` failed. `may_eject` False: the pool may not lose another replica."""
        if self.state is BreakerState.CLOSED:
            failures = self.consecutive_failures + 1
            ratio = self.failure_ratio + policy.ratio_weight * (1.0 - self.failure_ratio)
            if may_eject and (failures >= policy.failure_threshold or ratio >= policy.failure_ratio):
                return self._ejected(now_s, failures, ratio, policy)
            return replace(self, consecutive_failures=failures, failure_ratio=ratio)
        if self.state is BreakerState.PROBING and sent_s >= self.probe_sent_s:
            return self._ejected(now_s, self.consecutive_failures + 1, self.failure_ratio, policy)
        return self  # stale

    def _ejected(self, now_s: float, failures: int, ratio: float, policy: BreakerPolicy) -> Breaker:
        escalate = self.cooldown_s > 0 and (self.state is not BreakerState.CLOSED
                                            or now_s - self.closed_at_s < policy.max_cooldown_s)
        cooldown = min(self.cooldown_s * 2.0, policy.max_cooldown_s) if escalate else policy.cooldown_s
        return Breaker(BreakerState.OPEN, failures, ratio, now_s + cooldown, cooldown)


CLOSED_BREAKER = Breaker()


def is_routable(health: ReplicaHealth, breaker: Breaker, now_s: float) -> bool:
    """UNKNOWN counts as not yet routable: a replica is trusted after its first good health check."""
    return health is ReplicaHealth.HEALTHY and breaker.admits(now_s)
