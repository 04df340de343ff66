"""policy.background_share: batch work takes the level slots the interactive demand leaves on
average over its memory, never below 0; and the pool controller's queries that feed it."""

from __future__ import annotations

import math

from tidegate.policy.background_share import DemandMemory, background_slots, remember_demand
from tidegate.policy.pool import PoolController, PoolReplica
from tidegate.policy.tiers import default_tiers
from tidegate.types import PoolRequest


def _fed(samples: list[tuple[float, float]], memory_s: float = 10.0) -> DemandMemory:
    memory = DemandMemory()
    for now_s, demand in samples:
        memory = remember_demand(memory, now_s, demand, memory_s)
    return memory


def test_batch_takes_what_interactive_leaves_on_average() -> None:
    # demand 4 of 6 level slots for a minute: batch gets the 2 left
    steady = _fed([(t / 10, 4.0) for t in range(600)])
    assert math.isclose(steady.mean, 4.0) and background_slots(6, steady) == 2


def test_a_lull_does_not_hand_batch_the_slots_the_next_burst_needs() -> None:
    # bursts of 6 for 1 s every 2 s, nothing between: the instant demand is 0 half the time, the
    # mean about 3, so batch holds about half, not all, of the slots in a lull
    memory = _fed([(t / 10, 6.0 if (t // 10) % 2 == 0 else 0.0) for t in range(600)])
    assert 2.5 < memory.mean < 3.5
    assert background_slots(6, memory) in (2, 3)


def test_a_surge_shrinks_the_share_within_its_memory_and_never_below_zero() -> None:
    memory = _fed([(t / 10, 1.0) for t in range(301)])  # 1 until 30 s
    assert background_slots(6, memory) == 5
    surged = remember_demand(memory, 31.0, 12.0, 10.0)  # 12 for 1 s: 1 + 11 (1 - e^-0.1) = 2.05
    assert math.isclose(surged.mean, 1 + 11 * (1 - math.exp(-0.1))) and background_slots(6, surged) == 3
    surged = remember_demand(surged, 40.0, 12.0, 10.0)  # 12 for 10 s: 1 + 11 (1 - e^-1) = 7.95
    assert math.isclose(surged.mean, 1 + 11 * (1 - math.exp(-1))) and background_slots(6, surged) == 0


def test_no_memory_follows_the_last_sample() -> None:
    memory = _fed([(0.0, 5.0), (1.0, 2.0)], memory_s=0.0)
    assert memory.mean == 2.0 and background_slots(6, memory) == 4


def test_a_fraction_of_demand_keeps_a_whole_slot() -> None:
    assert background_slots(6, DemandMemory(0.2, 0.0)) == 5 and background_slots(6, DemandMemory(0.0, 0.0)) == 6


def test_the_pool_reports_its_level_slots_and_the_demand_above_a_tier_without_changing() -> None:
    controller = PoolController([PoolReplica("a", max_requests=3, headroom=1),
                                 PoolReplica("b", max_requests=3, headroom=1)], default_tiers())
    assert controller.level_slots(0.0) == 6 and controller.demand_above("batch") == 0
    for i, tier in enumerate(("standard", "standard", "critical", "batch")):
        controller.on_arrival(0.0, PoolRequest(i, 0.0, "t", tier, 8, 8))
    snapshot = controller.snapshot(0.0)
    assert controller.demand_above("batch") == 3  # the batch request is not interactive demand
    assert controller.demand_above("standard") == 1  # only critical is better than standard
    assert controller.snapshot(0.0) == snapshot
