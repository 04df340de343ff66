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

Load from outside the gateways: clients that reach an engine directly (a notebook, another
service, a gateway restarted while its requests still run) take slots no gateway counts. The
engine's own gauges are the ground truth: what it runs and queues, less what the gateways hold
there, is outside load (`OutsideLoad`), and the gateways split only the slots it leaves
(`sim.active_active.outside_load`: clients sending a quarter of the engines' capacity past three
gateways at 2x kept the engines' queues at 7.8 requests unsubtracted, 1.3 subtracted, and the
gateways' goodput rose from 3.93 to 5.00 requests/s).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

__all__ = ["fair_shares", "grant", "fallback_slots", "OutsideLoad"]


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


def grant(wanted: int, slot_limit: int, others: Sequence[tuple[int, int]], outside: int = 0) -> int:
    """A gateway's grant at a replica: what it wants, up to what outside load and the others'
    claims leave; each of `others` is (held, granted), and claims the larger. (The heartbeat
    script's rule, in Redis.)"""
    claimed = sum(max(held, granted) for held, granted in others)
    return max(0, min(wanted, slot_limit - outside - claimed))


def fallback_slots(slot_limit: int, gateway_count: int) -> int:
    """A gateway's slots at a replica when the others cannot be heard from (the shared store is
    gone): an equal part, rounded down so that the configured gateways never overcommit it; at
    least one, so that a replica is never left unused by a gateway alone."""
    return max(1, slot_limit // max(1, gateway_count))


class OutsideLoad:
    """Requests at one replica that no gateway sent, from the engine's gauges (running + waiting)
    less what the gateways hold there, read at each scrape of the engine.

    One reading overstates it whenever a gateway sent requests since the figures of its held ones
    were published (a heartbeat ago) and understates it while a request ended at the engine but
    not yet at the gateway, so the estimate is the least of the last `samples` readings: a
    passing excess is forgotten, a lasting one counts from its second reading
    (`test_a_passing_excess_of_the_engines_count_is_not_outside_load`). It goes down at once
    when outside load ends, since the least reading goes with it.

    `samples` = 2, measured (`sim.active_active.outside_load`, chat answers, outside clients at a
    quarter of the engines' capacity, a scrape every 2 s): 1 reading left the engines' queues at
    0.4 requests with the batch 93-94 % in use (excesses read as outside load), 2 readings 1.2-1.4
    with 96 %, 3 readings 2.1 with 97 %; unsubtracted, 7.2. Outside clients' requests come when
    they will: a gateway sees them only at the next scrape, so the engines queue what outside
    arrivals exceed the estimate until then (a scrape every 0.5 s: 0.8 with 2 readings)."""

    __slots__ = ("_readings",)

    def __init__(self, samples: int = 2) -> None:
        if samples < 1:
            raise ValueError("samples >= 1 needed")
        self._readings: deque[int] = deque(maxlen=samples)

    def observe(self, engine_sequences: int, gateways_held: int) -> None:
        """One scrape: the engine runs and queues `engine_sequences`; the gateways hold `gateways_held` there."""
        self._readings.append(max(0, engine_sequences - gateways_held))

    def forget(self) -> None:
        """The engine's figures stop (it is down, or not scraped): nothing is known of outside load."""
        self._readings.clear()

    @property
    def sequences(self) -> int:
        """The estimate: the least reading of the last `samples`; 0 before there are that many."""
        readings = self._readings
        return min(readings) if len(readings) == readings.maxlen else 0
