"""The pool controller's rules, one behaviour per test, on hand-made events (no event loop)."""

from __future__ import annotations

from weakref import WeakKeyDictionary

from tidegate.policy.pool import (REFUSED_NO_REPLICA, REFUSED_UNKNOWN_TIER, PoolController, PoolReplica,
                                  PoolSettings, ServiceClass)
from tidegate.policy.shares import TenantShares
from tidegate.policy.tiers import default_tiers
from tidegate.types import ArrivalVerdict, Assignment, Dispatch, PoolRequest, ReplicaHealth

TIERS = default_tiers()


def request(request_id: int, tier: str = "standard", prompt_tokens: int = 100, tenant: str = "t",
            now_s: float = 0.0) -> PoolRequest:
    return PoolRequest(request_id, now_s, tenant, tier, prompt_tokens, 50)


def controller(*replicas: PoolReplica, shares: TenantShares | None = None) -> PoolController:
    return PoolController(replicas or (PoolReplica("r0", max_requests=4),), TIERS, shares=shares)


# per controller: what it assigned at arrival (nothing was waiting), not yet handed to the test. Weakly
# keyed by the controller itself, not by id(): a test that left assignments here and a later test's
# controller made at the same address shared them (an extra assignment, once, in a whole-suite run)
_ASSIGNED_AT_ARRIVAL: WeakKeyDictionary[PoolController, list[Assignment]] = WeakKeyDictionary()


def arrive_all(ctl: PoolController, *requests: PoolRequest, now_s: float = 0.0, refusals: bool = False) -> None:
    for item in requests:
        decision = ctl.on_arrival(now_s, item)
        assert refusals or decision.verdict in (ArrivalVerdict.QUEUED, ArrivalVerdict.ASSIGNED)
        if decision.assignment is not None:
            _ASSIGNED_AT_ARRIVAL.setdefault(ctl, []).append(decision.assignment)


def capacity(ctl: PoolController, now_s: float) -> Dispatch:
    """What a body carries out at `now_s`: the assignments made at arrival, then `on_capacity`'s."""
    dispatch = ctl.on_capacity(now_s)
    return Dispatch(tuple(_ASSIGNED_AT_ARRIVAL.pop(ctl, ())) + dispatch.assignments, dispatch.refusals,
                    dispatch.wake_at_s)


def teach(ctl: PoolController, replica_id: str, fixed_s: float = 0.05, s_per_token: float = 0.001) -> None:
    """Feeds the replica's TTFT line exact samples (sent and answered one at a time)."""
    base = 1_000_000
    for offset, tokens in enumerate((100, 400, 900, 200)):
        now_s = 100.0 + offset
        arrive_all(ctl, request(base + offset, prompt_tokens=tokens, now_s=now_s), now_s=now_s)
        sent = capacity(ctl, now_s).assignments
        assert [a.replica_id for a in sent] == [replica_id]
        ctl.on_first_token(now_s + fixed_s + s_per_token * tokens, base + offset)
        ctl.on_finish(now_s + 1.0, base + offset)


def test_unknown_tier_is_refused() -> None:
    decision = controller().on_arrival(0.0, request(1, tier="gold"))
    assert decision.verdict is ArrivalVerdict.REFUSED and decision.reason == REFUSED_UNKNOWN_TIER


def test_no_routable_replica_refuses_at_arrival() -> None:
    ctl = controller()
    ctl.on_replica_health(0.0, "r0", ReplicaHealth.UNHEALTHY)
    assert ctl.on_arrival(0.0, request(1)).reason == REFUSED_NO_REPLICA


def test_before_anything_is_measured_a_replica_takes_what_its_slots_allow() -> None:
    """Rules 4 and 5: no fit yet, no budget either; only the slots hold a cold replica back."""
    ctl = controller(PoolReplica("r0", max_requests=2))
    arrive_all(ctl, request(1, prompt_tokens=3000), request(2, prompt_tokens=3000), request(3))
    assert [a.request_id for a in capacity(ctl, 0.0).assignments] == [1, 2]
    assert ctl.queued == 1


def test_a_request_predicted_past_its_engine_budget_waits() -> None:
    """Rule 3: standard's engine budget is 0.5 x 5 s = 2.5 s; at 1 ms a token, 2,450 tokens."""
    ctl = controller(PoolReplica("r0", max_requests=16))
    teach(ctl, "r0")
    arrive_all(ctl, request(1, prompt_tokens=2000), request(2, prompt_tokens=600), request(3, prompt_tokens=100))
    # 2 would start after 2,600 tokens (2.65 s); 3 waits behind it: strict order within the queue
    assert [a.request_id for a in capacity(ctl, 0.0).assignments] == [1]
    ctl.on_first_token(2.05, 1)
    assert [a.request_id for a in capacity(ctl, 2.05).assignments] == [2, 3]


def test_a_better_level_counts_only_its_own_work_ahead() -> None:
    """Rules 2 and 3: a critical request is not held back by sheddable prefill in the engine."""
    ctl = controller(PoolReplica("r0", max_requests=16))
    teach(ctl, "r0")
    arrive_all(ctl, request(1, "sheddable", prompt_tokens=3000))
    assert [a.priority for a in capacity(ctl, 0.0).assignments] == [4]
    arrive_all(ctl, request(2, "critical", prompt_tokens=1000))
    assert [(a.request_id, a.priority) for a in capacity(ctl, 0.0).assignments] == [(2, 0)]


def test_an_engine_ignoring_priority_counts_every_levels_prefill_ahead() -> None:
    """Rule 3 on an engine that ignores priority: a critical request waits behind sheddable prefill
    too (critical's budget 0.5 x 3 s; 4,000 tokens ahead of its first token at 1 ms a token)."""
    ctl = controller(PoolReplica("r0", max_requests=16, orders_by_priority=False))
    teach(ctl, "r0")
    arrive_all(ctl, request(1, "sheddable", prompt_tokens=3000))
    assert [a.request_id for a in capacity(ctl, 0.0).assignments] == [1]
    arrive_all(ctl, request(2, "critical", prompt_tokens=1000))
    assert capacity(ctl, 0.0).assignments == ()
    ctl.on_first_token(1.0, 1)
    assert [a.request_id for a in capacity(ctl, 1.0).assignments] == [2]


def test_headroom_lets_a_better_request_past_a_full_replica() -> None:
    """Rule 5: sheddable requests fill `max_requests`; a critical one still starts at once."""
    ctl = controller(PoolReplica("r0", max_requests=2, headroom=1))
    arrive_all(ctl, request(0, "critical"))  # a better tier is active
    assert [a.request_id for a in capacity(ctl, 0.0).assignments] == [0]
    ctl.on_finish(0.05, 0)
    arrive_all(ctl, request(1, "sheddable"), request(2, "sheddable"), request(3, "sheddable"), now_s=0.1)
    assert [a.request_id for a in capacity(ctl, 0.1).assignments] == [1, 2]
    arrive_all(ctl, request(4, "critical"), now_s=0.2)
    assert [a.request_id for a in capacity(ctl, 0.2).assignments] == [4]
    assert ctl.queued == 1  # the third sheddable one waits: headroom is not for its level


def test_a_tier_with_no_better_one_active_uses_the_headroom_too() -> None:
    """Rule 5 (`small_engines`): the headroom is kept only for a better tier seen within
    `headroom_memory_s`; a pool that serves one tier uses its whole engine."""
    ctl = PoolController((PoolReplica("r0", max_requests=1, headroom=1),), TIERS, PoolSettings(headroom_memory_s=2.0))
    arrive_all(ctl, request(1), request(2), request(3))
    assert [a.request_id for a in capacity(ctl, 0.0).assignments] == [1, 2]  # the engine's two sequences
    ctl.on_finish(1.0, 1)
    ctl.on_finish(1.0, 2)
    arrive_all(ctl, request(4, "critical"), now_s=1.0)  # a better tier comes: the headroom is its again
    assert [a.request_id for a in capacity(ctl, 1.0).assignments] == [4]  # 3 would take its level's last slot
    ctl.on_finish(1.5, 4)
    assert [a.request_id for a in capacity(ctl, 1.5).assignments] == [3]
    arrive_all(ctl, request(5), now_s=1.5)
    assert capacity(ctl, 1.5).assignments == ()  # 3 holds its level's one slot; the other is critical's
    assert [a.request_id for a in capacity(ctl, 3.1).assignments] == [5]  # critical not seen for 2 s


def test_the_headroom_follows_the_better_levels_arrivals() -> None:
    """Rule 5's headroom sized to demand (`noisy_tenant`'s work): while a critical request is sent
    for every one that ends, the whole configured headroom stays critical's; once one is sent for
    nine that end, the sheddable level may take all but the floor (3 of 8) and one more slot; when
    critical requests come again, the headroom is theirs again at the next tick."""
    ctl = controller(PoolReplica("r0", max_requests=8, headroom=8))
    arrive_all(ctl, request(0, "critical"))
    assert [a.request_id for a in capacity(ctl, 0.0).assignments] == [0]
    ctl.on_finish(0.01, 0)
    arrive_all(ctl, *(request(i, "sheddable") for i in range(1, 40)), now_s=0.1)
    assert len(capacity(ctl, 0.1).assignments) == 8  # one sent, one ended: 6 + 3 wanted, 8 kept
    for i in range(1, 9):
        ctl.on_finish(0.2, i)
    assert len(capacity(ctl, 0.3).assignments) == 12  # one sent for nine ended: 1 + 3 kept
    arrive_all(ctl, request(100, "critical", now_s=0.3), now_s=0.3)
    assert [a.request_id for a in capacity(ctl, 0.3).assignments] == [100]  # past the sheddable cap
    for request_id in (100, *range(9, 21)):
        ctl.on_finish(0.4, request_id)
    capacity(ctl, 20.0)  # the sheddable requests left are past their deadline; the counts decay
    arrive_all(ctl, *(request(i, "critical", now_s=20.0) for i in range(101, 105)), now_s=20.0)
    for i in range(101, 105):
        ctl.on_finish(20.1, i)
    assert len(capacity(ctl, 20.1).assignments) == 4  # the body's call after they end: a tick
    arrive_all(ctl, *(request(i, "sheddable", now_s=20.1) for i in range(200, 220)), now_s=20.1)
    assert len(capacity(ctl, 20.1).assignments) == 8  # four sent for about five ended: 8 kept again


def test_a_flooding_tenant_is_demoted_one_level() -> None:
    shares = TenantShares(half_life_s=1.0)
    ctl = controller(PoolReplica("r0", max_requests=1), shares=shares)
    held: list[int | str] = []
    for step in range(200):  # one request served each 10 ms; the flood sends three, the quiet tenant one in 20
        now_s = step * 0.01
        for request_id in held:
            ctl.on_first_token(now_s, request_id)
            ctl.on_finish(now_s, request_id)
        flood = (request(3 * step + k, tenant="flood", now_s=now_s) for k in range(3))
        arrive_all(ctl, *flood, now_s=now_s, refusals=True)
        if step % 20 == 0:
            arrive_all(ctl, request(10_000 + step, tenant="quiet", now_s=now_s), now_s=now_s, refusals=True)
        held = [a.request_id for a in capacity(ctl, now_s).assignments]
    assert ctl.service_class(2.0, "standard", "flood") is ServiceClass.DEMOTED
    assert ctl.service_class(2.0, "standard", "quiet") is ServiceClass.REGULAR
    assert ctl.engine_level("standard", ServiceClass.DEMOTED) == 3


class _Verdicts(TenantShares):
    """Shares whose verdict the test sets (the rates behind it are `TenantShares`' own tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.flooding: frozenset[str] = frozenset()

    def over_share(self, now_s: float, tier: str) -> frozenset[str]:
        return self.flooding


def test_a_flooding_tenants_requests_sent_before_its_verdict_leave_the_others_room() -> None:
    shares = _Verdicts()
    ctl = controller(PoolReplica("r0", max_requests=4, headroom=2), shares=shares)
    teach(ctl, "r0")  # by 105 s
    arrive_all(ctl, request(99, "critical", now_s=110.0), now_s=110.0)  # a better tier is active (rule 5)
    assert [a.request_id for a in capacity(ctl, 110.0).assignments] == [99]
    ctl.on_finish(110.0, 99)
    arrive_all(ctl, *(request(k, tenant="flood", now_s=110.0) for k in range(6)), now_s=110.0)
    assert len(capacity(ctl, 110.0).assignments) == 4  # at the regular level; two wait
    for k in range(4):
        ctl.on_first_token(110.1, k)
    shares.flooding = frozenset({"flood"})  # judged over its share once its first requests run
    arrive_all(ctl, request(10, tenant="quiet", now_s=110.2), now_s=110.2)
    sent = capacity(ctl, 110.2).assignments
    # the flood's four count as demoted now: the quiet tenant's request takes a slot at once (without
    # the move it waited for one of the flood's to finish), and the flood's level, quiet one included,
    # still holds at most `max_requests`
    assert [(a.request_id, a.priority) for a in sent] == [(10, 2)]
    ctl.on_finish(110.3, 0)
    assert capacity(ctl, 110.3).assignments == ()
    ctl.on_finish(110.4, 1)
    assert [(a.request_id, a.priority) for a in capacity(ctl, 110.4).assignments] == [(4, 3)]


def test_a_retry_goes_first_and_never_to_the_replica_that_failed_it() -> None:
    ctl = controller(PoolReplica("r0", max_requests=4), PoolReplica("r1", max_requests=4))
    arrive_all(ctl, request(1))
    first = capacity(ctl, 0.0).assignments[0]
    ctl.on_failure(0.1, 1, "connect", retry=True)
    arrive_all(ctl, request(2), now_s=0.1)  # the retry waits: it queues behind it
    sent = capacity(ctl, 0.1).assignments
    assert sent[0].request_id == 1 and sent[0].replica_id != first.replica_id


def test_cancel_frees_the_slot_and_the_prefill_count() -> None:
    ctl = controller(PoolReplica("r0", max_requests=1))
    arrive_all(ctl, request(1), request(2))
    capacity(ctl, 0.0)
    ctl.on_cancel(0.1, 1)
    snapshot = ctl.snapshot(0.1)
    assert snapshot.replicas[0].requests == 0 and sum(snapshot.replicas[0].prefill_tokens) == 0
    assert [a.request_id for a in capacity(ctl, 0.1).assignments] == [2]


def test_queued_requests_are_refused_at_their_deadline_and_the_controller_asks_to_wake_then() -> None:
    ctl = controller(PoolReplica("r0", max_requests=1))
    arrive_all(ctl, request(1, "critical"), request(2, "critical"))
    dispatch = capacity(ctl, 0.0)
    assert dispatch.wake_at_s == TIERS["critical"].max_queue_wait_s
    late = capacity(ctl, dispatch.wake_at_s)
    assert [r.request_id for r in late.refusals] == [2]


def test_every_replica_down_refuses_every_waiting_request() -> None:
    ctl = controller(PoolReplica("r0", max_requests=1))
    arrive_all(ctl, request(1), request(2))
    capacity(ctl, 0.0)
    ctl.on_replica_health(0.1, "r0", ReplicaHealth.UNHEALTHY)
    assert [(r.request_id, r.reason) for r in capacity(ctl, 0.1).refusals] == [(2, REFUSED_NO_REPLICA)]


def test_queries_change_nothing() -> None:
    ctl = controller(PoolReplica("r0", max_requests=1))
    arrive_all(ctl, request(1), request(2))
    before = ctl.snapshot(0.0)
    ctl.service_class(0.0, "standard", "t")
    ctl.engine_budget_s(0.0, TIERS["standard"], PoolReplica("r0"))
    assert ctl.snapshot(0.0) == before and ctl.queued == 1


def whole(request_id: int, prompt_tokens: int = 100, now_s: float = 0.0) -> PoolRequest:
    return PoolRequest(request_id, now_s, "t", "standard", prompt_tokens, 50, streamed=False)


def test_a_whole_answer_holds_the_budget_for_its_predicted_prefill() -> None:
    """Rule 3 for answers that report no first token: the fit's prediction stands in for it."""
    ctl = controller(PoolReplica("r0", max_requests=16))
    teach(ctl, "r0")  # 50 ms + 1 ms a token
    arrive_all(ctl, whole(1, prompt_tokens=2000), whole(2, prompt_tokens=600))
    dispatch = capacity(ctl, 0.0)
    assert [a.request_id for a in dispatch.assignments] == [1]
    wake_at_s = dispatch.wake_at_s  # its prefill is predicted done then: ask again
    assert wake_at_s is not None and abs(wake_at_s - 2.05) < 1e-6
    assert capacity(ctl, 2.0).assignments == ()
    assert [a.request_id for a in capacity(ctl, wake_at_s).assignments] == [2]


def test_whole_answers_before_any_fit_are_bounded_by_slots_alone() -> None:
    """Nothing measures their prefill, nor predicts it: they do not hold the budget."""
    ctl = controller(PoolReplica("r0", max_requests=3))
    arrive_all(ctl, *(whole(i) for i in range(5)))
    assert [a.request_id for a in capacity(ctl, 0.0).assignments] == [0, 1, 2]


def test_arrival_reports_the_predicted_pressure() -> None:
    ctl = controller(PoolReplica("r0", max_requests=1))
    ctl.on_arrival(0.0, request(1))
    decision = ctl.on_arrival(0.0, request(2))
    assert decision.verdict is ArrivalVerdict.QUEUED and decision.pressure == 0.0


def test_a_request_that_finds_nobody_waiting_is_assigned_at_arrival() -> None:
    """Rule 1 with an empty queue: no queueing round trip; the next one, with the replica's one
    slot taken, waits (rule 5), and so does the one after it, behind it."""
    ctl = controller(PoolReplica("r0", max_requests=1))
    first = ctl.on_arrival(0.0, request(1))
    assert first.verdict is ArrivalVerdict.ASSIGNED and first.assignment == Assignment(1, "r0", 2)
    assert first.predicted_wait_s == 0.0
    assert ctl.on_arrival(0.0, request(2)).verdict is ArrivalVerdict.QUEUED
    assert ctl.on_arrival(0.0, request(3)).verdict is ArrivalVerdict.QUEUED  # behind 2, never past it
    assert ctl.snapshot(0.0).replicas[0].requests == 1


def test_a_request_is_not_sent_where_it_would_start_past_what_is_left_of_its_target() -> None:
    """Rule 3 counts the wait so far: standard's 5 s target, 3.5 s waited, 1.5 s left; an engine
    1,000 prefill tokens deep would start a 600-token prompt 1.65 s from now (50 ms + 1 ms a token):
    inside the engine budget of 2.5 s, yet too late. (Live at 4x capacity, sending such requests
    made 60 % of those served late: goodput 0.54 of 1x; not sending them, 1.32.)"""
    ctl = controller(PoolReplica("r0", max_requests=2))
    teach(ctl, "r0")
    arrive_all(ctl, request(1, prompt_tokens=1000), request(2, prompt_tokens=1000), request(3, prompt_tokens=600))
    assert [a.request_id for a in capacity(ctl, 0.0).assignments] == [1, 2]  # 3 waits for a slot
    ctl.on_first_token(1.05, 1)  # as the line predicts; 2 is still in prefill at 3.5 s
    ctl.on_finish(3.5, 1)
    assert capacity(ctl, 3.5).assignments == ()
    ctl.on_first_token(3.6, 2)  # the engine's prefill queue is empty: rule 4 takes it
    assert [a.request_id for a in capacity(ctl, 3.6).assignments] == [3]


def test_a_whole_answers_predicted_prefill_ends_before_the_next_arrival_is_assigned_at_once() -> None:
    """With nothing waiting, no `on_capacity` runs between arrivals: the arrival itself retires the
    prefill the fit says is done, as `on_capacity` would."""
    ctl = controller(PoolReplica("r0", max_requests=16))
    teach(ctl, "r0")  # 50 ms + 1 ms a token
    assert ctl.on_arrival(0.0, whole(1, prompt_tokens=2400)).verdict is ArrivalVerdict.ASSIGNED
    # at 2.5 s its prefill (2.45 s) is over: 2,400 tokens ahead would not fit standard's 2.5 s budget
    assert ctl.on_arrival(2.5, whole(2, prompt_tokens=500, now_s=2.5)).verdict is ArrivalVerdict.ASSIGNED


def test_a_waiting_retry_leaves_the_replica_that_failed_it_to_the_queue() -> None:
    # two replicas of one slot, both busy, one request queued: the request on r0 fails and is to be
    # retried; it may not return to r0 and r1 is full, so it waits, but r0's free slot is the
    # queue's (before, the retry held the queue head back until r1 freed a slot)
    ctl = controller(PoolReplica("r0", max_requests=1), PoolReplica("r1", max_requests=1))
    arrive_all(ctl, request(1), request(2), request(3))
    assert sorted((a.request_id, a.replica_id) for a in capacity(ctl, 0.0).assignments) == [(1, "r0"), (2, "r1")]
    ctl.on_failure(0.1, 1, "connect", retry=True)
    assert [(a.request_id, a.replica_id) for a in capacity(ctl, 0.1).assignments] == [(3, "r0")]
    assert ctl.snapshot(0.1).retries_waiting == 1
    ctl.on_finish(0.2, 2)  # r1 frees a slot: the retry's, ahead of anything queued since
    arrive_all(ctl, request(4, now_s=0.2), now_s=0.2)
    assert [(a.request_id, a.replica_id) for a in capacity(ctl, 0.2).assignments] == [(1, "r1")]


def test_a_waiting_retry_does_not_hold_back_a_later_one_that_can_go() -> None:
    ctl = controller(PoolReplica("r0", max_requests=1), PoolReplica("r1", max_requests=1),
                     PoolReplica("r2", max_requests=1))
    arrive_all(ctl, request(1), request(2), request(3))
    assert sorted((a.request_id, a.replica_id) for a in capacity(ctl, 0.0).assignments) == [
        (1, "r0"), (2, "r1"), (3, "r2")]
    ctl.on_failure(0.1, 1, "connect", retry=True)
    assert capacity(ctl, 0.1).assignments == ()  # only r0 is free, the replica that failed it
    ctl.on_failure(0.2, 2, "connect", retry=True)
    ctl.on_replica_health(0.2, "r1", ReplicaHealth.UNHEALTHY)
    # the retry of 1 still has nowhere to go; the retry of 2 may take r0
    assert [(a.request_id, a.replica_id) for a in capacity(ctl, 0.2).assignments] == [(2, "r0")]
    assert ctl.snapshot(0.2).retries_waiting == 1


def test_a_request_sent_at_once_reads_as_a_queue_record_in_the_fair_share_accounts() -> None:
    """`PoolRequest.expected_output_tokens` is its `max_output_tokens` field read by index (a C getter,
    at every request's end): a field moved before it would charge the wrong number."""
    sent = PoolRequest(1, 0.0, "t", "standard", 100, 37)
    assert (sent.expected_output_tokens, sent.tokens) == (37, 137)
