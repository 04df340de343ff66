"""The degradation ladder of one model pool: what to answer when the way to the model is blocked.

Follows Google SRE "Handling Overload" / "Addressing Cascading Failures": serve a degraded answer
rather than none, shed by criticality, and reject cheaply with an honest Retry-After. Rungs, tried
in order: a lighter fallback pool -> a cached answer (when caching exists; the caller says whether
one is available) -> a preset reply (configurable text) sent as 503 + Retry-After. A tier degrades
once the load pressure (predicted wait / allowed wait) reaches its `degrade_at_pressure`, so
sheddable tiers degrade first; a request whose wait would miss its deadline always degrades.
The rung that served is named in the `x-tidegate-degradation` response header.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tidegate.policy.tiers import TierSpec

__all__ = ["DEGRADATION_HEADER", "Rung", "LadderConfig", "DegradationDecision", "DegradationLadder"]

DEGRADATION_HEADER = "x-tidegate-degradation"


class Rung(Enum):
    PRIMARY = "primary"  # not degraded: queue for the requested pool
    FALLBACK_POOL = "fallback_pool"
    CACHED_ANSWER = "cached_answer"
    PRESET_REPLY = "preset_reply"


@dataclass(frozen=True, slots=True)
class LadderConfig:
    fallback_pool: str | None = None  # a lighter model pool to send degraded requests to
    use_cached_answers: bool = True  # take a cached answer when the caller has one
    preset_reply: str = "The service is busy; please retry later."  # configurable, e.g. "系统繁忙，请稍后重试"
    min_retry_after_s: float = 1.0  # Retry-After of the preset reply when no prediction gives one


@dataclass(frozen=True, slots=True)
class DegradationDecision:
    rung: Rung
    pool: str | None  # the pool to queue for, with PRIMARY and FALLBACK_POOL
    status: int | None  # the HTTP status to answer with now (PRESET_REPLY: 503); None: serve normally
    retry_after_s: float | None  # with PRESET_REPLY
    message: str | None  # with PRESET_REPLY: the preset text, as the OpenAI error message

    @property
    def degraded(self) -> bool:
        return self.rung is not Rung.PRIMARY

    def headers(self) -> dict[str, str]:
        return {DEGRADATION_HEADER: self.rung.value} if self.degraded else {}


class DegradationLadder:
    def __init__(self, pool: str, config: LadderConfig = LadderConfig()) -> None:
        if config.fallback_pool == pool:
            raise ValueError(f"pool {pool} cannot be its own fallback")
        self.pool = pool
        self.config = config
        self._primary = DegradationDecision(Rung.PRIMARY, pool, None, None, None)

    def should_degrade(self, tier: TierSpec, pressure: float, misses_deadline: bool = False) -> bool:
        return misses_deadline or pressure >= tier.degrade_at_pressure

    def decide(
        self,
        tier: TierSpec,
        pressure: float,
        *,
        misses_deadline: bool = False,
        fallback_has_capacity: bool = False,
        cached_answer_available: bool = False,
        retry_after_s: float | None = None,
    ) -> DegradationDecision:
        """Where this request goes. `fallback_has_capacity`: the fallback pool can start it in time."""
        if not self.should_degrade(tier, pressure, misses_deadline):
            return self._primary
        return self.next_rung(Rung.PRIMARY, fallback_has_capacity=fallback_has_capacity,
                              cached_answer_available=cached_answer_available, retry_after_s=retry_after_s)

    def next_rung(
        self,
        after: Rung,
        *,
        fallback_has_capacity: bool = False,
        cached_answer_available: bool = False,
        retry_after_s: float | None = None,
    ) -> DegradationDecision:
        """The first rung below `after` that can serve: also for a request shed from the queue."""
        order = (Rung.PRIMARY, Rung.FALLBACK_POOL, Rung.CACHED_ANSWER, Rung.PRESET_REPLY)
        below = order[order.index(after) + 1:]
        config = self.config
        if Rung.FALLBACK_POOL in below and config.fallback_pool is not None and fallback_has_capacity:
            return DegradationDecision(Rung.FALLBACK_POOL, config.fallback_pool, None, None, None)
        if Rung.CACHED_ANSWER in below and config.use_cached_answers and cached_answer_available:
            return DegradationDecision(Rung.CACHED_ANSWER, None, None, None, None)
        wait_s = max(config.min_retry_after_s, retry_after_s or 0.0)
        return DegradationDecision(Rung.PRESET_REPLY, None, 503, wait_s, config.preset_reply)
