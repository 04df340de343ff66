"""Overload control above the pools: rate limits, the degradation ladder, and the pools' controllers.

A request's way through (../DESIGN): rate-limit admission (reserve) -> its pool's controller
(`policy.pool`: the queue, predicted wait, early refusal, late-binding dispatch, engine levels) ->
the degradation ladder when the controller refuses it or the pool is pressed (Google SRE: degrade
before refusing; sheddable first) -> settle (refund unused tokens). Everything about when and where
a request runs is the controller's; this facade decides only what an arrival is answered with
when its pool will not take it, and keeps the rate limiter's accounts, per request id, so that the
caller never forgets a refund. A rate-limit decision may also be taken outside (a store shared by
several gateways: `arrive(admission=...)`); its reservation is then the caller's to settle, and
`finish` only gives the settlement's arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from tidegate.policy.admission import AdmissionDecision, AdmissionOutcome, RateLimiter, Reservation, Settlement
from tidegate.policy.degradation import DegradationDecision, DegradationLadder, LadderConfig, Rung
from tidegate.policy.pool import REFUSED_NO_REPLICA, PoolController
from tidegate.policy.tiers import TierSpec, TierTable
from tidegate.types import ArrivalDecision, ArrivalVerdict, Assignment, PoolRequest, Refusal

__all__ = [
    "ArrivalOutcome",
    "ShedNotice",
    "Arrival",
    "PoolPolicies",
    "OverloadControl",
]


class ArrivalOutcome(Enum):
    QUEUED = "queued"  # held by `Arrival.pool`'s controller until it assigns or refuses it
    ASSIGNED = "assigned"  # `Arrival.pool`'s controller assigned it a replica at once: `Arrival.assignment`
    RATE_LIMITED = "rate_limited"  # answer 429 + Retry-After + rate-limit headers
    TOO_LARGE = "too_large"  # answer 429: it can never fit the tenant's token limit
    CACHED_ANSWER = "cached_answer"  # answer from the cache
    PRESET_REPLY = "preset_reply"  # answer 503 + Retry-After with the preset text
    NO_REPLICA = "no_replica"  # answer 503: no replica of the pool (or its fallback) is routable


@dataclass(frozen=True, slots=True)
class ShedNotice:
    """A queued request pushed out by a better one: answer it with `reply`, or, with `moved_to`,
    it now waits in that fallback pool (its reservation kept)."""

    request_id: str
    tier: str
    pool: str  # the pool it was pushed out of
    reason: str
    reply: DegradationDecision
    moved_to: str | None = None
    assignment: Assignment | None = None  # with `moved_to`: the fallback pool assigned it at once


class Arrival(NamedTuple):
    outcome: ArrivalOutcome
    tier: TierSpec
    pool: str | None  # with QUEUED or ASSIGNED: the pool it waits in (the fallback pool when degraded)
    rung: Rung  # the rung serving it; its value goes in the degradation header when not PRIMARY
    admission: AdmissionDecision  # rate-limit headers for the response; retry_after_s for a 429
    predicted_wait_s: float | None  # the controller's prediction when it queued it
    reason: str | None  # why the pool refused it (the controller's reason), when it did
    reply: DegradationDecision | None  # with PRESET_REPLY: status, Retry-After and message
    shed: tuple[ShedNotice, ...]  # other requests pushed out to make room: answer them
    assignment: Assignment | None = None  # with ASSIGNED


@dataclass(slots=True)
class PoolPolicies:
    """One model pool: its controller (the whole dispatch decision) and its degradation ladder."""

    controller: PoolController
    ladder: DegradationLadder

    @classmethod
    def create(cls, pool: str, controller: PoolController, ladder: LadderConfig = LadderConfig()) -> PoolPolicies:
        return cls(controller, DegradationLadder(pool, ladder))


# every request's admission when no rate limit is configured (`RateLimiter.unlimited`): the limiter
# would keep no account of it, so none is built (its reservation None: nothing reserved), nor settled
_NO_LIMITS = AdmissionDecision(AdmissionOutcome.ADMITTED, None, None, None, None, "")
# read on every arrival as a module name: through its class, on Python 3.10 and 3.11, the read goes
# through `EnumType.__getattr__`'s slot hook (some 850 instructions)
_ADMITTED = AdmissionOutcome.ADMITTED
_ASSIGNED_OUTCOME = ArrivalOutcome.ASSIGNED  # and these two for every request assigned at once under rate limits
_PRIMARY = Rung.PRIMARY


@dataclass(slots=True)
class _Admitted:
    reservation: Reservation | None  # None: no limit applies, nothing to settle
    request: PoolRequest
    moved: bool = False  # waits in a fallback pool already: never moved again
    cached_answer: bool = False  # the cache holds an answer to it: the ladder's cached-answer rung can serve it
    external: bool = False  # admitted by a limiter outside this object: settled there, not by `limiter`


class OverloadControl:
    def __init__(self, tiers: TierTable, limiter: RateLimiter, pools: Mapping[str, PoolPolicies]) -> None:
        for name, policies in pools.items():
            fallback = policies.ladder.config.fallback_pool
            if fallback is not None and fallback not in pools:
                raise ValueError(f"pool {name} falls back to unknown pool {fallback}")
        self.tiers = tiers
        self._tier_specs = {tier.name: tier for tier in tiers}  # a dict's lookup: no call per request
        self.limiter = limiter
        self._no_limits = limiter.unlimited
        self.pools = dict(pools)
        # admitted and not yet settled; a request with nothing to settle, no cached answer and not yet
        # moved is kept as its own record (the common case: no `_Admitted` is built for it; `_admitted_of`)
        self._admitted: dict[str, _Admitted | PoolRequest] = {}

    def arrive(self, now_s: float, model: str, request: PoolRequest, *, cached_answer_available: bool = False,
               admission: AdmissionDecision | None = None) -> Arrival | Assignment:
        """Admission, then the pool `model`'s controller, then the ladder when it will not take the
        request. `request` is the one record of it the controllers keep: its tier a configured tier's
        name (`tiers.get(None).name` for the default), its arrival `now_s`. The common case below
        capacity with no rate limit configured, a request its pool assigned at once, is answered with
        the controller's `Assignment` alone (no record built around it); every other, with an `Arrival`.

        `admission`: the rate-limit decision, when a limiter outside this object took it (one shared
        by several gateways); its reservation is then settled by that limiter, never by `limiter`.
        Raises KeyError for an unknown tier or pool (validate those first: 401 / 404), ValueError
        for a request id already in flight.
        """
        request_id = request.request_id
        if request_id in self._admitted:
            raise ValueError(f"request {request_id} is already in flight")
        tier = self._tier_specs[request.tier]
        policies = self.pools[model]
        external = admission is not None
        if admission is None:
            admission = _NO_LIMITS if self._no_limits else self.limiter.admit(
                now_s, request.tenant, model, request.prompt_tokens, request.max_output_tokens)
        if admission is not _NO_LIMITS and admission.outcome is not _ADMITTED:  # no limit: admitted, no read
            outcome = (ArrivalOutcome.TOO_LARGE if admission.outcome is AdmissionOutcome.TOO_LARGE
                       else ArrivalOutcome.RATE_LIMITED)
            return Arrival(outcome, tier, None, Rung.PRIMARY, admission, None, None, None, ())
        if admission is _NO_LIMITS and not cached_answer_available:
            self._admitted[request_id] = request
        else:
            self._admitted[request_id] = _Admitted(admission.reservation, request, False, cached_answer_available,
                                                   external)
        decision = policies.controller.on_arrival(now_s, request)
        if type(decision) is Assignment:  # nothing waited: nothing pressed, nothing shed
            if admission is _NO_LIMITS:  # and no rate limit to report: the assignment says it all
                return decision
            return Arrival(_ASSIGNED_OUTCOME, tier, model, _PRIMARY, admission, 0.0, None, None, (),
                           decision)
        shed = self._displaced(now_s, policies, decision.displaced)
        fallback = self._fallback(policies)
        if decision.verdict is ArrivalVerdict.QUEUED:
            # a pressed pool sends the tiers that degrade first to a lighter model while it can
            # start them in time; without one they stay: refusing what would be served in time
            # is not protection
            if fallback is not None and policies.ladder.should_degrade(tier, decision.pressure):
                moved = self._move(now_s, fallback, request_id, request, shed)
                if moved is not None:
                    policies.controller.on_cancel(now_s, request_id)
                    return self._moved(moved, tier, fallback, admission, None, shed)
            return Arrival(ArrivalOutcome.QUEUED, tier, model, Rung.PRIMARY, admission,
                           decision.predicted_wait_s, None, None, tuple(shed))
        after = Rung.PRIMARY
        if fallback is not None:
            moved = self._move(now_s, fallback, request_id, request, shed)
            if moved is not None:
                return self._moved(moved, tier, fallback, admission, decision.reason, shed)
            after = Rung.FALLBACK_POOL
        # answered without a model: nothing of the reservation is used
        self.finish(now_s, request_id, used_tokens=0)
        reply = policies.ladder.next_rung(after, cached_answer_available=cached_answer_available,
                                          retry_after_s=decision.retry_after_s)
        if reply.rung is Rung.CACHED_ANSWER:
            outcome = ArrivalOutcome.CACHED_ANSWER
        elif decision.reason == REFUSED_NO_REPLICA:
            outcome = ArrivalOutcome.NO_REPLICA
        else:
            outcome = ArrivalOutcome.PRESET_REPLY
        return Arrival(outcome, tier, None, reply.rung, admission, None, decision.reason, reply, tuple(shed))

    def refusal_reply(self, pool: str, refusal: Refusal) -> DegradationDecision:
        """What to answer a queued request its controller gave up (deadline, no replica, pushed out):
        a cached answer when the cache holds one, else the preset reply. A query."""
        admitted = self._admitted.get(str(refusal.request_id))
        return self.pools[pool].ladder.next_rung(Rung.FALLBACK_POOL, retry_after_s=refusal.retry_after_s,
                                                 cached_answer_available=type(admitted) is _Admitted
                                                 and admitted.cached_answer)

    def finish(self, now_s: float, request_id: str, *, used_tokens: int) -> Settlement | None:
        """A request admitted by `arrive` ended, however it ended (served, failed, refused while
        queued, client gone): settle its reservation with the tokens it used. Idempotent. None: nothing
        to settle (settled already, or no rate limit is configured)."""
        admitted = self._admitted.pop(request_id, None)
        if type(admitted) is not _Admitted or admitted.reservation is None:  # a bare request: nothing reserved
            return None
        if admitted.external:  # its limiter settles it: what it is to refund, or charge beyond the reservation
            reserved = admitted.reservation.reserved_tokens
            refund = max(0, reserved - used_tokens)
            return Settlement(reserved, used_tokens, refund, float(reserved - refund + max(0, used_tokens - reserved)))
        return self.limiter.settle(now_s, admitted.reservation, used_tokens)

    @property
    def open_requests(self) -> int:
        """Admitted requests not yet settled: should return to 0 when traffic stops."""
        return len(self._admitted)

    # ---- internals ----------------------------------------------------------------------------

    @staticmethod
    def _moved(moved: ArrivalDecision | Assignment, tier: TierSpec, fallback: PoolPolicies,
               admission: AdmissionDecision,
               reason: str | None, shed: list[ShedNotice]) -> Arrival:
        outcome = ArrivalOutcome.ASSIGNED if moved.verdict is ArrivalVerdict.ASSIGNED else ArrivalOutcome.QUEUED
        return Arrival(outcome, tier, fallback.ladder.pool, Rung.FALLBACK_POOL, admission, moved.predicted_wait_s,
                       reason, None, tuple(shed), moved.assignment)

    def _fallback(self, policies: PoolPolicies) -> PoolPolicies | None:
        name = policies.ladder.config.fallback_pool
        return None if name is None else self.pools[name]

    def _move(self, now_s: float, fallback: PoolPolicies, request_id: str, request: PoolRequest,
              shed: list[ShedNotice]) -> ArrivalDecision | Assignment | None:
        """Queues the request in the fallback pool, once; None when that pool refuses it too."""
        admitted = self._admitted_of(request_id)
        if admitted.moved:
            return None
        decision = fallback.controller.on_arrival(now_s, request)
        shed += self._displaced(now_s, fallback, decision.displaced)
        if decision.verdict is ArrivalVerdict.REFUSED:
            return None
        admitted.moved = True
        return decision

    def _admitted_of(self, request_id: str) -> _Admitted:
        """The request's `_Admitted`, built now for one kept as its bare request (`test_overload`'s
        moves and sheds of requests admitted without rate limits)."""
        admitted = self._admitted[request_id]
        if type(admitted) is not _Admitted:
            admitted = self._admitted[request_id] = _Admitted(None, admitted)
        return admitted

    def _displaced(self, now_s: float, policies: PoolPolicies, refusals: tuple[Refusal, ...]) -> list[ShedNotice]:
        """Requests a better one pushed out of `policies`' queue try the fallback pool, once, with
        what is left of their wait; the rest get the preset reply."""
        notices: list[ShedNotice] = []
        fallback = self._fallback(policies)
        pool = policies.ladder.pool
        for refusal in refusals:
            request_id = str(refusal.request_id)
            admitted = self._admitted.get(request_id)
            if admitted is None:
                continue
            request = admitted if type(admitted) is PoolRequest else admitted.request
            if fallback is not None:
                tier = self.tiers[request.tier]
                left_s = tier.max_queue_wait_s - (now_s - request.arrival_s)
                if request.timeout_s is not None:
                    left_s = min(left_s, request.timeout_s - (now_s - request.arrival_s))
                if left_s > 0:
                    moved = self._move(now_s, fallback, request_id, request._replace(timeout_s=left_s), notices)
                    if moved is not None:
                        reply = policies.ladder.next_rung(Rung.PRIMARY, fallback_has_capacity=True)
                        notices.append(ShedNotice(request_id, request.tier, pool, refusal.reason, reply,
                                                  fallback.ladder.pool, moved.assignment))
                        continue
            notices.append(ShedNotice(request_id, request.tier, pool, refusal.reason,
                                      self.refusal_reply(pool, refusal)))
        return notices
