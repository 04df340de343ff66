"""Three gateways in front of two replicas, simulated with the live policy (`sim.active_active`)."""

from __future__ import annotations

from tidegate.sim.active_active import GatewayFleet, active_active, run_fleet
from tidegate.policy.tiers import default_tiers
from tidegate.types import PoolRequest


def test_split_gateways_serve_as_one_gateway_does_with_the_engines_queues_near_zero() -> None:
    verdict = active_active(seeds=(191,))
    assert verdict.passed, "\n".join(verdict.figures)
    assert verdict.value("3_split_ratio") >= 0.9 and verdict.value("3_split_631_ratio") >= 0.9
    assert verdict.value("3_split_waiting") <= 1.0


def test_unsplit_gateways_fill_the_engines_queues() -> None:
    unsplit = run_fleet("3 unsplit", (1.0, 1.0, 1.0), False, seed=191)
    split = run_fleet("3 split", (1.0, 1.0, 1.0), True, seed=191)
    assert unsplit.waiting_mean > 5.0 > split.waiting_mean
    assert split.goodput() > unsplit.goodput()


def test_split_gateways_never_hold_more_than_a_replica_at_a_heartbeat() -> None:
    fleet = GatewayFleet(["r0", "r1"], default_tiers(), 8, (1.0, 1.0, 1.0), split=True)
    sent: list[int] = []
    for request_id in range(600):
        now_s = request_id * 0.01
        decision = fleet.on_arrival(now_s, PoolRequest(request_id, now_s, "a", "standard", 100, 50))
        if decision.assignment is not None:
            sent.append(int(decision.assignment.request_id))
        sent += [int(a.request_id) for a in fleet.on_capacity(now_s).assignments]
        if request_id % 5 == 0 and sent:  # the oldest ends, so demands and grants move
            fleet.on_finish(now_s, sent.pop(0))
    assert len(fleet.sent_beyond) > 30 and max(fleet.sent_beyond) == 0
