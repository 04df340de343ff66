"""The max-min fair split of a replica's slots among gateways (`policy.slot_split`)."""

from __future__ import annotations

import itertools
import random

import pytest

from tidegate.policy.slot_split import GatewayDemand, fallback_slots, split_slots


def demands(*triples: tuple[str, int, int]) -> list[GatewayDemand]:
    return [GatewayDemand(gateway_id, held, demand) for gateway_id, held, demand in triples]


def test_equal_demands_past_the_slots_split_them_equally() -> None:
    grants = split_slots(9, demands(("a", 0, 20), ("b", 0, 20), ("c", 0, 20)))
    assert grants == {"a": 3, "b": 3, "c": 3}


def test_a_gateway_asking_little_gets_what_it_asks_and_the_rest_share_the_remainder() -> None:
    grants = split_slots(8, demands(("a", 1, 2), ("b", 0, 30), ("c", 0, 30)))
    assert grants == {"a": 2, "b": 3, "c": 3}


def test_slots_nobody_asks_for_are_spread() -> None:
    grants = split_slots(8, demands(("a", 1, 1), ("b", 0, 0)))
    assert sum(grants.values()) == 8
    assert grants["a"] >= 1 and grants["b"] >= 3


def test_the_slot_rounding_leaves_goes_to_the_largest_unmet_demand() -> None:
    grants = split_slots(4, demands(("a", 0, 10), ("b", 0, 12), ("c", 0, 10)))
    assert grants == {"a": 1, "b": 2, "c": 1}


def test_a_gateway_holding_past_its_grant_shrinks_the_others_until_its_requests_end() -> None:
    # `a` was alone and holds the whole replica; `b` arrives with a queue
    assert split_slots(4, demands(("a", 4, 10), ("b", 0, 10))) == {"a": 4, "b": 0}
    assert split_slots(4, demands(("a", 3, 10), ("b", 0, 10))) == {"a": 3, "b": 1}
    assert split_slots(4, demands(("a", 2, 10), ("b", 1, 10))) == {"a": 2, "b": 2}


def test_claims_never_exceed_the_replica() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        slots = rng.randint(0, 12)
        count = rng.randint(1, 5)
        wants = []
        for index in range(count):
            held = rng.randint(0, 6)
            wants.append(GatewayDemand(f"g{index}", held, held + rng.randint(0, 8)))
        grants = split_slots(slots, wants)
        claims = sum(max(w.held, grants[w.gateway_id]) for w in wants)
        assert claims <= max(slots, sum(w.held for w in wants))
        assert all(grants[w.gateway_id] >= w.held for w in wants)
        if sum(w.held for w in wants) <= slots:
            assert sum(grants.values()) == slots  # work conserving: no slot left unassigned


def test_every_gateway_computes_the_same_split() -> None:
    wants = demands(("a", 0, 5), ("b", 2, 3), ("c", 1, 9))
    expected = split_slots(7, wants)
    for order in itertools.permutations(wants):
        assert split_slots(7, list(order)) == expected


def test_max_min_fairness_no_gateway_short_of_its_demand_gets_less_than_another_with_more() -> None:
    rng = random.Random(11)
    for _ in range(500):
        wants = [GatewayDemand(f"g{i}", 0, rng.randint(0, 10)) for i in range(rng.randint(2, 5))]
        grants = split_slots(rng.randint(1, 16), wants)
        for w in wants:
            if grants[w.gateway_id] < w.demand:  # short: nobody else has more than one slot above it
                assert all(grants[o.gateway_id] <= grants[w.gateway_id] + 1 for o in wants)


def test_unique_ids_and_sane_counts_are_required() -> None:
    with pytest.raises(ValueError):
        split_slots(4, demands(("a", 0, 1), ("a", 0, 1)))
    with pytest.raises(ValueError):
        GatewayDemand("a", 3, 2)


def test_the_fallback_is_an_equal_part_rounded_down_but_never_none() -> None:
    assert fallback_slots(9, 3) == 3
    assert fallback_slots(4, 3) == 1
    assert fallback_slots(2, 3) == 1
