"""Which replica serves the next request: filter, then score, then pick. Pure, time passed in.

Filter: routable (active health HEALTHY, breaker admits at now_s), not excluded (a replica that just
failed this request), has a free slot (outstanding < slot_limit: late binding, engines kept just full).
Score: fewest outstanding requests; ties by lowest KV-cache use, then fewest waiting sequences;
remaining ties by round robin from a cursor the caller keeps, so equal replicas share load.

The runtime passes its live replica objects (anything with the `RoutableReplica` attributes), so the
hot path allocates nothing; tests and the simulator pass frozen records.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from tidegate.policy.health import Breaker, is_routable
from tidegate.types import ReplicaHealth, ReplicaLoad

__all__ = ["RoutableReplica", "ReplicaSnapshot", "RoutingChoice", "pick_replica", "any_routable"]


class RoutableReplica(Protocol):
    @property
    def replica_id(self) -> str: ...
    @property
    def health(self) -> ReplicaHealth: ...
    @property
    def breaker(self) -> Breaker: ...
    @property
    def outstanding(self) -> int: ...  # requests sent by this gateway and not finished
    @property
    def slot_limit(self) -> int: ...  # most requests this replica may hold at once
    @property
    def load(self) -> ReplicaLoad: ...  # last self-report (engine /metrics); zeros if unknown


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """A RoutableReplica as a plain record, for tests and the simulator."""

    replica_id: str
    health: ReplicaHealth = ReplicaHealth.HEALTHY
    breaker: Breaker = Breaker()
    outstanding: int = 0
    slot_limit: int = 64
    load: ReplicaLoad = ReplicaLoad()


@dataclass(frozen=True, slots=True)
class RoutingChoice:
    index: int | None  # position in the replicas given; None: no replica can take it now
    next_cursor: int  # round-robin cursor to pass to the next call


def pick_replica(
    replicas: Sequence[RoutableReplica],
    now_s: float,
    cursor: int,
    exclude: Collection[str] = (),
) -> RoutingChoice:
    count = len(replicas)
    best_index: int | None = None
    best_key: tuple[int, float, int] | None = None
    # scanning from the cursor makes the first of equal replicas rotate between calls
    for step in range(count):
        index = (cursor + step) % count
        replica = replicas[index]
        if replica.outstanding >= replica.slot_limit:
            continue
        if not is_routable(replica.health, replica.breaker, now_s):
            continue
        if exclude and replica.replica_id in exclude:
            continue
        load = replica.load
        key = (replica.outstanding, load.kv_cache_usage, load.waiting_sequences)
        if best_key is None or key < best_key:
            best_index, best_key = index, key
    if best_index is None:
        return RoutingChoice(None, cursor)
    return RoutingChoice(best_index, (best_index + 1) % count)


def any_routable(replicas: Sequence[RoutableReplica], now_s: float, exclude: Collection[str] = ()) -> bool:
    """Is some replica up, full or not? Tells 'wait for a slot' apart from 'nothing to wait for'."""
    return any(
        is_routable(r.health, r.breaker, now_s) and r.replica_id not in exclude for r in replicas
    )
