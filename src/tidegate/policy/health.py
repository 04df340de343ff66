"""Passive ejection of a failing replica: a pure circuit-breaker state machine, time passed in.

A CLOSED replica is ejected (OPEN) for a cool-down, each ejection with its `EjectionReason`:
- CONSECUTIVE: it fails `failure_threshold` times in a row (more when the pool's other replicas
  fail so often that such a run is no longer rare: `run_chance`);
- SUCCESS_RATE: its recent failure ratio (a moving average over about `ratio_window` outcomes)
  exceeds the median of the pool's other replicas by `failure_ratio`, and by `ratio_confidence`
  standard errors of the pool's ratio over the window (Envoy's success-rate outlier detection,
  against the median, which one outlier cannot drag). A replica failing 30 % of
  requests at random rarely fails three times in a row, and its instant errors keep its outstanding
  count lowest, so least-outstanding routing would favour it
  (`test_replica_failing_a_third_is_ejected_by_ratio`); but when every replica fails alike (an
  overloaded fleet, a bad request pattern) none is an outlier, and ejecting would only take
  capacity away (`test_a_fleet_failing_alike_is_not_ejected_by_ratio`). The moving average starts
  at 0, so at least four failures are needed: the minimum request volume.
- LATENCY: the pool controller's fitted speed factor (`policy.pool`) is `latency_factor` times the
  median of the others' or more; off by default (see `BreakerPolicy.latency_factor`).

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

import math
from dataclasses import dataclass, replace
from enum import Enum

from tidegate.types import ReplicaHealth

__all__ = ["BreakerState", "EjectionReason", "BreakerPolicy", "Breaker", "CLOSED_BREAKER", "is_routable",
           "median"]


class BreakerState(Enum):
    CLOSED = "closed"  # traffic flows
    OPEN = "open"  # ejected until `reopen_at_s`
    HALF_OPEN = "half_open"  # cool-down over: the next request routed here is the probe
    PROBING = "probing"  # the probe is in flight: nothing else until it answers (or `reopen_at_s`)


# Members read on every request's way, as module names: on Python 3.10 and 3.11 an Enum member read
# through its class goes through `EnumType.__getattr__`'s slot hook, some 850 instructions a read
# (bench/gateway_instructions.py); a module global is a dictionary hit
_CLOSED = BreakerState.CLOSED
_HEALTHY = ReplicaHealth.HEALTHY


class EjectionReason(Enum):
    CONSECUTIVE = "consecutive"  # failure_threshold failures in a row (or its probe failed)
    SUCCESS_RATE = "success_rate"  # failure ratio far above the pool's median
    LATENCY = "latency"  # engine speed far below the pool's median


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failure_threshold: int = 3  # consecutive failures that eject a closed replica
    cooldown_s: float = 5.0  # first ejection's length
    max_cooldown_s: float = 60.0  # repeated ejections double the cool-down up to this
    # eject when the moving failure ratio exceeds the median of the pool's other replicas by this; a
    # healthy replica's 5xx are rare, and at 0.2 a replica failing 30 % beside healthy ones is
    # ejected after ~20 of its requests
    failure_ratio: float = 0.2
    ratio_window: int = 16  # outcomes the failure ratio averages over (weight 1/window each)
    # the consecutive rule needs a run of failures this improbable at the pool's failure ratio
    # (p ** run >= this lengthens the run asked for): in a fleet failing 30 % alike, three in a row
    # come every ~50 requests on every replica, and ejected one replica or two in every run
    # (`test_a_fleet_failing_alike_is_seldom_ejected_for_consecutive_failures`); beside a healthy
    # pool the run stays `failure_threshold` (`test_threshold_failures_eject_for_cooldown`)
    run_chance: float = 1e-4
    # a replica is a success-rate outlier only when its failure ratio also exceeds the pool's by this
    # many binomial standard errors of a window of `ratio_window` outcomes failing at the pool's ratio:
    # when the whole fleet fails alike (~30 %), a ratio of ~16 outcomes wanders 0.2 above the median by
    # chance alone, and ejecting for it only loses capacity
    # (`test_a_fleet_failing_alike_is_seldom_ejected_by_ratio`). 3.5, not 2: the ratio is tested after
    # every failure, hundreds of looks a minute, and at 2 a fleet failing 30 % alike still lost a
    # replica in 197 of 200 runs (`bench/outlier_alike.py`). It binds only above a pool ratio of
    # ~5.5 %: beside a healthy pool the rule is the plain `failure_ratio` one
    # (`test_one_replica_failing_among_healthy_ones_is_still_ejected`)
    ratio_confidence: float = 3.5
    # the breakers of a pool never eject more than this share of its replicas (at least one), so
    # an error every replica gives (a bad request pattern, an overloaded fleet) cannot empty it
    max_ejected_fraction: float = 0.5
    # eject a replica whose fitted engine speed factor is this many times the median of the pool's
    # others (slower); None: off. Off by default: routing by least predicted TTFT already sends a
    # slow replica little, while ejecting one that still serves takes its capacity away from a pool
    # in overload (`bench/chaos.py --only outliers --latency-factor 3` measures both)
    latency_factor: float | None = None
    latency_min_samples: int = 4  # first tokens a replica needs before its speed can eject it

    @property
    def ratio_weight(self) -> float:
        return 1.0 / self.ratio_window

    def consecutive_threshold(self, pool_failure_ratio: float) -> float:
        """Failures in a row that eject: `failure_threshold`, or more when the pool fails so often
        that a shorter run is no sign of a replica of its own going wrong; never, at a ratio of 1."""
        p = min(max(pool_failure_ratio, 0.0), 1.0)
        if p >= 1.0:
            return math.inf
        if p <= 0.0:
            return self.failure_threshold
        return max(self.failure_threshold, math.ceil(math.log(self.run_chance) / math.log(p) - 1e-9))

    def ratio_margin(self, pool_failure_ratio: float) -> float:
        """How far above the pool's failure ratio a replica's must be to make it an outlier."""
        p = min(max(pool_failure_ratio, 0.0), 1.0)
        standard_error = math.sqrt(p * (1.0 - p) / self.ratio_window)
        return max(self.failure_ratio, self.ratio_confidence * standard_error)


@dataclass(frozen=True, slots=True)
class Breaker:
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    failure_ratio: float = 0.0  # moving average of outcomes, a failure counting 1
    reopen_at_s: float = 0.0  # OPEN: when the cool-down ends; PROBING: when another probe may go
    cooldown_s: float = 0.0  # length of the current/last ejection; 0 before the first
    probe_sent_s: float = 0.0  # PROBING: when the probe was dispatched
    closed_at_s: float = 0.0  # when the last probe closed it: ejections soon after escalate
    ejected_s: float = -1.0  # when it was last ejected; -1: never (a new ejection moves it)
    reason: EjectionReason | None = None  # why it was last ejected

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
        if self.state is _CLOSED:
            if self.consecutive_failures == 0 and self.failure_ratio == 0.0:
                return self  # the hot path: no allocation
            ratio = self.failure_ratio * (1.0 - policy.ratio_weight)
            return replace(self, consecutive_failures=0, failure_ratio=ratio if ratio > 1e-3 else 0.0)
        if self.state is BreakerState.PROBING and sent_s >= self.probe_sent_s:
            return Breaker(BreakerState.CLOSED, 0, self.failure_ratio * (1.0 - policy.ratio_weight),
                           cooldown_s=self.cooldown_s, closed_at_s=now_s, ejected_s=self.ejected_s,
                           reason=self.reason)
        return self  # stale: sent before the ejection or before the probe

    def on_failure(self, now_s: float, sent_s: float, policy: BreakerPolicy, may_eject: bool = True,
                   pool_failure_ratio: float = 0.0) -> Breaker:
        """A request sent at `sent_s` failed. `may_eject` False: the pool may not lose another replica.
        `pool_failure_ratio`: the median failure ratio of the pool's other replicas."""
        if self.state is BreakerState.CLOSED:
            failures = self.consecutive_failures + 1
            ratio = self.failure_ratio + policy.ratio_weight * (1.0 - self.failure_ratio)
            if may_eject:
                if failures >= policy.consecutive_threshold(pool_failure_ratio):
                    return self._ejected(now_s, failures, ratio, policy, EjectionReason.CONSECUTIVE)
                if ratio - pool_failure_ratio >= policy.ratio_margin(pool_failure_ratio):
                    return self._ejected(now_s, failures, ratio, policy, EjectionReason.SUCCESS_RATE)
            return replace(self, consecutive_failures=failures, failure_ratio=ratio)
        if self.state is BreakerState.PROBING and sent_s >= self.probe_sent_s:
            return self._ejected(now_s, self.consecutive_failures + 1, self.failure_ratio, policy,
                                 self.reason or EjectionReason.CONSECUTIVE)
        return self  # stale

    def on_slow(self, now_s: float, policy: BreakerPolicy) -> Breaker:
        """Its speed made it a latency outlier (the caller checked the rule and the pool's ejection cap)."""
        if self.state is not BreakerState.CLOSED:
            return self
        return self._ejected(now_s, self.consecutive_failures, self.failure_ratio, policy, EjectionReason.LATENCY)

    def _ejected(self, now_s: float, failures: int, ratio: float, policy: BreakerPolicy,
                 reason: EjectionReason) -> Breaker:
        escalate = self.cooldown_s > 0 and (self.state is not BreakerState.CLOSED
                                            or now_s - self.closed_at_s < policy.max_cooldown_s)
        cooldown = min(self.cooldown_s * 2.0, policy.max_cooldown_s) if escalate else policy.cooldown_s
        return Breaker(BreakerState.OPEN, failures, ratio, now_s + cooldown, cooldown, ejected_s=now_s, reason=reason)


CLOSED_BREAKER = Breaker()


def median(values: list[float]) -> float:
    """The median of `values`; 0.0 for none (a pool of one replica compares it with no failures)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2.0


def is_routable(health: ReplicaHealth, breaker: Breaker, now_s: float) -> bool:
    """UNKNOWN counts as not yet routable: a replica is trusted after its first good health check."""
    # a closed breaker admits: asked first, without a call, as every pick asks for every replica
    return health is _HEALTHY and (breaker.state is _CLOSED or breaker.admits(now_s))
