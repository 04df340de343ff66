"""FIFO: the baseline every overload mechanism is compared with (DESIGN: never do less good work).

One queue in arrival order, whatever the tier; a static slot limit per replica; routing by the
pure router (`policy.routing.pick_replica`) and passive ejection by its breakers
(`policy.health.Breaker`, weighed against the pool's failure ratio as the live FIFO gateway
does). A queued request still waiting `max_queue_wait_s` (its tier's) after arrival is refused;
an arrival beyond its tier's `queue_bound` is refused at once. No retries.

Pure: time and replica loads come in as arguments; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tidegate.policy.health import Breaker, BreakerPolicy, BreakerState, median
from tidegate.policy.routing import pick_replica
from tidegate.policy.tiers import TierTable
from tidegate.types import (QUEUED, ArrivalDecision, ArrivalVerdict, Assignment, Dispatch, PoolRequest, Refusal,
                            ReplicaHealth, ReplicaLoad)

__all__ = ["FifoDispatcher", "ReplicaView", "REFUSED_QUEUE_WAIT", "REFUSED_QUEUE_FULL", "REFUSED_UNKNOWN_TIER"]

REFUSED_QUEUE_WAIT = "queue_wait"
REFUSED_QUEUE_FULL = "queue_full"
REFUSED_UNKNOWN_TIER = "unknown_tier"


@dataclass(slots=True)
class ReplicaView:
    """The dispatcher's view of one replica; satisfies `policy.routing.RoutableReplica`."""

    replica_id: str
    slot_limit: int
    health: ReplicaHealth = ReplicaHealth.HEALTHY  # a replica starting up is UNHEALTHY until ready
    breaker: Breaker = Breaker()
    outstanding: int = 0
    load: ReplicaLoad = ReplicaLoad()


@dataclass(frozen=True, slots=True)
class _Sent:
    replica_id: str
    sent_s: float  # the breaker tells stale outcomes (sent before an ejection) by this


class FifoDispatcher:
    def __init__(self, replica_ids: Sequence[str], tiers: TierTable, slot_limit: int = 8,
                 breaker_policy: BreakerPolicy = BreakerPolicy(), forward_priority: bool = False) -> None:
        if slot_limit < 1:
            raise ValueError(f"slot_limit must be >= 1, got {slot_limit}")
        self.tiers = tiers
        self.breaker_policy = breaker_policy
        # True: the engine schedules by tier rank, as the live gateway does for embedded engines
        self.forward_priority = forward_priority
        self._views = [ReplicaView(replica_id, slot_limit) for replica_id in replica_ids]
        self._by_id = {view.replica_id: view for view in self._views}
        # one deque per tier: within a tier deadlines rise with arrival, so expiry looks at heads only
        self._queues: dict[str, deque[PoolRequest]] = {tier.name: deque() for tier in tiers}
        self._sent: dict[int, _Sent] = {}
        self._cursor = 0

    # queries: they change nothing
    def breaker(self, replica_id: str) -> Breaker:
        return self._by_id[replica_id].breaker

    def outstanding(self, replica_id: str) -> int:
        return self._by_id[replica_id].outstanding

    @property
    def queued(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    # events
    def on_arrival(self, now_s: float, request: PoolRequest) -> ArrivalDecision:
        if request.tier not in self.tiers:
            return ArrivalDecision(ArrivalVerdict.REFUSED, REFUSED_UNKNOWN_TIER)
        queue = self._queues[request.tier]
        if len(queue) >= self.tiers[request.tier].queue_bound:
            return ArrivalDecision(ArrivalVerdict.REFUSED, REFUSED_QUEUE_FULL)
        queue.append(request)
        return QUEUED

    def on_capacity(self, now_s: float, loads: Mapping[str, ReplicaLoad]) -> Dispatch:
        for view in self._views:
            view.breaker = view.breaker.current(now_s)
            if view.replica_id in loads:
                view.load = loads[view.replica_id]
        refusals = self._expire(now_s)
        assignments: list[Assignment] = []
        while (request := self._oldest()) is not None:
            choice = pick_replica(self._views, now_s, self._cursor)
            if choice.index is None:
                break
            self._cursor = choice.next_cursor
            view = self._views[choice.index]
            self._queues[request.tier].popleft()
            view.outstanding += 1
            view.breaker = view.breaker.on_dispatch(now_s)
            self._sent[request.request_id] = _Sent(view.replica_id, now_s)
            priority = self.tiers[request.tier].rank if self.forward_priority else 0
            assignments.append(Assignment(request.request_id, view.replica_id, priority))
        return Dispatch(tuple(assignments), refusals, self._wake_at_s(now_s))

    def on_first_token(self, now_s: float, request_id: int) -> None:
        pass  # FIFO learns nothing from a first token; an adaptive controller would

    def on_finish(self, now_s: float, request_id: int) -> None:
        sent = self._sent.pop(request_id)
        view = self._by_id[sent.replica_id]
        view.outstanding -= 1
        view.breaker = view.breaker.on_success(now_s, sent.sent_s, self.breaker_policy)

    def on_failure(self, now_s: float, request_id: int, reason: str) -> None:
        sent = self._sent.pop(request_id)
        view = self._by_id[sent.replica_id]
        view.outstanding -= 1
        # the pool's failure ratio, as the live FIFO gateway passes it (`gateway/dispatch.py`): in a
        # fleet failing alike a run of failures is no outlier
        # (`test_a_fleet_failing_alike_keeps_its_replicas`)
        pool_ratio = median([other.breaker.failure_ratio for other in self._views if other is not view])
        view.breaker = view.breaker.on_failure(now_s, sent.sent_s, self.breaker_policy,
                                               may_eject=self._may_eject(now_s), pool_failure_ratio=pool_ratio)

    def on_replica_health(self, now_s: float, replica_id: str, health: ReplicaHealth) -> None:
        self._by_id[replica_id].health = health

    # internals
    def _oldest(self) -> PoolRequest | None:
        heads = [queue[0] for queue in self._queues.values() if queue]
        return min(heads, key=lambda r: (r.arrival_s, r.request_id)) if heads else None

    def _expire(self, now_s: float) -> tuple[Refusal, ...]:
        refusals: list[Refusal] = []
        for tier_name, queue in self._queues.items():
            max_wait_s = self.tiers[tier_name].max_queue_wait_s
            while queue and now_s >= queue[0].arrival_s + max_wait_s:
                refusals.append(Refusal(queue.popleft().request_id, REFUSED_QUEUE_WAIT))
        return tuple(sorted(refusals, key=lambda r: r.request_id))

    def _wake_at_s(self, now_s: float) -> float | None:
        """The next queue deadline; while requests wait, also the next breaker cool-down's end."""
        times = [queue[0].arrival_s + self.tiers[name].max_queue_wait_s
                 for name, queue in self._queues.items() if queue]
        if times:
            times += [view.breaker.reopen_at_s for view in self._views
                      if view.breaker.state is not BreakerState.CLOSED and view.breaker.reopen_at_s > now_s]
        return min(times) if times else None

    def _may_eject(self, now_s: float) -> bool:
        """The breakers never eject more than `max_ejected_fraction` of the pool (at least one);
        counted as the live gateway counts it, so both bodies eject alike."""
        ejected = sum(1 for view in self._views if not view.breaker.admits(now_s))
        return ejected < max(1, int(len(self._views) * self.breaker_policy.max_ejected_fraction))
