"""Active-active dispatch: N gateways share each replica's slots instead of each claiming them all.

Every gateway's pool controller holds at most `slot_limit` requests at a replica (its engine's
batch). N gateways in front of the same replicas, each believing it owns every slot, send up to N x
the batch: the rest waits inside the engine, where no gateway can order, refuse or reroute it
(`tidegate.sim.active_active`: three gateways at 2x capacity left the engines' queues tens of
requests deep and served fewer requests within target than one gateway).

The split, in two steps, each gateway every heartbeat (`gateway.shared_dispatch` drives it live,
`sim.active_active` in the simulator):
- its want: its part of the max-min fair split of each replica's slots over every live gateway's
  demand there (requests held there + its pool's queued requests, any of which the replica could
  take), the same whichever gateway computes it (`fair_shares`);
- its grant: what it wants, up to what the others do not claim, a gateway claiming the larger of
  what it holds and what it was granted (`grant`; the shared store applies it atomically). A grant
  grows only into room the others have given back, so the claims never add up past the slots.

The want has no floor at what a gateway holds: with one, a gateway that held more than its share
(sent under an older grant) wanted it again, refilled it from its queue as each request ended,
and kept it for good while another got nothing (`sim.active_active`, answers of 16 tokens: one of
three gateways granted 0 of a replica's 6 slots for seconds, the engines' batch 83 % in use;
`test_a_gateway_holding_past_its_share_wants_only_its_share`).

- Max-min fair: one water level L; a gateway is granted min(demand, L). A gateway asking less than
  an equal share gets all it asks; the rest is shared equally among the others
  (`test_a_gateway_asking_little_gets_what_it_asks_and_the_rest_share_the_remainder`).
- What nobody asks for is spread equally too, so a request arriving at an idle gateway finds a slot
  at once instead of waiting for the next heartbeat (`test_slots_nobody_asks_for_are_spread`).
- Integer slots: what the level leaves over goes to the largest unmet demand first, then by id
  (`test_every_gateway_computes_the_same_split`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["fair_shares", "grant", "fallback_slots"]


def _fill(capacity: int, floors: Sequence[int], caps: Sequence[float]) -> list[float]:
    """The water level's shares: x_i = clamp(L, floor_i, cap_i) with sum x_i = capacity (or every
    x_i at its cap when they cannot reach it). Floors are assumed to fit in `capacity`."""
    count = len(floors)
    if sum(caps) <= capacity:
        return [float(c) for c in caps]
    # the level lies between two breakpoints; try them in order (counts are small: gateways)
    points = sorted({float(f) for f in floors} | {float(c) for c in caps if c != math.inf})
    low = 0.0
    for point in points + [math.inf]:
        total = sum(min(max(point, f), c) for f, c in zip(floors, caps))
        if total >= capacity:
            # between `low` and `point` the total grows linearly with the gateways free to grow
            free = [i for i in range(count) if floors[i] <= low and caps[i] > low]
            base = sum(min(max(low, f), c) for f, c in zip(floors, caps))
            level = low + (capacity - base) / len(free) if free else low
            return [min(max(level, f), c) for f, c in zip(floors, caps)]
        low = point
    return [float(c) for c in caps]  # unreachable: the infinite point always reaches capacity


def fair_shares(slot_limit: int, demands: Mapping[str, int]) -> dict[str, int]:
    """Each gateway's max-min fair part of a replica's `slot_limit` slots, by gateway id, from
    every live gateway's demand there; the parts add up to `slot_limit`."""
    if slot_limit < 0 or any(d < 0 for d in demands.values()):
        raise ValueError("slot_limit >= 0 and demands >= 0 needed")
    if not demands:
        return {}
    ids = sorted(demands)
    wanted = [demands[i] for i in ids]
    # asked-for slots first, max-min fair; then what nobody asked for, equally
    shares = _fill(slot_limit, [0] * len(ids), [float(d) for d in wanted])
    if sum(shares) < slot_limit:
        shares = _fill(slot_limit, [math.floor(x + 1e-9) for x in shares], [math.inf] * len(ids))
    parts = [math.floor(x + 1e-9) for x in shares]
    left = slot_limit - sum(parts)
    # the slots rounding left over: the largest unmet demand first, then the largest remainder, then by id
    order = sorted(range(len(ids)), key=lambda i: (-(wanted[i] - parts[i]), -(shares[i] - parts[i]), ids[i]))
    for index in order[:max(0, left)]:
        parts[index] += 1
    return dict(zip(ids, parts))


def grant(wanted: int, slot_limit: int, others: Sequence[tuple[int, int]]) -> int:
    """A gateway's grant at a replica: what it wants, up to what the others' claims leave; each of
    `others` is (held, granted), and claims the larger. (The heartbeat script's rule, in Redis.)"""
    claimed = sum(max(held, granted) for held, granted in others)
    return max(0, min(wanted, slot_limit - claimed))


def fallback_slots(slot_limit: int, gateway_count: int) -> int:
    """A gateway's slots at a replica when the others cannot be heard from (the shared store is
    gone): an equal part, rounded down so that the configured gateways never overcommit it; at
    least one, so that a replica is never left unused by a gateway alone."""
    return max(1, slot_limit // max(1, gateway_count))
