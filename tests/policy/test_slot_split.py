"""The split of a replica's slots among gateways (`policy.slot_split`): fair wants, capped grants."""

from __future__ import annotations

import itertools
import random

import pytest

from tidegate.policy.slot_split import OutsideLoad, fair_shares, fallback_slots, grant


def test_equal_demands_past_the_slots_split_them_equally() -> None:
    assert fair_shares(9, {"a": 20, "b": 20, "c": 20}) == {"a": 3, "b": 3, "c": 3}


def test_a_gateway_asking_little_gets_what_it_asks_and_the_rest_share_the_remainder() -> None:
    assert fair_shares(8, {"a": 2, "b": 30, "c": 30}) == {"a": 2, "b": 3, "c": 3}


def test_slots_nobody_asks_for_are_spread() -> None:
    shares = fair_shares(8, {"a": 1, "b": 0})
    assert sum(shares.values()) == 8 and shares["a"] >= 1 and shares["b"] >= 3


def test_the_slot_rounding_leaves_goes_to_the_largest_unmet_demand() -> None:
    assert fair_shares(4, {"a": 10, "b": 12, "c": 10}) == {"a": 1, "b": 2, "c": 1}


def test_every_gateway_computes_the_same_split() -> None:
    demands = {"a": 5, "b": 3, "c": 9}
    expected = fair_shares(7, demands)
    for order in itertools.permutations(demands):
        assert fair_shares(7, {k: demands[k] for k in order}) == expected


def test_shares_always_add_up_to_the_slots_and_are_max_min_fair() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        slots = rng.randint(0, 16)
        demands = {f"g{i}": rng.randint(0, 10) for i in range(rng.randint(1, 5))}
        shares = fair_shares(slots, demands)
        assert sum(shares.values()) == slots
        for gateway, share in shares.items():
            if share < demands[gateway]:  # short: nobody else has more than one slot above it
                assert all(other <= share + 1 for other in shares.values())


def test_a_gateway_holding_past_its_share_wants_only_its_share() -> None:
    # it holds 5 of 6 under an older grant: what it wants is still a third, whatever it holds
    assert fair_shares(6, {"a": 25, "b": 30, "c": 30}) == {"a": 2, "b": 2, "c": 2}


def test_a_grant_grows_only_into_what_the_others_do_not_claim() -> None:
    assert grant(4, 8, [(0, 4)]) == 4
    assert grant(4, 8, [(6, 4)]) == 2  # the other holds past its grant: its requests count
    assert grant(4, 8, [(0, 8)]) == 0  # the other has not given its slots back yet
    assert grant(3, 8, []) == 3


def test_grants_made_in_any_order_never_claim_more_than_the_slots() -> None:
    rng = random.Random(7)
    for _ in range(500):
        slots, count = rng.randint(1, 12), rng.randint(1, 4)
        held = [0] * count
        granted = [0] * count
        for _ in range(30):
            index = rng.randrange(count)
            demands = {str(k): rng.randint(0, 10) for k in range(count)}
            want = fair_shares(slots, demands)[str(index)]
            granted[index] = grant(want, slots, [(held[k], granted[k]) for k in range(count) if k != index])
            # it sends up to its grant; some of its requests end
            held[index] = rng.randint(0, max(held[index], granted[index]))
            held[index] = max(held[index], min(granted[index], held[index] + rng.randint(0, 3)))
            assert sum(max(h, g) for h, g in zip(held, granted)) <= slots


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        fair_shares(-1, {"a": 1})
    with pytest.raises(ValueError):
        fair_shares(4, {"a": -1})


def test_the_fallback_is_an_equal_part_rounded_down_but_never_none() -> None:
    assert fallback_slots(9, 3) == 3
    assert fallback_slots(4, 3) == 1
    assert fallback_slots(2, 3) == 1


def test_outside_load_is_what_the_engine_runs_past_the_gateways_held_requests() -> None:
    outside = OutsideLoad(samples=2)
    outside.observe(engine_sequences=10, gateways_held=6)
    assert outside.sequences == 0  # one reading is not enough
    outside.observe(engine_sequences=9, gateways_held=6)
    assert outside.sequences == 3
    outside.observe(engine_sequences=4, gateways_held=6)  # requests sent, not yet at the engine
    assert outside.sequences == 0


def test_a_passing_excess_of_the_engines_count_is_not_outside_load() -> None:
    # a gateway sent three since its last heartbeat: the engine shows them once, then the figures agree
    outside = OutsideLoad(samples=2)
    for engine, held in ((8, 8), (11, 8), (11, 11), (12, 11), (12, 11)):
        outside.observe(engine, held)
    assert outside.sequences == 1
    outside.forget()
    assert outside.sequences == 0


def test_outside_load_leaves_fewer_slots_to_grant() -> None:
    assert grant(wanted=6, slot_limit=16, others=[(5, 5), (5, 5)], outside=3) == 3
    assert grant(wanted=6, slot_limit=16, others=[(5, 5), (5, 5)], outside=20) == 0
    with pytest.raises(ValueError):
        OutsideLoad(samples=0)
