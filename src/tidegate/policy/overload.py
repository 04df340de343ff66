"""One facade over the overload policies, so that the runtime and the simulator wire them alike.

It follows a request's way through (../DESIGN): rate-limit admission (reserve) -> predicted wait
(early rejection, Mooncake) -> degradation ladder (Google SRE: degrade before refusing; sheddable
first) -> the pool's fair priority queue (VTC within a tier) -> late-binding dispatch -> settle
(refund unused tokens, correct the fair-share charge). It keeps, per request id, what must be
undone or settled later, so the caller deals only in request ids and never forgets a refund.
Adaptive slots stay per replica (`concurrency.ReplicaSlots`), next to routing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from tidegate.policy.admission import AdmissionDecision, AdmissionOutcome, RateLimiter, Reservation, Settlement
from tidegate.policy.degradation import DegradationDecision, DegradationLadder, LadderConfig, Rung
from tidegate.policy.prediction import WaitPrediction, WaitPredictor, WorkUnit
from tidegate.policy.queueing import FairPriorityQueue, QueuedRequest, ShedReason, ShedRequest
from tidegate.policy.shares import TenantShares
from tidegate.policy.tiers import TierSpec, TierTable

__all__ = [
    "RequestFacts",
    "ArrivalOutcome",
    "ShedNotice",
    "Arrival",
    "Dispatch",
    "PoolPolicies",
    "OverloadControl",
]


@dataclass(frozen=True, slots=True)
class RequestFacts:
    request_id: str
    tenant: str
    tier: str | None  # None: the default tier
    model: str  # the model pool asked for
    prompt_tokens: int
    max_tokens: int
    expected_output_tokens: int | None = None  # fair-share estimate; None: max_tokens
    timeout_s: float | None = None  # the client's `x-request-timeout`, if any


class ArrivalOutcome(Enum):
    QUEUED = "queued"  # waits in `Arrival.pool`; it leaves through `dispatch`
    RATE_LIMITED = "rate_limited"  # answer 429 + Retry-After + rate-limit headers
    TOO_LARGE = "too_large"  # answer 429: it can never fit the tenant's token limit
    CACHED_ANSWER = "cached_answer"  # answer from the cache
    PRESET_REPLY = "preset_reply"  # answer 503 + Retry-After with the preset text


@dataclass(frozen=True, slots=True)
class ShedNotice:
    """A request that was waiting and must be answered now (its reservation is already refunded),
    or, with `moved_to`, one displaced from its pool's queue that now waits in the fallback pool
    (its reservation kept; it leaves through that pool's `dispatch`)."""

    request: QueuedRequest
    reason: ShedReason
    reply: DegradationDecision  # the preset reply: 503 + Retry-After; FALLBACK_POOL when moved
    moved_to: str | None = None


@dataclass(frozen=True, slots=True)
class Arrival:
    outcome: ArrivalOutcome
    tier: TierSpec
    pool: str | None  # with QUEUED: the pool it waits in (the fallback pool when degraded)
    rung: Rung  # the rung serving it; its value goes in the degradation header when not PRIMARY
    admission: AdmissionDecision  # rate-limit headers for the response; retry_after_s for a 429
    prediction: WaitPrediction | None  # None when refused before prediction
    reply: DegradationDecision | None  # with PRESET_REPLY: status, Retry-After and message
    shed: tuple[ShedNotice, ...]  # other requests dropped to make room or found expired


@dataclass(frozen=True, slots=True)
class Dispatch:
    request: QueuedRequest | None  # send it to the replica whose slot freed; None: nothing waits
    shed: tuple[ShedNotice, ...]  # requests found past their deadline: answer them


@dataclass(slots=True)
class PoolPolicies:
    """The queue, wait predictor and degradation ladder of one model pool, and, when isolation is
    on, its tenants' shares (who floods a tier, who stays within its share)."""

    queue: FairPriorityQueue
    predictor: WaitPredictor
    ladder: DegradationLadder
    shares: TenantShares | None = None
    hopeless_checked_s: float = -math.inf  # when the queue was last searched for requests that cannot start in time

    @classmethod
    def create(cls, pool: str, tiers: TierTable, *, max_queued: int, ladder: LadderConfig = LadderConfig(),
               tenant_weights: Mapping[str, float] | None = None, unit: WorkUnit = WorkUnit.TOKENS,
               shares: TenantShares | None = None) -> PoolPolicies:
        return cls(FairPriorityQueue(tiers, max_queued=max_queued, tenant_weights=tenant_weights),
                   WaitPredictor(unit), DegradationLadder(pool, ladder), shares)


class OverloadControl:
    FIRST_TOKEN_WEIGHT = 0.05  # of each sample in the smoothed replica time to first token
    MIN_WAIT_SHARE = 0.25  # the queue wait budget never falls below this share of the tier's maximum
    HOPELESS_CHECK_S = 0.1  # how often a pool's queue is searched for requests that cannot start in time

    def __init__(self, tiers: TierTable, limiter: RateLimiter, pools: Mapping[str, PoolPolicies]) -> None:
        for name, policies in pools.items():
            fallback = policies.ladder.config.fallback_pool
            if fallback is not None and fallback not in pools:
                raise ValueError(f"pool {name} falls back to unknown pool {fallback}")
        self.tiers = tiers
        self.limiter = limiter
        self.pools = dict(pools)
        self._reservations: dict[str, Reservation] = {}  # admitted and not yet settled
        self._dispatched: dict[str, tuple[PoolPolicies, QueuedRequest]] = {}  # left the queue, not finished
        self._moved: set[str] = set()  # displaced to a fallback pool once: never again
        self._first_token_s: dict[tuple[str, str], float] = {}  # (pool, tier) -> smoothed replica TTFT

    def arrive(self, now_s: float, facts: RequestFacts, *, cached_answer_available: bool = False) -> Arrival:
        """Step 1: admission, prediction, degradation and queueing of a new request.

        Raises KeyError for an unknown tier or pool (validate those first: 400 / 404), ValueError
        for a request id already in flight.
        """
        if facts.request_id in self._reservations:
            raise ValueError(f"request {facts.request_id} is already in flight")
        tier = self.tiers.get(facts.tier)
        policies = self.pools[facts.model]  # KeyError: the caller answers 404 before this
        admission = self.limiter.admit(now_s, facts.tenant, facts.model, facts.prompt_tokens, facts.max_tokens)
        if not admission.admitted:
            outcome = (ArrivalOutcome.TOO_LARGE if admission.outcome is AdmissionOutcome.TOO_LARGE
                       else ArrivalOutcome.RATE_LIMITED)
            return Arrival(outcome, tier, None, Rung.PRIMARY, admission, None, None, ())
        assert admission.reservation is not None
        self._reservations[facts.request_id] = admission.reservation
        if policies.shares is not None:  # demand counts whether or not it is served
            policies.shares.on_arrival(now_s, tier.name, facts.tenant, facts.prompt_tokens + facts.max_tokens)

        # expire first: the prediction must not count requests already past their deadline, and
        # the predictor must learn if that emptied the queue
        shed = [self._notice(now_s, policies, item) for item in self._expire(now_s, policies)]
        wait_budget_s = self._wait_budget_s(facts.model, tier, facts)
        deadline_s = now_s + wait_budget_s
        prediction = self._predict(now_s, policies, tier, deadline_s, facts)
        fallback = self._fallback(policies)
        fallback_ok = (fallback is not None
                       and not self._predict(now_s, fallback, tier, deadline_s, facts).misses_deadline)
        decision = policies.ladder.decide(
            tier, prediction.pressure, misses_deadline=prediction.misses_deadline,
            fallback_has_capacity=fallback_ok, cached_answer_available=cached_answer_available,
            retry_after_s=prediction.retry_after_s,
        )
        if decision.rung is Rung.PRIMARY:
            if self._enqueue(now_s, policies, facts, tier, shed, wait_budget_s):
                return Arrival(ArrivalOutcome.QUEUED, tier, facts.model, Rung.PRIMARY, admission, prediction, None,
                               tuple(shed))
            decision = policies.ladder.next_rung(Rung.PRIMARY, fallback_has_capacity=fallback_ok,
                                                 cached_answer_available=cached_answer_available,
                                                 retry_after_s=prediction.retry_after_s)
        if decision.rung is Rung.FALLBACK_POOL and fallback is not None:
            if self._enqueue(now_s, fallback, facts, tier, shed,
                             self._wait_budget_s(fallback.ladder.pool, tier, facts)):
                return Arrival(ArrivalOutcome.QUEUED, tier, decision.pool, Rung.FALLBACK_POOL, admission, prediction,
                               None, tuple(shed))
            decision = policies.ladder.next_rung(Rung.FALLBACK_POOL, cached_answer_available=cached_answer_available,
                                                 retry_after_s=prediction.retry_after_s)
        # Answered without a model: nothing of the reservation is used.
        self._settle(now_s, facts.request_id, 0)
        if decision.rung is Rung.CACHED_ANSWER:
            return Arrival(ArrivalOutcome.CACHED_ANSWER, tier, None, Rung.CACHED_ANSWER, admission, prediction, None,
                           tuple(shed))
        return Arrival(ArrivalOutcome.PRESET_REPLY, tier, None, Rung.PRESET_REPLY, admission, prediction, decision,
                       tuple(shed))

    def dispatch(self, now_s: float, pool: str, skip_tenants: frozenset[str] = frozenset()) -> Dispatch:
        """Step 2: a replica of `pool` has a free slot: the request to send it, if any (passing
        over `skip_tenants` in the tier whose turn it is, as `peek` did)."""
        policies = self.pools[pool]
        # expired first, so that the predictor learns if that emptied the queue; dequeue then finds none
        shed = tuple(self._notice(now_s, policies, item) for item in self._expire(now_s, policies))
        result = policies.queue.dequeue(now_s, skip_tenants)
        request = result.request
        if request is not None:
            policies.predictor.on_dispatch(now_s, request.tokens, queued_after=len(policies.queue))
            if policies.shares is not None:
                policies.shares.on_dispatch(now_s, request.tier, request.tokens)
            self._dispatched[request.request_id] = (policies, request)
        return Dispatch(request, shed)

    def protected(self, now_s: float, pool: str, request: QueuedRequest) -> bool:
        """Whether `request` is served like the best tier: it is of the best tier, or its tenant
        stays within its fair share while another tenant of its tier floods it (`shares`)."""
        if request.tier == self.tiers.best.name:
            return True
        shares = self.pools[pool].shares
        return shares is not None and shares.protects(now_s, request.tier, request.tenant)

    def floods(self, now_s: float, pool: str, tier: str, tenant: str) -> bool:
        """Whether `tenant` sends more than its fair share of `tier` by the isolation's factor."""
        return tenant in self.flooding(now_s, pool, tier)

    def flooding(self, now_s: float, pool: str, tier: str) -> frozenset[str]:
        """The tenants that send more than their fair share of `tier` by the isolation's factor."""
        shares = self.pools[pool].shares
        return frozenset() if shares is None else shares.over_share(now_s, tier)

    def isolating(self, now_s: float, pool: str) -> bool:
        """Whether some tenant floods a tier of `pool` (its tier's other tenants are protected)."""
        return any(self.flooding(now_s, pool, tier.name) for tier in self.tiers)

    def peek(self, pool: str, skip_tenants: frozenset[str] = frozenset()) -> QueuedRequest | None:
        """The request `dispatch` would hand out next, left waiting (to check a replica suits it)."""
        return self.pools[pool].queue.peek(skip_tenants)

    def expire(self, now_s: float, pool: str) -> tuple[ShedNotice, ...]:
        """Requests of `pool` past their deadline (call at `queue.next_deadline_s()`): answer them."""
        policies = self.pools[pool]
        return tuple(self._notice(now_s, policies, item) for item in self._expire(now_s, policies))

    def finish(self, now_s: float, request_id: str, *, prompt_tokens: int, completion_tokens: int) -> Settlement | None:
        """Step 3: a dispatched request ended (completed, failed, client gone): settle its accounts.

        Pass the tokens it really used (0 when it failed before any). Not needed after an arrival
        answered without the model (rate-limited, cached answer, preset reply) or a shed notice.
        """
        dispatched = self._dispatched.pop(request_id, None)
        if dispatched is not None:
            policies, request = dispatched
            policies.queue.settle_service(request, completion_tokens)
            if policies.shares is not None:
                policies.shares.on_finish(now_s, request.tier, request.tokens)
        return self._settle(now_s, request_id, prompt_tokens + completion_tokens)

    def cancel(self, now_s: float, request_id: str) -> bool:
        """The client went away while its request waited: drop it, refund it; False if not waiting.

        A request already dispatched is ended with `finish` (with the tokens it used), not here.
        """
        for policies in self.pools.values():
            if policies.queue.cancel(request_id) is not None:
                self._settle(now_s, request_id, 0)
                if not len(policies.queue):
                    policies.predictor.on_queue_emptied()
                return True
        return False

    # ---- internals ----------------------------------------------------------------------------

    def _expire(self, now_s: float, policies: PoolPolicies) -> tuple[ShedRequest, ...]:
        """Requests past their deadline, and, every `HOPELESS_CHECK_S`, those that can no longer start
        by it (`FairPriorityQueue.shed_hopeless`): a refusal known now is answered now."""
        expired = policies.queue.expire(now_s)
        predictor = policies.predictor
        if (predictor.service_rate_per_s and len(policies.queue)
                and now_s - policies.hopeless_checked_s >= self.HOPELESS_CHECK_S):
            policies.hopeless_checked_s = now_s
            expired += policies.queue.shed_hopeless(now_s, lambda rank: predictor.rate_left_per_s(now_s, rank),
                                                    predictor.unit is WorkUnit.TOKENS)
        if expired and not len(policies.queue):
            policies.predictor.on_queue_emptied()
        return expired

    def observe_first_token(self, pool: str, tier: str, latency_s: float) -> None:
        """A replica's time from dispatch to the first token, for a request of `tier` in `pool`."""
        key = (pool, tier)
        smoothed = self._first_token_s.get(key)
        self._first_token_s[key] = latency_s if smoothed is None else (
            smoothed + self.FIRST_TOKEN_WEIGHT * (latency_s - smoothed))

    def _wait_budget_s(self, pool: str, tier: TierSpec, facts: RequestFacts) -> float:
        """How long the request may wait in the queue: the tier's maximum wait or the client's
        timeout, and no longer than the tier's TTFT target less the replicas' own time to first
        token, since a request that waits longer is answered too late to count, at the cost of
        capacity that one still in time could have used. Never under `MIN_WAIT_SHARE` of the
        tier's maximum wait: replicas slower than the target itself still serve, just late."""
        budget_s = tier.max_queue_wait_s if facts.timeout_s is None else min(tier.max_queue_wait_s, facts.timeout_s)
        first_token_s = self._first_token_s.get((pool, tier.name))
        if first_token_s is not None:
            budget_s = min(budget_s, max(tier.ttft_target_s - first_token_s,
                                         self.MIN_WAIT_SHARE * tier.max_queue_wait_s))
        return budget_s

    @staticmethod
    def _predict(now_s: float, policies: PoolPolicies, tier: TierSpec, deadline_s: float,
                 facts: RequestFacts | None = None) -> WaitPrediction:
        ahead = (policies.queue.work_ahead(tier.name) if facts is None else
                 policies.queue.work_ahead(tier.name, facts.tenant, facts.prompt_tokens + facts.max_tokens))
        return policies.predictor.predict(now_s, ahead, deadline_s, tier.rank)

    def _fallback(self, policies: PoolPolicies) -> PoolPolicies | None:
        name = policies.ladder.config.fallback_pool
        return None if name is None else self.pools[name]

    def _enqueue(self, now_s: float, policies: PoolPolicies, facts: RequestFacts, tier: TierSpec,
                 shed: list[ShedNotice], wait_budget_s: float | None) -> bool:
        expected = facts.max_tokens if facts.expected_output_tokens is None else facts.expected_output_tokens
        decision = policies.queue.enqueue(now_s, request_id=facts.request_id, tenant=facts.tenant, tier=tier.name,
                                          prompt_tokens=facts.prompt_tokens, expected_output_tokens=expected,
                                          timeout_s=wait_budget_s)
        if decision.queued:
            policies.predictor.on_queued(now_s, tier.rank, facts.prompt_tokens + expected)
        for item in decision.shed:
            moved_to = self._move_to_fallback(now_s, policies, item, shed)
            if moved_to is None:
                shed.append(self._notice(now_s, policies, item))
            else:
                reply = policies.ladder.next_rung(Rung.PRIMARY, fallback_has_capacity=True)
                shed.append(ShedNotice(item.request, item.reason, reply, moved_to))
        return decision.queued

    def _move_to_fallback(self, now_s: float, policies: PoolPolicies, item: ShedRequest,
                          shed: list[ShedNotice]) -> str | None:
        """A request displaced by a better tier tries the fallback pool, once, before the preset
        reply; one whose deadline has come, or that the fallback could not start by it, does not."""
        fallback, request = self._fallback(policies), item.request
        if (fallback is None or item.reason is not ShedReason.DISPLACED or request.request_id in self._moved
                or request.deadline_s <= now_s):
            return None
        tier = self.tiers[request.tier]
        if self._predict(now_s, fallback, tier, request.deadline_s).misses_deadline:
            return None
        facts = RequestFacts(request.request_id, request.tenant, request.tier, fallback.ladder.pool,
                             request.prompt_tokens, request.expected_output_tokens,
                             expected_output_tokens=request.expected_output_tokens,
                             timeout_s=request.deadline_s - now_s)
        self._moved.add(request.request_id)
        if not self._enqueue(now_s, fallback, facts, tier, shed, facts.timeout_s):
            return None
        return fallback.ladder.pool

    def _notice(self, now_s: float, policies: PoolPolicies, item: ShedRequest) -> ShedNotice:
        self._settle(now_s, item.request.request_id, 0)
        prediction = self._predict(now_s, policies, self.tiers[item.request.tier], now_s)
        reply = policies.ladder.next_rung(Rung.CACHED_ANSWER, retry_after_s=prediction.retry_after_s)
        return ShedNotice(item.request, item.reason, reply)

    def _settle(self, now_s: float, request_id: str, used_tokens: int) -> Settlement | None:
        self._moved.discard(request_id)
        reservation = self._reservations.pop(request_id, None)
        return None if reservation is None else self.limiter.settle(now_s, reservation, used_tokens)

    @property
    def open_requests(self) -> int:
        """Admitted requests not yet settled: should return to 0 when traffic stops."""
        return len(self._reservations)

