"""Rule 9 of the pool controller: preemptible background work gives its slot to a better tier's
waiting request. Hand-made events, no event loop."""

from __future__ import annotations

from tidegate.policy.pool import PoolController, PoolReplica
from tidegate.policy.tiers import default_tiers
from tidegate.types import ArrivalVerdict, PoolRequest, Preemption

TIERS = default_tiers()


def request(request_id: int, tier: str = "standard", preemptible: bool = False, now_s: float = 0.0) -> PoolRequest:
    return PoolRequest(request_id, now_s, "t", tier, 100, 50, preemptible=preemptible)


def full_replica(preemptible: bool = True) -> PoolController:
    """r0 holds 3 of its 3 slots: batch 1 (sent at 0 s), batch 2 (sent at 1 s), standard 3 (at 2 s)."""
    ctl = PoolController((PoolReplica("r0", max_requests=3),), TIERS)
    for request_id, tier, now_s in ((1, "batch", 0.0), (2, "batch", 1.0), (3, "standard", 2.0)):
        decision = ctl.on_arrival(now_s, request(request_id, tier, preemptible and tier == "batch", now_s))
        assert decision.verdict is ArrivalVerdict.ASSIGNED
    return ctl


def test_a_waiting_request_preempts_the_youngest_background_request_on_a_full_replica() -> None:
    ctl = full_replica()
    assert ctl.on_arrival(3.0, request(4, now_s=3.0)).verdict is ArrivalVerdict.QUEUED
    dispatch = ctl.on_capacity(3.0)
    assert dispatch.preemptions == (Preemption(2, "r0", 4, 2.0),)  # sent at 1 s: the youngest
    assert [(a.request_id, a.replica_id) for a in dispatch.assignments] == [(4, "r0")]
    assert ctl.held("r0") == 3 and ctl.queued == 0


def test_background_work_sent_without_the_flag_is_never_stopped() -> None:
    ctl = full_replica(preemptible=False)
    ctl.on_arrival(3.0, request(4, now_s=3.0))
    dispatch = ctl.on_capacity(3.0)
    assert dispatch.preemptions == () and dispatch.assignments == ()
    assert ctl.queued == 1


def test_background_work_does_not_preempt_background_work() -> None:
    ctl = full_replica()
    ctl.on_arrival(3.0, request(4, "batch", preemptible=True, now_s=3.0))
    dispatch = ctl.on_capacity(3.0)
    assert dispatch.preemptions == () and dispatch.assignments == ()


def test_the_preempted_requests_end_reported_later_changes_nothing() -> None:
    """The body cancels the preempted call and reports its end: the slot was freed once, at the
    preemption, so the waiting batch request still finds the replica full."""
    ctl = full_replica()
    ctl.on_arrival(3.0, request(4, now_s=3.0))
    ctl.on_capacity(3.0)
    ctl.on_arrival(3.0, request(5, "batch", preemptible=True, now_s=3.0))
    ctl.on_cancel(3.01, 2)
    assert ctl.on_capacity(3.01).assignments == ()
    assert ctl.held("r0") == 3
    ctl.on_finish(3.2, 1)
    assert [a.request_id for a in ctl.on_capacity(3.2).assignments] == [5]


def test_a_request_another_replica_takes_preempts_nothing() -> None:
    ctl = PoolController((PoolReplica("r0", max_requests=1), PoolReplica("r1", max_requests=1)), TIERS)
    assert ctl.on_arrival(0.0, request(1, "batch", preemptible=True)).verdict is ArrivalVerdict.ASSIGNED
    decision = ctl.on_arrival(0.1, request(2, now_s=0.1))
    assert decision.verdict is ArrivalVerdict.ASSIGNED and decision.assignment.replica_id == "r1"
    assert ctl.on_capacity(0.1).preemptions == ()
