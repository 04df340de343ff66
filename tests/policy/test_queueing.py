"""Fair priority queue: tiers in strict order with aging, VTC fairness within a tier, deadlines, shed order."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.policy.queueing import EnqueueOutcome, FairPriorityQueue, QueueAhead, QueuedRequest, ShedReason
from tidegate.policy.tiers import TierSpec, TierTable, default_tiers

_ids = itertools.count()


def _tiers(*, aging: bool = False, bound: int = 1000, wait_s: float = 1e9) -> TierTable:
    names = ("critical", "standard", "sheddable", "batch")
    return TierTable(
        [TierSpec(name, rank, bound, wait_s, 1.0, aging_offset_s=(60.0 * rank if aging else None))
         for rank, name in enumerate(names)],
        default_tier="standard",
    )


def _put(queue: FairPriorityQueue, now_s: float, tenant: str = "a", tier: str = "standard",
         tokens: int = 10, timeout_s: float | None = None, request_id: str | None = None):
    return queue.enqueue(now_s, request_id=request_id or f"r{next(_ids)}", tenant=tenant, tier=tier,
                         prompt_tokens=tokens, expected_output_tokens=0, timeout_s=timeout_s)


def _drain(queue: FairPriorityQueue, now_s: float) -> list[str]:
    order = []
    while (request := queue.dequeue(now_s).request) is not None:
        order.append(request.request_id)
    return order


def test_better_tier_dequeued_first() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10)
    _put(queue, 0.0, tier="sheddable", request_id="s")
    _put(queue, 1.0, tier="critical", request_id="c")
    _put(queue, 2.0, tier="standard", request_id="n")
    assert _drain(queue, 3.0) == ["c", "n", "s"]


def test_one_tenant_is_served_in_arrival_order() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10)
    for name in "xyz":
        _put(queue, 0.0, request_id=name)
    assert _drain(queue, 0.0) == ["x", "y", "z"]


def test_least_served_tenant_goes_next() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=100)
    for i in range(3):
        _put(queue, 0.0, tenant="flood", tokens=100, request_id=f"f{i}")
    _put(queue, 0.0, tenant="quiet", tokens=100, request_id="q0")
    assert _drain(queue, 0.0) == ["f0", "q0", "f1", "f2"]


def test_a_skipped_tenants_turn_passes_to_the_next_least_served() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=100)
    for i in range(2):
        _put(queue, 0.0, tenant="flood", tokens=100, request_id=f"f{i}")
        _put(queue, 0.0, tenant="quiet", tokens=100, request_id=f"q{i}")
    _put(queue, 0.0, tenant="other", tier="sheddable", request_id="s")
    skip = frozenset({"flood"})
    assert queue.peek().request_id == "f0"  # its turn, but it may not go now
    assert queue.peek(skip).request_id == "q0"
    assert [queue.dequeue(0.0, skip).request.request_id for _ in range(2)] == ["q0", "q1"]
    # only skipped tenants wait in the tier whose turn it is: nothing, not a lower tier's request
    assert queue.peek(skip) is None and queue.dequeue(0.0, skip).request is None
    assert _drain(queue, 0.0) == ["f0", "f1", "s"]


def test_tenant_weight_buys_a_larger_share() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=100, tenant_weights={"gold": 3.0})
    for i in range(8):
        _put(queue, 0.0, tenant="gold", request_id=f"g{i}")
        _put(queue, 0.0, tenant="plain", request_id=f"p{i}")
    first_eight = _drain(queue, 0.0)[:8]
    assert sum(name.startswith("g") for name in first_eight) == 6


def test_idle_tenant_banks_no_credit() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=100)
    for i in range(5):
        _put(queue, 0.0, tenant="busy", request_id=f"b{i}")
    _drain(queue, 0.0)  # busy is served 50 tokens while late is idle
    for i in range(3):
        _put(queue, 1.0, tenant="busy", request_id=f"b{i + 5}")
        _put(queue, 1.0, tenant="late", request_id=f"l{i}")
    order = _drain(queue, 1.0)
    assert order[:2] in (["b5", "l0"], ["l0", "b5"])  # alternation, not a run of `late`


def test_a_sparse_tenants_request_goes_before_a_flooding_tenants_next() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=100)
    for i in range(20):
        _put(queue, 0.0, tenant="flood", request_id=f"f{i}")
    order = []
    for i in range(5):  # one request at a time from `sparse`, each arriving behind the flood
        order.append(queue.dequeue(float(i)).request.request_id)
        _put(queue, float(i), tenant="sparse", request_id=f"s{i}")
        order.append(queue.dequeue(float(i)).request.request_id)
    assert order == ["f0", "s0", "f1", "s1", "f2", "s2", "f3", "s3", "f4", "s4"]
    assert queue.dequeue(5.0).request.request_id == "f5"
    # two at once: the first goes ahead, the second alternates with the flood as VTC has it
    _put(queue, 5.0, tenant="sparse", request_id="a")
    _put(queue, 5.0, tenant="sparse", request_id="b")
    assert _drain(queue, 5.0)[:4] == ["a", "f6", "b", "f7"]


def test_settle_service_charges_the_real_output() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10, output_token_weight=2.0)
    _put(queue, 0.0, tenant="a")
    request = queue.dequeue(0.0).request
    queue.settle_service(request, actual_output_tokens=5)  # expected 0
    assert queue.service_counter("standard", "a") == 10 + 2 * 5


def test_aging_lets_batch_overtake_after_its_offset() -> None:
    queue = FairPriorityQueue(_tiers(aging=True), max_queued=10)
    _put(queue, 0.0, tier="batch", request_id="old-batch")  # competes as if it arrived at 180 s
    _put(queue, 179.0, tier="critical", request_id="c1")
    _put(queue, 181.0, tier="critical", request_id="c2")
    assert _drain(queue, 182.0) == ["c1", "old-batch", "c2"]


def test_best_tier_without_offset_goes_before_younger_aged_tiers() -> None:
    # default_tiers(): critical has no aging offset, the tiers below it have one
    queue = FairPriorityQueue(default_tiers(), max_queued=10)
    _put(queue, 0.0, tier="sheddable", request_id="s")
    _put(queue, 1.0, tier="critical", request_id="c")
    assert queue.dequeue(2.0).request.request_id == "c"


def test_expired_request_is_returned_not_dispatched() -> None:
    queue = FairPriorityQueue(_tiers(wait_s=5.0), max_queued=10)
    _put(queue, 0.0, request_id="late")
    result = queue.dequeue(5.0)
    assert result.request is None
    assert [(s.request.request_id, s.reason) for s in result.expired] == [("late", ShedReason.DEADLINE)]


def test_client_timeout_shortens_the_deadline() -> None:
    queue = FairPriorityQueue(_tiers(wait_s=30.0), max_queued=10)
    assert _put(queue, 0.0, timeout_s=2.0).request.deadline_s == 2.0


def test_client_timeout_already_passed_is_rejected() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10)
    assert _put(queue, 0.0, timeout_s=0.0).outcome is EnqueueOutcome.REJECTED_PAST_DEADLINE


def test_full_tier_rejects_the_newcomer() -> None:
    queue = FairPriorityQueue(_tiers(bound=1), max_queued=10)
    _put(queue, 0.0)
    assert _put(queue, 0.0).outcome is EnqueueOutcome.REJECTED_TIER_FULL


def test_full_queue_sheds_the_lowest_tiers_newest() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=3)
    _put(queue, 0.0, tier="sheddable", request_id="s-old")
    _put(queue, 1.0, tier="sheddable", request_id="s-new")
    _put(queue, 2.0, tier="standard", request_id="n")
    decision = _put(queue, 3.0, tier="critical", request_id="c")
    assert decision.queued
    assert [(s.request.request_id, s.reason) for s in decision.shed] == [("s-new", ShedReason.DISPLACED)]


def test_full_queue_rejects_a_newcomer_of_the_lowest_tier_present() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=2)
    _put(queue, 0.0, tier="critical")
    _put(queue, 0.0, tier="standard")
    decision = _put(queue, 0.0, tier="standard")
    assert decision.outcome is EnqueueOutcome.REJECTED_QUEUE_FULL and decision.shed == ()


def test_expired_requests_make_room_before_shedding() -> None:
    queue = FairPriorityQueue(_tiers(wait_s=1.0), max_queued=1)
    _put(queue, 0.0, tier="sheddable", request_id="stale")
    decision = _put(queue, 2.0, tier="sheddable")
    assert decision.queued and decision.shed[0].reason is ShedReason.DEADLINE


def test_cancel_removes_a_waiting_request() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10)
    _put(queue, 0.0, request_id="gone")
    assert queue.cancel("gone").request_id == "gone"
    assert queue.cancel("gone") is None
    assert len(queue) == 0 and queue.dequeue(0.0).request is None


def test_work_ahead_counts_same_and_better_tiers() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10)
    _put(queue, 0.0, tier="critical", tokens=5)
    _put(queue, 0.0, tier="standard", tokens=7)
    _put(queue, 0.0, tier="batch", tokens=100)
    ahead = queue.work_ahead("standard")
    assert (ahead.requests, ahead.tokens) == (2, 12)


def test_next_deadline_skips_dispatched_requests() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10)
    _put(queue, 0.0, timeout_s=1.0, request_id="first")
    _put(queue, 0.0, timeout_s=5.0)
    queue.dequeue(0.0)
    assert queue.next_deadline_s() == 5.0


def test_default_tiers_work() -> None:
    queue = FairPriorityQueue(default_tiers(), max_queued=10)
    assert _put(queue, 0.0, tier="batch").queued


def test_unknown_tier_is_an_error() -> None:
    with pytest.raises(ValueError):
        _put(FairPriorityQueue(_tiers(), max_queued=1), 0.0, tier="gold")


# ---- properties -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    flood=st.integers(1, 400),
    others=st.integers(1, 30),
    costs=st.lists(st.integers(1, 50), min_size=1, max_size=20),
)
def test_service_gap_between_backlogged_tenants_is_bounded(flood: int, others: int, costs: list[int]) -> None:
    """VTC: while both wait, service differs by at most one request's cost, whatever the flood."""
    max_cost = max(costs)
    queue = FairPriorityQueue(_tiers(), max_queued=10_000)
    for i in range(flood):
        _put(queue, 0.0, tenant="flood", tokens=costs[i % len(costs)])
    for i in range(others):
        _put(queue, 0.0, tenant="other", tokens=costs[(i * 7) % len(costs)])
    served = {"flood": 0, "other": 0}
    backlog = {"flood": flood, "other": others}
    while backlog["flood"] and backlog["other"]:
        request = queue.dequeue(0.0).request
        served[request.tenant] += request.tokens
        backlog[request.tenant] -= 1
        assert abs(served["flood"] - served["other"]) <= max_cost


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3), st.sampled_from("abc"), st.floats(0.0, 100.0)),
        st.tuples(st.just("take"), st.just(0), st.just(""), st.floats(0.0, 100.0)),
    ),
    max_size=80,
)


@settings(max_examples=120, deadline=None)
@given(_ops, st.booleans())
def test_lower_tier_waits_unless_aged(ops, aging: bool) -> None:
    """A lower tier is dequeued while a better one waits only by the aging rule."""
    tiers = _tiers(aging=aging)
    names = [tier.name for tier in tiers]
    queue = FairPriorityQueue(tiers, max_queued=10_000)
    waiting: dict[str, tuple[int, float]] = {}  # request id -> (rank, enqueued_at_s)
    now_s = 0.0
    for op, rank, tenant, dt in ops:
        now_s += dt
        if op == "put":
            decision = _put(queue, now_s, tenant=tenant, tier=names[rank])
            waiting[decision.request.request_id] = (rank, now_s)
            continue
        request = queue.dequeue(now_s).request
        if request is None:
            assert not waiting
            continue
        rank = waiting[request.request_id][0]
        offset = {tier.rank: math.inf if tier.aging_offset_s is None else tier.aging_offset_s for tier in tiers}
        # the tier competes with the arrival time of its oldest request (VTC may pick another of it)
        own_key = min(t for r, t in waiting.values() if r == rank) + offset[rank]
        del waiting[request.request_id]
        for better_rank, enqueued_at_s in waiting.values():
            if better_rank < rank:
                assert own_key < enqueued_at_s + offset[better_rank], "a better tier was passed over without aging"


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0.0, 1.0)), max_size=60), st.integers(1, 8))
def test_shed_is_always_the_lowest_tiers_newest(puts, max_queued: int) -> None:
    tiers = _tiers()
    names = [tier.name for tier in tiers]
    queue = FairPriorityQueue(tiers, max_queued=max_queued)
    waiting: dict[str, tuple[int, int]] = {}  # request id -> (rank, arrival number)
    for number, (rank, dt) in enumerate(puts):
        decision = _put(queue, float(number), tier=names[rank])
        candidates = list(waiting.items()) + [(decision.request.request_id, (rank, number))]
        lowest_newest = max(candidates, key=lambda item: item[1])[0]
        if decision.queued:
            waiting[decision.request.request_id] = (rank, number)
        for shed in decision.shed:
            assert shed.request.request_id == lowest_newest
            del waiting[shed.request.request_id]
        if not decision.queued:
            assert decision.request.request_id == lowest_newest
        assert len(queue) == len(waiting) <= max_queued


def test_another_tenants_flood_counts_only_its_fair_share_ahead() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=1000)
    for _ in range(100):
        _put(queue, 0.0, tenant="flood", tokens=10)
    _put(queue, 0.0, tenant="quiet", tokens=10)
    ahead = queue.work_ahead("standard", "quiet", tokens=10)
    assert (ahead.requests, ahead.tokens) == (1 + 2, 10 + 20)  # its own one, then one each more
    assert queue.work_ahead("standard").requests == 101


def test_work_ahead_forgets_drained_tenants() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10)
    _put(queue, 0.0, tenant="gone", tokens=10)
    queue.dequeue(0.0)
    assert queue.work_ahead("standard", "new", tokens=5) == QueueAhead(0, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from("abc"), st.integers(1, 50)), max_size=40))
def test_peek_names_the_next_dequeue(puts) -> None:
    tiers = _tiers(aging=True)
    names = [tier.name for tier in tiers]
    queue = FairPriorityQueue(tiers, max_queued=1000)
    for number, (rank, tenant, tokens) in enumerate(puts):
        _put(queue, float(number), tenant=tenant, tier=names[rank], tokens=tokens)
    while (peeked := queue.peek()) is not None:
        assert queue.dequeue(float(len(puts))).request == peeked
    assert queue.dequeue(0.0).request is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 500)), min_size=1, max_size=12))
def test_serving_a_request_unqueued_charges_as_enqueue_then_dequeue_would(served) -> None:
    """A request that finds its tier empty goes at once (the pool controller's fast way); the fair
    order that follows is the same as if it had been queued and taken out again."""
    queued, unqueued = FairPriorityQueue(_tiers(), max_queued=100), FairPriorityQueue(_tiers(), max_queued=100)
    for tenant, tokens in served:
        _put(queued, 0.0, tenant=tenant, tokens=tokens)
        assert queued.dequeue(0.0).request is not None
        unqueued.charge_unqueued("standard", tenant, tokens, 0)
    for queue in (queued, unqueued):
        for tenant in "abc":
            _put(queue, 1.0, tenant=tenant, tokens=100, request_id=f"next-{tenant}")
    assert _drain(queued, 1.0) == _drain(unqueued, 1.0)


def test_serving_unqueued_is_refused_while_its_tier_has_requests_waiting() -> None:
    queue = FairPriorityQueue(_tiers(), max_queued=10)
    decision = _put(queue, 0.0)
    with pytest.raises(ValueError, match="waiting"):
        request = decision.request
        queue.charge_unqueued(request.tier, request.tenant, request.prompt_tokens, request.expected_output_tokens)
