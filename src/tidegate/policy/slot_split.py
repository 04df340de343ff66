"""Active-active dispatch: N gateways share each replica's slots instead of each claiming them all.

Every gateway's pool controller holds at most `slot_limit` requests at a replica (its engine's
batch). N gateways in front of the same replicas, each believing it owns every slot, send up to N x
the batch: the rest waits inside the engine, where no gateway can order, refuse or reroute it
(`tidegate.sim.active_active`: three gateways at 2x capacity left the engines' queues tens of
requests deep and served fewer requests within target than one gateway).

The split: each gateway publishes, per replica, its demand (requests held there + its pool's queued
requests, any of which that replica could take) and the requests it holds there; each computes the
same max-min fair split of the replica's slots over everyone's demand and takes its own grant as
its slot limit. Pure: the numbers come in, the grants go out (`split_slots`).

- Max-min fair: one water level L; a gateway is granted min(demand, L), at least what it holds.
  A gateway asking less than an equal share gets all it asks; the rest is shared equally among the
  others (`test_a_gateway_asking_little_gets_what_it_asks_and_the_rest_share_the_remainder`).
- What nobody asks for is spread equally too, so a request arriving at an idle gateway finds a slot
  at once instead of waiting for the next heartbeat (`test_slots_nobody_asks_for_are_spread`).
- Never over the replica: a gateway may hold more than its new grant (requests sent under an older,
  larger one). Its claim is max(held, grant), and the claims together never exceed the slots: the
  others' grants shrink until those requests finish (`test_claims_never_exceed_the_replica`).
- Integer slots: what the level leaves over goes to the largest unmet demand first, then by id, so
  the split is the same whichever gateway computes it (`test_every_gateway_computes_the_same_split`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GatewayDemand", "split_slots", "fallback_slots"]


@dataclass(frozen=True, slots=True)
class GatewayDemand:
    """One gateway's published wants at one replica."""

    gateway_id: str
    held: int  # requests it has sent there and not yet seen end
    demand: int  # held + the requests queued in its pool (any of which the replica could take)

    def __post_init__(self) -> None:
        if self.held < 0 or self.demand < self.held:
            raise ValueError("0 <= held <= demand needed")


def _fill(capacity: int, floors: Sequence[int], caps: Sequence[float]) -> list[float]:
    """The water level's shares: x_i = clamp(L, floor_i, cap_i) with sum x_i = capacity (or every
    x_i at its cap when they cannot reach it). Floors are assumed to fit in `capacity`."""
    count = len(floors)
    if sum(min(c, math.inf) for c in caps) <= capacity:
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


def split_slots(slot_limit: int, demands: Sequence[GatewayDemand]) -> dict[str, int]:
    """Each gateway's slot grant at a replica of `slot_limit` slots, from every live gateway's
    demand there. The grants and the requests held past them never add up to more than
    `slot_limit`."""
    if slot_limit < 0:
        raise ValueError("slot_limit >= 0 needed")
    if not demands:
        return {}
    ids = [d.gateway_id for d in demands]
    if len(set(ids)) != len(ids):
        raise ValueError("gateway ids must be unique")
    held = [d.held for d in demands]
    if sum(held) >= slot_limit:  # already full (or over, under older grants): nobody sends more
        return {d.gateway_id: d.held for d in demands}
    # asked-for slots first, max-min fair; then what nobody asked for, equally
    asked = _fill(slot_limit, held, [float(d.demand) for d in demands])
    if sum(asked) < slot_limit:
        asked = _fill(slot_limit, [math.floor(a + 1e-9) for a in asked], [math.inf] * len(demands))
    grants = [max(h, math.floor(a + 1e-9)) for h, a in zip(held, asked)]
    left = slot_limit - sum(grants)
    # the slots rounding left over: the largest unmet demand first, then the lowest id
    order = sorted(range(len(demands)), key=lambda i: (-(demands[i].demand - grants[i]), -(asked[i] - grants[i]),
                                                       ids[i]))
    for index in order[:max(0, left)]:
        grants[index] += 1
    return dict(zip(ids, grants))


def fallback_slots(slot_limit: int, gateway_count: int) -> int:
    """A gateway's slots at a replica when the others cannot be heard from (the shared store is
    gone): an equal part, rounded down so that the configured gateways never overcommit it; at
    least one, so that a replica is never left unused by a gateway alone."""
    return max(1, slot_limit // max(1, gateway_count))
