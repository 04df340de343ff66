"""The overload facade: a request's way through admission, prediction, ladder, queue, dispatch, settle."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.policy.admission import RateLimit, RateLimiter
from tidegate.policy.degradation import LadderConfig, Rung
from tidegate.policy.overload import ArrivalOutcome, OverloadControl, PoolPolicies, RequestFacts
from tidegate.policy.prediction import WorkUnit
from tidegate.policy.queueing import ShedReason
from tidegate.policy.shares import TenantShares
from tidegate.policy.tiers import default_tiers

TIERS = default_tiers()
_ids = itertools.count()


def _control(*, tpm: int = 100_000, max_queued: int = 100, fallback: bool = False) -> OverloadControl:
    pools = {"big": PoolPolicies.create("big", TIERS, max_queued=max_queued, unit=WorkUnit.REQUESTS,
                                        ladder=LadderConfig(fallback_pool="small" if fallback else None)),
             "small": PoolPolicies.create("small", TIERS, max_queued=max_queued, unit=WorkUnit.REQUESTS)}
    return OverloadControl(TIERS, RateLimiter(default_limit=RateLimit(requests_per_minute=10_000, tokens_per_minute=tpm)),
                           pools)


def _facts(tier: str = "standard", tenant: str = "t", model: str = "big", request_id: str | None = None) -> RequestFacts:
    return RequestFacts(request_id or f"r{next(_ids)}", tenant, tier, model, prompt_tokens=10, max_tokens=90)


def _impatient_sheddable(request_id: str) -> RequestFacts:
    return RequestFacts(request_id, "s", "sheddable", "big", prompt_tokens=10, max_tokens=90, timeout_s=3.0)


def _remaining_tokens(control: OverloadControl, now_s: float) -> int:
    return control.limiter.headers(now_s, "t", "big").remaining_tokens


DISPATCHED_BY_SATURATE = 12


def _saturate(control: OverloadControl, pool: str = "big", rate_per_s: float = 10.0, backlog: int = 100,
              one_tenant: bool = False, tier: str = "standard") -> float:
    """Queues `backlog` requests of `tier` and dispatches a few at `rate_per_s`, so the pool's rate is
    known. From as many tenants, or all from tenant "t" (`one_tenant`). What the queue cannot start
    by its deadline at that rate is refused as soon as the rate is known."""
    for index in range(backlog):
        control.arrive(0.0, _facts(model=pool, tier=tier, tenant="t" if one_tenant else f"t{index}"))
    now_s = 0.0
    for _ in range(DISPATCHED_BY_SATURATE):  # the first rate estimate takes 1 s of backlogged dispatches
        now_s += 1.0 / rate_per_s
        control.dispatch(now_s, pool)
    return now_s


def test_request_queues_dispatches_and_settles() -> None:
    control = _control(tpm=1000)
    arrival = control.arrive(0.0, _facts(request_id="a"))
    assert arrival.outcome is ArrivalOutcome.QUEUED and arrival.pool == "big"
    assert _remaining_tokens(control, 0.0) == 900  # prompt + max_tokens reserved
    assert control.dispatch(0.0, "big").request.request_id == "a"
    settlement = control.finish(0.0, "a", prompt_tokens=10, completion_tokens=20)
    assert settlement.refunded_tokens == 70
    assert _remaining_tokens(control, 0.0) == 970
    assert control.open_requests == 0


def test_rate_limited_request_is_not_queued() -> None:
    control = _control(tpm=150)
    control.arrive(0.0, _facts())
    arrival = control.arrive(0.0, _facts())
    assert arrival.outcome is ArrivalOutcome.RATE_LIMITED and arrival.admission.retry_after_s > 0
    assert len(control.pools["big"].queue) == 1


def test_predicted_miss_is_answered_at_once_and_refunded() -> None:
    control = _control(tpm=1_000_000)
    now_s = _saturate(control, tier="sheddable")  # ~75 still queued at 10 requests/s: 7.5 s ahead
    before = _remaining_tokens(control, now_s)
    arrival = control.arrive(now_s, _impatient_sheddable("impatient"))  # may wait 3 s
    assert arrival.outcome is ArrivalOutcome.PRESET_REPLY
    assert arrival.reply.status == 503 and arrival.reply.retry_after_s >= 1.0
    assert _remaining_tokens(control, now_s) == before


def test_critical_still_queues_when_sheddable_is_refused() -> None:
    control = _control()
    now_s = _saturate(control, tier="sheddable")
    assert control.arrive(now_s, _impatient_sheddable("refused")).outcome is not ArrivalOutcome.QUEUED
    assert control.arrive(now_s, _facts(tier="critical")).outcome is ArrivalOutcome.QUEUED


def test_pressed_sheddable_request_goes_to_the_fallback_pool() -> None:
    control = _control(fallback=True)
    now_s = _saturate(control, tier="sheddable")
    arrival = control.arrive(now_s, _impatient_sheddable("pressed"))
    assert (arrival.outcome, arrival.pool, arrival.rung) == (ArrivalOutcome.QUEUED, "small", Rung.FALLBACK_POOL)


def test_cached_answer_is_used_before_the_preset_reply() -> None:
    control = _control()
    now_s = _saturate(control, tier="sheddable")
    arrival = control.arrive(now_s, _impatient_sheddable("cached"), cached_answer_available=True)
    assert arrival.outcome is ArrivalOutcome.CACHED_ANSWER


def test_displaced_request_is_answered_and_refunded() -> None:
    control = _control(max_queued=1)
    control.arrive(0.0, _facts(tier="sheddable", request_id="low"))
    arrival = control.arrive(0.0, _facts(tier="critical"))
    assert [(n.request.request_id, n.reason, n.reply.status) for n in arrival.shed] == [("low", ShedReason.DISPLACED, 503)]
    assert control.open_requests == 1


def test_displaced_request_moves_to_the_fallback_pool_keeping_its_reservation_and_deadline() -> None:
    control = _control(max_queued=1, fallback=True, tpm=1000)
    control.arrive(0.0, _facts(tier="sheddable", request_id="low"))
    before = _remaining_tokens(control, 2.0)
    arrival = control.arrive(2.0, _facts(tier="critical"))
    [notice] = arrival.shed
    assert (notice.request.request_id, notice.reason, notice.moved_to) == ("low", ShedReason.DISPLACED, "small")
    assert notice.reply.rung is Rung.FALLBACK_POOL and notice.reply.status is None
    assert control.open_requests == 2
    assert _remaining_tokens(control, 2.0) == before - 100  # the newcomer's reservation; nothing refunded
    moved = control.pools["small"].queue.peek()
    assert moved.request_id == "low" and moved.deadline_s == notice.request.deadline_s  # the wait so far counts
    assert control.dispatch(2.0, "small").request.request_id == "low"
    control.finish(2.0, "low", prompt_tokens=10, completion_tokens=5)
    assert control.open_requests == 1


def test_a_request_moves_to_the_fallback_pool_once() -> None:
    pools = {name: PoolPolicies.create(name, TIERS, max_queued=1, unit=WorkUnit.REQUESTS,
                                       ladder=LadderConfig(fallback_pool=other))
             for name, other in (("big", "small"), ("small", "big"))}
    control = OverloadControl(TIERS, RateLimiter(default_limit=RateLimit(requests_per_minute=10_000)), pools)
    control.arrive(0.0, _facts(tier="sheddable", request_id="low"))
    assert [n.moved_to for n in control.arrive(0.0, _facts(tier="critical")).shed] == ["small"]
    # displaced again, from the fallback pool: no way back to the first, so the preset reply
    shed = control.arrive(0.0, _facts(tier="critical", model="small")).shed
    assert [(n.request.request_id, n.moved_to, n.reply.status) for n in shed] == [("low", None, 503)]
    assert control.open_requests == 2


def test_request_at_its_deadline_is_not_moved() -> None:
    control = _control(max_queued=1, fallback=True)
    control.arrive(0.0, _facts(tier="sheddable", request_id="low"))
    shed = control.arrive(1000.0, _facts(tier="critical")).shed
    assert [(n.request.request_id, n.moved_to, n.reply.status) for n in shed] == [("low", None, 503)]


def test_full_queue_gives_the_newcomer_a_preset_reply() -> None:
    control = _control(max_queued=1)
    control.arrive(0.0, _facts(tier="critical"))
    assert control.arrive(0.0, _facts(tier="sheddable")).outcome is ArrivalOutcome.PRESET_REPLY
    assert control.open_requests == 1


def test_expired_request_is_answered_at_dispatch() -> None:
    control = _control()
    control.arrive(0.0, _facts(tier="sheddable", request_id="old"))
    dispatch = control.dispatch(100.0, "big")
    assert dispatch.request is None and dispatch.shed[0].reason is ShedReason.DEADLINE
    assert control.open_requests == 0


def test_cancel_refunds_a_waiting_request() -> None:
    control = _control(tpm=1000)
    control.arrive(0.0, _facts(request_id="gone"))
    assert control.cancel(0.0, "gone")
    assert _remaining_tokens(control, 0.0) == 1000 and control.open_requests == 0


def test_cancel_leaves_a_dispatched_request_to_finish() -> None:
    control = _control()
    control.arrive(0.0, _facts(request_id="running"))
    control.dispatch(0.0, "big")
    assert not control.cancel(0.0, "running")
    assert control.open_requests == 1


_lifecycle = st.lists(
    st.tuples(st.sampled_from(["arrive", "dispatch", "finish", "cancel", "tick"]),
              st.sampled_from(["critical", "standard", "sheddable", "batch"]),
              st.integers(0, 200)),
    max_size=80,
)


@settings(max_examples=80, deadline=None)
@given(_lifecycle)
def test_every_reservation_is_settled_exactly_once(ops) -> None:
    """Whatever happens to requests (shed, expired, cancelled, finished), each reservation is settled once."""
    control = _control(tpm=2000, max_queued=5)
    now_s, waiting_or_running, running = 0.0, set(), []
    for op, tier, number in ops:
        if op == "arrive":
            request_id = f"r{next(_ids)}"
            arrival = control.arrive(now_s, _facts(tier=tier, request_id=request_id))
            waiting_or_running -= {n.request.request_id for n in arrival.shed}
            if arrival.outcome is ArrivalOutcome.QUEUED:
                waiting_or_running.add(request_id)
                assert request_id in control.pools[arrival.pool].queue
        elif op == "dispatch":
            dispatch = control.dispatch(now_s, "big")
            waiting_or_running -= {n.request.request_id for n in dispatch.shed}
            if dispatch.request is not None:
                running.append(dispatch.request.request_id)
        elif op == "finish" and running:
            request_id = running.pop(0)
            control.finish(now_s, request_id, prompt_tokens=10, completion_tokens=number)
            waiting_or_running.discard(request_id)
        elif op == "cancel" and waiting_or_running - set(running):
            request_id = sorted(waiting_or_running - set(running))[0]
            assert control.cancel(now_s, request_id)
            waiting_or_running.discard(request_id)
        elif op == "tick":
            now_s += number / 10.0
    for request_id in running:
        control.finish(now_s, request_id, prompt_tokens=10, completion_tokens=0)
    for request_id in waiting_or_running - set(running):
        control.cancel(now_s, request_id)
    assert control.open_requests == 0
    assert control.limiter.open_reservations == 0  # settling one twice would have raised


def test_a_request_id_in_flight_cannot_arrive_again() -> None:
    control = _control()
    control.arrive(0.0, _facts(request_id="twice"))
    with pytest.raises(ValueError):
        control.arrive(0.0, _facts(request_id="twice"))


def test_a_flooding_tenant_does_not_get_a_quiet_tenant_refused() -> None:
    control = _control()
    now_s = _saturate(control, one_tenant=True)  # tenant "t" floods the standard tier: 9.5 s of work queued
    assert control.arrive(now_s, _facts(tenant="quiet")).outcome is ArrivalOutcome.QUEUED
    # what was refused is the flood's own requests that its own backlog kept from starting in time
    assert len(control.pools["big"].queue) < 95 / 2


@pytest.mark.parametrize("emptied_by", ["expiry", "cancel"])
def test_idle_time_after_a_backlog_drains_does_not_collapse_the_service_rate(emptied_by: str) -> None:
    control = _control()
    now_s = _saturate(control, backlog=DISPATCHED_BY_SATURATE + 1)  # one still waits
    waiting = control.peek("big").request_id
    if emptied_by == "expiry":
        now_s += 4.0  # the standard tier's maximum wait
        assert len(control.expire(now_s, "big")) == 1
    else:
        assert control.cancel(now_s, waiting)
    # a new burst, 60 s later: the quiet minute between is not a minute of service
    now_s += 60.0
    control.arrive(now_s, _facts(request_id="first"))
    control.arrive(now_s, _facts(request_id="second"))
    control.dispatch(now_s, "big")
    assert control.pools["big"].predictor.service_rate_per_s == pytest.approx(10.0)
    assert control.arrive(now_s, _facts(tenant="other")).outcome is ArrivalOutcome.QUEUED


@pytest.mark.parametrize("isolation", [True, False])
def test_a_tenant_within_its_share_is_protected_while_another_floods_its_tier(isolation: bool) -> None:
    shares = TenantShares() if isolation else None
    control = OverloadControl(TIERS, RateLimiter(), {"big": PoolPolicies.create("big", TIERS, max_queued=1000,
                                                                              shares=shares)})
    now_s = 0.0
    for _ in range(80):  # "noisy" sends 10 requests a second, "quiet" one; 2 a second are served
        now_s += 0.1
        if round(now_s * 10) % 5 == 0:
            served = control.dispatch(now_s, "big").request
            if served is not None:
                control.finish(now_s, served.request_id, prompt_tokens=10, completion_tokens=10)
        control.arrive(now_s, _facts(tenant="noisy"))
        if round(now_s * 10) % 10 == 0:
            control.arrive(now_s, _facts(tenant="quiet"))
    quiet = control.peek("big")
    assert quiet is not None and quiet.tenant == "quiet"  # sparse-tenant priority: it goes first
    assert control.protected(now_s, "big", quiet) is isolation
    control.dispatch(now_s, "big")
    noisy = control.peek("big")
    assert noisy is not None and noisy.tenant == "noisy" and not control.protected(now_s, "big", noisy)
    critical = control.arrive(now_s, _facts(tier="critical", tenant="gold", request_id="gold"))
    assert critical.outcome is ArrivalOutcome.QUEUED
    assert control.protected(now_s, "big", control.peek("big"))  # the best tier, always


@pytest.mark.parametrize(("replica_first_token_s", "wait_budget_s"), [(None, 4.0), (3.0, 2.0), (10.0, 1.0)])
def test_a_request_waits_no_longer_than_its_ttft_target_leaves_after_the_replicas_own_time(
        replica_first_token_s: float | None, wait_budget_s: float) -> None:
    # standard: at most 4 s in the queue, 5 s TTFT target; replicas slower than the target itself
    # still get a quarter of the maximum wait (1 s), not an instant refusal of everything
    control = _control()
    if replica_first_token_s is not None:
        control.observe_first_token("big", "standard", replica_first_token_s)
    control.arrive(0.0, _facts(request_id="waits"))
    assert control.expire(wait_budget_s - 0.01, "big") == ()
    shed = control.expire(wait_budget_s + 0.01, "big")
    assert [notice.request.request_id for notice in shed] == ["waits"]
    assert shed[0].reason is ShedReason.DEADLINE


def test_request_displaced_behind_better_work_is_refused_at_once() -> None:
    control = _control(max_queued=1000)
    now_s = _saturate(control, backlog=DISPATCHED_BY_SATURATE)  # 10 requests/s measured, nothing left queued
    waiting = control.arrive(now_s, _impatient_sheddable("displaced"))
    assert waiting.outcome is ArrivalOutcome.QUEUED  # nothing ahead, 3 s to start
    # a burst of better traffic, 28 requests all served before it (each of which can start in time)
    for index in range(28):
        tier = "critical" if index < 24 else "standard"
        arrival = control.arrive(now_s + 0.2, _facts(tier=tier, tenant=f"c{index}"))
        assert arrival.outcome is ArrivalOutcome.QUEUED and arrival.shed == ()
    shed = control.dispatch(now_s + 0.35, "big").shed  # the next time the queue moves, not in 3 s
    assert [(n.request.request_id, n.reason) for n in shed] == [("displaced", ShedReason.HOPELESS)]
    assert shed[0].reply.status == 503
    assert control.open_requests == DISPATCHED_BY_SATURATE + 28  # its reservation refunded; the dispatched are open


def test_request_that_can_still_start_in_time_is_kept() -> None:
    control = _control(max_queued=1000)
    now_s = _saturate(control, backlog=DISPATCHED_BY_SATURATE)
    control.arrive(now_s, _impatient_sheddable("patient"))
    for index in range(15):  # 1.5 s of work ahead of it at 10/s (1.8 s at what they leave), 2.65 s left
        control.arrive(now_s + 0.2, _facts(tier="critical", tenant=f"c{index}"))
    assert control.dispatch(now_s + 0.35, "big").shed == ()


def test_request_behind_its_tiers_backlog_is_refused_before_its_deadline() -> None:
    # a burst lands before any service rate is known: all of it queues. Once the rate is measured,
    # what cannot start by its deadline is refused then, not after waiting its 4 s out
    control = _control(max_queued=1000)
    for index in range(60):  # 3 tenants, 20 standard requests each, interleaved
        assert control.arrive(0.0, _facts(tenant=f"t{index % 3}")).outcome is ArrivalOutcome.QUEUED
    refused: list[tuple[float, ShedReason]] = []
    dispatched = 0
    now_s = 0.0
    while now_s < 6.0:  # the replicas take one request every 0.1 s
        now_s = round(now_s + 0.1, 6)
        dispatch = control.dispatch(now_s, "big")
        refused += [(now_s, notice.reason) for notice in dispatch.shed]
        dispatched += dispatch.request is not None
    early = [at_s for at_s, reason in refused if reason is ShedReason.HOPELESS]
    at_deadline = [at_s for at_s, reason in refused if reason is ShedReason.DEADLINE]
    assert dispatched + len(refused) == 60
    assert dispatched >= 38  # 4 s of service at 10 requests/s, less what was in flight
    # known once the rate is (its first estimate takes 1 s of dispatches), not at the 4 s deadline
    assert len([at_s for at_s in early if at_s < 1.5]) >= 15
    assert len(at_deadline) + len([at_s for at_s in early if at_s >= 1.5]) <= 2  # the odd one at the margin


def test_lower_tier_is_refused_at_once_when_better_tiers_take_the_capacity() -> None:
    # critical traffic keeps queueing at nearly the whole service rate: a standard request with
    # only a little work ahead still cannot start in time, and is told so now, not at its deadline
    control = _control(max_queued=1000)
    now_s = _saturate(control, backlog=DISPATCHED_BY_SATURATE)  # 10 requests/s measured, nothing left queued
    served_s = now_s
    for step in range(1, 301):  # 30 s of critical arrivals at 9.5/s (3 time constants), each served in turn
        now_s = round(now_s + 1 / 9.5, 6)
        assert control.arrive(now_s, _facts(tier="critical", tenant=f"c{step}")).outcome is ArrivalOutcome.QUEUED
        if now_s - served_s >= 0.1:
            control.dispatch(now_s, "big")
            served_s = now_s
    for index in range(5):  # a little standard work queued: 0.5 s at the whole rate
        control.arrive(now_s, _facts(tier="standard", tenant=f"s{index}"))
    arrival = control.arrive(now_s, _facts(tier="standard", tenant="late"))
    assert arrival.outcome is ArrivalOutcome.PRESET_REPLY
    assert arrival.prediction.misses_deadline
