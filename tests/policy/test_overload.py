"""The overload facade: rate limits, the pools' controllers, the ladder, settlement."""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.policy.admission import RateLimit, RateLimiter
from tidegate.policy.degradation import LadderConfig, Rung
from tidegate.policy.overload import Arrival, ArrivalOutcome, OverloadControl, PoolPolicies
from tidegate.policy.pool import PoolController, PoolReplica, PoolSettings
from tidegate.policy.tiers import TierSpec, TierTable, default_tiers
from tidegate.types import Assignment, PoolRequest, ReplicaHealth

TIERS = default_tiers()
_ids = itertools.count()


def _pool(name: str, tiers: TierTable = TIERS, max_requests: int = 1, fallback: str | None = None) -> PoolPolicies:
    controller = PoolController((PoolReplica(f"{name}#0", max_requests=max_requests),), tiers)
    return PoolPolicies.create(name, controller, LadderConfig(fallback_pool=fallback))


def _control(*, tpm: int = 100_000, fallback: bool = False, tiers: TierTable = TIERS) -> OverloadControl:
    pools = {"big": _pool("big", tiers, fallback="small" if fallback else None), "small": _pool("small", tiers)}
    return OverloadControl(tiers, RateLimiter(default_limit=RateLimit(requests_per_minute=10_000,
                                                                      tokens_per_minute=tpm)), pools)


class _Facts(NamedTuple):
    """A request as a test sends it: the pool it asks for, and the one record the controllers keep."""

    model: str
    request: PoolRequest

    @property
    def request_id(self) -> str:
        return str(self.request.request_id)


def _facts(tier: str = "standard", tenant: str = "t", model: str = "big", request_id: str | None = None,
           prompt_tokens: int = 10) -> _Facts:
    return _Facts(model, PoolRequest(request_id or f"r{next(_ids)}", 0.0, tenant, tier, prompt_tokens, 90))


def _arrive(control: OverloadControl, now_s: float, facts: _Facts, **options: Any) -> Arrival | Assignment:
    return control.arrive(now_s, facts.model, facts.request._replace(arrival_s=now_s), **options)


def _remaining_tokens(control: OverloadControl, now_s: float) -> int:
    return control.limiter.headers(now_s, "t", "big").remaining_tokens


def _take_the_slot(control: OverloadControl, model: str = "big") -> _Facts:
    """The pool's one slot taken by a request assigned at arrival: the next ones queue."""
    facts = _facts(model=model)
    arrival = _arrive(control, 0.0, facts)  # with no rate limit configured, the assignment alone
    assert type(arrival) is Assignment or arrival.outcome is ArrivalOutcome.ASSIGNED
    return facts


def test_request_is_assigned_at_once_when_nothing_waits_and_settles() -> None:
    control = _control()
    facts = _facts()
    arrival = _arrive(control, 0.0, facts)
    assert (arrival.outcome, arrival.pool, arrival.rung) == (ArrivalOutcome.ASSIGNED, "big", Rung.PRIMARY)
    assert arrival.assignment is not None and arrival.assignment.request_id == facts.request_id
    assert _remaining_tokens(control, 0.0) == 100_000 - 100
    control.finish(1.0, facts.request_id, used_tokens=30)
    assert control.open_requests == 0
    assert _remaining_tokens(control, 1.0) >= 100_000 - 30


def test_request_queues_behind_a_full_replica_and_is_assigned_when_it_frees() -> None:
    control = _control()
    first = _take_the_slot(control)
    facts = _facts()
    arrival = _arrive(control, 0.0, facts)
    assert (arrival.outcome, arrival.pool, arrival.assignment) == (ArrivalOutcome.QUEUED, "big", None)
    controller = control.pools["big"].controller
    controller.on_first_token(0.1, first.request_id)
    controller.on_finish(0.2, first.request_id)
    assignment, = controller.on_capacity(0.2).assignments
    assert assignment.request_id == facts.request_id


def test_rate_limited_request_is_not_queued() -> None:
    control = _control(tpm=150)
    _take_the_slot(control)
    arrival = _arrive(control, 0.0, _facts())
    assert arrival.outcome is ArrivalOutcome.RATE_LIMITED and arrival.admission.retry_after_s
    assert control.pools["big"].controller.queued == 0 and control.open_requests == 1


def _one_slot_tiers() -> TierTable:
    return TierTable((TierSpec("critical", rank=0, queue_bound=10, max_queue_wait_s=2.5, ttft_target_s=3.0),
                      TierSpec("standard", rank=1, queue_bound=1, max_queue_wait_s=4.0, ttft_target_s=5.0,
                               degrade_at_pressure=0.9)), default_tier="standard")


def test_a_request_its_pool_refuses_gets_the_preset_reply_and_is_refunded() -> None:
    control = _control(tiers=_one_slot_tiers())
    _take_the_slot(control)
    _arrive(control, 0.0, _facts())
    arrival = _arrive(control, 0.0, _facts())  # standard's queue holds one
    assert arrival.outcome is ArrivalOutcome.PRESET_REPLY and arrival.reply is not None
    assert arrival.reply.status == 503 and arrival.reply.retry_after_s and arrival.reason == "tier_full"
    assert control.open_requests == 2


def test_a_request_its_pool_refuses_goes_to_the_fallback_pool() -> None:
    control = _control(tiers=_one_slot_tiers(), fallback=True)
    _take_the_slot(control)
    _arrive(control, 0.0, _facts())
    arrival = _arrive(control, 0.0, _facts())
    # nothing waits in the lighter pool: it starts there at once
    assert (arrival.outcome, arrival.pool, arrival.rung) == (ArrivalOutcome.ASSIGNED, "small", Rung.FALLBACK_POOL)
    assert arrival.assignment is not None and arrival.assignment.replica_id == "small#0"
    arrival = _arrive(control, 0.0, _facts())  # ... and with its one slot taken, the next one queues there
    assert (arrival.outcome, arrival.pool) == (ArrivalOutcome.QUEUED, "small")
    assert control.pools["small"].controller.queued == 1


def test_cached_answer_is_used_before_the_preset_reply() -> None:
    control = _control(tiers=_one_slot_tiers())
    _take_the_slot(control)
    _arrive(control, 0.0, _facts())
    arrival = _arrive(control, 0.0, _facts(), cached_answer_available=True)
    assert arrival.outcome is ArrivalOutcome.CACHED_ANSWER


def test_no_routable_replica_is_its_own_outcome() -> None:
    control = _control()
    control.pools["big"].controller.on_replica_health(0.0, "big#0", ReplicaHealth.UNHEALTHY)
    arrival = _arrive(control, 0.0, _facts())
    assert arrival.outcome is ArrivalOutcome.NO_REPLICA and control.open_requests == 0


def _roomy_tiers() -> TierTable:
    return TierTable((TierSpec("critical", rank=0, queue_bound=10, max_queue_wait_s=2.5, ttft_target_s=3.0),
                      TierSpec("standard", rank=1, queue_bound=10, max_queue_wait_s=4.0, ttft_target_s=5.0)),
                     default_tier="standard")


def test_a_displaced_request_is_answered_and_a_better_one_takes_its_place() -> None:
    full = _roomy_tiers()
    pools = {"big": PoolPolicies.create("big", PoolController((PoolReplica("b", max_requests=1),), full,
                                                              settings=PoolSettings(max_queued=1)))}
    control = OverloadControl(full, RateLimiter(), pools)
    _take_the_slot(control)
    waiting = _facts()
    _arrive(control, 0.0, waiting)
    arrival = _arrive(control, 0.0, _facts("critical"))
    assert arrival.outcome is ArrivalOutcome.QUEUED
    notice, = arrival.shed
    assert (notice.request_id, notice.moved_to, notice.reply.rung) == (waiting.request_id, None, Rung.PRESET_REPLY)


def test_a_displaced_request_moves_to_the_fallback_pool_once() -> None:
    full = _roomy_tiers()
    small = PoolController((PoolReplica("s", max_requests=1),), full, settings=PoolSettings(max_queued=1))
    pools = {"big": PoolPolicies.create("big", PoolController((PoolReplica("b", max_requests=1),), full,
                                                              settings=PoolSettings(max_queued=1)),
                                        LadderConfig(fallback_pool="small")),
             "small": PoolPolicies.create("small", small)}
    control = OverloadControl(full, RateLimiter(), pools)
    _take_the_slot(control)
    _take_the_slot(control, "small")
    waiting = _facts()
    _arrive(control, 0.0, waiting)
    notice, = _arrive(control, 1.0, _facts("critical")).shed
    assert notice.moved_to == "small" and notice.assignment is None and small.queued == 1
    # pushed out of the fallback too: answered, not moved back
    arrival = _arrive(control, 1.0, _facts("critical", model="small"))
    notice, = arrival.shed
    assert notice.request_id == waiting.request_id and notice.moved_to is None


def test_a_request_moved_once_is_not_moved_again_down_a_chain_of_fallbacks() -> None:
    """With no rate limit, a request is kept as its bare record until it moves: the move is remembered."""
    full = _roomy_tiers()

    def pool(name: str, fallback: str | None) -> PoolPolicies:
        controller = PoolController((PoolReplica(name[0], max_requests=1),), full, settings=PoolSettings(max_queued=1))
        return PoolPolicies.create(name, controller, LadderConfig(fallback_pool=fallback))

    pools = {"big": pool("big", "small"), "small": pool("small", "tiny"), "tiny": pool("tiny", None)}
    control = OverloadControl(full, RateLimiter(), pools)
    for model in pools:
        _take_the_slot(control, model)
    waiting = _facts()
    _arrive(control, 0.0, waiting)
    notice, = _arrive(control, 1.0, _facts("critical")).shed
    assert notice.moved_to == "small"
    notice, = _arrive(control, 1.0, _facts("critical", model="small")).shed
    assert notice.request_id == waiting.request_id and notice.moved_to is None


def test_pressure_sends_a_tier_that_degrades_early_to_the_fallback_but_never_refuses_it() -> None:
    """Sheddable degrades at pressure 0.5: to a lighter pool if there is one; kept otherwise,
    since it would still start by its deadline."""
    for fallback in (True, False):
        control = _control(fallback=fallback)
        controller = control.pools["big"].controller
        # a measured service rate: 1 request every 0.1 s with a backlog (one slot)
        backlog = [_facts("standard", tenant=f"t{i}") for i in range(60)]
        arrivals = [_arrive(control, 0.0, facts) for facts in backlog]
        now_s = 0.0
        sent = [a.assignment.request_id for a in arrivals if a.assignment is not None]
        sent += [a.request_id for a in controller.on_capacity(now_s).assignments]
        for _ in range(30):
            now_s += 0.1
            controller.on_finish(now_s, sent[-1])
            sent += [a.request_id for a in controller.on_capacity(now_s).assignments]
        arrival = _arrive(control, now_s, _facts("sheddable"))
        assert arrival.outcome in (ArrivalOutcome.QUEUED, ArrivalOutcome.ASSIGNED)
        assert (arrival.pool, arrival.rung) == (("small", Rung.FALLBACK_POOL) if fallback else ("big", Rung.PRIMARY))


def test_a_request_id_in_flight_cannot_arrive_again() -> None:
    control = _control()
    facts = _facts()
    _arrive(control, 0.0, facts)
    with pytest.raises(ValueError, match="in flight"):
        _arrive(control, 0.0, facts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["arrive", "assign", "finish", "refuse"]),
                          st.sampled_from(["critical", "standard", "sheddable"])), max_size=40))
def test_every_reservation_is_settled_exactly_once(ops) -> None:
    """Whatever happens, finishing every admitted request returns the limiter to whole."""
    control = _control(tpm=10_000_000, fallback=True, tiers=TIERS)
    admitted: list[str] = []
    now_s = 0.0
    for op, tier in ops:
        now_s += 0.05
        if op == "arrive":
            facts = _facts(tier)
            if _arrive(control, now_s, facts).outcome in (ArrivalOutcome.QUEUED, ArrivalOutcome.ASSIGNED):
                admitted.append(facts.request_id)
        elif op == "assign":
            for name in ("big", "small"):
                control.pools[name].controller.on_capacity(now_s)
        elif admitted:
            request_id = admitted.pop(0)
            for name in ("big", "small"):
                control.pools[name].controller.on_cancel(now_s, request_id)
            control.finish(now_s, request_id, used_tokens=5)
            control.finish(now_s, request_id, used_tokens=5)  # idempotent
    for request_id in admitted:
        control.finish(now_s, request_id, used_tokens=0)
    assert control.open_requests == 0
    assert _remaining_tokens(control, now_s + 120) == 10_000_000


def test_with_no_rate_limit_configured_nothing_is_reserved_nor_settled() -> None:
    pools = {"big": _pool("big", TIERS), "small": _pool("small", TIERS)}
    control = OverloadControl(TIERS, RateLimiter(), pools)
    facts = _facts()
    # assigned at once with no rate limit to report: the controller's assignment is the whole answer
    assert _arrive(control, 0.0, facts) == Assignment(facts.request_id, "big#0", 2)
    assert control.finish(1.0, facts.request_id, used_tokens=30) is None  # no reservation was kept
    assert control.open_requests == 0
    _arrive(control, 1.0, _facts())  # the slot taken: the next one queues, and is told so
    assert _arrive(control, 1.0, _facts()).outcome is ArrivalOutcome.QUEUED
