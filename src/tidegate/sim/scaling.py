"""An autoscaler driving a simulated pool: the body's side of `policy.autoscale`, on virtual time.

Each `period_s` the loop reads the pool (replicas ready, starting, draining; requests on the
replicas and queued; arrivals since the last tick), asks the autoscaler, and acts: starts replicas
that are down (each serves after its cold start), or drains the most recently started ready ones
(they take no new request and stop when empty: nothing is aborted), through `policy.fleet`'s
actions: with `standby`, that many replicas are kept loaded and out of traffic, promoted first
by a scale-out (serving `promote_s` later), refilled by warming stopped ones, and a drained
replica is kept as the standby when one is missing. It records every decision and the
replica-seconds paid (a replica costs from its request to its stop; a standby all along).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tidegate.policy.autoscale import ScaleLayer, ScalePolicy, ScaleSignals
from tidegate.policy.fleet import FleetCounts, fleet_actions
from tidegate.sim.harness import Harness

__all__ = ["ScaleEvent", "ScalingLoop", "oscillations"]


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    t_s: float
    ready: int
    starting: int
    draining: int
    desired: int
    layer: ScaleLayer
    reason: str
    standby: int = 0  # loaded and out of traffic, or loading to be


class ScalingLoop:
    def __init__(self, harness: Harness, autoscaler: ScalePolicy, *, period_s: float = 1.0, standby: int = 0,
                 promote_s: float = 2.0, ttft_targets_s: Mapping[str, float] | None = None) -> None:
        """`ttft_targets_s`: tier -> the P99 TTFT the pool is held to; given, each tick reports the
        worst tier's P99 TTFT of the first tokens since the previous tick over its target
        (`ScaleSignals.ttft_ratio`, as the gateway does against its tiers' targets)."""
        if period_s <= 0 or standby < 0 or promote_s < 0:
            raise ValueError("period_s must be > 0, standby and promote_s >= 0")
        self.ttft_targets_s = dict(ttft_targets_s or {})
        self._first_tokens_read = 0
        self.standby = standby  # warm standbys kept (`policy.fleet`)
        self.promote_s = promote_s  # a promoted standby serves this long after the decision
        self.harness = harness
        self.autoscaler = autoscaler
        self.period_s = period_s
        self.events: list[ScaleEvent] = []
        self.replica_s = 0.0  # replicas paid for (starting, ready or draining) x seconds
        self._arrived = 0
        self._arrived_tokens = 0
        self._refused = 0
        self._served_tokens = 0
        self._order = list(harness.replicas)  # started in this order, drained in the reverse

    def install(self, until_s: float, initial: int) -> None:
        """Before the run: the first `initial` replicas serve, the others are down; ticks every
        `period_s` from 0 until `until_s` (a tick never outlives the run's traffic)."""
        if not 1 <= initial <= len(self._order):
            raise ValueError(f"initial replicas must be in [1, {len(self._order)}], got {initial}")
        self.harness.hold_down(self._order[initial:])
        for replica_id in self._order[initial:initial + self.standby]:  # loaded before the run, as the fleet is
            self.harness.loop.call_at(0.0, self._warm_now, replica_id)
        ticks = int(until_s / self.period_s)
        for index in range(ticks + 1):
            self.harness.loop.call_at(index * self.period_s, self._tick)

    def _warm_now(self, replica_id: str) -> None:
        """A standby present at the start is loaded already (its warm-up came before the run)."""
        h = self.harness
        h.replicas[replica_id].start()
        h.standby.add(replica_id)

    # queries
    def up(self) -> list[str]:
        """Replicas serving and not draining (standbys are not serving)."""
        h = self.harness
        return [i for i in self._order if h.replicas[i].alive and i not in h.draining and i not in h.standby]

    @property
    def replica_hours(self) -> float:
        return self.replica_s / 3600.0

    # the tick (changes state)
    def _tick(self) -> None:
        h, now_s = self.harness, self.harness.loop.now_s
        up = self.up()
        paid = len(up) + len(h.starting) + len(h.draining) + len(h.warming) + len(h.standby)
        if self.events:
            self.replica_s += paid * self.period_s
        in_flight = sum(h.replicas[i].load.running_sequences + h.replicas[i].load.waiting_sequences
                        for i in self._order if h.replicas[i].alive)
        signals = ScaleSignals(now_s, ready=len(up), starting=len(h.starting), in_flight=in_flight, queued=h.queued,
                               arrivals=h.arrived - self._arrived, refused=h.refused - self._refused,
                               arrived_tokens=h.arrived_tokens - self._arrived_tokens,
                               served_tokens=h.served_tokens - self._served_tokens, ttft_ratio=self._ttft_ratio())
        self._arrived, self._refused, self._arrived_tokens = h.arrived, h.refused, h.arrived_tokens
        self._served_tokens = h.served_tokens
        decision = self.autoscaler.on_tick(signals)
        # a draining replica kept as a standby counts as warming (it will be one): not refilled twice
        actions = fleet_actions(decision.desired, FleetCounts(len(up), len(h.starting), len(h.standby),
                                                              len(h.warming) + h.kept_draining, self.standby))
        for replica_id in [i for i in self._order if i in h.standby][:actions.promote]:
            h.promote_replica(replica_id, self.promote_s)
        down = [i for i in self._order if not h.replicas[i].alive and i not in h.starting and i not in h.warming]
        for replica_id in down[:actions.start]:
            h.start_replica(replica_id)
        for replica_id in down[actions.start:actions.start + actions.warm]:
            h.warm_replica(replica_id)
        for index, replica_id in enumerate(list(reversed(up))[:actions.drain]):
            h.drain_replica(replica_id)
            if index < actions.keep_drained and replica_id in h.draining:
                h.keep_drained(replica_id)
        self.events.append(ScaleEvent(now_s, len(self.up()), len(h.starting), len(h.draining), decision.desired,
                                      decision.layer, decision.reason, len(h.standby) + len(h.warming)))

    def _ttft_ratio(self) -> float | None:
        """The worst tier's P99 TTFT since the previous tick over its target; None without a first
        token of a tier with a target (changes state: the next tick reads from here)."""
        h = self.harness
        by_tier: dict[str, list[float]] = {}
        for tier, ttft_s in h.first_tokens[self._first_tokens_read:]:
            if tier in self.ttft_targets_s:
                by_tier.setdefault(tier, []).append(ttft_s)
        self._first_tokens_read = len(h.first_tokens)
        worst: float | None = None
        for tier, ttfts in by_tier.items():
            ttfts.sort()
            ratio = ttfts[math.ceil(0.99 * len(ttfts)) - 1] / self.ttft_targets_s[tier]
            worst = ratio if worst is None else max(worst, ratio)
        return worst


def oscillations(events: Sequence[ScaleEvent], window_s: float) -> int:
    """Scale-ins followed by a scale-out within `window_s`: the flapping stabilisation prevents."""
    count = 0
    last_in_s: float | None = None
    previous = None
    for event in events:
        if previous is not None and event.desired < previous.desired:
            last_in_s = event.t_s
        elif previous is not None and event.desired > previous.desired and last_in_s is not None \
                and event.t_s - last_in_s <= window_s:
            count += 1
            last_in_s = None
        previous = event
    return count
