"""Which tenants of a tier send more than their fair share, and which stay within it.

VTC (`queueing`) divides a tier's *throughput* fairly, but under a flood the flooding tenant keeps
every free slot filled, so each batch runs at the slot limit's latency target, and a tenant that
sends only its share waits no longer in the queue yet still gets its first token that much later.
The isolation the gateway offers against that: while some tenant of a tier is *over* its share,
the requests of that tier's tenants *within* theirs are protected (the headroom and a reserve
inside each replica's limit, no target stretched for the flood's backlog, limits aimed at the
latency from before the flood, and the flood's requests a priority step lower in engines that
schedule by it), so the flood's excess gets only the slots and steps they leave.

A tenant's share is its max-min fair rate (weighted water-filling, as in fair queueing: Demers,
Keshav and Shenker 1989): the tier's measured service rate divided so that no tenant gets more
than it asks and the rest is split by weight. Tenants are over their share when their recent
arrival rates exceed `over_share_factor` times that rate *and* that many times the rate of every
tenant they would be protected from: the largest group of tenants, from the highest rate down,
that stands out so from all the others. Rates are exponentially decaying averages (`half_life_s`)
of the work arriving (tokens reserved at admission), dispatched and finished.

The tier's service rate is the smaller of the rates its work is dispatched and finished at: when
a flood starts, the replicas' free slots take its first requests at once, so dispatches keep pace
with arrivals for the second or two the batch takes to fill, while finishes show the engines'
throughput from the start (a verdict on dispatches alone came about 3 s into a flood, after the
engines were full of it). While the tier is served all it asks for, nobody is over.

The gap condition keeps the verdict from feeding on itself: protection narrows the batches, which
lowers the service rate and with it every fair share, and tenants sending alike would then take
turns being "over" by chance, holding the tier in protection at a fraction of its throughput.
Against each other, equal tenants are never over, whatever the load, and neither is a tenant alone
in its tier. It also keeps the verdict when the service rate reads low for every tenant: after
idle, finishes lag arrivals by a service time, and until they catch up every tenant may send
over twice the fair level. No verdict is given in a tier's first `half_life_s`, while its rates
still rest on a handful of requests, nor on fewer than `MIN_REQUESTS` of a tenant's recent
requests (after idle, a tenant's first two stand out from the others' none); and a tenant gone
quiet is no one to stand out from.

Pure: every method takes `now_s`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["DecayingRate", "TenantShares", "fair_rate"]


class DecayingRate:
    """Events per second (weighted by `amount`), averaged with an exponential decay of `half_life_s`."""

    __slots__ = ("_tau_s", "_value", "_at_s")

    def __init__(self, half_life_s: float) -> None:
        self._tau_s = half_life_s / math.log(2)
        self._value = 0.0  # amount arrived, decayed: rate x tau in a steady state
        self._at_s: float | None = None

    def add(self, now_s: float, amount: float) -> None:
        self._value = self.amount(now_s) + amount
        if self._at_s is None or now_s > self._at_s:
            self._at_s = now_s

    def rate(self, now_s: float) -> float:
        """A query: reading changes nothing."""
        return self.amount(now_s) / self._tau_s

    def amount(self, now_s: float) -> float:
        """The amount arrived, each part decayed by its age (a query)."""
        if self._at_s is not None and now_s > self._at_s:
            return self._value * math.exp(-(now_s - self._at_s) / self._tau_s)
        return self._value


def fair_rate(demands: Mapping[str, float], weights: Mapping[str, float], capacity: float) -> float:
    """The max-min fair level per unit weight: each tenant gets min(demand, weight x level), adding
    up to `capacity`; infinite when the demands fit (nobody is held back)."""
    if sum(demands.values()) <= capacity:
        return math.inf
    remaining, weight_left = capacity, sum(weights.get(t, 1.0) for t in demands)
    for tenant, demand in sorted(demands.items(), key=lambda item: item[1] / weights.get(item[0], 1.0)):
        weight = weights.get(tenant, 1.0)
        if demand / weight * weight_left > remaining:
            break  # this tenant and every one after it are held to the level
        remaining -= demand
        weight_left -= weight
    else:
        return math.inf  # all fit after all (the sums differed only by rounding)
    return max(remaining, 0.0) / weight_left


class TenantShares:
    """Per tier: tenants' arrival rates, the tier's service rate, and who is over or within share."""

    # a tenant whose rate has decayed below this fraction of its tier's service rate is forgotten
    FORGET_BELOW = 1e-4
    # a tenant is judged over its share only on this many of its requests (decayed by age): after
    # idle every rate has decayed to nothing, and a tenant's first two requests would stand out
    # from the others' none. A flood reaches it within a fraction of a second; a tenant sending
    # under MIN_REQUESTS / (half_life_s / ln 2) a second (1.1 at the default 5 s) is never judged
    MIN_REQUESTS = 8.0

    def __init__(self, *, half_life_s: float = 5.0, over_share_factor: float = 2.0,
                 tenant_weights: Mapping[str, float] | None = None) -> None:
        if half_life_s <= 0 or over_share_factor < 1:
            raise ValueError("half_life_s > 0 and over_share_factor >= 1 needed")
        self._half_life_s = half_life_s
        self._factor = over_share_factor
        self._weights = dict(tenant_weights or {})
        self._arrivals: dict[str, dict[str, DecayingRate]] = {}  # tier -> tenant -> work arriving
        self._requests: dict[str, dict[str, DecayingRate]] = {}  # tier -> tenant -> requests arriving
        self._dispatched: dict[str, DecayingRate] = {}  # tier -> work dispatched
        self._finished: dict[str, DecayingRate] = {}  # tier -> work finished (or given up) by replicas
        self._first_arrival_s: dict[str, float] = {}  # tier -> when its rates began
        # tier -> (when computed, tenants over share); recomputed once per instant
        self._verdicts: dict[str, tuple[float, frozenset[str]]] = {}

    def on_arrival(self, now_s: float, tier: str, tenant: str, work: float) -> None:
        """Work (tokens reserved) admitted for `tenant` in `tier`, whether it is served or not;
        tenants of the tier whose rate has decayed to nearly nothing are forgotten."""
        tenants = self._arrivals.setdefault(tier, {})
        if tenant not in tenants:  # a newcomer: the time to drop those gone quiet (a verdict skips them anyway)
            floor = self.FORGET_BELOW * self.service_rate(now_s, tier)
            for gone in [name for name, rate in tenants.items() if rate.rate(now_s) <= floor]:
                del tenants[gone], self._requests[tier][gone]
        self._first_arrival_s.setdefault(tier, now_s)
        for rates, amount in ((tenants, work), (self._requests.setdefault(tier, {}), 1.0)):
            rate = rates.get(tenant)
            if rate is None:
                rate = rates[tenant] = DecayingRate(self._half_life_s)
            rate.add(now_s, amount)
        self._verdicts.pop(tier, None)

    def on_dispatch(self, now_s: float, tier: str, work: float) -> None:
        """Work of `tier` handed to a replica."""
        self._add(self._dispatched, now_s, tier, work)

    def on_finish(self, now_s: float, tier: str, work: float) -> None:
        """Work of `tier` a replica is done with (answered, failed or abandoned), counted as it was
        at dispatch (tokens reserved), so that it compares with the arrivals."""
        self._add(self._finished, now_s, tier, work)

    def _add(self, rates: dict[str, DecayingRate], now_s: float, tier: str, work: float) -> None:
        rate = rates.get(tier)
        if rate is None:
            rate = rates[tier] = DecayingRate(self._half_life_s)
        rate.add(now_s, work)
        self._verdicts.pop(tier, None)

    def service_rate(self, now_s: float, tier: str) -> float:
        """Work a second `tier` is served: the smaller of its dispatch and finish rates."""
        dispatched, finished = self._dispatched.get(tier), self._finished.get(tier)
        if dispatched is None or finished is None:
            return 0.0
        return min(dispatched.rate(now_s), finished.rate(now_s))

    def over_share(self, now_s: float, tier: str) -> frozenset[str]:
        """Tenants of `tier` whose arrival rate exceeds `over_share_factor` x their fair share."""
        return self._verdict(now_s, tier)[1]

    def protects(self, now_s: float, tier: str, tenant: str) -> bool:
        """True when some tenant of `tier` is over its share and `tenant` is not."""
        over = self._verdict(now_s, tier)[1]
        return bool(over) and tenant not in over

    def _standing_out(self, weighted: Mapping[str, float], level: float) -> frozenset[str]:
        """The most tenants, taken from the top rate down, that each send over `factor` x the fair
        level and over `factor` x the rate of every tenant below them; none if no such gap."""
        ranked = sorted(weighted.items(), key=lambda item: item[1], reverse=True)
        # The largest such top group: a rate gap lower down is still a gap between floods and the
        # tenants they would crowd out. While the service rate is still catching up (it lags the
        # arrivals for a service time after idle, so every fair level reads low for a second or
        # two), every tenant may exceed `factor` x the level; the gap still tells the flood.
        for count in range(len(ranked) - 1, 0, -1):
            lowest_over, highest_below = ranked[count - 1][1], ranked[count][1]
            if lowest_over > self._factor * max(level, highest_below):
                return frozenset(tenant for tenant, _ in ranked[:count])
        return frozenset()

    def _verdict(self, now_s: float, tier: str) -> tuple[float, frozenset[str]]:
        cached = self._verdicts.get(tier)
        if cached is not None and cached[0] == now_s:
            return cached
        tenants = self._arrivals.get(tier, {})
        if len(tenants) < 2:  # a tenant alone in its tier floods nobody (the common case: no tenants)
            verdict = self._verdicts[tier] = (now_s, frozenset())
            return verdict
        capacity = self.service_rate(now_s, tier)
        demands = {tenant: demand for tenant, rate in tenants.items()
                   if (demand := rate.rate(now_s)) > self.FORGET_BELOW * capacity}
        level = fair_rate(demands, self._weights, capacity)
        # a tenant gone quiet (its requests, decayed by age, add up to under half of one: about
        # none in the last half-life) is no one to stand out from: next to its rate of nearly
        # nothing, every tenant still sending would
        requests = {tenant: count.amount(now_s) for tenant, count in self._requests.get(tier, {}).items()}
        weighted = {tenant: demand / self._weights.get(tenant, 1.0) for tenant, demand in demands.items()
                    if requests[tenant] >= 0.5}
        over = frozenset(tenant for tenant in self._standing_out(weighted, level)
                         if requests[tenant] >= self.MIN_REQUESTS)
        if now_s - self._first_arrival_s.get(tier, now_s) < self._half_life_s:
            over = frozenset()  # too few requests yet for a verdict
        verdict = self._verdicts[tier] = (now_s, over)
        return verdict
