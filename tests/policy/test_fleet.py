"""The fleet's actions: standbys first on a scale-out, refilled after, drained replicas kept as standbys."""

from __future__ import annotations

from tidegate.policy.fleet import FleetActions, FleetCounts, fleet_actions


def test_a_scale_out_promotes_standbys_before_it_starts_cold_replicas() -> None:
    actions = fleet_actions(6, FleetCounts(serving=3, starting=0, standby=2, warming=0, standby_target=2))
    assert actions == FleetActions(promote=2, start=1, warm=2)  # the two promoted are refilled


def test_without_standbys_a_scale_out_starts_replicas() -> None:
    assert fleet_actions(5, FleetCounts(3, 1, 0, 0, 0)) == FleetActions(start=1)


def test_a_drained_replica_refills_the_standby_before_a_new_one_starts() -> None:
    actions = fleet_actions(2, FleetCounts(serving=4, starting=0, standby=0, warming=0, standby_target=1))
    assert actions == FleetActions(drain=2, keep_drained=1)


def test_standbys_warming_count_towards_the_target() -> None:
    assert fleet_actions(3, FleetCounts(3, 0, 0, 1, 1)) == FleetActions()
    assert fleet_actions(3, FleetCounts(3, 0, 0, 0, 2)) == FleetActions(warm=2)


def test_the_last_serving_replica_is_never_drained() -> None:
    assert fleet_actions(0, FleetCounts(1, 0, 0, 0, 0)).drain == 0
    assert fleet_actions(1, FleetCounts(1, 2, 0, 0, 0)).drain == 0  # the two starting are not drainable
