"""Rule 8 of the pool controller: a gateway's grant of a shared replica's slots (`on_slot_grant`)."""

from __future__ import annotations

from tests.policy.test_pool import arrive_all, capacity, request
from tidegate.policy.pool import PoolController, PoolReplica
from tidegate.policy.tiers import default_tiers


def controller() -> PoolController:
    return PoolController((PoolReplica("r0", max_requests=6, headroom=2),), default_tiers())


def test_a_gateway_holds_no_more_than_its_grant_of_a_replica() -> None:
    ctl = controller()
    ctl.on_slot_grant(0.0, "r0", 3)
    arrive_all(ctl, *(request(i) for i in range(10)))
    assert len(capacity(ctl, 0.0).assignments) == 3
    assert ctl.held("r0") == 3 and ctl.slot_grant("r0") == 3


def test_a_larger_grant_sends_more_at_the_next_capacity_call() -> None:
    ctl = controller()
    ctl.on_slot_grant(0.0, "r0", 2)
    arrive_all(ctl, *(request(i) for i in range(10)))
    assert len(capacity(ctl, 0.0).assignments) == 2
    ctl.on_slot_grant(0.5, "r0", 5)
    assert len(capacity(ctl, 0.5).assignments) == 3


def test_a_smaller_grant_sends_nothing_until_the_requests_past_it_end() -> None:
    ctl = controller()
    arrive_all(ctl, *(request(i) for i in range(10)))
    assert len(capacity(ctl, 0.0).assignments) == 8  # the whole batch: nothing better seen
    ctl.on_slot_grant(0.5, "r0", 4)
    for request_id in range(4):
        ctl.on_finish(0.6, request_id)
        assert not capacity(ctl, 0.6).assignments
    ctl.on_finish(0.7, 4)
    assert len(capacity(ctl, 0.7).assignments) == 1


def test_a_grant_of_none_gives_back_every_configured_slot() -> None:
    ctl = controller()
    ctl.on_slot_grant(0.0, "r0", 0)
    arrive_all(ctl, *(request(i) for i in range(10)))
    assert not capacity(ctl, 0.0).assignments
    ctl.on_slot_grant(0.1, "r0", None)
    assert len(capacity(ctl, 0.1).assignments) == 8 and ctl.slot_grant("r0") == 8


def test_the_headroom_is_kept_in_proportion_within_a_grant() -> None:
    ctl = controller()
    ctl.on_slot_grant(0.0, "r0", 4)  # 6 + 2 configured: 3 for a level and better, 1 only better levels take
    arrive_all(ctl, request(100, tier="critical"))
    ctl.on_finish(0.0, capacity(ctl, 0.0).assignments[0].request_id)  # a better tier was seen
    arrive_all(ctl, *(request(i) for i in range(10)), now_s=0.1)
    assert len(capacity(ctl, 0.1).assignments) == 3
    arrive_all(ctl, request(101, tier="critical", now_s=0.2), now_s=0.2)
    assert [a.request_id for a in capacity(ctl, 0.2).assignments] == [101]
